"""What this CPU can do, read once: the vector extensions that decide kernels, dtypes and figures.

Machines differ from run to run (one with AVX-512 BF16, the next with AVX2 only), so the cpu
backend builds the kernel for the level the CPU really has, benchmarks print it with every
figure, and models default to bfloat16 only where the CPU computes it natively (AVX512-BF16 or
AMX; elsewhere torch's bf16 matmul is two orders of magnitude slower than fp32).
"""
from __future__ import annotations

import functools
import os
import platform

# kernel levels, best first: (name, cpuinfo flags it needs); avx512amx is avx512bf16 with AMX tiles where a kernel
# has a tile path (varlen_attention's two products), and needs the OS to grant the tile state too (amx_permitted)
ISA_LEVELS = (
    ("avx512amx", ("avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_bf16", "fma", "f16c", "amx_tile",
                   "amx_bf16")),
    ("avx512bf16", ("avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_bf16", "fma", "f16c")),
    ("avx512", ("avx512f", "avx512bw", "avx512dq", "avx512vl", "fma", "f16c")),
    ("avx2", ("avx2", "fma", "f16c")),
    ("generic", ()),
)


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset:
    """The CPU feature flags (Linux /proc/cpuinfo); empty where they cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


@functools.lru_cache(maxsize=1)
def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def best_isa() -> str:
    """The best kernel level this CPU runs (`generic` off x86 or when flags are unknown)."""
    return next(name for name, _ in ISA_LEVELS if supports_isa(name))


def supports_isa(isa: str) -> bool:
    needs = dict(ISA_LEVELS).get(isa)
    if needs is None:
        return False
    if isa == "generic":
        return True
    return (platform.machine() in ("x86_64", "AMD64") and all(f in cpu_flags() for f in needs)
            and ("amx_tile" not in needs or amx_permitted()))


@functools.lru_cache(maxsize=1)
def amx_permitted() -> bool:
    """True where the CPU has AMX tiles and Linux has granted this process their state (arch_prctl
    ARCH_REQ_XCOMP_PERM, through torch's `_init_amx`, as oneDNN asks): without the grant the first tile instruction
    kills the process. The grant is per process, so asking once covers every thread the kernels run on."""
    import torch

    return bool(torch.cpu._is_amx_tile_supported() and torch._C._cpu._init_amx())


def native_bf16() -> bool:
    """True when the CPU computes bf16 natively (AVX512-BF16 or AMX): only then is bf16 a fast CPU dtype."""
    flags = cpu_flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def native_int8() -> bool:
    """True when the CPU has int8 dot-product instructions (AVX-512 VNNI, AVX-VNNI or AMX) and oneDNN may use
    them: only then does torch._int_mm (oneDNN) run an exact int8 GEMM faster than a float one. oneDNN capped
    below VNNI (ONEDNN_MAX_CPU_ISA=AVX2 or DNNL_MAX_CPU_ISA=AVX2, ...) counts as none: its AVX2 s8s8 GEMM saturates int16 sums
    (measured on torch 2.13: 127s x 127s over K=2048 gave 261120, not 33032192; 3.7% of the entries of
    quantised Gaussian rows wrong)."""
    for name in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):  # oneDNN honours both (DNNL_ is the older name)
        cap = os.environ.get(name, "").strip().upper()
        if cap and cap not in ("ALL", "DEFAULT") and not any(k in cap for k in ("VNNI", "AMX", "BF16", "FP16",
                                                                                "AVX10")):
            return False
    flags = cpu_flags()
    return bool({"avx512_vnni", "avx_vnni", "amx_int8"} & flags)


def capability() -> str:
    """One line for benchmark headers, e.g. 'AMD EPYC: AVX-512, AVX-512 BF16, AVX-512 VNNI (kernel avx512bf16)'."""
    flags = cpu_flags()
    names = [("avx2", "AVX2"), ("avx512f", "AVX-512"), ("avx512_bf16", "AVX-512 BF16"),
             ("avx512_vnni", "AVX-512 VNNI"), ("avx_vnni", "AVX-VNNI"), ("amx_tile", "AMX")]
    have = [label for flag, label in names if flag in flags] or ["no vector extensions known"]
    return f"{cpu_model()}: {', '.join(have)} (kernel level {best_isa()})"


@functools.lru_cache(maxsize=1)
def onednn_bf16() -> bool:
    """Whether oneDNN runs bf16 matmuls on this CPU (AVX-512 BF16 or AMX; not on AVX2-only CPUs)."""
    import torch

    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
