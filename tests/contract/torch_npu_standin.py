"""Stand-in for torch_npu: its documented signatures and limits, computed with pypto-gym's goldens.

The only stand-in the project allows (SPEC 2.6): torch_npu cannot be installed without CANN, so
the `npu` backend's mapping (argument names, output order and layout, casts, limits) is checked
against this module, written from torch_npu's API pages:
  npu_rms_norm(self, gamma, epsilon=1e-06) -> (y, rstd)          self 2-8 dims; empty tensors allowed;
      (x, gamma) dtype pairs per chip (A2/A3: fp16/fp32, bf16/fp32, fp16/fp16, bf16/bf16, fp32/fp32)
  npu_add_rms_norm(x1, x2, gamma, epsilon=1e-06) -> (y, rstd, x)  1-8 dims; no empty tensors; gamma
      dtype = x1's; no bf16 on Atlas inference series chips
  npu_add_rms_norm_dynamic_quant(x1, x2, gamma, *, smooth_scale1=None, smooth_scale2=None, beta=None,
      epsilon=1e-06, output_mask=None, y_dtype=None) -> (y1, y2, x_out, scale1, scale2)
      2-8 dims; no empty tensors; fp16/bf16; y_dtype int8 or torch.quint4x2 (eight int4 per int32,
      D % 8 == 0); an output the mask turns off is an empty tensor; A2/A3 chips only.
  npu_quant_matmul(x1, x2, scale, *, offset=None, pertoken_scale=None, bias=None, output_dtype=None)
      x1 int8 [m, k] (2-6 dims), x2 int8 [k, n]; scale [n] or [1] fp32/bf16; pertoken_scale fp32 [m]
      (not on Atlas inference series chips); documented rows with pertoken_scale: output bf16 with
      scale fp32/bf16 and bias int32/bf16/fp32, or output fp16 with scale fp32 and bias int32/bf16/fp32 (no fp16
      bias); a float bias is added after dequantisation; x1, x2 and scale must not be empty; the last dims of x1
      and x2 (k and n) at most 65535. x1 ND; x2 ND or NZ (npu_format_cast(x2, 29)): on A2/A3 the [k, n] weight cast
      untransposed (recommended), on the inference series the [n, k] weight cast, then passed transposed (required).
  npu_format_cast(input, acl_format) -> a copy in ACL format 2 (ND) or 29 (FRACTAL_NZ) of a contiguous input; the
      format is remembered per storage (`format_of`), so a transposed view of an NZ tensor is NZ too.
  npu_add_rms_norm_quant(x1, x2, gamma, scales1, zero_points1=None, beta=None, scales2=None, zero_points2=None,
      *, axis=-1, epsilon=1e-06, div_mode=True) -> (y1, y2, x_out): 1-8 dims, no empty tensors, fp16/bf16 (bf16 on
      A2/A3); y1 = round(rms_norm(x1 + x2) * gamma (+ beta) / scales1 + zero_points1) per channel (div_mode=True;
      x * scales1 otherwise), int8; scales2 / zero_points2 must be None (y2 is then empty). Its dtype table: fp16 x
      with fp16 gamma/beta, fp32 scales1 and int32 zero_points1; bf16 x with bf16 for all four; shapes [D]; on
      Atlas inference series chips (fp16 only) D >= 32.
  npu_quantize(input, scales, zero_points, dtype, axis=1, div_mode=True) -> int8 codes of input per channel along
      axis (scales/zero_points [D] or [1]), torch.qint8 only here; with div_mode=True scales fp32 (or bf16 on A2/A3)
      and zero_points int8/uint8/int32 (or bf16 on A2/A3), with div_mode=False both of input's dtype.
  npu_trans_quant_param(scale, offset=None, round_mode=0) -> int64: each fp32 scale kept to its upper 19 bits
      (truncated, or rounded with round_mode=1) in the low 32 bits, bit 46 set (the fp16 output's scale): what
      npu_quant_matmul then computes with.
  Static rows of npu_quant_matmul (no pertoken_scale): output bf16 with scale fp32, output fp16 with scale int64
      (npu_trans_quant_param); an int32 bias is added to the int32 accumulator before dequantisation.
  npu_swiglu(input, dim=-1) -> swish(A) * B for the halves A, B of input along dim: 1-8 dims, dim's size
      even, contiguous, not empty, fp32/fp16/bf16; Atlas A2/A3.
  npu_rotary_mul(input, r1, r2, rotary_mode="half") -> r1 * input + r2 * rotate_half(input): 4-D,
      fp16/bf16/fp32, r1/r2 of input's dtype; A2/A3: D < 896 and even, B and N < 1000, BSND input with
      r1/r2 as 1S1D, BS1D or BSND (older series: D = 128).
  npu_apply_rotary_pos_emb(query, key, cos, sin, layout="BSND", rotary_mode="half") -> (query, key),
      rotated in place; B and S of all four equal, D equal and 128 or 64, one dtype (no bf16 on the inference
      series), no empty tensors. npu_rotary_mul's r1/r2 within [-1, 1] (its documented data range).
  npu_fused_infer_attention_score(query, key, value, *, ..., actual_seq_lengths=None, actual_seq_lengths_kv=None,
      num_heads=1, scale=1.0, pre_tokens=2147483647, next_tokens=2147483647, input_layout="BSH",
      num_key_value_heads=0, sparse_mode=0, ...) -> (attention_out, softmax_lse): query fp16/bf16/int8, contiguous,
      ND; Atlas A2/A3; prefill B <= 65536 (<= 128 with D not 32-byte aligned), N <= 256, D <= 512 and 16-byte
      aligned, decode KV_S <= 262144. Two layouts are stood in for: TND (what vllm-ascend's vision attention calls):
      [T, N, D] query, key/value [T, N_kv, D] with D 128 (or 192 for q and k), actual_seq_lengths(_kv) the
      cumulative ends of each sequence (at most 4096), no mask; and
      BNSD: query [B, N, S, D], key/value [B, N_kv, S_kv, D] (N a multiple of num_key_value_heads: query head h
      reads KV head h // (N / N_kv)), atten_mask bool True where a position is masked, [B, 1, S, S_kv] with
      sparse_mode 0, or the 2048 x 2048 upper-triangular mask with sparse_mode 3 (causal, S = S_kv here).
      Softmax in fp32, the output rounded once.
`npu.get_device_name()` reports the chip this stand-in pretends to be (`DEVICE_NAME`).
"""
import types
import weakref

