"""patch_embed on the cpu backend: the GEMM the convolution is (oneDNN through F.linear)."""
from ...ops.defs.patch_embed import PATCH_EMBED, as_linear

PATCH_EMBED.impl("cpu")(lambda backend, x, weight, bias: as_linear(x, weight, bias))
