"""layer_norm and add_layer_norm on the npu backend: the NPU's own layer norm (aclnnLayerNorm, which torch_npu
registers for `F.layer_norm`, the golden itself; torch_npu's replacement for its deprecated `npu_layer_norm_eval`).
Its page (hicann/ops-nn, aclnnLayerNorm) lists Atlas A2/A3 and the training series, not the Atlas inference series
(Ascend310P): declined there. add_layer_norm is the golden's add, then that norm: torch_npu's npu_add_layer_norm
has no API page (only op-plugin's test), and aclnnAddLayerNorm's page does not say whether the sum it normalises is
rounded to the dtype first, as HF's block's is, so the fused call is not taken."""
from ...ops.defs.add_layer_norm import ADD_LAYER_NORM, add_layer_norm
from ...ops.defs.layer_norm import LAYER_NORM, layer_norm


def _npu_supports(backend, x, *rest):
    if backend.series_of(x) == "inference":
        return "aclnnLayerNorm (F.layer_norm on the NPU) is not supported on Atlas inference series chips"
    return None


LAYER_NORM.impl("npu", supports=_npu_supports)(lambda backend, *args: layer_norm(*args))
ADD_LAYER_NORM.impl("npu", supports=_npu_supports)(lambda backend, *args: add_layer_norm(*args))
