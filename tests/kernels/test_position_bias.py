"""An additive logit bias (T5's relative position bias) for the kernels with logits: softmax, gaussian, cosine,
against float64 brute force; T5 runs them (softmax = SDPA exactly) and refuses feature-map kernels clearly."""

from __future__ import annotations

import copy

import pytest
import torch

import hf_kernel_attn
from hf_kernel_attn.kernels import KERNELS
from tests.kernels import reference as ref
from tests.kernels.helpers import SCALING, make_inputs, make_kernel, make_mask

f64 = torch.float64


def _logits(kern, q, k, scaling):
    """The kernel's logits, written out (GQA expanded): s q·k, -inv ||q - k||²/2 (+ its q-norm, which cancels),
    g cos(q, k)."""
    g = q.shape[1] // k.shape[1]
    qd, kd = q.to(f64), k.to(f64).repeat_interleave(g, 1)
    if kern.name == "softmax":
        return scaling * qd @ kd.transpose(-1, -2)
    if kern.name == "gaussian":
        inv = ref.gaussian_inv_sigma_sq(kern, q.shape[-1], scaling)[None, :, None, None]
        return -inv * ((qd[..., :, None, :] - kd[..., None, :, :]) ** 2).sum(-1) / 2
    gain = kern.log_gain.to(f64).exp()[None, :, None, None]
    return gain * (qd / qd.norm(dim=-1, keepdim=True)) @ (kd / kd.norm(dim=-1, keepdim=True)).transpose(-1, -2)


@pytest.mark.parametrize("nm", [(6, 6), (4, 9)], ids=["self", "cross"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
@pytest.mark.parametrize("name", sorted(n for n, c in KERNELS.items() if c.supports_bias))
def test_additive_bias_matches_brute_force(name, causal, nm):
    n, m = nm
    kern = make_kernel(name, 4, 2)
    q, k, v = make_inputs(2, 4, 2, n, m, seed=4)
    mask = make_mask(2, m, causal, pad=2)
    bias = torch.randn(1, 4, n, m, generator=torch.Generator().manual_seed(5))
    out = kern(q, k, v, key_mask=mask, causal=causal, scaling=SCALING, bias=bias)
    vis = ref.visible(2, n, m, causal, mask)
    g = q.shape[1] // k.shape[1]
    expected = ref.softmax_from_logits(_logits(kern, q, k, SCALING) + bias.to(f64),
                                       v.to(f64).repeat_interleave(g, 1), vis)
    rows = ref.real_queries(2, n, m, causal, mask)
    torch.testing.assert_close(out.double()[rows], expected[rows], atol=1e-5, rtol=1e-5)
    plain = kern(q, k, v, key_mask=mask, causal=causal, scaling=SCALING)
    assert (plain - out).abs().max() > 1e-3  # the bias is not ignored


@pytest.fixture(scope="module")
def tiny_t5():
    from transformers import AutoConfig, T5ForConditionalGeneration

    cfg = AutoConfig.for_model("t5", d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
                               vocab_size=100, decoder_start_token_id=0)
    torch.manual_seed(0)
    try:
        return T5ForConditionalGeneration._from_config(cfg, attn_implementation="sdpa").eval()
    except ValueError as e:  # older transformers: T5's attention does not go through the attention interface
        pytest.skip(f"this transformers' T5 has no attention-interface path: {e}")


T5_INPUTS = dict(input_ids=torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(1)),
                 attention_mask=torch.tensor([[1] * 12, [1] * 9 + [0] * 3]),
                 decoder_input_ids=torch.randint(0, 100, (2, 7), generator=torch.Generator().manual_seed(2)))


@pytest.mark.parametrize("name", ["softmax", "gaussian", "cosine"])
def test_t5_runs_kernels_with_logits(tiny_t5, name):
    model = copy.deepcopy(tiny_t5)
    with torch.no_grad():
        stock = model(**T5_INPUTS).logits
    hf_kernel_attn.patch(model, kernel=name)
    calls = []
    for module in model.modules():
        if hasattr(module, "kernel_attn"):
            module.kernel_attn.register_forward_hook(lambda *a: calls.append(1))
    with torch.no_grad():
        out = model(**T5_INPUTS).logits
    assert len(calls) == 6  # encoder self x2, decoder self x2, cross x2: every layer runs the kernel
    assert torch.isfinite(out).all()
    if name == "softmax":
        torch.testing.assert_close(out, stock, atol=1e-5, rtol=1e-5)
    else:
        assert (out - stock).abs().max() > 1e-3
    model.generate(T5_INPUTS["input_ids"], attention_mask=T5_INPUTS["attention_mask"], max_new_tokens=3)
    hf_kernel_attn.unpatch(model)
    with torch.no_grad():
        torch.testing.assert_close(model(**T5_INPUTS).logits, stock, atol=1e-5, rtol=1e-5)


def test_t5_refuses_feature_map_kernels_clearly(tiny_t5):
    model = copy.deepcopy(tiny_t5)
    hf_kernel_attn.patch(model, kernel="elu")
    with pytest.raises(ValueError, match=r"position bias.*\[1, 4, 12, 12\].*\['cosine', 'gaussian', 'softmax'\]"):
        model(**T5_INPUTS)
