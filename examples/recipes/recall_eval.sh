#!/usr/bin/env bash
# The recall comparison for one model, appended to docs/results/recall/NAME.jsonl: WikiText-2 perplexity (first
# 40 windows of 512 tokens of wiki.valid.raw), ARC-Easy and LAMBADA (first 200 examples of the development
# files) from ../shared/data, and, unless PASSKEY=0, the passkey at 1k, 2k and 4k tokens (5 depths x SAMPLES);
# NIAH=1 adds the natural-text needle (niah, single key) at the same lengths. Long-context records carry the
# decode cache bytes after the prompt and the decode ms/token. LENGTHS="1024 2048 4096 8192" sets the passkey
# lengths (default 1024 2048 4096); the niah lengths stay 1k-4k.
#   bash examples/recipes/recall_eval.sh NAME MODEL_DIR [eval options, e.g. --kernel softmax --param window=64]
# One torch thread (run two at once on two cores).
set -euo pipefail
name=$1; model=$2; shift 2
out=docs/results/recall/$name.jsonl
mkdir -p docs/results/recall
data=${DATA_DIR:-../shared/data}
common=(--data-dir "$data" --split validation --threads 1 --output "$out")
hf-kernel-attn eval --model "$model" "$@" --tasks wikitext2 --limit 40 --context 512 "${common[@]}"
hf-kernel-attn eval --model "$model" "$@" --tasks arc_easy lambada_openai --limit 200 "${common[@]}"
if [ "${PASSKEY:-1}" != 0 ]; then
  # shellcheck disable=SC2086
  hf-kernel-attn eval --model "$model" "$@" --tasks passkey --lengths ${LENGTHS:-1024 2048 4096} \
    --samples "${SAMPLES:-2}" --threads 1 --output "$out"
fi
if [ "${NIAH:-0}" = 1 ]; then
  hf-kernel-attn eval --model "$model" "$@" --tasks niah --lengths 1024 2048 4096 --samples "${SAMPLES:-2}" \
    "${common[@]}"
fi
