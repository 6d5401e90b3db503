// The Python module of the cpu kernels: every op source's PG_KERNELS bindings, and the level compiled.
// backend.py builds it as one translation unit that includes every pypto_gym/kernels/cpu/*.cpp before this file.
#include "common.h"

namespace {

// Which vector path this build compiled (reported by the benchmarks; checked against the CPU by cpu.py).
std::string isa() {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(PG_SIMD)
  return "avx512amx";
#elif defined(__AVX512BF16__) && defined(PG_SIMD)
  return "avx512bf16";
#elif defined(__AVX512F__) && defined(PG_SIMD)
  return "avx512";
#elif defined(PG_SIMD)
  return "avx2";
#else
  return "generic";
#endif
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  for (auto reg : pg_registrars()) reg(m);
  m.def("isa", &isa, "the instruction-set level this build was compiled for");
}