import torch

from pypto_gym.ops import OPS
from pypto_gym.ops.defs.norm_quant import normalise
from pypto_gym.ops.quantize import pack_int4_to_int32, quantize_rows

calls = []
DEVICE_NAME = "Ascend910B2"
npu = types.SimpleNamespace(get_device_name=lambda device=None: DEVICE_NAME)
A2_A3_PAIRS = {(torch.float16, torch.float32), (torch.bfloat16, torch.float32), (torch.float16, torch.float16),
               (torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32)}


ACL_FORMATS = {2: "ND", 29: "FRACTAL_NZ"}
_formats: dict = {}  # storage data_ptr -> ACL format of a tensor npu_format_cast made


def npu_format_cast(input, acl_format):
    calls.append("npu_format_cast")
    _check(acl_format in ACL_FORMATS, f"npu_format_cast: acl_format {acl_format} is not one modelled here (2, 29)")
    _check(input.is_contiguous(), "npu_format_cast: the input must be contiguous")
    out = input.clone()
    key = out.untyped_storage().data_ptr()
    _formats[key] = acl_format
    weakref.finalize(out, _formats.pop, key, None)  # a view keeps `out` alive through its _base
    return out


def format_of(t) -> str:
    return ACL_FORMATS[_formats.get(t.untyped_storage().data_ptr(), 2)] if t.numel() else "ND"


def _a2_a3() -> bool:
    return DEVICE_NAME.startswith(("Ascend910B", "Ascend910_93"))


def _rstd(x, eps):
    return torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)


def _check(cond, message):
    if not cond:
        raise RuntimeError(message)


def npu_rms_norm(self, gamma, epsilon=1e-06):
    calls.append("npu_rms_norm")
    _check(2 <= self.dim() <= 8, f"npu_rms_norm: self must have 2-8 dims, got {self.dim()}")
    pairs = A2_A3_PAIRS if _a2_a3() else {(torch.float16, torch.float16), (torch.float32, torch.float32)}
    _check((self.dtype, gamma.dtype) in pairs, f"npu_rms_norm: unsupported dtypes {self.dtype}, {gamma.dtype}")
    _check(gamma.shape == self.shape[-1:], f"npu_rms_norm: gamma shape {tuple(gamma.shape)}")
    y = OPS["rms_norm"].golden(self, gamma.float(), epsilon, "fp32").to(self.dtype)  # fp32 math, one cast
    return y, _rstd(self, epsilon)


def npu_add_rms_norm(x1, x2, gamma, epsilon=1e-06):
    calls.append("npu_add_rms_norm")
    _check(1 <= x1.dim() <= 8 and x1.shape == x2.shape, "npu_add_rms_norm: x1/x2 must match, 1-8 dims")
    _check(x1.numel() > 0, "npu_add_rms_norm: empty tensors are not supported")
    _check(gamma.dtype == x1.dtype and gamma.shape == x1.shape[-1:], "npu_add_rms_norm: gamma must be [D] of x1's dtype")
    _check(_a2_a3() or x1.dtype != torch.bfloat16, "npu_add_rms_norm: no bfloat16 on this chip")
    y, x = OPS["add_rms_norm"].golden(x1, x2, gamma, epsilon, "fp32")
    return y, _rstd(x, epsilon), x


def npu_add_rms_norm_dynamic_quant(x1, x2, gamma, *, smooth_scale1=None, smooth_scale2=None, beta=None,
                                   epsilon=1e-06, output_mask=None, y_dtype=None):
    calls.append("npu_add_rms_norm_dynamic_quant")
    _check(_a2_a3(), "npu_add_rms_norm_dynamic_quant: Atlas A2/A3 only")
    _check(2 <= x1.dim() <= 8 and x1.shape == x2.shape, "npu_add_rms_norm_dynamic_quant: x1/x2 must match, 2-8 dims")
    _check(x1.numel() > 0, "npu_add_rms_norm_dynamic_quant: empty tensors are not supported")
    _check(x1.dtype in (torch.float16, torch.bfloat16), "npu_add_rms_norm_dynamic_quant: fp16/bf16 only")
    for name, t in (("gamma", gamma), ("smooth_scale1", smooth_scale1), ("smooth_scale2", smooth_scale2),
                    ("beta", beta)):
        _check(t is None or (t.dtype == x1.dtype and t.shape == x1.shape[-1:]), f"{name} must be [D] of x1's dtype")
    _check(y_dtype in (None, torch.int8, torch.quint4x2), f"y_dtype {y_dtype} not supported")
    int4 = y_dtype == torch.quint4x2
    _check(not int4 or x1.shape[-1] % 8 == 0, "int4 needs the last dim divisible by 8")
    if output_mask is not None:
        _check(len(output_mask) == 2 and any(output_mask), "output_mask: two bools, not both False")
        _check(smooth_scale1 is None or output_mask[0], "smooth_scale1 given but output_mask[0] is False")
        _check(smooth_scale2 is None or output_mask[1], "smooth_scale2 given but output_mask[1] is False")
        out1, out2 = output_mask
    else:
        out1, out2 = True, smooth_scale1 is not None and smooth_scale2 is not None
    dst = "int4" if int4 else "int8"
    x_out = x1 + x2
    n = normalise(x_out, gamma, beta, epsilon)
    results = []
    for wanted, smooth in ((out1, smooth_scale1), (out2, smooth_scale2)):
        if not wanted:
            results.append((torch.empty(0, dtype=torch.int32 if int4 else torch.int8), torch.empty(0)))
            continue
        y, s = quantize_rows(n if smooth is None else n * smooth.float(), dst)
        results.append((pack_int4_to_int32(y) if int4 else y, s))
    (y1, s1), (y2, s2) = results
    return y1, y2, x_out, s1, s2


