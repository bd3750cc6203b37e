"""``hf_kernel_attn.from_pretrained(saved_kernel_checkpoint, option=value)`` without ``kernel=``: the option
replaces the saved one in every layer running the saved kernel (as the CLI's ``--param KEY=VALUE``), is
validated, runs, and is saved again; and the file modes docs/security.md states, on real saves."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import hf_kernel_attn
from hf_kernel_attn.fileio import write_json_atomic, write_text_atomic
from hf_kernel_attn.integration.attention import KERNEL_ATTR
from hf_kernel_attn.integration.loading import with_saved_kernel_options
from hf_kernel_attn.integration.modules import attention_modules
from tests.conftest import tiny_llama_model

SAVED = {"window": 8, "sinks": 2, "sparse_cache": 4, "sparse_block": 2}
IDS = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def hedgehog_ckpt(tmp_path_factory) -> Path:
    """A tiny Llama swapped to hedgehog with :data:`SAVED`, saved."""
    model = tiny_llama_model()
    hf_kernel_attn.patch(model, kernel="hedgehog", **SAVED)
    path = tmp_path_factory.mktemp("hedgehog")
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def mixed_ckpt(tmp_path_factory) -> Path:
    """Layer 0 softmax, layer 1 hedgehog with :data:`SAVED`, saved."""
    model = tiny_llama_model()
    hf_kernel_attn.patch(model, kernel="hedgehog", layers={0: "softmax"}, **SAVED)
    path = tmp_path_factory.mktemp("mixed")
    model.save_pretrained(path)
    return path


def patched_in_memory(ckpt: Path, **options) -> torch.nn.Module:
    """The expected model: a fresh tiny Llama patched with hedgehog and ``options`` directly, with the
    checkpoint's tensors (kernel weights included) loaded from its safetensors file."""
    model = tiny_llama_model()
    hf_kernel_attn.patch(model, kernel="hedgehog", **options)
    model.load_state_dict(load_file(ckpt / "model.safetensors"), strict=True)
    return model.eval()


def kernel_options(model) -> list[dict | None]:
    """Each attention layer's attached kernel options (None where no kernel is attached)."""
    out = []
    for module in attention_modules(model):
        kernel = getattr(module, KERNEL_ATTR, None)
        out.append(None if kernel is None else vars(kernel.options))
    return out


def logits_and_decode(model) -> tuple[torch.Tensor, torch.Tensor]:
    """A full forward's logits and 12 greedily decoded steps' logits (sparse_cache matters in both)."""
    with torch.no_grad():
        full = model(IDS).logits
        out = model.generate(IDS, max_new_tokens=12, min_new_tokens=12, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
    return full, torch.stack(out.logits)


def assert_runs_like(model, expected) -> None:
    got, want = logits_and_decode(model), logits_and_decode(expected)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=1e-5)


def test_option_keyword_changes_every_kernel_layer_and_runs(hedgehog_ckpt):
    model = hf_kernel_attn.from_pretrained(hedgehog_ckpt, sparse_cache=100, window=16).eval()
    wanted = {**SAVED, "sparse_cache": 100, "window": 16}
    assert model.config.kernel_attention["params"] == wanted
    assert model.config.kernel_attention["layers"] == {}
    for options in kernel_options(model):
        assert {k: options[k] for k in wanted} == wanted
    expected = patched_in_memory(hedgehog_ckpt, **wanted)
    assert_runs_like(model, expected)
    # and it is not the saved model: the new options change the output
    with pytest.raises(AssertionError):
        assert_runs_like(model, patched_in_memory(hedgehog_ckpt, **SAVED))


def test_round_trip_saves_the_option_that_runs(hedgehog_ckpt, tmp_path):
    model = hf_kernel_attn.from_pretrained(hedgehog_ckpt, sparse_cache=100).eval()
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())["kernel_attention"]
    assert saved["params"] == {**SAVED, "sparse_cache": 100}
    again = AutoModelForCausalLM.from_pretrained(tmp_path).eval()  # stock loading, the plugin imported
    assert [o["sparse_cache"] for o in kernel_options(again)] == [100, 100]
    assert_runs_like(again, patched_in_memory(hedgehog_ckpt, **{**SAVED, "sparse_cache": 100}))


