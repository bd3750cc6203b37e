"""torch.compile: a patched model adds no graph breaks (softmax-like kernels) or at most two (linear kernels) to the
stock model's in a plain forward without padding, measured with ``torch._dynamo.explain``; the compiled model
computes what the eager one does (``aot_eager`` backend: dynamo + AOT autograd, without inductor's codegen)."""

from __future__ import annotations

import copy

import pytest
import torch

import hf_kernel_attn
from hf_kernel_attn.kernels import LayerShape, build_kernel
from tests.conftest import tiny_llama_model

SOFTMAX_LIKE = [("softmax", {}), ("gaussian", {}), ("cosine", {})]
LINEAR = [("elu", {}), ("hedgehog", {}), ("taylor", {}), ("hedgehog", {"window": 16})]


@pytest.fixture(scope="module")
def tiny_llama():
    return tiny_llama_model()


IDS = torch.randint(0, 128, (1, 48), generator=torch.Generator().manual_seed(0))
INPUTS = {"no-mask": {"input_ids": IDS}, "ones-mask": {"input_ids": IDS, "attention_mask": torch.ones_like(IDS)}}


def _breaks(model, inputs) -> tuple[int, list[str]]:
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(**inputs)
    return explained.graph_break_count, [str(r.reason)[:200] for r in explained.break_reasons]


@pytest.fixture(scope="module")
def stock_breaks(tiny_llama):
    return {name: _breaks(tiny_llama, inputs)[0] for name, inputs in INPUTS.items()}


def _patched(model, name, params):
    model = copy.deepcopy(model)
    hf_kernel_attn.patch(model, kernel=name, **params)
    return model


def _label(case):
    name, params = case
    return name + ("-window" if params else "")


@pytest.mark.parametrize("inputs", sorted(INPUTS))
@pytest.mark.parametrize("case", SOFTMAX_LIKE, ids=_label)
def test_softmax_like_kernels_add_no_graph_breaks(tiny_llama, stock_breaks, case, inputs):
    model = _patched(tiny_llama, *case)
    count, reasons = _breaks(model, INPUTS[inputs])
    assert count == stock_breaks[inputs], reasons


@pytest.mark.parametrize("case,inputs", [(c, "no-mask") for c in LINEAR] + [(("hedgehog", {}), "ones-mask")],
                         ids=lambda x: _label(x) if isinstance(x, tuple) else x)
def test_linear_kernels_add_at_most_two_graph_breaks(tiny_llama, stock_breaks, case, inputs):
    model = _patched(tiny_llama, *case)
    count, reasons = _breaks(model, INPUTS[inputs])
    assert count <= stock_breaks[inputs] + 2, reasons


@pytest.mark.parametrize("case", [("softmax", {}), ("hedgehog", {"window": 16})], ids=_label)
def test_compiled_equals_eager_forward_and_backward(tiny_llama, case):
    """Within the stock model's own compile tolerance: the stock model compiled the same way differs from its
    eager run by ``tol`` (0 with aot_eager on CPU); the patched model may differ by fp32 rounding on top."""
    torch._dynamo.reset()
    model = _patched(tiny_llama, *case)
    mask = torch.ones_like(IDS)
    mask[0, :5] = 0  # left padding: the compiled mask and position paths
    with torch.no_grad():
        eager = model(IDS, attention_mask=mask).logits
    compiled = torch.compile(model, backend="aot_eager")
    with torch.no_grad():
        got = compiled(IDS, attention_mask=mask).logits
    rows = mask.bool()
    torch.testing.assert_close(got[rows], eager[rows], atol=1e-5, rtol=1e-5)
    model.train()
    eager_loss = model(IDS, labels=IDS).loss
    eager_loss.backward()
    eager_grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)
    loss = compiled(IDS, labels=IDS).loss
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert len(grads) == len(eager_grads)
    torch.testing.assert_close(loss, eager_loss, atol=1e-6, rtol=1e-6)
    for a, b in zip(grads, eager_grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_sparse_cache_under_inductor_keeps_the_eager_pairs():
    """The default backend (inductor, with its buffer reuse) keeps the cached pairs and outputs of the eager run:
    torch 2.13's inductor once wrote the pending keys' buffer in place while a gather from an earlier
    concatenation of it was still to be read, so the compiled cache held other pairs and outputs moved by ~1."""
    torch._dynamo.reset()
    kern = build_kernel("hedgehog", LayerShape(4, 2, 8, 0, 4096),
                        {"window": 4, "sinks": 1, "sparse_cache": 2, "sparse_block": 4})
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 17, 8, generator=gen) for h in (4, 2, 2))

    def run(q, k, v):
        out, state = kern.forward_with_state(q, k, v, causal=True)
        return out, state.sparse.pos, state.sparse.valid

    with torch.no_grad():
        eager = run(q, k, v)
        compiled = torch.compile(run)(q, k, v)
    assert eager[2].all()  # the cache is full: its pairs were chosen by their scores
    assert torch.equal(compiled[1], eager[1])
    torch.testing.assert_close(compiled[0], eager[0], atol=1e-5, rtol=1e-5)