def npu_quant_matmul(x1, x2, scale, *, offset=None, pertoken_scale=None, bias=None, output_dtype=None):
    calls.append("npu_quant_matmul")
    _check(x1.dtype == torch.int8 and x2.dtype == torch.int8, "npu_quant_matmul: x1/x2 must be int8 here")
    _check(2 <= x1.dim() <= 6 and 2 <= x2.dim() <= 6, "npu_quant_matmul: x1/x2 must have 2-6 dims")
    _check(x1.numel() > 0 and x2.numel() > 0 and scale.numel() > 0, "npu_quant_matmul: empty x1, x2 or scale")
    _check(format_of(x1) == "ND", "npu_quant_matmul: x1 must be ND")
    # 约束说明: the inference series must transpose x2 before the NZ cast (A2/A3: recommended not to)
    _check(_a2_a3() or format_of(x2) != "FRACTAL_NZ" or not x2.is_contiguous(),
           "npu_quant_matmul: an NZ x2 must be cast from the [n, k] weight and passed transposed on Atlas inference "
           "series chips")
    m, k = x1.shape[-2:]
    k2, n = x2.shape[-2:]
    _check(k == k2, f"npu_quant_matmul: x1 [.., {k}] and x2 [{k2}, ..] disagree on k")
    # 约束说明: "x1与x2最后一维的shape大小不能超过65535"
    _check(k <= 65535 and n <= 65535, f"npu_quant_matmul: last dims {k} (x1) and {n} (x2) must not exceed 65535")
    _check(scale.dim() == 1 and scale.shape[0] in (1, n), f"npu_quant_matmul: scale shape {tuple(scale.shape)}")
    _check(offset is None, "npu_quant_matmul: offset is not documented with a float output")
    if pertoken_scale is not None:
        _check(_a2_a3(), "npu_quant_matmul: pertoken_scale is not supported on this chip")
        _check(pertoken_scale.dtype == torch.float32 and tuple(pertoken_scale.shape) == (m,),
               f"npu_quant_matmul: pertoken_scale must be float32 [{m}]")
    if pertoken_scale is None:
        return _static_quant_matmul(x1, x2, scale, bias, output_dtype, n)
    # table 2 (Atlas A2/A3) rows with pertoken_scale float32: output bfloat16 with scale float32/bfloat16, bias
    # int32/bfloat16/float32/None; output float16 with scale float32, bias int32/bfloat16/float32/None (no float16 bias)
    rows = {torch.bfloat16: ({torch.float32, torch.bfloat16}, {torch.int32, torch.bfloat16, torch.float32}),
            torch.float16: ({torch.float32}, {torch.int32, torch.bfloat16, torch.float32})}
    _check(output_dtype in rows and pertoken_scale is not None, "npu_quant_matmul: only the documented "
           "pertoken rows (output bfloat16 or float16) are modelled here")
    scales, biases = rows[output_dtype]
    _check(scale.dtype in scales, f"npu_quant_matmul: scale {scale.dtype} with output {output_dtype}")
    _check(bias is None or (bias.dtype in biases and tuple(bias.shape) == (n,)),
           f"npu_quant_matmul: bias {bias.dtype if bias is not None else None} [n] with output {output_dtype} is not "
           f"a documented combination")
    _check(bias is None or bias.dtype != torch.int32, "npu_quant_matmul: an int32 bias is not modelled here")
    return OPS["quant_matmul"].golden(x1, x2.transpose(-1, -2), pertoken_scale, scale.float().expand(n), bias,
                                  output_dtype)


def _static_quant_matmul(x1, x2, scale, bias, output_dtype, n):
    """npu_quant_matmul without pertoken_scale: bf16 output with an fp32 scale, fp16 output with an int64 one; an
    int32 bias added to the accumulator."""
    wanted = {torch.bfloat16: torch.float32, torch.float16: torch.int64}
    _check(output_dtype in wanted, f"npu_quant_matmul: output {output_dtype} without pertoken_scale is not modelled")
    _check(scale.dtype == wanted[output_dtype], f"npu_quant_matmul: scale {scale.dtype} with output {output_dtype}")
    _check(output_dtype != torch.bfloat16 or _a2_a3(), "npu_quant_matmul: bfloat16 output on A2/A3 only")
    _check(bias is None or (bias.dtype == torch.int32 and tuple(bias.shape) == (n,)),
           "npu_quant_matmul: bias int32 [n]")
    if scale.dtype == torch.int64:  # npu_trans_quant_param's encoding: bit 46 set, the 19-bit fp32 scale below
        _check(bool(((scale >> 46) & 1).all()), "npu_quant_matmul: an int64 scale not made by npu_trans_quant_param")
        low = scale & 0xFFFFFFFF
        scale = torch.where(low >= 2 ** 31, low - 2 ** 32, low).to(torch.int32).view(torch.float32)
    return OPS["quant_matmul_static"].golden(x1, x2.transpose(-1, -2), scale.expand(n), bias, output_dtype)


def _per_channel(n, scales, zero_points, div_mode):
    v = n / scales.float() if div_mode else n * scales.float()
    if zero_points is not None:
        v = v + zero_points.float()
    return torch.round(v).clamp(-128, 127).to(torch.int8)


