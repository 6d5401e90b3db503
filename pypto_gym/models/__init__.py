"""Model families pypto-gym knows how to build and load (one module per family)."""