def test_same_as_the_cli_path(hedgehog_ckpt):
    """``--param KEY=VALUE`` without ``--kernel`` reaches ``kernel_params=`` / :func:`with_saved_kernel_options`;
    the keyword gives the same config, and ``kernel_params`` wins over a keyword (as with ``kernel=``)."""
    by_keyword = hf_kernel_attn.from_pretrained(hedgehog_ckpt, sparse_cache=100)
    by_params = hf_kernel_attn.from_pretrained(hedgehog_ckpt, kernel_params={"sparse_cache": 100})
    stock = AutoModelForCausalLM.from_pretrained(hedgehog_ckpt)
    direct = with_saved_kernel_options(stock.config, {"sparse_cache": 100}).kernel_attention
    assert by_keyword.config.kernel_attention == by_params.config.kernel_attention == direct
    both = hf_kernel_attn.from_pretrained(hedgehog_ckpt, sparse_cache=50, kernel_params={"sparse_cache": 100})
    assert both.config.kernel_attention == direct


def test_softmax_layers_keep_their_saved_choice(mixed_ckpt):
    model = hf_kernel_attn.from_pretrained(mixed_ckpt, window=16)
    assert model.config.kernel_attention["layers"] == {"0": "softmax"}
    assert model.config.kernel_attention["params"] == {**SAVED, "window": 16}
    first, second = kernel_options(model)
    # softmax's own window option: not given to it, as on the CLI
    assert {k: first[k] for k in ("window", "sinks", "slots")} == {"window": 0, "sinks": 0, "slots": 0}
    assert second["window"] == 16


def test_invalid_value_raises_the_kernels_own_error(hedgehog_ckpt):
    with pytest.raises(ValueError, match=r"sparse_cache.*-1"):
        hf_kernel_attn.from_pretrained(hedgehog_ckpt, sparse_cache=-1)
    with pytest.raises(ValueError, match=r"window"):
        hf_kernel_attn.from_pretrained(hedgehog_ckpt, window="wide")


@pytest.mark.parametrize("key, hint", [("sigma", None), ("sparse_cach", "sparse_cache"), ("window_mixx", "window_mix")])
def test_an_option_the_checkpoint_lacks_is_named(hedgehog_ckpt, key, hint):
    with pytest.raises(ValueError) as info:
        hf_kernel_attn.from_pretrained(hedgehog_ckpt, **{key: 1})
    text = str(info.value)
    assert f"unknown option {key!r}" in text and "'hedgehog'" in text
    assert "'sparse_block'" in text and "'feature_dim'" in text  # the valid options
    assert "with_saved_kernel_options" in text
    assert (f"did you mean {hint!r}" in text) if hint else ("did you mean" not in text)


def test_the_error_names_the_other_kernels_of_the_checkpoint(mixed_ckpt):
    with pytest.raises(ValueError, match=r"layers \[0\] run 'softmax' \(options: \['window', 'sinks', 'slots', "
                                         r"'retention', 'retention_decay', 'retention_block', 'gate_hidden', "
                                         r"'gate_bias'\]\), kept as saved"):
        hf_kernel_attn.from_pretrained(mixed_ckpt, sigma=1.0)


def test_kernel_dot_key_without_kernel_is_refused_as_on_the_cli(hedgehog_ckpt):
    with pytest.raises(ValueError, match=r"hedgehog\.window=\.\.\. names a kernel, but no kernel= is given"):
        hf_kernel_attn.from_pretrained(hedgehog_ckpt, **{"hedgehog.window": 16})