def npu_add_rms_norm_quant(x1, x2, gamma, scales1, zero_points1=None, beta=None, scales2=None, zero_points2=None, *,
                           axis=-1, epsilon=1e-06, div_mode=True):
    calls.append("npu_add_rms_norm_quant")
    _check(1 <= x1.dim() <= 8 and x1.shape == x2.shape, "npu_add_rms_norm_quant: x1/x2 must match, 1-8 dims")
    _check(x1.numel() > 0, "npu_add_rms_norm_quant: empty tensors are not supported")
    _check(x1.dtype in (torch.float16, torch.bfloat16), "npu_add_rms_norm_quant: fp16/bf16 only")
    _check(_a2_a3() or x1.dtype != torch.bfloat16, "npu_add_rms_norm_quant: no bfloat16 on this chip")
    _check(scales2 is None and zero_points2 is None, "npu_add_rms_norm_quant: scales2/zero_points2 must be None")
    _check(axis == -1, "npu_add_rms_norm_quant: axis must be -1")
    D = x1.shape[-1]
    # the dtype table (各产品型号支持数据类型说明): x1 float16 -> gamma/beta float16, scales float32, zero_points int32;
    # x1 bfloat16 (A2/A3) -> gamma, beta, scales and zero_points all bfloat16; shapes those of gamma ([D])
    table = {torch.float16: (torch.float16, torch.float32, torch.int32),
             torch.bfloat16: (torch.bfloat16, torch.bfloat16, torch.bfloat16)}
    vector_t, scale_t, zero_t = table[x1.dtype]
    for name, t, want in (("gamma", gamma, vector_t), ("beta", beta, vector_t), ("scales1", scales1, scale_t),
                          ("zero_points1", zero_points1, zero_t)):
        _check(t is None or (t.dtype == want and tuple(t.shape) == (D,)),
               f"npu_add_rms_norm_quant: {name} {t.dtype if t is not None else None} {tuple(t.shape) if t is not None else ''}"
               f" with x1 {x1.dtype}; the documented table has {want} [{D}]")
    # 约束说明: on Atlas inference series, x1's last dim and every vector's element count >= 32
    _check(_a2_a3() or D >= 32, f"npu_add_rms_norm_quant: last dim {D} < 32 on Atlas inference series chips")
    _check(not div_mode or bool((scales1 != 0).all()), "npu_add_rms_norm_quant: scales1 must not be 0 with div_mode")
    x_out = x1 + x2
    y1 = _per_channel(normalise(x_out, gamma, beta, epsilon), scales1, zero_points1, div_mode)
    return y1, torch.empty(0, dtype=torch.int8), x_out


def npu_quantize(input, scales, zero_points, dtype, axis=1, div_mode=True):
    calls.append("npu_quantize")
    _check(dtype == torch.qint8, f"npu_quantize: dtype {dtype} is not modelled here (torch.qint8)")
    _check(input.numel() > 0, "npu_quantize: empty tensors are not supported")
    _check(axis in (-1, input.dim() - 1), "npu_quantize: only the last axis is modelled here")
    D = input.shape[-1]
    _check(scales.shape in ((D,), (1,)) and (zero_points is None or zero_points.shape == scales.shape),
           "npu_quantize: scales/zero_points must be [D] or [1]")
    _check(input.dtype in ((torch.float32, torch.float16, torch.bfloat16) if _a2_a3() else (torch.float32,
                                                                                            torch.float16)),
           f"npu_quantize: self {input.dtype} not supported on this chip")
    if div_mode:  # the div_mode=True dtypes of scales and zero_points, per chip series
        scale_ok = (torch.float32, torch.bfloat16) if _a2_a3() else (torch.float32,)
        zero_ok = (torch.int8, torch.uint8, torch.int32) + ((torch.bfloat16,) if _a2_a3() else ())
        _check(scales.dtype in scale_ok, f"npu_quantize: scales {scales.dtype} with div_mode=True; documented: "
                                         f"{', '.join(map(str, scale_ok))}")
        _check(zero_points is None or zero_points.dtype in zero_ok,
               f"npu_quantize: zero_points {zero_points.dtype} with div_mode=True; documented: "
               f"{', '.join(map(str, zero_ok))}")
    else:  # div_mode=False: scales and zero_points of self's dtype
        _check(scales.dtype == input.dtype and (zero_points is None or zero_points.dtype == input.dtype),
               "npu_quantize: scales/zero_points must have self's dtype with div_mode=False")
    return _per_channel(input.float(), scales, zero_points, div_mode)


def trans_quant_scale(scale, round_mode=0):
    """The fp32 scale npu_trans_quant_param leaves (torch_npu-npu_trans_quant_param.md, 计算公式): round_mode 1 rounds
    the bit pattern to its upper 19 bits (sign, exponent, 10 mantissa bits), round_mode 0 truncates to them."""
    bits = scale.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    if round_mode == 1:
        bits = bits + 0x1000
    bits = bits & 0xFFFFE000
    return torch.where(bits >= 2 ** 31, bits - 2 ** 32, bits).to(torch.int32).view(torch.float32)


def npu_trans_quant_param(scale, offset=None, round_mode=0):
    calls.append("npu_trans_quant_param")
    _check(scale.dtype == torch.float32 and offset is None, "npu_trans_quant_param: fp32 scale, no offset here")
    _check(round_mode in (0, 1), f"npu_trans_quant_param: round_mode {round_mode} (0 or 1)")
    # out = (scale's upper 19 bits) | (1 << 46), the fp32 bits in the low 32
    bits = trans_quant_scale(scale, round_mode).view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    return bits | (1 << 46)


def npu_swiglu(input, dim=-1):
    calls.append("npu_swiglu")
    _check(_a2_a3(), "npu_swiglu: Atlas A2/A3 only")
    _check(1 <= input.dim() <= 8, f"npu_swiglu: input must have 1-8 dims, got {input.dim()}")
    _check(input.numel() > 0 and input.is_contiguous(), "npu_swiglu: empty or non-contiguous input")
    _check(input.dtype in (torch.float32, torch.float16, torch.bfloat16), f"npu_swiglu: dtype {input.dtype}")
    _check(input.shape[dim] % 2 == 0, f"npu_swiglu: dim {dim} of size {input.shape[dim]} is odd")
    a, b = input.chunk(2, dim=dim)
    return OPS["swiglu"].golden(a, b, "fp32")  # computed in fp32, rounded once


