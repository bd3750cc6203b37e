"""The same numbers with autograd on and off, so that reentrant gradient checkpointing (a forward under no_grad,
recomputed under grad in the backward) and non-reentrant checkpointing give the gradients of no checkpointing."""

from __future__ import annotations

import pytest
import torch

import hf_kernel_attn
from hf_kernel_attn.kernels import KERNELS
from tests.kernels.helpers import make_inputs, make_kernel, make_mask

CASES = [(n, {}) for n in sorted(KERNELS)] + [
    (n, {"window": 5}) for n, c in sorted(KERNELS.items()) if c.is_linear or n == "softmax"]


def _label(case):
    name, params = case
    return name + ("-window" if params else "")


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
@pytest.mark.parametrize("case", CASES, ids=_label)
def test_grad_mode_does_not_change_the_numbers(case, causal):
    name, params = case
    if name == "skyformer" and causal:
        pytest.skip("bidirectional only")
    if not causal and not KERNELS[name].supports_bidirectional:
        pytest.skip("causal only")
    params = {**params, "chunk_size": 16} if KERNELS[name].is_linear else params
    kern = make_kernel(name, 4, 2, params, max_positions=128)
    q, k, v = make_inputs(2, 4, 2, 70, 70)
    mask = make_mask(2, 70, causal, pad=9)
    with torch.no_grad():
        off = kern(q, k, v, key_mask=mask, causal=causal, scaling=0.3)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    on = kern(*leaves, key_mask=mask, causal=causal, scaling=0.3)
    assert torch.equal(on.detach(), off)


def _grads(model, run, mode):
    model.zero_grad(set_to_none=True)
    if mode is None:
        model.gradient_checkpointing_disable()
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": mode == "reentrant"})
    run().backward()
    model.gradient_checkpointing_disable()
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def _relative(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.real_model
@pytest.mark.parametrize("spec", [("elu", {"window": 64}), ("taylor", {})], ids=_label)
def test_smollm2_checkpointing_gives_the_gradients_of_none(smollm2, spec, fresh):
    fresh(smollm2)
    name, params = spec
    hf_kernel_attn.patch(smollm2, kernel=name, **params)
    ids = torch.randint(100, 5000, (1, 96), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        off = smollm2(ids, use_cache=False).logits
    on = smollm2(ids, use_cache=False).logits
    assert torch.equal(on.detach(), off)
    smollm2.train()
    try:
        def run():
            return smollm2(ids, labels=ids, use_cache=False).loss

        plain = _grads(smollm2, run, None)
        for mode in ("reentrant", "non-reentrant"):
            assert _relative(_grads(smollm2, run, mode), plain) <= 1e-6, mode
    finally:
        smollm2.eval()
        smollm2.zero_grad(set_to_none=True)


@pytest.mark.real_model
@pytest.mark.parametrize("name", ["performer", "taylor"])
def test_minilm_checkpointing_gives_the_gradients_of_none(minilm, minilm_tok, name, fresh):
    fresh(minilm)
    hf_kernel_attn.patch(minilm, kernel=name)
    batch = minilm_tok(["A man is playing a guitar on the stage tonight. " * 6, "Short one."], padding=True,
                       return_tensors="pt")
    dropouts = [(m, m.p) for m in minilm.modules() if isinstance(m, torch.nn.Dropout)]
    minilm.train()
    for m, _ in dropouts:
        m.p = 0.0
    try:
        def run():
            return minilm(**batch).last_hidden_state.pow(2).mean()

        plain = _grads(minilm, run, None)
        for mode in ("reentrant", "non-reentrant"):
            assert _relative(_grads(minilm, run, mode), plain) <= 1e-6, mode
    finally:
        for m, p in dropouts:
            m.p = p
        minilm.eval()
        minilm.zero_grad(set_to_none=True)
