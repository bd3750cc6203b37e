"""Property tests (hypothesis): random shapes, GQA groups, odd head dims, padding patterns, causal and
bidirectional, chunk boundaries, grad / no-grad paths; every kernel equals the float64 brute force of
tests/kernels/reference.py, and decoding from a state (kernel level and through a model's cache) equals recomputation.

Examples are derandomized (the same cases on every run) and few, so the file runs in seconds."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

try:  # keep hypothesis' files (it writes .hypothesis/ into the working directory) out of the checkout
    from hypothesis.configuration import set_hypothesis_home_dir
except ImportError:  # older hypothesis
    set_hypothesis_home_dir = None
if set_hypothesis_home_dir is not None and not os.environ.get("HYPOTHESIS_STORAGE_DIRECTORY"):
    set_hypothesis_home_dir(os.path.join(tempfile.gettempdir(), "hf_kernel_attn_hypothesis"))


from hf_kernel_attn.kernels import KERNELS  # noqa: E402
from hf_kernel_attn.kernels.linear import PastKeys, cost  # noqa: E402
from tests.compat import cache_arg, needs_state_cache  # noqa: E402
from tests.kernels import reference as ref  # noqa: E402
from tests.kernels.helpers import make_kernel  # noqa: E402

ALL = sorted(KERNELS)
LINEAR = sorted(n for n, c in KERNELS.items() if c.is_linear)
MAX_POS = 96
FP32_INSIDE = {"gaussian", "cosine", "skyformer"}  # compute in fp32 even for fp64 inputs
# HF_KERNEL_ATTN_EXPLORE=N: N random (not derandomized) examples per test, for a longer bug hunt
EXPLORE = int(os.environ.get("HF_KERNEL_ATTN_EXPLORE", "0"))


def budget(examples: int) -> settings:
    return settings(max_examples=EXPLORE or examples, deadline=None, derandomize=not EXPLORE, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])



@dataclass
class Case:
    """One drawn attention problem."""

    name: str
    causal: bool
    batch: int
    kv_heads: int
    group: int
    head_dim: int
    value_dim: int
    n: int
    m: int
    mask: torch.Tensor | None
    params: dict
    scaling: float | None
    grad: bool
    tiny_blocks: bool
    seed: int


@st.composite
def padding(draw: st.DrawFn, batch: int, m: int) -> torch.Tensor | None:
    """Per row: no padding, left, right, both ends, random holes, or fully padded."""
    if not draw(st.booleans()):
        return None
    rows = []
    for _ in range(batch):
        kind = draw(st.sampled_from(["none", "left", "right", "both", "holes", "full"]))
        row = torch.ones(m, dtype=torch.bool)
        if kind in ("left", "both"):
            row[: draw(st.integers(0, m))] = False
        if kind in ("right", "both"):
            row[m - draw(st.integers(0, m)):] = False
        if kind == "holes":
            row = torch.tensor(draw(st.lists(st.booleans(), min_size=m, max_size=m)), dtype=torch.bool)
        if kind == "full":
            row[:] = False
        rows.append(row)
    return torch.stack(rows)


@st.composite
def cases(draw: st.DrawFn, names: list[str]) -> Case:
    name = draw(st.sampled_from(names))
    causal = draw(st.booleans()) if KERNELS[name].supports_causal else False
    causal = causal or not KERNELS[name].supports_bidirectional
    batch = draw(st.integers(1, 3))
    kv_heads = draw(st.integers(1, 3))
    group = draw(st.integers(1, 3))
    head_dim = draw(st.integers(1, 9))
    n = draw(st.integers(1, 40))
    m = n if name == "skyformer" else n + draw(st.integers(0, 20))
    params: dict = {}
    if KERNELS[name].is_linear:
        params["chunk_size"] = draw(st.integers(1, 17))
    if name == "skyformer":
        head_dim = max(head_dim, 4)  # Nyström on 1-3-dim points: near-singular landmark Gram (see docs)
        params = {"num_landmarks": draw(st.integers(2, 12)), "newton_iters": 30}
    if name == "performer":
        head_dim = max(head_dim, 2)  # default m = floor(D ln D) is 0 at D = 1 (see docs/robustness.md)
    if name == "taylor":
        params["quadratic_below"] = draw(st.sampled_from([0, 10**6]))
    if name == "cosformer":
        params["horizon"] = MAX_POS
    return Case(name=name, causal=causal, batch=batch, kv_heads=kv_heads, group=group, head_dim=head_dim,
                value_dim=draw(st.integers(1, 6)), n=n, m=m, mask=draw(padding(batch, m)), params=params,
                scaling=draw(st.sampled_from([None, 0.3, 1.0])), grad=draw(st.booleans()),
                tiny_blocks=draw(st.booleans()), seed=draw(st.integers(0, 2**16)))


@contextlib.contextmanager
def block_size(tiny: bool) -> Iterator[None]:
    """tiny: one chunk per block, so the no-grad causal path crosses many blocks."""
    old = cost.BLOCK_FEATURE_VALUES
    if tiny:
        cost.BLOCK_FEATURE_VALUES = 1
    try:
        yield
    finally:
        cost.BLOCK_FEATURE_VALUES = old


def tensors(c: Case, n: int | None = None, m: int | None = None):
    gen = torch.Generator().manual_seed(c.seed)
    n, m = n or c.n, m or c.m
    q = torch.randn(c.batch, c.kv_heads * c.group, n, c.head_dim, generator=gen)
    k = torch.randn(c.batch, c.kv_heads, m, c.head_dim, generator=gen)
    v = torch.randn(c.batch, c.kv_heads, m, c.value_dim, generator=gen)
    return q, k, v


def build(c: Case):
    return make_kernel(c.name, c.kv_heads * c.group, c.kv_heads, c.params, max_positions=MAX_POS,
                       head_dim=c.head_dim)


@pytest.mark.parametrize("name", ALL)
@budget(25)
@given(data=st.data())
def test_every_kernel_matches_brute_force(name: str, data: st.DataObject):
    c = data.draw(cases([name]), label="case")
    kern = build(c)
    q, k, v = tensors(c)
    with block_size(c.tiny_blocks), torch.set_grad_enabled(c.grad):
        if c.grad:
            q.requires_grad_(True)
        out = kern(q, k, v, key_mask=c.mask, causal=c.causal, scaling=c.scaling)
    assert out.shape == (c.batch, c.n, c.kv_heads * c.group, c.value_dim)
    assert torch.isfinite(out).all(), "non-finite output (padded or key-less rows included)"
    rows = ref.real_queries(c.batch, c.n, c.m, c.causal, c.mask)
    expected = ref.reference(kern, q.detach(), k, v, key_mask=c.mask, causal=c.causal, scaling=c.scaling)
    torch.testing.assert_close(out.detach().double()[rows], expected.detach()[rows], atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("name", ALL)
@budget(8)
@given(data=st.data())
def test_every_kernel_gradients_match_brute_force(name: str, data: st.DataObject):
    """d(q, k, v, parameters) of a random weighting of the real rows, against autograd through the reference,
    in float64 (fp32 tolerance for the kernels that compute in fp32 inside); every gradient finite, padded and
    key-less rows included."""
    c = data.draw(cases([name]), label="case")
    if name == "cosine":  # at D = 1 cos(q, k) = ±1 has zero gradient; fp32 normalisation leaves eps/|q| noise
        c.head_dim = max(c.head_dim, 2)
    kern = build(c).double()
    q, k, v = (t.double() for t in tensors(c))
    rows = ref.real_queries(c.batch, c.n, c.m, c.causal, c.mask)
    weight = torch.randn(c.batch, c.n, c.kv_heads * c.group, c.value_dim, dtype=torch.float64,
                         generator=torch.Generator().manual_seed(c.seed + 1))
    grads = []
    for fn in (kern, lambda *a, **kw: ref.reference(kern, *a, **kw)):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        kern.zero_grad(set_to_none=True)
        with block_size(c.tiny_blocks):
            out = fn(*leaves, key_mask=c.mask, causal=c.causal, scaling=c.scaling)
        (out[rows] * weight[rows]).sum().backward()
        named = {name: p.grad.clone() for name, p in kern.named_parameters() if p.grad is not None}
        # an input no real output reaches (every key padded) may get no gradient at all: zero
        grads.append({**{key: torch.zeros_like(x) if x.grad is None else x.grad
                         for key, x in zip("qkv", leaves, strict=True)}, **named})
    got, expected = grads
    # likewise a parameter: a zero gradient on one side and none on the other are the same derivative
    for a, b in ((got, expected), (expected, got)):
        for key in set(b) - set(a):
            a[key] = torch.zeros_like(b[key])
    # relative to each gradient's scale, plus a floor relative to the largest one for gradients that vanish
    # mathematically (e.g. dq with a single visible key) and keep only rounding noise
    rel, floor = (1e-3, 1e-5) if c.name in FP32_INSIDE else (1e-7, 1e-9)
    overall = max(g.abs().max().item() for g in expected.values())
    for key in got:
        assert torch.isfinite(got[key]).all(), f"d{key} not finite"
        scale = expected[key].abs().max().item()
        torch.testing.assert_close(got[key], expected[key], atol=rel * scale + floor * overall, rtol=rel,
                                   msg=lambda m, key=key: f"d{key}: {m}")


@st.composite
def decode_cases(draw: st.DrawFn, name: str) -> tuple[Case, list[int]]:
    c = draw(cases([name]))
    c.causal, c.m = True, c.n
    if c.mask is not None:  # decoding batches are left-padded (a fully padded row included)
        lefts = [draw(st.integers(0, c.n)) for _ in range(c.batch)]
        c.mask = torch.stack([torch.arange(c.n) >= pad for pad in lefts])
    cuts = sorted(set(draw(st.lists(st.integers(1, c.n - 1), max_size=6)))) if c.n > 1 else []
    return c, cuts


@pytest.mark.parametrize("name", LINEAR)
@budget(15)
@given(data=st.data())
def test_decoding_from_state_equals_recomputation(name: str, data: st.DataObject):
    """A causal sequence fed in random pieces (prefill, chunks, single steps), each continuing from the state
    of the ones before at offset = tokens seen, equals the brute force over the whole sequence."""
    c, cuts = data.draw(decode_cases(name), label="case")
    kern = build(c)
    q, k, v = tensors(c)
    bounds = [0, *cuts, c.n]
    state, outs = None, []
    with block_size(c.tiny_blocks), torch.set_grad_enabled(c.grad):
        for start, end in zip(bounds[:-1], bounds[1:], strict=True):
            sl = slice(start, end)
            piece_mask = None if c.mask is None else c.mask[:, sl]
            out, state = kern.forward_with_state(q[:, :, sl], k[:, :, sl], v[:, :, sl], key_mask=piece_mask,
                                                 causal=True, scaling=c.scaling, past=PastKeys(state, start))
            outs.append(out)
    out = torch.cat(outs, 1)
    assert torch.isfinite(out).all()
    rows = ref.real_queries(c.batch, c.n, c.n, True, c.mask)
    expected = ref.reference(kern, q, k, v, key_mask=c.mask, causal=True, scaling=c.scaling)
    torch.testing.assert_close(out.detach().double()[rows], expected.detach()[rows], atol=2e-4, rtol=2e-4)


# ------------------------------------------------------------------------- through a model and its cache


_MODELS: dict[str, torch.nn.Module] = {}


def tiny_model(kernel: str) -> torch.nn.Module:
    """A float64 2-layer Llama (GQA 4/2, head dim 8) patched with ``kernel``, built once per kernel."""
    if kernel not in _MODELS:
        from transformers import LlamaConfig, LlamaForCausalLM

        import hf_kernel_attn

        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=MAX_POS)
        model = LlamaForCausalLM(cfg).eval().double()
        hf_kernel_attn.patch(model, kernel=kernel, **({"chunk_size": 5} if KERNELS[kernel].is_linear else {}))
        _MODELS[kernel] = model
    return _MODELS[kernel]


@budget(15)
@given(kernel=st.sampled_from(LINEAR), batch=st.integers(1, 3), prompt=st.integers(1, 12),
       steps=st.integers(1, 6), data=st.data())
@needs_state_cache
def test_model_decoding_with_cache_equals_recomputation(kernel, batch, prompt, steps, data):
    """Left-padded prompt, prefill into a RecurrentStateCache, then single-token steps with the growing mask:
    each step's logits equal a no-cache forward over the whole sequence so far."""
    from hf_kernel_attn.integration.cache import RecurrentStateCache

    model = tiny_model(kernel)
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    total = prompt + steps
    ids = torch.randint(1, 61, (batch, total), generator=gen)
    pads = [data.draw(st.integers(0, prompt - 1)) for _ in range(batch)]
    mask = torch.stack([torch.arange(total) >= p for p in pads]).long()
    cache = RecurrentStateCache(model)
    with torch.no_grad():
        out = model(input_ids=ids[:, :prompt], attention_mask=mask[:, :prompt], **cache_arg(cache), use_cache=True)
        got = [out.logits[:, -1]]
        for t in range(prompt, total):
            out = model(input_ids=ids[:, t:t + 1], attention_mask=mask[:, :t + 1], **cache_arg(cache), use_cache=True)
            got.append(out.logits[:, -1])
        full = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    expected = full[:, prompt - 1:]
    torch.testing.assert_close(torch.stack(got, 1), expected, atol=1e-9, rtol=1e-7)
    assert cache.get_seq_length() == total
