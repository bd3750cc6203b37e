"""Where the asked needle of an eval prompt sits, for the probes beside this file that ask what a cache holds of
it (``sparse_cache_probe.py``, ``attention_received_probe.py``). Not part of the package: the probes run as
scripts from this folder and import it by name."""

from __future__ import annotations

from hf_kernel_attn.evaluation.long_context.base import TASKS, Sample
from hf_kernel_attn.evaluation.long_context.niah import NEEDLE as NIAH_NEEDLE
from hf_kernel_attn.evaluation.long_context.passkey import NEEDLE as PASSKEY_NEEDLE
from hf_kernel_attn.evaluation.long_context.runner import TokenizedText, bos_ids, read_filler_text

NEEDLE_TASKS = ("passkey", "niah")


def probe_prompts(task: str, tokenizer, data_dir=None):
    """A function ``(length, depth, index) -> (sample, span, digits)``: the eval's own prompt of that cell (seed 0, its
    ``index``-th sample), the token positions of its asked needle and those of the needle's digit tokens. niah reads
    its filler text (WikiText-2 validation) from ``data_dir`` once."""
    if task not in NEEDLE_TASKS:
        raise ValueError(f"probe prompts are built for {NEEDLE_TASKS}, got {task!r}")

    def encode(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    filler = {}
    if task == "niah":
        natural = TokenizedText(tokenizer, read_filler_text(data_dir, "validation"))
        filler = {"text_ids": natural}

    def prompt(length: int, depth: int, index: int = 0) -> tuple[Sample, range, set[int]]:
        sample = TASKS[task].samples(encode, length, depth, index + 1, 0, bos=bos_ids(tokenizer), **filler)[index]
        key = sample.answers[0]
        needle = (NIAH_NEEDLE.format(key=sample.extra["key"], value=key) if task == "niah"
                  else PASSKEY_NEEDLE.format(key=key))
        span = range(sample.needle_start, sample.needle_start + len(encode(needle)))
        digits = {i for i in span if tokenizer.decode([sample.ids[i]]).strip().isdigit()}
        return sample, span, digits

    return prompt
