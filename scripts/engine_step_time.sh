#!/usr/bin/env bash
# Step time of the SmolLM2 hedgehog + window 64 preset's transfer and LoRA stages under two checkouts of this
# package, run side by side (one torch thread each) for ROUNDS rounds; prints the median seconds per step of each
# stage, excluding each stage's first step.
#   bash scripts/engine_step_time.sh OLD_CHECKOUT NEW_CHECKOUT BASE_MODEL_DIR [STEPS] [ROUNDS]
# BASE_MODEL_DIR: SmolLM2 converted from GGUF once (a run's output_dir/base-model).
set -euo pipefail
old=$1 new=$2 base=$3 steps=${4:-8} rounds=${5:-2}
work=$(mktemp -d)
here=$(cd "$(dirname "$0")/.." && pwd)
for r in $(seq "$rounds"); do
  for side in old new; do
    dir=${!side}
    (cd "$dir" && PYTHONPATH="$dir" OMP_NUM_THREADS=1 python -m hf_kernel_attn.cli finetune \
      "$here/configs/smollm2/hedgehog-window64.yaml" --set model="$base" --set gguf_file=null \
      --set "data.train=[\"$here/../shared/data/tinyshakespeare/train.txt\",\"$here/../shared/data/ptb/ptb.valid.txt\"]" \
      --set stages.transfer.steps="$steps" --set stages.lora.steps="$steps" --set stages.transfer.max_minutes=null \
      --set stages.lora.max_minutes=null --set validate=false --set save_every=0 --set log_with=none \
      --set output_dir="$work/$side-$r" > "$work/$side-$r.log" 2>&1) &
  done
  wait
done
python - "$work" "$rounds" <<'PY'
import json, statistics, sys
from pathlib import Path
work, rounds = Path(sys.argv[1]), int(sys.argv[2])
for side in ("old", "new"):
    per = {}
    for r in range(1, rounds + 1):
        rows = [json.loads(ln) for ln in (work / f"{side}-{r}" / "training_log.jsonl").read_text().splitlines()]
        for stage in ("transfer", "lora"):
            s = [x for x in rows if x["stage"] == stage]
            per.setdefault(stage, []).extend(b["seconds"] - a["seconds"] for a, b in zip(s, s[1:]))
    print(json.dumps({"side": side, **{f"{k}_s_per_step": round(statistics.median(v), 3) for k, v in per.items()}}))
PY
