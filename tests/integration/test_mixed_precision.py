"""Mixed precision as users run it: ``torch.autocast`` (bf16, fp16) around forward and backward, half-precision
weights, and ``transformers.Trainer(bf16=True)``.

Every kernel except softmax computes outside autocast in fp32 (kernels/base.py); so under autocast its output is
the fp64 brute-force reference (tests/kernels/reference.py) of the same half-precision inputs, to the rounding of the
half-precision output. Softmax is the host's own SDPA under autocast."""

from __future__ import annotations

import copy

import pytest
import torch

import hf_kernel_attn
from hf_kernel_attn.kernels import KERNELS
from tests.conftest import tiny_llama_model
from tests.kernels import reference as ref
from tests.kernels.helpers import DV, SCALING, D, make_kernel, make_mask
from tests.paths import REPO

HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}
NON_SOFTMAX = sorted(n for n in KERNELS if n != "softmax")
CAUSAL = sorted(n for n, c in KERNELS.items() if c.supports_causal)
WINDOWED = [("elu", {"window": 4}), ("hedgehog", {"window": 4}), ("dijiang", {"window": 4})]


def _half_inputs(dtype, causal, seed=0, n=11, m=11, hq=4, hkv=2):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, hq, n, D, generator=gen).to(dtype)
    k = torch.randn(2, hkv, m, D, generator=gen).to(dtype)
    v = torch.randn(2, hkv, m, DV, generator=gen).to(dtype)
    return q, k, v, make_mask(2, m, causal)


def _check_autocast_kernel(kern, dtype, causal):
    q, k, v, mask = _half_inputs(dtype, causal)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    with torch.autocast("cpu", dtype=dtype):
        out = kern(*leaves, key_mask=mask, causal=causal, scaling=SCALING)
        # a backward inside the region runs (PyTorch autocasts the backward's own matmuls there, so its numbers
        # are not checked: users call backward outside, as the second one below)
        out.float().pow(2).sum().backward(retain_graph=True)
    for t in leaves:
        t.grad = None
    out.float().pow(2).sum().backward()
    assert out.dtype == dtype
    expected = ref.reference(kern, q, k, v, key_mask=mask, causal=causal, scaling=SCALING)
    rows = ref.real_queries(2, q.shape[-2], k.shape[-2], causal, mask)
    eps = torch.finfo(dtype).eps
    err = (out.double() - expected)[rows].abs().max().item()
    # the output rounded once to half precision: |Δ| ≤ eps·|out| (a bf16 computation is ~10x off)
    assert err <= 1.5 * eps * expected[rows].abs().max().item() + 1e-6, (kern.name, err)
    # gradients: the fp32 kernel's on the same rounded inputs (the backward also runs in fp32)
    leaves32 = [t.float().clone().requires_grad_() for t in (q, k, v)]
    out32 = kern(*leaves32, key_mask=mask, causal=causal, scaling=SCALING)
    out32.to(dtype).float().pow(2).sum().backward()
    for a, b in zip(leaves, leaves32, strict=False):
        assert a.grad is not None and torch.isfinite(a.grad).all()
        scale = b.grad.abs().max().item()
        assert (a.grad.float() - b.grad).abs().max().item() <= 4 * eps * scale + 1e-6


@pytest.mark.parametrize("dtype", sorted(HALF))
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
@pytest.mark.parametrize("name", NON_SOFTMAX)
def test_kernel_under_autocast_is_fp32_arithmetic(name, causal, dtype):
    if name == "skyformer" and causal:
        pytest.skip("bidirectional only")
    if not causal and not KERNELS[name].supports_bidirectional:
        pytest.skip("causal only")
    _check_autocast_kernel(make_kernel(name, 4, 2), HALF[dtype], causal)


@pytest.mark.parametrize("dtype", sorted(HALF))
@pytest.mark.parametrize("name,params", WINDOWED, ids=[n for n, _ in WINDOWED])
def test_window_hybrid_under_autocast_is_fp32_arithmetic(name, params, dtype):
    _check_autocast_kernel(make_kernel(name, 4, 2, params), HALF[dtype], causal=True)


@pytest.fixture(scope="module")
def tiny_llama():
    return tiny_llama_model()


MODEL_CASES = [(n, {}) for n in CAUSAL] + [("hedgehog", {"window": 8}), ("softmax", {"window": 8})]


