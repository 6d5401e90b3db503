"""Shared fixtures: real transformers models, built offline from the repo's own assets.

The suite runs strict (PYPTO_GYM_STRICT=1): a capability fallback or a kernel error raises, so a
backend that silently did not run fails the test that used it. Tests about fallbacks opt out
with the `lenient` fixture.
"""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ["PYPTO_GYM_STRICT"] = "1"
os.environ.pop("USE_PTO_RMS_NORM", None)
os.environ.pop("PYPTO_GYM_BACKEND", None)

import pytest  # noqa: E402

import pypto_gym  # noqa: E402
from pypto_gym.models.qwen2_5_vl import SAMPLE_IMAGE, TINY_DIR, load  # noqa: E402

assert pypto_gym.is_strict(), "the suite must run strict"


@pytest.fixture
def lenient():
    """Fallbacks allowed (counted, warned) for the duration of a test."""
    with pypto_gym.config.scoped(strict=False):
        yield


@pytest.fixture(autouse=True)
def _switches_restored():
    """Every test starts with the kernels enabled and strict mode on, and leaves them so."""
    with pypto_gym.config.scoped(enabled=True, strict=True):
        yield


@pytest.fixture
def model32(tiny_loaded):
    """A float32 copy of the embedded model: torch-backend comparisons must be bit-exact."""
    import copy

    return copy.deepcopy(tiny_loaded[0]).float()


@pytest.fixture(scope="session")
def tiny_loaded():
    """The embedded checkpoint (bf16) and its processor; tests must not mutate it (use copies)."""
    return load(TINY_DIR)


@pytest.fixture(scope="session")
def sample_inputs(tiny_loaded):
    from PIL import Image

    model, processor = tiny_loaded
    return processor(["Read the text in the image."], [Image.open(SAMPLE_IMAGE).convert("RGB")], model=model)