def test_transformers_keywords_go_to_transformers(hedgehog_ckpt):
    model, info = hf_kernel_attn.from_pretrained(hedgehog_ckpt, dtype=torch.bfloat16, output_loading_info=True,
                                                 sparse_cache=100)
    assert model.dtype == torch.bfloat16
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert model.config.kernel_attention["params"] == {**SAVED, "sparse_cache": 100}


def test_seed_is_an_option_of_a_performer_checkpoint(tmp_path):
    """``seed`` is no transformers keyword: on a checkpoint whose kernel has it, it is that kernel's option."""
    model = tiny_llama_model()
    hf_kernel_attn.patch(model, kernel="performer", seed=1)
    model.save_pretrained(tmp_path)
    loaded = hf_kernel_attn.from_pretrained(tmp_path, seed=7)
    assert loaded.config.kernel_attention["params"] == {"seed": 7}
    assert [o["seed"] for o in kernel_options(loaded)] == [7, 7]


def test_a_stock_checkpoint_has_no_saved_kernel_to_change(tmp_path):
    tiny_llama_model().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"no saved kernel.*name the kernel"):
        hf_kernel_attn.from_pretrained(tmp_path, sparse_cache=4)


def test_explicit_kernel_replaces_the_saved_choice_as_before(hedgehog_ckpt):
    model = hf_kernel_attn.from_pretrained(hedgehog_ckpt, kernel="hedgehog", window=16)
    assert model.config.kernel_attention["params"] == {"window": 16}
    assert [o["window"] for o in kernel_options(model)] == [16, 16]
    assert [o["sparse_cache"] for o in kernel_options(model)] == [0, 0]
    other = hf_kernel_attn.from_pretrained(hedgehog_ckpt, kernel="elu", layers=[1])
    assert other.config.kernel_attention["kernel"] == "elu"
    assert other.config.kernel_attention["layers"] == {"0": "softmax"}


# ---------------------------------------------------------------- file modes, as docs/security.md states them


@contextmanager
def umask(mask: int) -> Iterator[None]:
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


@pytest.mark.parametrize("mask", [0o022, 0o027])
def test_file_modes_are_as_documented(tmp_path, mask, minilm_dir):
    """docs/security.md: the plugin's files (and transformers' JSON) get 0666 less the umask (0644 under the usual
    022); ``model.safetensors`` gets 0600 whatever the umask, safetensors' own choice (its ``save_file`` alone
    does it); the tokenizer's files and training checkpoint files get 0666 less the umask too."""
    from transformers import AutoTokenizer

    from hf_kernel_attn.training.checkpoint import save_checkpoint

    plain = 0o666 & ~mask
    with umask(mask):
        model = tiny_llama_model()
        hf_kernel_attn.patch(model, kernel="hedgehog", **SAVED)
        model.save_pretrained(tmp_path / "model")
        tokenizer_files = AutoTokenizer.from_pretrained(minilm_dir).save_pretrained(tmp_path / "tokenizer")
        save_file({"w": torch.zeros(2)}, tmp_path / "bare.safetensors")
        write_text_atomic(tmp_path / "atomic.txt", "x")
        write_json_atomic(tmp_path / "atomic.json", {})
        ckpt = save_checkpoint(tmp_path / "run", 1, {"model.pt": {"w": torch.zeros(2)}}, {"step": 1})
    out = tmp_path / "model"
    assert plain == (0o644 if mask == 0o022 else 0o640)
    for name in ("config.json", "generation_config.json", "hf_kernel_attn_model.py"):
        assert mode(out / name) == plain, name
    assert mode(out / "model.safetensors") == 0o600
    assert mode(tmp_path / "bare.safetensors") == 0o600
    assert tokenizer_files
    for name in tokenizer_files:
        assert mode(Path(name)) == plain, name
    assert mode(tmp_path / "atomic.txt") == mode(tmp_path / "atomic.json") == plain
    files = sorted(ckpt.iterdir())
    assert {p.name for p in files} >= {"model.pt", "manifest.json", "trainer_state.json"}
    for p in files:
        assert mode(p) == plain, p.name
