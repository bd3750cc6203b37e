"""The one kernel-option syntax of every command (hf_kernel_attn.kernel_args): ``NAME:KEY=VALUE,...`` and
``--param [NAME.]KEY=VALUE``, its precedence, its errors, and the options reaching the model through the CLI
(compared with the library patched directly)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hf_kernel_attn.kernel_args import (
    format_kernel_spec,
    parse_kernel_spec,
    parse_param,
    resolve_kernels,
)

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
WIKI = DATA / "wikitext-2-raw" / "wiki.valid.raw"


def test_a_spec_is_a_name_and_json_values():
    assert parse_kernel_spec("hedgehog") == ("hedgehog", {})
    assert parse_kernel_spec("hedgehog:window=64,sinks=4,window_mix=true,label=abc") == (
        "hedgehog", {"window": 64, "sinks": 4, "window_mix": True, "label": "abc"})
    assert parse_param("window=64") == (None, "window", 64)
    assert parse_param("performer.num_features=128") == ("performer", "num_features", 128)
    assert parse_param("softmax.softmax_heads=[0,3]") == ("softmax", "softmax_heads", [0, 3])


def test_format_reads_back():
    for spec in ("elu", "hedgehog:window=64,sinks=4", "softmax:window=64,window_mix=true"):
        assert format_kernel_spec(*parse_kernel_spec(spec)) == spec


def test_precedence_inline_then_named_then_every_kernel_but_softmax():
    got = resolve_kernels(["softmax", "hedgehog:window=8", "elu"],
                          ["window=4", "sinks=2", "elu.sinks=1", "softmax.window=16"], softmax="softmax")
    assert got == [("softmax", {"window": 16}), ("hedgehog", {"window": 8, "sinks": 2}),
                   ("elu", {"window": 4, "sinks": 1})]


@pytest.mark.parametrize(("specs", "params", "message"), [
    (["hedgehog:window"], [], "expected name:key=value"),
    ([":window=3"], [], "no kernel name"),
    (["elu"], ["window"], "--param expects KEY=VALUE or KERNEL.KEY=VALUE"),
    (["elu"], ["hedgehog.window=3"], "does not run"),
])
def test_bad_syntax_names_the_part_and_the_valid_form(specs, params, message):
    with pytest.raises(ValueError, match=message):
        resolve_kernels(specs, params, softmax="softmax")


def test_perplexity_command_applies_the_options_as_written(tiny_llama, tmp_path):
    """`perplexity --kernels softmax elu:window=8 --param window=4 --param softmax.window=16` scores softmax with
    a 16-token window and elu with an 8-token window: the numbers equal the library's with those options."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import hf_kernel_attn
    from hf_kernel_attn.cli import main
    from hf_kernel_attn.evaluation.perplexity import perplexity, read_text

    out = tmp_path / "ppl.json"
    assert main(["perplexity", "--model", str(tiny_llama), "--kernels", "softmax", "elu:window=8",
                 "--param", "window=4", "--param", "softmax.window=16", "--data-file", str(WIKI),
                 "--block-size", "64", "--max-tokens", "192", "--threads", "1", "--output", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["kernel"] for r in rows] == ["softmax", "elu:window=8"]
    model = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    text = read_text(WIKI)
    want = []
    for kernel, options in (("softmax", {"window": 16}), ("elu", {"window": 8})):
        hf_kernel_attn.patch(model, kernel=kernel, **options)
        with torch.no_grad():
            want.append(perplexity(model, tok, text, block_size=64, max_tokens=192)["perplexity"])
    assert [r["perplexity"] for r in rows] == pytest.approx(want, rel=1e-6)
    # the options matter: without them the numbers differ (the check above could not pass by accident)
    hf_kernel_attn.patch(model, kernel="elu")
    assert perplexity(model, tok, text, block_size=64, max_tokens=192)["perplexity"] != pytest.approx(want[1])
