"""examples/custom_kernel/windowed_kernel.py, a user's feature map whose defaults are the window hybrid with sinks
and a sparse cache: written against the public contract alone, it passes ``check_kernel`` with its defaults (whose
brute force models the window, sinks and the sparse cache; also at kit size, with and without the learnable mix,
and with the hybrid off), its cached pairs on a longer sequence are the float64 brute force's
(tests/kernels/sparse_cache_reference.py, the package's reference), and a tiny Llama patched with it generates the
same tokens with its recurrent cache as without a cache."""

from __future__ import annotations

import ast
import importlib.util
import sys
from collections.abc import Iterator
from types import ModuleType

import pytest
import torch

import hf_kernel_attn
from hf_kernel_attn.integration.cache import RecurrentStateCache
from hf_kernel_attn.kernels import KERNELS, LayerShape, build_kernel
from hf_kernel_attn.testing import check_kernel
from tests.compat import needs_state_cache
from tests.kernels.sparse_cache_reference import (
    SCALING,
    D,
    brute_force,
    cached_positions,
    f64,
    inputs,
    padding,
    tiny_lm,
)
from tests.paths import REPO

EXAMPLE = REPO / "examples" / "custom_kernel" / "windowed_kernel.py"
NAME = "signed_softplus"


@pytest.fixture(scope="module")
def example() -> Iterator[ModuleType]:
    """The example file imported as a user would (module ``windowed_kernel``), unregistered afterwards."""
    spec = importlib.util.spec_from_file_location("windowed_kernel", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)
        KERNELS.pop(NAME, None)


def test_the_example_uses_only_public_names():
    """No underscored attribute or module of hf_kernel_attn (dunders aside), imports from public modules only."""
    tree = ast.parse(EXAMPLE.read_text(encoding="utf-8"))
    private = [node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
               and node.attr.startswith("_") and not node.attr.endswith("__")]
    modules = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            modules.append(node.module)
            if node.module.startswith("hf_kernel_attn"):
                private += [a.name for a in node.names if a.name.startswith("_")]
        elif isinstance(node, ast.Import):
            modules += [a.name for a in node.names]
    private += [m for m in modules if m.startswith("hf_kernel_attn") and any(p.startswith("_") for p in m.split("."))]
    assert not private, private
    assert {m.split(".")[0] for m in modules} == {"__future__", "dataclasses", "torch", "hf_kernel_attn"}


