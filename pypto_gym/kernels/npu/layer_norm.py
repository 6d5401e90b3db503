"""layer_norm on the npu backend: the NPU's own layer norm (aclnnLayerNorm, which torch_npu registers for
`F.layer_norm`, the golden itself; torch_npu's replacement for its deprecated `npu_layer_norm_eval`). Its page
(hicann/ops-nn, aclnnLayerNorm) lists Atlas A2/A3 and the training series, not the Atlas inference series
(Ascend310P): declined there."""
from ...ops.defs.layer_norm import LAYER_NORM, layer_norm


def _npu_supports(backend, x, gamma, beta, eps):
    if backend.series_of(x) == "inference":
        return "aclnnLayerNorm (F.layer_norm on the NPU) is not supported on Atlas inference series chips"
    return None


LAYER_NORM.impl("npu", supports=_npu_supports)(lambda backend, *args: layer_norm(*args))
