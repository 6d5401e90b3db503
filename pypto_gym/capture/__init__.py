"""Shape capture (ShapeRecorder), the JSON test-case format, and the case runner."""
from .cases import CaseError, load_cases
from .recorder import ShapeRecorder

__all__ = ["ShapeRecorder", "load_cases", "CaseError"]