def test_the_docs_show_the_example_as_it_is():
    """docs/custom_kernels.md section 5 shows the file's code from the options class on, unchanged."""
    page = (REPO / "docs" / "custom_kernels.md").read_text(encoding="utf-8")
    block = page.split("## 5. ", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    code = EXAMPLE.read_text(encoding="utf-8")
    start = "@dataclasses.dataclass"
    assert block[block.index(start):] == code[code.index(start):]


def test_defaults_are_the_window_hybrid_with_sinks_and_a_sparse_cache(example):
    opts = example.WindowedOptions()
    assert (opts.window, opts.sinks, opts.sparse_cache, opts.sparse_block) == (64, 4, 16, 16)
    model = tiny_lm()
    hf_kernel_attn.patch(model, kernel=NAME)
    kern = model.model.layers[0].self_attn.kernel_attn
    assert isinstance(kern, example.SignedSoftplus) and kern.options == opts
    assert (kern.scale.shape, kern.shift.shape) == ((16,), (16,))


def test_check_kernel_passes(example):
    """By name, with its defaults: W = 64, S = 4, C = 16 as they are (at 17 tokens every key is in the window;
    bidirectional calls are refused) and at kit size (window 5, 2 sinks, 3 pairs chosen every 4 positions), in
    every causal form; then with the learnable per-head mix λ_h; then with the hybrid off (the plain feature map
    and its window=5 hybrid, causal and bidirectional)."""
    kit = "window=5 sinks=2 sparse_cache=3 sparse_block=4"
    errors = check_kernel(NAME)
    mixed = check_kernel(example.SignedSoftplus, {"window_mix": True})
    plain = check_kernel(NAME, {"window": 0, "sinks": 0, "sparse_cache": 0})
    for forms in (errors, mixed):
        assert any(f.startswith("causal window=64 sinks=4 sparse_cache=16 sparse_block=16 ") for f in forms)
        assert any(f.startswith(f"decoding {kit}") and "from the state" in f for f in forms)
        assert any(f.startswith(f"decoding {kit}") and "packed steps" in f for f in forms)
        assert any(f.startswith(f"gradients causal {kit}") and f.endswith("dshift") for f in forms)
        assert any(f.startswith(f"causal {kit}") and "key padding" in f for f in forms)
        assert any(f.startswith(f"bidirectional {kit}") and "refused" in f for f in forms)
        assert not any(f.startswith("bidirectional") and "refused" not in f for f in forms)
    assert any(f.endswith("dwindow_log_mix") for f in mixed)
    assert any(f.startswith("causal Hq=4") for f in plain)  # the pure feature-map forms
    assert any("bidirectional window=5" in f and "key padding" in f for f in plain)


@pytest.mark.parametrize("pad", [0, 3])
def test_sinks_and_sparse_cache_match_the_brute_force(example, pad):
    """Window 5, 2 sinks, 3 cached pairs chosen every 4 positions, 41 tokens, left padding on one row: outputs and
    cached pairs (which ``check_kernel`` does not compare) equal the float64 brute force, and the cache changes the
    outputs."""
    params = dict(window=5, sinks=2, sparse_cache=3, sparse_block=4, window_mix=True, chunk_size=8)
    kern = build_kernel(NAME, LayerShape(4, 2, D, 0, 4096), params).to(f64)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in kern.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=gen, dtype=f64))
    q, k, v = inputs(2, 4, 2, 41, seed=pad)
    mask = padding(2, 41, pad) if pad else None
    got, state = kern.forward_with_state(q, k, v, key_mask=mask, causal=True, scaling=SCALING)
    with torch.no_grad():
        want, caches = brute_force(kern, q, k, v, mask)
    rows = torch.ones(2, 41, dtype=torch.bool) if mask is None else mask
    torch.testing.assert_close(got[rows], want[rows], rtol=1e-9, atol=1e-10)
    for (r, h), cache in caches.items():
        assert cached_positions(state, r, h) == cache and len(cache) == 3
    plain = build_kernel(NAME, kern.shape, {**params, "sparse_cache": 0}).to(f64)
    plain.load_state_dict(kern.state_dict())
    assert not torch.allclose(plain(q, k, v, key_mask=mask, causal=True, scaling=SCALING)[rows], got[rows])


@needs_state_cache
def test_cached_generation_equals_recomputation(example):
    """A 2-layer Llama, window 6 + 2 sinks + a 4-pair cache chosen every 3 positions: 20 greedy tokens after a
    left-padded 40-token prompt, with the recurrent cache and with none, give the same tokens and logits."""
    model = tiny_lm()
    hf_kernel_attn.patch(model, kernel=NAME, window=6, sinks=2, sparse_cache=4, sparse_block=3)
    ids = torch.randint(1, 97, (2, 40), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    kw = dict(max_new_tokens=20, min_new_tokens=20, do_sample=False, return_dict_in_generate=True, output_logits=True)
    with torch.no_grad():
        cached = model.generate(ids, attention_mask=mask, **kw)
        full = model.generate(ids, attention_mask=mask, use_cache=False, **kw)
    assert isinstance(cached.past_key_values, RecurrentStateCache)
    sparse = cached.past_key_values.layers[0].state.sparse  # the cache in use: every slot of every KV head filled
    assert sparse.valid.shape == (2, 2, 4) and sparse.valid.all()
    assert torch.equal(cached.sequences, full.sequences)
    torch.testing.assert_close(torch.stack(cached.logits), torch.stack(full.logits), rtol=1e-4, atol=1e-4)
