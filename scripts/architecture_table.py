"""Regenerate docs/architectures.md: tiny random models of many transformers architectures, each patched with
softmax, gaussian, cosine, elu and hedgehog (hf_kernel_attn/testing/architectures.py).

    python scripts/architecture_table.py [--output docs/architectures.md] [--json rows.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

INTRO = """# Architecture coverage

Which transformers architectures `hf_kernel_attn.patch` can swap the attention kernel of. For each row a tiny
random config is built with `AutoConfig.for_model(model_type, ...)` (hidden size 32, 2 layers, 4 heads, 2 KV
heads where the config has them, head dim 8, vocab 128, 128 positions; a config with a local-attention window by
default gets `sliding_window=4`, shorter than the inputs; extra per-row settings are listed below the table). The
model is built under a fixed seed with `attn_implementation="sdpa"` (`"eager"` where transformers has no SDPA
path for it) and run once on unpadded inputs (`input_ids` `[2, 12]` with an all-ones `attention_mask`;
`decoder_input_ids` `[2, 12]` for encoder-decoders; `pixel_values` `[2, 3, 32, 32]` for vision towers). Then a
deep copy is patched with each kernel and run on the same inputs. A cell is

* **ok**: the forward ran, the output is finite, every attached kernel was called, and (softmax) the output
  equals the unpatched model's within {atol:g} (max abs difference);
* **refused**: `patch` or the forward raised a `ValueError`/`NotImplementedError` from hf_kernel_attn that names
  the reason, e.g. an architecture whose attention does not dispatch through transformers' `AttentionInterface`
  (`ALL_ATTENTION_FUNCTIONS`) is refused at `patch` time, and so is a config with sliding-window attention;
* **error**, **mismatch**, **non-finite**, **not run**: any other exception, softmax differing from the
  reference, NaN/inf in the output, or kernels attached but never called (the model ran its own attention).

The error column gives the exception's first line and the file and line that raised it. Regenerate with

    python scripts/architecture_table.py

`tests/integration/test_architectures.py` runs the same harness and checks that these statuses are current.

Measured with transformers {transformers}, torch {torch} (CPU), {when}.

{summary}.
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=ROOT / "docs" / "architectures.md")
    parser.add_argument("--json", type=Path, default=None, help="also write the raw rows as JSON")
    args = parser.parse_args(argv)

    warnings.filterwarnings("ignore")
    import torch
    import transformers
    from transformers.utils import logging

    logging.set_verbosity_error()
    from hf_kernel_attn.testing import architectures as A

    def progress(row):
        status = "ok" if A.all_ok(row) else "; ".join(A.row_errors(row))[:150]
        print(f"{row['architecture']:<28} {row['seconds']:5.1f}s  {status}", file=sys.stderr, flush=True)

    start = time.perf_counter()
    rows = A.run_all(progress=progress)
    print(f"{len(rows)} architectures in {time.perf_counter() - start:.0f}s", file=sys.stderr)

    extras = [f"* {r['architecture']}: " + ", ".join(f"`{k}={v!r}`" for k, v in r["overrides"].items())
              for r in rows if r["overrides"]]
    text = INTRO.format(atol=A.SOFTMAX_ATOL, transformers=transformers.__version__, torch=torch.__version__,
                        when=time.strftime("%Y-%m-%d"), summary=A.summary(rows))
    text += "\n" + A.markdown_table(rows)
    if extras:
        text += "\nPer-row config settings on top of the tiny sizes:\n\n" + "\n".join(extras) + "\n"
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text)
    print(f"wrote {args.output}", file=sys.stderr)
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
