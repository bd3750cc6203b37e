#!/usr/bin/env bash
# Conversion runs on all-MiniLM-L6-v2 for docs/results.md:
#   TASK=embeddings: configs/minilm/embeddings-<kernel>.yaml, then STS-B Spearman (held-out pairs)
#   TASK=sst2:       configs/minilm/sst2-<kernel>.yaml, then SST-2 accuracy (held-out rows)
# Results are appended to docs/results/minilm-<task>.jsonl. Resumable: rerunning continues.
set -euo pipefail
cd "$(dirname "$0")/../.."
DATA_DIR=${DATA_DIR:-../shared/data}
TASK=${TASK:-embeddings}
mkdir -p docs/results
case $TASK in
  embeddings) kernels=${KERNELS:-gaussian cosine hedgehog elu}; evaltask=stsb_embedding;;
  sst2) kernels=${KERNELS:-softmax gaussian cosine hedgehog elu}; evaltask=sst2;;
  *) echo "TASK must be embeddings or sst2" >&2; exit 2;;
esac
for k in $kernels; do
  out=outputs/minilm-$TASK-$k
  resume=()
  [ -e "$out/training_log.jsonl" ] && resume=(--resume)
  hf-kernel-attn finetune configs/minilm/$TASK-$k.yaml "${resume[@]}"
  hf-kernel-attn eval --model "$out/final" --tasks $evaltask --data-dir "$DATA_DIR" --split validation \
    --output "docs/results/minilm-$TASK.jsonl"
done
