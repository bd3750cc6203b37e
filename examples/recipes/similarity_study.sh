#!/usr/bin/env bash
# The association benchmarks of docs/similarity.md: 3 settings x 6 kernels x 3 seeds, one thread each,
# resumable (finished runs in the results file are skipped), then the mean ± std table and the leaderboard.
# Seeds are the outer loop, so a partial sweep already covers every setting and kernel.
# Usage: bash examples/recipes/similarity_study.sh [RESULTS_DIR]   (default outputs/similarity)
# The measured sweep ran as: OMP_NUM_THREADS=1 taskset -c 1 bash examples/recipes/similarity_study.sh outputs/similarity
# (about 75 CPU-minutes for the 54 runs; CPU-seconds per run are in each record and in the table).
set -euo pipefail
OUT=${1:-outputs/similarity}
mkdir -p "$OUT"
KERNELS="softmax gaussian cosine elu hedgehog performer"
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
for SEED in 0 1 2; do
  hf-kernel-attn synthetic mqar --setting mqar-short mqar-long --kernel $KERNELS --seed $SEED \
    --threads 1 --output "$OUT/results.jsonl"
  hf-kernel-attn synthetic listops --setting listops --kernel $KERNELS --seed $SEED \
    --threads 1 --output "$OUT/results.jsonl"
done
python -m hf_kernel_attn.similarity.report "$OUT/results.jsonl" --output-dir "$OUT"
