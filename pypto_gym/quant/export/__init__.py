"""A W8A8-patched model saved as a checkpoint its consumers load, and such a checkpoint loaded onto the fused kernels.

One module per format (compressed_tensors: what llm-compressor writes and transformers, through compressed-tensors,
and vLLM load; msmodelslim: what msModelSlim writes and vllm-ascend loads), each saying which tensors an int8 linear
has beyond `weight` int8 [out, in] and `weight_scale` fp32 [out, 1], how its metadata is written, and how it is
checked on loading; save.py and load.py run either; checkpoint.py is what they share (the output folder staged, a
checkpoint's files read). The int8 weights written are the ones the model runs (no re-quantisation); every other
tensor is written as the model holds it.

A smoothed model (a calibration file) is written with every smooth scale folded into what writes the rows it scales
(quant/fold.py: norm weights, up_proj's and v_proj's output rows, ln_q), as llm-compressor's SmoothQuant writes its
checkpoints: neither format has a tensor for an activation smooth scale. A folded int8 linear's weight_scale (and
bias) carries the factor.

lm_head is float by default (in `ignore`, FLOAT in msModelSlim's description): what vLLM and vllm-ascend load. An int8
lm_head (int8_lm_head=True) is written int8 and said to be so (LM_HEAD_CONSUMERS); tied to the embedding it is
written once, as the embedding's float table, and quantised again on loading.
"""
from .checkpoint import SIDECAR, check_out_dir
from .load import int8_format, load, quant_mode_of
from .msmodelslim import MSMODELSLIM_JSON, MSMODELSLIM_WEIGHTS, deq_scale_from_int64
from .save import FORMATS, LM_HEAD_CONSUMERS, save, text_only_refusal

__all__ = ["FORMATS", "LM_HEAD_CONSUMERS", "MSMODELSLIM_JSON", "MSMODELSLIM_WEIGHTS", "SIDECAR", "check_out_dir",
           "deq_scale_from_int64", "int8_format", "load", "quant_mode_of", "save", "text_only_refusal"]