def npu_gelu(input, approximate="none"):
    """torch_npu-npu_gelu.md: GELU in the form asked for ('none': erf, 'tanh'), the output in input's dtype; input
    up to 8 dims; Atlas A2 fp32/fp16/bf16, the training and inference series fp16/fp32 (Atlas A3 is not on its
    page)."""
    calls.append("npu_gelu")
    _check(not DEVICE_NAME.startswith(("Ascend910_93", "Ascend950")), f"npu_gelu: {DEVICE_NAME} is not on its page")
    _check(input is not None and input.dim() <= 8, "npu_gelu: input must be a tensor of at most 8 dims")
    dtypes = (torch.float32, torch.float16) + ((torch.bfloat16,) if _a2_a3() else ())
    _check(input.dtype in dtypes, f"npu_gelu: dtype {input.dtype}")
    _check(approximate in ("none", "tanh"), f"npu_gelu: approximate {approximate!r}; expected 'none' or 'tanh'")
    return torch.nn.functional.gelu(input, approximate=approximate)  # the form asked, in input's dtype


def npu_dynamic_quant(x, *, smooth_scales=None, group_index=None, dst_type=None):
    """The documented formula: scale = rowMax(|x * smooth|) / DTYPE_MAX, y = round(x * smooth / scale)."""
    calls.append("npu_dynamic_quant")
    _check(_a2_a3(), "npu_dynamic_quant: Atlas A2/A3 only")
    _check(x.dim() > 1 and x.numel() > 0, f"npu_dynamic_quant: x must be non-empty and >1-D, got {tuple(x.shape)}")
    _check(x.dtype in (torch.float16, torch.bfloat16), f"npu_dynamic_quant: dtype {x.dtype}")
    _check(group_index is None, "npu_dynamic_quant: grouped (MoE) smooth scales are not modelled here")
    # 约束说明: without group_index smooth_scales is 1-D with the last dim's element count; in single-op mode of
    # input's dtype (graph mode may differ: not what the mapping runs)
    _check(smooth_scales is None or (smooth_scales.dtype == x.dtype and tuple(smooth_scales.shape) == (x.shape[-1],)),
           "npu_dynamic_quant: smooth_scales must be [D] of input's dtype (single-op mode)")
    int4 = dst_type == torch.quint4x2
    _check(dst_type in (None, torch.int8) or int4, f"npu_dynamic_quant: dst_type {dst_type}")
    _check(not int4 or x.shape[-1] % 8 == 0, "npu_dynamic_quant: int4 needs the last dim divisible by 8")
    y, scale = OPS["dynamic_quant"].golden(x, smooth_scales, "int4" if int4 else "int8")
    return (pack_int4_to_int32(y) if int4 else y), scale


