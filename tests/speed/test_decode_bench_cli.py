"""``hf-kernel-attn decode-bench --kernels saved``: a converted folder's own kernels, per layer, timed beside
softmax and a named kernel, each on its own copy of the model."""

from __future__ import annotations

import json
import shutil

import torch
from transformers import AutoModelForCausalLM

import hf_kernel_attn
from hf_kernel_attn.cli import main
from hf_kernel_attn.integration.cache import cache_bytes, new_cache
from tests.compat import cache_arg, needs_state_cache


@needs_state_cache
def test_decode_bench_saved_times_the_folders_own_kernels(tiny_llama, tmp_path, capsys):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    hf_kernel_attn.patch(model, kernel="elu", layers={
        0: {"kernel": "elu", "params": {"window": 4}},
        1: {"kernel": "elu", "params": {"window": 4, "sinks": 2, "sparse_cache": 3, "softmax_heads": [0, 1, 2, 3]}}})
    folder = tmp_path / "m"
    model.save_pretrained(folder)
    for f in tiny_llama.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, folder / f.name)
    out = tmp_path / "d.json"
    assert main(["decode-bench", "--model", str(folder), "--kernels", "saved", "elu", "--contexts", "24", "40",
                 "--steps", "1", "--output", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    by = {(r["kernel"], r["context"]): r for r in rows}
    assert set(by) == {(k, c) for k in ("softmax", "saved", "elu") for c in (24, 40)}
    # the saved row's cache is the one the folder's kernels build (sinks and cached pairs in layer 1), the same
    # bytes at both contexts once its slots are filled (block 16: the first choice at position 16); softmax's grows
    loaded = AutoModelForCausalLM.from_pretrained(folder).eval()
    cache = new_cache(loaded)
    with torch.no_grad():
        loaded(torch.randint(0, 100, (1, 24)), **cache_arg(cache), use_cache=True)
    assert by[("saved", 40)]["cache_bytes"] == by[("saved", 24)]["cache_bytes"] == cache_bytes(cache)
    assert by[("saved", 24)]["cache_bytes"] != by[("elu", 24)]["cache_bytes"]
    assert by[("softmax", 40)]["cache_bytes"] > by[("softmax", 24)]["cache_bytes"]
    assert "| saved | 24 |" in capsys.readouterr().out
