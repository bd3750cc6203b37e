#!/usr/bin/env bash
# The GPU launch presets, each on a few steps, on a machine with CUDA (every visible GPU): DDP and FSDP2 through
# accelerate (configs/accelerate/gpu-ddp.yaml, gpu-fsdp.yaml), DeepSpeed ZeRO-2/3 when deepspeed is installed,
# bf16 autocast throughout. MiniLM full fine-tune (sentence embeddings, gaussian) and SmolLM2 hedgehog + window 64
# transfer + LoRA. Results (exit codes, last log lines) go to ${OUT:-gpu-check}/summary.txt. Under 10 minutes on one
# H200.
#   bash scripts/gpu_check.sh [DATA_DIR]
set -uo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
data=${1:-$here/../shared/data}
cd "$here"
out=${OUT:-gpu-check}
mkdir -p "$out"
gpus=$(python -c "import torch; print(torch.cuda.device_count())")
[ "$gpus" -ge 1 ] || { echo "no CUDA device"; exit 1; }
presets=(gpu-ddp gpu-fsdp)
python -c "import deepspeed" 2>/dev/null && presets+=(gpu-deepspeed-zero2 gpu-deepspeed-zero3)
minilm=(configs/minilm/embeddings-gaussian.yaml --set "data.train=[\"$data/stsb/train.tsv\"]"
        --set stages.transfer.steps=20 --set stages.full.steps=20 --set stages.transfer.max_minutes=null
        --set stages.full.max_minutes=null --set threads=null --set budget_clock=wall --set sharding=fsdp)
smollm2=(configs/smollm2/hedgehog-window64.yaml
         --set "data.train=[\"$data/tinyshakespeare/train.txt\",\"$data/ptb/ptb.valid.txt\"]"
         --set stages.transfer.steps=20 --set stages.lora.steps=20 --set stages.transfer.max_minutes=null
         --set stages.lora.max_minutes=null --set threads=null --set budget_clock=wall)
: > "$out/summary.txt"
for preset in "${presets[@]}"; do
  for job in minilm smollm2; do
    args=("${minilm[@]}"); [ $job = smollm2 ] && args=("${smollm2[@]}")
    [ $job = smollm2 ] && [ $preset = gpu-fsdp ] && continue  # FSDP: the full fine-tune
    [ $preset = gpu-fsdp ] && args+=(--set stages.transfer.steps=0)  # accelerate's FSDP runs the full stage alone
    run="$out/$preset-$job"
    rm -rf "$run"
    timeout 240 accelerate launch --config_file "configs/accelerate/$preset.yaml" --num_processes "$gpus" \
      -m hf_kernel_attn.cli finetune "${args[@]}" --set output_dir="$run" --set mixed_precision=bf16 \
      > "$run.log" 2>&1
    rc=$?
    { echo "== $preset $job: exit $rc"; tail -n 2 "$run/training_log.jsonl" 2>/dev/null; tail -n 1 "$run/validation.jsonl" 2>/dev/null
      [ $rc = 0 ] || tail -n 20 "$run.log"; } >> "$out/summary.txt"
  done
done
cat "$out/summary.txt"
