"""Test helpers shared by the op tests: the one assert_close, ulps, and the parametrisation over ops and examples."""
import math

import pytest
import torch

from pypto_gym import ops
from pypto_gym.ops import OPS
from pypto_gym.precision import compare_outputs


def assert_close(actual, golden, outputs):
    """Every output within SPEC 5's rule for its kind; `outputs` are names or an op's output declarations."""
    for c in compare_outputs(actual, golden, outputs):
        assert c.passed, f"{c.name}: {c.reason} (max abs {c.max_abs:g})"


def run_on(backend: str, op, args):
    """Run `op` on exactly `backend` (strict: a fallback raises) and return its outputs."""
    stats = ops.Stats()
    out = op.call(args, backend, stats)
    assert stats.ran == {backend: 1} and not stats.fallbacks, (stats.ran, stats.fallbacks)
    return out


def op_examples(backend: str | None = None):
    """pytest params (op, example) for every op's examples, optionally only ops implemented on `backend`."""
    return [pytest.param(op, ex, id=f"{name}[{i}]") for name, op in OPS.items()
            if backend is None or backend in op.impls for i, ex in enumerate(op.examples)]


def ulps_apart(actual: torch.Tensor, golden: torch.Tensor) -> float:
    """Largest distance in units in the last place of the golden's dtype (NaN where both are NaN: 0)."""
    assert actual.dtype == golden.dtype and actual.shape == golden.shape
    if not golden.numel():
        return 0.0
    a, g = actual.double(), golden.double()
    info = torch.finfo(golden.dtype)
    bits, tiny = round(-math.log2(info.eps)), info.tiny  # stored mantissa bits
    _, exp = torch.frexp(g.abs().clamp_min(tiny))
    ulp = torch.ldexp(torch.ones_like(g), exp - 1 - bits)
    same = (a == g) | (torch.isnan(a) & torch.isnan(g))
    return float(torch.where(same, 0.0, (a - g).abs() / ulp).max())