@pytest.mark.parametrize("dtype", sorted(HALF))
@pytest.mark.parametrize("name,params", MODEL_CASES, ids=[f"{n}{'-window' if p else ''}" for n, p in MODEL_CASES])
def test_tiny_llama_autocast_and_half_weights(tiny_llama, name, params, dtype):
    """fwd+bwd under autocast (left-padded batch) and in half-precision weights: finite, the host dtype out."""
    model = copy.deepcopy(tiny_llama)
    hf_kernel_attn.patch(model, kernel=name, **params)
    ids = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :6] = 0
    with torch.autocast("cpu", dtype=HALF[dtype]):
        out = model(ids, attention_mask=mask, labels=ids)
    out.loss.backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert torch.isfinite(out.logits).all() and all(g is not None and torch.isfinite(g).all() for g in grads)
    model.zero_grad(set_to_none=True)
    model.to(HALF[dtype])
    out = model(ids, attention_mask=mask, labels=ids)
    out.loss.backward()
    assert out.logits.dtype == HALF[dtype] and torch.isfinite(out.logits).all()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


# ----------------------------------------------------------------------------------------- real models

SMOLLM2_KERNELS = CAUSAL  # the 10 causal kernels


@pytest.fixture(scope="module")
def smollm2_ids(smollm2_tok):
    text = "The tower is 324 metres tall, about the same height as an 81-storey building, and the tallest " \
           "structure in Paris. Its base is square, measuring 125 metres on each side."
    return smollm2_tok(text, return_tensors="pt").input_ids[:, :20]


@pytest.mark.parametrize("name", SMOLLM2_KERNELS)
def test_smollm2_bf16_autocast_fwd_bwd(smollm2, smollm2_ids, name, fresh):
    fresh(smollm2)
    hf_kernel_attn.patch(smollm2, kernel=name)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = smollm2(smollm2_ids, labels=smollm2_ids)
    out.loss.backward()
    try:
        assert torch.isfinite(out.loss) and torch.isfinite(out.logits).all()
        grads = [p.grad for p in smollm2.parameters() if p.grad is not None]
        assert grads and all(torch.isfinite(g).all() for g in grads)
    finally:
        smollm2.zero_grad(set_to_none=True)


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_minilm_bf16_autocast_fwd_bwd(minilm, minilm_tok, name, fresh):
    if not KERNELS[name].supports_bidirectional:
        pytest.skip("causal only (MiniLM is an encoder)")
    fresh(minilm)
    hf_kernel_attn.patch(minilm, kernel=name)
    batch = minilm_tok(["A man is playing a guitar on the stage.", "Short."], padding=True, return_tensors="pt")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        hidden = minilm(**batch).last_hidden_state
    hidden.float().pow(2).mean().backward()
    try:
        assert torch.isfinite(hidden).all()
        grads = [p.grad for p in minilm.parameters() if p.grad is not None]
        assert grads and all(torch.isfinite(g).all() for g in grads)
    finally:
        minilm.zero_grad(set_to_none=True)


def test_trainer_bf16_trains_patched_smollm2(smollm2_dir, smollm2_tok, tmp_path):
    """Stock transformers.Trainer with bf16=True (autocast on CPU) trains hedgehog SmolLM2 for 5 steps."""
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, attn_implementation="hedgehog")
    text = open(REPO / "README.md").read()
    ids = smollm2_tok(text, return_tensors="pt").input_ids[0, :5 * 2 * 24].view(-1, 24)
    rows = [{"input_ids": r, "labels": r} for r in ids]
    before = {n: p.detach().clone() for n, p in model.named_parameters() if "kernel_attn" in n}
    args = TrainingArguments(output_dir=str(tmp_path), bf16=True, use_cpu=True, max_steps=5,
                             per_device_train_batch_size=2, learning_rate=1e-3, report_to=[], save_strategy="no",
                             logging_steps=1, dataloader_num_workers=0)
    trainer = Trainer(model=model, args=args, train_dataset=rows)
    result = trainer.train()
    assert trainer.state.global_step == 5
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 5 and all(torch.isfinite(torch.tensor(loss)) for loss in losses)
    assert result.training_loss == pytest.approx(sum(losses) / 5, rel=1e-3)
    moved = [n for n, p in model.named_parameters() if n in before and not torch.equal(p, before[n])]
    assert moved  # the hedgehog feature maps were trained
