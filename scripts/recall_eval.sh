#!/usr/bin/env bash
# Issue 22's comparison for one model: held-out perplexity and zero-shot tasks (first 200 examples / windows of
# the validation files in ../shared/data) and the passkey at 1k-4k tokens, appended to one JSONL file.
#   bash scripts/recall_eval.sh NAME MODEL_DIR [eval options, e.g. --kernel softmax --param window=64]
# Results: docs/results/recall/NAME.jsonl. One torch thread (run two at once on two cores).
set -euo pipefail
name=$1; model=$2; shift 2
out=docs/results/recall/$name.jsonl
mkdir -p docs/results/recall
data=${DATA_DIR:-../shared/data}
hf-kernel-attn eval --model "$model" "$@" --tasks wikitext2 arc_easy lambada_openai --data-dir "$data" \
  --split validation --limit 200 --context 512 --threads 1 --output "$out"
hf-kernel-attn eval --model "$model" "$@" --tasks passkey --lengths 1024 2048 4096 --samples "${SAMPLES:-2}" \
  --threads 1 --output "$out"
