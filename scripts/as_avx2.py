"""Run a pypto-gym command as if this CPU had AVX2 only (no AVX-512, VNNI, AMX): an emulation for the README's
AVX2 figures when no AVX2-only machine is at hand, e.g.

    python scripts/as_avx2.py bench gemm --json docs/results/gemm_avx2_emulated.json --png /tmp/g.png
    python scripts/as_avx2.py bench e2e --quick --quant w8a8 --json docs/results/e2e_avx2_emulated.json

pypto-gym sees the CPU flags without the AVX-512 / VNNI / AMX ones (so its kernels build at the avx2 level,
models default to float32, and the int8 linears take the no-VNNI GEMM); torch's own kernels are capped too:
ATen at ATEN_CPU_CAPABILITY=avx2, oneDNN at ONEDNN_MAX_CPU_ISA=AVX2, MKL at MKL_ENABLE_INSTRUCTIONS=AVX2,
all set before torch is imported. What it cannot hide: the caps are the libraries' own and the cores are
this machine's (clock, caches, memory), so a real AVX2-only CPU still has to confirm the figures.
"""
import os
import sys

CAPS = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
HIDDEN = ("avx512", "vnni", "amx")  # any flag containing one of these


def main(argv) -> int:
    os.environ.update(CAPS)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from pypto_gym import hardware

    flags = hardware.cpu_flags()
    avx2_only = frozenset(f for f in flags if not any(h in f for h in HIDDEN))
    hardware.cpu_flags.cache_clear()
    hardware.cpu_flags = lambda: avx2_only
    print(f"as_avx2: hiding {len(flags) - len(avx2_only)} CPU flags ({hardware.capability()}); "
          + ", ".join(f"{k}={v}" for k, v in CAPS.items()), flush=True)
    from pypto_gym.cli import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
