"""Shared fixtures: real transformers models, built offline from the repo's own assets."""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402

from pypto_gym.models.qwen2_5_vl import SAMPLE_IMAGE, TINY_DIR, load_model_and_processor  # noqa: E402


@pytest.fixture(scope="session")
def tiny_loaded():
    """The embedded checkpoint (bf16) and its processor; tests must not mutate it (use copies)."""
    return load_model_and_processor(TINY_DIR)


@pytest.fixture(scope="session")
def sample_inputs(tiny_loaded):
    from PIL import Image

    model, processor = tiny_loaded
    return processor(["Read the text in the image."], [Image.open(SAMPLE_IMAGE).convert("RGB")], model=model)