def npu_dequant_swiglu_quant(x, *, weight_scale=None, activation_scale=None, bias=None, quant_scale=None,
                             quant_offset=None, group_index=None, activate_left=False, quant_mode=0, swiglu_mode=0,
                             clamp_limit=7.0, glu_alpha=1.702, glu_bias=1.0):
    """The documented formula (op-plugin's docs and test golden): x * weight_scale * activation_scale, swish of one
    half times the other, * quant_scale, dynamic: scale = row_max / 127, y = round(n * (127 / row_max))."""
    calls.append("npu_dequant_swiglu_quant")
    _check(_a2_a3(), "npu_dequant_swiglu_quant: Atlas A2/A3 only")
    _check(x.dim() == 2 and x.dtype == torch.int32 and x.shape[-1] % 2 == 0,
           f"npu_dequant_swiglu_quant: x must be int32 [T, 2H], got {x.dtype} {tuple(x.shape)}")
    T, N = x.shape
    _check(weight_scale is not None and weight_scale.dtype == torch.float32 and tuple(weight_scale.shape) == (1, N),
           "npu_dequant_swiglu_quant: weight_scale must be float32 [groupNum=1, 2H]")
    _check(activation_scale is not None and activation_scale.dtype == torch.float32
           and tuple(activation_scale.shape) == (T, 1), "npu_dequant_swiglu_quant: activation_scale must be float32 [T, 1]")
    _check(bias is None and group_index is None and quant_offset is None and quant_mode == 1 and swiglu_mode == 0,
           "npu_dequant_swiglu_quant: only dynamic, ungrouped, bias-free standard swiglu is modelled here")
    _check(quant_scale is None or (tuple(quant_scale.shape) == (1, N // 2) and quant_scale.dtype in
                                   (torch.float32, torch.float16, torch.bfloat16)),
           "npu_dequant_swiglu_quant: quant_scale float32/float16/bfloat16 [groupNum=1, H]")
    f = x.float() * weight_scale * activation_scale
    a, b = f.chunk(2, dim=-1)
    out = torch.nn.functional.silu(a) * b if activate_left else torch.nn.functional.silu(b) * a
    if quant_scale is not None:
        out = out * quant_scale.float()
    amax = out.abs().amax(-1)
    return torch.round(out * (127 / amax).unsqueeze(-1)).clamp(-128, 127).to(torch.int8), amax / 127


def npu_swiglu_quant(x, *, smooth_scales=None, offsets=None, group_index=None, activate_left=False, quant_mode=0,
                     group_list_type=0, dst_type=None):
    """The documented formula (op-plugin's docs and test golden): swish of one half times the other in fp32,
    times smooth_scales, dynamic: scale = 127 / row_max|.|, y = round(y * scale)."""
    calls.append("npu_swiglu_quant")
    _check(_a2_a3(), "npu_swiglu_quant: Atlas A2/A3 only")
    _check(x.dim() > 1 and x.shape[-1] % 2 == 0 and x.shape[-1] <= 8192,
           f"npu_swiglu_quant: x must be >1-D with an even last dim <= 8192, got {tuple(x.shape)}")
    _check(x.dtype in (torch.float32, torch.float16, torch.bfloat16), f"npu_swiglu_quant: dtype {x.dtype}")
    _check(quant_mode == 1 and group_index is None and offsets is None, "npu_swiglu_quant: only dynamic, ungrouped "
           "quantisation is modelled here")
    _check(dst_type in (None, torch.int8), "npu_swiglu_quant: only int8 is modelled here")
    # smooth_scales: float32, shape [G, N] or [G] (G groups of group_index; one group without it)
    groups = 1 if group_index is None else group_index.shape[0]
    _check(smooth_scales is None or (smooth_scales.dtype == torch.float32 and tuple(smooth_scales.shape) in
                                     ((groups, x.shape[-1] // 2), (groups,))),
           f"npu_swiglu_quant: smooth_scales {None if smooth_scales is None else tuple(smooth_scales.shape)}: "
           f"documented float32 [G, N] or [G], G = {groups}")
    a, b = x.float().chunk(2, dim=-1)
    y = torch.nn.functional.silu(a) * b if activate_left else a * torch.nn.functional.silu(b)
    if smooth_scales is not None:
        y = y * (smooth_scales.reshape(-1) if smooth_scales.shape[-1] == y.shape[-1] else smooth_scales.reshape(()))
    scale = 127.0 / y.abs().amax(-1)
    return torch.round(y * scale.unsqueeze(-1)).clamp(-128, 127).to(torch.int8), scale


def _rotary(x, r1, r2):
    """r1 * x + r2 * rotate_half(x), computed in fp32 and rounded once to x's dtype."""
    xf = x.float()
    half = x.shape[-1] // 2
    return (xf * r1.float() + torch.cat((-xf[..., half:], xf[..., :half]), -1) * r2.float()).to(x.dtype)


def npu_rotary_mul(input, r1, r2, rotary_mode="half"):
    calls.append("npu_rotary_mul")
    _check(rotary_mode == "half", f"npu_rotary_mul: rotary_mode {rotary_mode!r} (this stand-in: half)")
    _check(input.dim() == 4 and r1.dim() == 4 and r2.shape == r1.shape, "npu_rotary_mul: 4-D input, r1, r2")
    _check(input.dtype in (torch.float32, torch.float16, torch.bfloat16) and r1.dtype == input.dtype == r2.dtype,
           f"npu_rotary_mul: dtypes {input.dtype}, {r1.dtype}, {r2.dtype}")
    B, S, N, D = input.shape
    if _a2_a3():
        _check(D < 896 and D % 2 == 0 and B < 1000 and N < 1000, f"npu_rotary_mul: shape {tuple(input.shape)}")
    else:  # jit_compile=True: B and N <= 1000, D = 128
        _check(D == 128 and B <= 1000 and N <= 1000, f"npu_rotary_mul: shape {tuple(input.shape)} (D 128 only)")
    # r1, r2: "数据范围：[-1, 1]"
    _check(bool((r1.float().abs() <= 1).all() and (r2.float().abs() <= 1).all()),
           "npu_rotary_mul: r1/r2 outside [-1, 1]")
    _check(r1.shape[0] in (1, B) and r1.shape[1] == S and r1.shape[2] in (1, N) and r1.shape[3] == D,
           f"npu_rotary_mul: r1 {tuple(r1.shape)} is not 1S1D, BS1D or BSND for input {tuple(input.shape)}")
    return _rotary(input, r1, r2)


def npu_mrope(positions, query, key, cos_sin_cache, head_size, *, mrope_section=None, rotary_mode="half",
              cache_mode="default"):
    """aclnnRopeWithSinCosCache: cos, sin = cos_sin_cache[positions].chunk(2) (mrope: section i from positions[i];
    cache_mode "interleave": the page's formula, rows 1 and 2 at columns 1::3 and 2::3 up to 3 x mrope_section[1]),
    the first rot dims of each head rotated, the rest passed through; Atlas A2/A3 only."""
    calls.append("npu_mrope")
    _check(_a2_a3(), "npu_mrope: Atlas A2/A3 only")
    _check(rotary_mode == "half", f"npu_mrope: rotary_mode {rotary_mode!r} (this stand-in: half)")
    # cache_mode: RoPE takes only "default"; MRoPE "default" or "interleave", not with [16, 16, 16, 16]
    _check(cache_mode in ("default", "interleave"), f"npu_mrope: cache_mode {cache_mode!r}")
    _check(cache_mode == "default" or (positions.dim() == 2 and mrope_section not in (None, [0, 0, 0])
                                       and len(mrope_section) == 3),
           f"npu_mrope: cache_mode 'interleave' needs three MRoPE sections, got {mrope_section}")
    _check(positions.dtype in (torch.int32, torch.int64) and positions.dim() in (1, 2),
           f"npu_mrope: positions {positions.dtype} {tuple(positions.shape)}")
    _check(query.dim() == 2 and key.dim() == 2 and cos_sin_cache.dim() == 2, "npu_mrope: 2-D query, key, cache")
    _check(len({query.dtype, key.dtype, cos_sin_cache.dtype}) == 1, "npu_mrope: one dtype")
    # 约束说明: head_size and rotary_dim multiples of 32 (fp16/bf16) or 16 (fp32); mrope_section one of the
    # documented splits (or none / [0, 0, 0]: RoPE)
    multiple = 16 if query.dtype == torch.float32 else 32
    _check(head_size % multiple == 0 and cos_sin_cache.shape[-1] % multiple == 0,
           f"npu_mrope: head_size {head_size} and rotary_dim {cos_sin_cache.shape[-1]} must be multiples of {multiple}")
    _check(mrope_section in (None, [0, 0, 0], [16, 24, 24], [24, 20, 20], [8, 12, 12], [16, 16, 16, 16]),
           f"npu_mrope: mrope_section {mrope_section} is not documented")
    T = positions.shape[-1]
    rot = cos_sin_cache.shape[-1]
    _check(query.shape[0] == T and key.shape[0] == T and query.shape[1] % head_size == 0
           and key.shape[1] % head_size == 0 and rot <= head_size, "npu_mrope: shapes")
    cos, sin = cos_sin_cache.float()[positions.long()].chunk(2, dim=-1)
    if positions.dim() == 2:
        _check(positions.shape[0] == 3 and mrope_section is not None and len(mrope_section) == 3
               and 2 * sum(mrope_section) == rot, f"npu_mrope: mrope_section {mrope_section}")
        if cache_mode == "interleave":  # the page's formula: mropeSection[1] bounds both rows' columns
            n = mrope_section[1] * 3

            def interleave(t):
                out = t[0].clone()
                out[..., 1:n:3], out[..., 2:n:3] = t[1, ..., 1:n:3], t[2, ..., 2:n:3]
                return out
            cos, sin = interleave(cos), interleave(sin)
        else:
            starts = [0, mrope_section[0], mrope_section[0] + mrope_section[1], rot // 2]
            cos, sin = (torch.cat([t[i, :, starts[i]:starts[i + 1]] for i in range(3)], dim=-1)
                        for t in (cos, sin))

    def one(x):
        x3 = x.float().reshape(T, -1, head_size)
        r = x3[..., :rot]
        r1, r2 = r[..., : rot // 2], r[..., rot // 2:]
        c, s = cos[:, None, :], sin[:, None, :]
        y = torch.cat((r1 * c - r2 * s, r2 * c + r1 * s, x3[..., rot:]), dim=-1)
        return y.reshape(x.shape).to(x.dtype)
    return one(query), one(key)


def npu_apply_rotary_pos_emb(query, key, cos, sin, layout="BSND", rotary_mode="half"):
    calls.append("npu_apply_rotary_pos_emb")
    _check(layout == "BSND" and rotary_mode == "half", f"npu_apply_rotary_pos_emb: {layout}, {rotary_mode}")
    _check(all(t.dim() == 4 for t in (query, key, cos, sin)), "npu_apply_rotary_pos_emb: 4-D tensors")
    _check(len({t.dtype for t in (query, key, cos, sin)}) == 1, "npu_apply_rotary_pos_emb: one dtype")
    _check(query.dtype in (torch.float32, torch.float16, torch.bfloat16)
           and (_a2_a3() or query.dtype != torch.bfloat16),
           f"npu_apply_rotary_pos_emb: dtype {query.dtype} (no bfloat16 on Atlas inference series chips)")
    # A2/A3 and the inference series: no empty tensors, D (of all four) 128 or 64
    _check(all(t.numel() for t in (query, key, cos, sin)), "npu_apply_rotary_pos_emb: empty tensors are not supported")
    _check(query.shape[-1] in (64, 128) and cos.shape[-1] in (64, 128),
           f"npu_apply_rotary_pos_emb: D {query.shape[-1]} must be 128 or 64")
    _check(all(t.shape[:2] == query.shape[:2] and t.shape[-1] == query.shape[-1] for t in (key, cos, sin)),
           "npu_apply_rotary_pos_emb: B, S and D of query, key, cos, sin must be equal")
    _check(cos.shape[2] == 1 and sin.shape == cos.shape, f"npu_apply_rotary_pos_emb: cos {tuple(cos.shape)}")
    query.copy_(_rotary(query, cos, sin))
    key.copy_(_rotary(key, cos, sin))
    return query, key


FIA_OTHER_KEYWORDS = {"dequant_scale1", "quant_scale1", "dequant_scale2", "quant_scale2", "quant_offset2",
                      "antiquant_scale", "antiquant_offset", "block_table", "query_padding_size", "kv_padding_size",
                      "key_antiquant_scale", "key_antiquant_offset", "value_antiquant_scale", "value_antiquant_offset",
                      "key_shared_prefix", "value_shared_prefix", "actual_shared_prefix_len", "query_rope", "key_rope",
                      "key_rope_antiquant_scale", "block_size", "antiquant_mode", "softmax_lse_flag",
                      "key_antiquant_mode", "value_antiquant_mode"}  # the signature's other keywords (函数原型)


def npu_fused_infer_attention_score(query, key, value, *, pse_shift=None, atten_mask=None, actual_seq_lengths=None,
                                    actual_seq_lengths_kv=None, num_heads=1, scale=1.0, pre_tokens=2147483647,
                                    next_tokens=2147483647, input_layout="BSH", num_key_value_heads=0, sparse_mode=0,
                                    inner_precise=0, **rest):
    calls.append("npu_fused_infer_attention_score")
    _check(set(rest) <= FIA_OTHER_KEYWORDS, f"npu_fused_infer_attention_score: no keyword {sorted(set(rest) - FIA_OTHER_KEYWORDS)}")
    _check(all(v in (None, 0, False) for v in rest.values()), "stand-in: quantisation, paging, prefix and rope "
                                                              "keywords are not stood in for")
    _check(inner_precise in (0, 1, 2, 3), f"npu_fused_infer_attention_score: inner_precise {inner_precise} (0-3)")
    _check(_a2_a3(), "npu_fused_infer_attention_score: Atlas A2/A3 only")
    _check(input_layout in ("TND", "BNSD"), f"stand-in: only the TND and BNSD layouts are stood in for, got "
                                            f"{input_layout}")
    _check(query.dtype in (torch.float16, torch.bfloat16) and key.dtype == value.dtype == query.dtype,
           f"npu_fused_infer_attention_score: dtypes {query.dtype}, {key.dtype}, {value.dtype}")
    _check(all(t.is_contiguous() and t.numel() for t in (query, key, value)), "non-contiguous or empty input")
    # 约束说明 (Atlas A2/A3): Q_S > 1: B <= 65536 (<= 128 where D is not 32-byte aligned), N <= 256, D <= 512, D of a
    # 16-bit query 16-byte aligned; Q_S = 1: B <= 65536, N <= 256, D <= 512, KV_S <= 262144
    size = query.element_size()
    if input_layout == "BNSD":
        B, N, S, D = query.shape
        kv = key.shape[2]
    else:
        B, N, D = len(actual_seq_lengths or []), query.shape[1], query.shape[-1]
        S, kv = 2, 0  # TND here is a prefill (the vision attention)
    _check(B <= 65536 and N <= 256 and D <= 512, f"npu_fused_infer_attention_score: B {B}, N {N}, D {D} beyond "
                                                  f"65536, 256, 512")
    _check(S == 1 or (D * size) % 16 == 0, f"npu_fused_infer_attention_score: D {D} not 16-byte aligned")
    _check(S == 1 or (D * size) % 32 == 0 or B <= 128, f"npu_fused_infer_attention_score: B {B} > 128 with D {D} "
                                                       f"not 32-byte aligned")
    _check(S > 1 or kv <= 262144, f"npu_fused_infer_attention_score: KV_S {kv} > 262144 at Q_S 1")
    if input_layout == "BNSD":
        return _fia_bnsd(query, key, value, atten_mask, num_heads, num_key_value_heads, scale, sparse_mode,
                         inner_precise), torch.empty(1, dtype=query.dtype)
    _check(query.dim() == 3 and query.shape[1] == num_heads, f"query {tuple(query.shape)} is not [T, {num_heads}, D]")
    _check(key.shape[1] == (num_key_value_heads or num_heads) and key.shape == value.shape, "key/value heads")
    T = query.shape[0]
    _check(actual_seq_lengths is not None and list(actual_seq_lengths_kv) == list(actual_seq_lengths),
           "TND self-attention: actual_seq_lengths and actual_seq_lengths_kv given and equal")
    ends = list(actual_seq_lengths)
    _check(all(b > a for a, b in zip([0] + ends[:-1], ends)) and ends[-1] == T,
           f"actual_seq_lengths {ends[:8]}...: cumulative ends rising to T = {T}")
    # TND布局约束: at most 4096 sequences; without rope (D != 512) Q_D = K_D = V_D = 128, or Q_D = K_D = 192 with
    # V_D 128 or 192
    _check(len(ends) <= 4096, f"npu_fused_infer_attention_score: {len(ends)} sequences in TND (at most 4096)")
    dims = (query.shape[-1], key.shape[-1], value.shape[-1])
    _check(dims == (128, 128, 128) or (dims[:2] == (192, 192) and dims[2] in (128, 192)),
           f"npu_fused_infer_attention_score: TND head dims {dims} (128, or 192 for q and k)")
    _check(atten_mask is None and pse_shift is None and sparse_mode == 0 and pre_tokens == next_tokens == 2147483647,
           "stand-in: the unmasked TND call only")
    out = OPS["varlen_attention"].golden(query, key, value, [0] + ends, scale, cast_mode="fp32")
    return out, torch.empty(1, dtype=query.dtype)


def _fia_bnsd(query, key, value, atten_mask, num_heads, num_key_value_heads, scale, sparse_mode, inner_precise):
    B, N, S, D = query.shape
    Nkv, Skv = key.shape[1], key.shape[2]
    _check(query.dim() == 4 and N == num_heads and Nkv == (num_key_value_heads or num_heads) and N % Nkv == 0,
           f"BNSD: query {tuple(query.shape)}, key {tuple(key.shape)}, num_heads {num_heads}, "
           f"num_key_value_heads {num_key_value_heads}")
    # num_key_value_heads: num_heads divisible by it, the ratio at most 64
    _check(N // Nkv <= 64, f"npu_fused_infer_attention_score: {N // Nkv} query heads per KV head (at most 64)")
    # inner_precise: at Q_S = 1 only 0 and 1 (its table's note)
    _check(S > 1 or inner_precise in (0, 1), f"npu_fused_infer_attention_score: inner_precise {inner_precise} at Q_S 1")
    _check(key.shape == value.shape and key.shape[0] == B and key.shape[3] == D, "BNSD: key/value shapes")
    masked = None
    if sparse_mode == 3:
        _check(atten_mask is not None and atten_mask.dtype == torch.bool and tuple(atten_mask.shape) == (2048, 2048)
               and torch.equal(atten_mask, torch.ones(2048, 2048, dtype=torch.bool).triu(1)),
               "sparse_mode 3: atten_mask must be the 2048 x 2048 upper-triangular bool mask")
        _check(S == Skv, "stand-in: sparse_mode 3 with S == S_kv only")
        masked = atten_mask[:S, :Skv]
    elif atten_mask is not None:
        _check(sparse_mode == 0 and atten_mask.dtype == torch.bool and tuple(atten_mask.shape) == (B, 1, S, Skv),
               f"atten_mask {tuple(atten_mask.shape)} {atten_mask.dtype} with sparse_mode {sparse_mode}: expected bool "
               f"[B, 1, S, S_kv] with sparse_mode 0")
        masked = atten_mask
    # a row the mask leaves no key to (a left-padded prompt's padding rows): the page's inner_precise table says such
    # rows need its row-invalid correction (2 or 3) in a prefill; corrected, the row is zeros (torch's sdpa gives
    # zeros there too)
    empty_rows = None if masked is None else masked.all(-1)
    if empty_rows is not None and S > 1 and bool(empty_rows.any()):
        _check(inner_precise in (2, 3), "npu_fused_infer_attention_score: a mask row with no key needs inner_precise "
                                        "2 or 3 (row-invalid correction)")
    groups = N // Nkv
    k, v = (t.float().repeat_interleave(groups, dim=1) for t in (key, value))
    scores = query.float() @ k.transpose(-1, -2) * scale
    if masked is not None:
        scores = scores.masked_fill(masked, float("-inf"))
    out = scores.softmax(-1) @ v
    if empty_rows is not None:
        out = out.masked_fill(empty_rows.expand(B, N, S)[..., None], 0.0)
    return out.to(query.dtype)
