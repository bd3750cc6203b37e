"""Packed rows (several documents in one row, position_ids restarting at each, no padding; what TRL's flattening
collator produces): every kernel attends within each document only, so a packed row equals the documents run
alone, in the forward and in the gradients; a caching forward of packed rows keeps no recurrent state."""

from __future__ import annotations

import copy

import pytest
import torch

import hf_kernel_attn
from hf_kernel_attn.kernels import KERNELS
from tests.conftest import tiny_llama_model

CASES = [(n, {}) for n, c in sorted(KERNELS.items()) if c.supports_causal] + [
    ("hedgehog", {"window": 4}), ("dijiang", {"window": 4}), ("softmax", {"window": 4, "sinks": 2})]
DOCS = (7, 12, 5)


@pytest.fixture(scope="module")
def tiny_llama():
    return tiny_llama_model(max_positions=64)


def _label(case):
    name, params = case
    return name + "".join(f"-{k}{v}" for k, v in params.items())


@pytest.mark.parametrize("case", CASES, ids=_label)
def test_packed_row_equals_documents_alone(tiny_llama, case):
    model = copy.deepcopy(tiny_llama)
    hf_kernel_attn.patch(model, kernel=case[0], **case[1])
    gen = torch.Generator().manual_seed(3)
    docs = [torch.randint(0, 128, (1, n), generator=gen) for n in DOCS]
    packed = torch.cat(docs, 1)
    positions = torch.cat([torch.arange(n) for n in DOCS])[None]
    with torch.no_grad():
        alone = torch.cat([model(d, use_cache=False).logits for d in docs], 1)
        got = model(packed, position_ids=positions).logits  # the config's use_cache: no state crosses documents
        unpacked = model(packed, use_cache=False).logits
    torch.testing.assert_close(got, alone, atol=2e-5, rtol=1e-4)
    assert (unpacked[:, DOCS[0]:] - alone[:, DOCS[0]:]).abs().max() > 1e-3  # positive control: the boundary matters
    # backward: the gradient of a weighted sum of the packed row's logits is the sum of the documents' gradients
    weights = torch.randn(alone.shape, generator=gen)
    model.zero_grad()
    (model(packed, position_ids=positions, use_cache=False).logits * weights).sum().backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    for doc, w in zip(docs, weights.split(DOCS, 1), strict=True):
        (model(doc, use_cache=False).logits * w).sum().backward()
    alone_grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert packed_grads.keys() == alone_grads.keys() and packed_grads
    for name, grad in alone_grads.items():  # within 1e-5 of the gradient's scale (fp32 sums in another order)
        err = float((packed_grads[name] - grad).abs().max())
        assert err <= 1e-5 * float(grad.abs().max()) + 1e-7, (name, err, float(grad.abs().max()))
    model.zero_grad()
    # two packed rows with different boundaries in one batch; gradients flow through every document
    other = torch.cat([torch.arange(10), torch.arange(14)])[None]
    batch = torch.cat([packed, packed.flip(1)], 0)
    model.train()
    out = model(batch, position_ids=torch.cat([positions, other], 0), labels=batch, use_cache=False)
    out.loss.backward()
    assert torch.isfinite(out.loss) and all(torch.isfinite(p.grad).all() for p in model.parameters()
                                            if p.grad is not None)
    with torch.no_grad():
        model.eval()
        second = model(packed.flip(1), position_ids=other, use_cache=False).logits
        first_doc = model(packed.flip(1)[:, :10], use_cache=False).logits
    torch.testing.assert_close(second[:, :10], first_doc, atol=2e-5, rtol=1e-4)
