#!/usr/bin/env bash
# Conversion runs on SmolLM2-135M-Instruct for docs/results.md: for each kernel, attention transfer
# alone (configs/smollm2/<kernel>.yaml with the LoRA stage off), WikiText-2 perplexity of that model,
# then -- with PHASE=lora -- the same run resumed into its LoRA stage, and perplexity again.
# Outputs: outputs/smollm2-<kernel>/ (checkpoints, training_log.jsonl, final/) and
# docs/results/smollm2-<kernel>-<phase>.json. Resumable: rerunning continues unfinished runs.
set -euo pipefail
cd "$(dirname "$0")/../.."
DATA_DIR=${DATA_DIR:-../shared/data}
PHASE=${PHASE:-transfer}
mkdir -p docs/results
for k in ${KERNELS:-gaussian cosine hedgehog performer}; do
  out=outputs/smollm2-$k
  if [ "$PHASE" = transfer ]; then
    sets=(--set stages.lora.steps=0)
  else
    sets=()
  fi
  resume=()
  [ -e "$out/training_log.jsonl" ] && resume=(--resume)
  hf-kernel-attn finetune configs/smollm2/$k.yaml "${sets[@]}" "${resume[@]}"
  hf-kernel-attn perplexity --model "$out/final" --kernels saved \
    --data-file "$DATA_DIR/wikitext-2-raw/wiki.valid.raw" --max-tokens 2048 --block-size 256 \
    --output "docs/results/smollm2-$k-$PHASE.json"
done
