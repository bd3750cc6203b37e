"""A checkpoint's config.json is a downloaded file: hostile or careless kernel options in it are refused by stock
``AutoModelForCausalLM.from_pretrained`` before anything is allocated, and the large values that are accepted cost
what the cache holds, not what the config says.

Each case edits the config.json of a converted SmolLM2-135M-Instruct (hedgehog, window 64, 4 sinks, sparse cache 64,
block 8) and loads it with the stock call after ``import hf_kernel_attn``. The table of docs/robustness.md ("Hostile
values in a checkpoint's config") is built from these outcomes; ``HF_KERNEL_ATTN_WRITE_DOCS=1 pytest
tests/integration/test_hostile_config.py`` rewrites it, a plain run fails when the doc and the outcomes differ."""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import hf_kernel_attn
from hf_kernel_attn.integration.cache import cache_bytes
from tests.paths import REPO

BASE = {"window": 64, "sinks": 4, "sparse_cache": 64, "sparse_block": 8}
PROMPT = 120  # tokens; 120 - 63 = 57 keys have left the window after it, fewer than the 64 slots of BASE
# (option, value as written into config.json, shown as): every value the docs table lists
REFUSED = [
    ("sparse_cache", 10**12, "10**12"),
    ("sparse_cache", 10**6, "10**6"),
    ("sparse_cache", 2**63, "2**63"),
    ("sparse_cache", 32769, "32769"),
    ("sparse_cache", -1, "-1"),
    ("sinks", 10**9, "10**9"),
    ("sparse_block", 10**12, "10**12"),
    ("sparse_block", 0, "0"),
    ("window", 10**12, "10**12"),
    ("chunk_size", 10**12, "10**12"),
    ("feature_dim", 10**9, "10**9"),
    ("feature_dim", 4097, "4097"),
    ("eps", math.inf, "Infinity"),
    ("eps", math.nan, "NaN"),
    ("eps", 1e300, "1e300"),
    ("eps", 0.0, "0"),
    ("eps", 1e-300, "1e-300"),
    ("softmax_heads", [99], "[99]"),
]
ACCEPTED = [("sparse_cache", 20000, "20000"), ("sparse_cache", 32768, "32768"), ("sinks", 32768, "32768"),
            ("sparse_block", 32768, "32768"), ("window", 32768, "32768")]
START, END = "<!-- hostile-values:start -->", "<!-- hostile-values:end -->"
DOC = REPO / "docs" / "robustness.md"


@pytest.fixture(scope="module")
def hostile_base(smollm2_dir, tmp_path_factory) -> Path:
    """The converted checkpoint whose config.json each case edits."""
    out = tmp_path_factory.mktemp("hostile") / "base"
    model = hf_kernel_attn.from_pretrained(smollm2_dir, kernel="hedgehog", **BASE)
    model.save_pretrained(out)
    return out


def edited(base: Path, folder: Path, option: str, value) -> Path:
    """A copy of ``base`` (weights linked) whose config.json sets the kernel option ``option`` to ``value``."""
    folder.mkdir(parents=True)
    for f in base.iterdir():
        if f.name == "model.safetensors":
            (folder / f.name).symlink_to(f)
        elif f.is_file():
            shutil.copy(f, folder / f.name)
    config = json.loads((folder / "config.json").read_text())
    config["kernel_attention"]["params"][option] = value
    (folder / "config.json").write_text(json.dumps(config))  # inf/nan as JSON's Infinity/NaN, as a file may hold
    return folder


def load(folder: Path):
    """Stock transformers loading (``import hf_kernel_attn`` registered the kernels)."""
    return AutoModelForCausalLM.from_pretrained(folder).eval()


def refusal(base: Path, tmp: Path, option: str, value) -> str:
    """The ValueError stock from_pretrained raises for the edited config (fails the test if it loads)."""
    with pytest.raises(ValueError) as info:
        load(edited(base, tmp, option, value))
    message = str(info.value)
    assert option in message, f"the error does not name {option}: {message}"
    return message


def prompt_ids() -> torch.Tensor:
    return torch.randint(100, 20000, (1, PROMPT), generator=torch.Generator().manual_seed(0))


def run(model) -> tuple[torch.Tensor, int, float]:
    """Greedy tokens of a 120-token prompt + 8, the decode cache's bytes after the prompt, and seconds taken."""
    start = time.perf_counter()
    with torch.no_grad():
        out = model(prompt_ids(), use_cache=True)
        held = cache_bytes(out.past_key_values)
        tokens = model.generate(prompt_ids(), max_new_tokens=8, do_sample=False)[0, PROMPT:]
    return tokens, held, time.perf_counter() - start


@pytest.fixture(scope="module")
def refusals(hostile_base, tmp_path_factory) -> dict[str, str]:
    """Each REFUSED value loaded once: its ``ValueError`` message, by the value as shown."""
    tmp = tmp_path_factory.mktemp("refused")
    return {f"{o}={s}": refusal(hostile_base, tmp / f"{o}-{s}", o, v) for o, v, s in REFUSED}


@pytest.mark.parametrize("option, value, shown", REFUSED, ids=[f"{o}={s}" for o, _, s in REFUSED])
def test_hostile_value_refused_at_load(refusals, option, value, shown):
    """Stock from_pretrained raised a ValueError naming the option (``refusal``) and its value."""
    message = refusals[f"{option}={shown}"]
    assert option in message
    assert str(value) in message or repr(value) in message or shown in message or option == "softmax_heads"


def per_token_bytes(model) -> int:
    """Bytes one key/value pair takes in every layer (fp32 keys and values, as the cache keeps them)."""
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    return config.num_hidden_layers * config.num_key_value_heads * head_dim * 2 * 4


def test_accepted_large_values_cost_what_is_held(hostile_base, tmp_path):
    """The largest accepted values: a 120-token generate runs well under 60 s, its decode cache holds at most the
    prompt's pairs (C = 32768 or S = 32768 slots are never allocated), and a cache larger than the keys that left the
    window gives exactly the tokens and bytes of C = 64 (both hold all 57 of them)."""
    torch.manual_seed(0)
    reference_tokens, reference_bytes, _ = run(load(hostile_base))
    for option, value, _ in ACCEPTED:
        model = load(edited(hostile_base, tmp_path / f"{option}-{value}", option, value))
        tokens, held, seconds = run(model)
        assert seconds < 60, f"{option}={value}: {seconds:.1f} s"
        # at most every prompt token's key and value in every layer (plus each layer's F x Dv state, small)
        assert held <= PROMPT * per_token_bytes(model) + reference_bytes, (option, value, held)
        if option == "sparse_cache":
            assert torch.equal(tokens, reference_tokens) and held == reference_bytes, (option, value)


def test_docs_table_is_what_loading_gives(refusals):
    rows = [f"| `{o}` | `{s}` | refused: `ValueError: {refusals[f'{o}={s}']}` |" for o, _, s in REFUSED]
    table = "\n".join(["| option | value in config.json | stock `from_pretrained` |", "|---|---|---|", *rows])
    text = DOC.read_text()
    assert START in text and END in text, f"{DOC} lacks the markers {START} … {END}"
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    current = rest.split(END, 1)[0].strip()
    if os.environ.get("HF_KERNEL_ATTN_WRITE_DOCS") == "1":
        DOC.write_text(f"{head}{START}\n{table}\n{END}{tail}")
        return
    assert current == table, ("docs/robustness.md's hostile-values table differs from what loading gives; rewrite it "
                              "with HF_KERNEL_ATTN_WRITE_DOCS=1 pytest tests/integration/test_hostile_config.py")
