"""Per-model assets (installed as the package `pypto_gym.modeling`): the embedded tiny Qwen2.5-VL
checkpoint and GutenOCR-3B's architecture config and sample page. No code lives here; a normal
`pip install .` ships these files so the main job runs without a checkout."""
