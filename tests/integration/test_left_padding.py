"""Left padding in a plain forward (no position_ids): each row equals the sequence run alone.

Without the position hook of ``integration/positions.py`` these comparisons fail on SmolLM2 for the feature-map
kernels (relative differences of 1e-2 to 5e-1) and on GPT-2 for every kernel (learned absolute positions).
"""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

import hf_kernel_attn
from hf_kernel_attn.integration import positions
from hf_kernel_attn.integration.cache import RecurrentStateCache
from hf_kernel_attn.kernels import KERNELS
from tests.compat import cache_arg, needs_state_cache

CAUSAL = [n for n, c in KERNELS.items() if c.supports_causal]
TEXTS = ["The capital of France is", "Once upon a time, in a small village by the sea, there lived an old", "Hi"]
VOCAB = 97


def relative_gaps(model, ids: torch.Tensor, mask: torch.Tensor) -> list[float]:
    """max |padded - alone| / max |alone| per row, over the row's real (left-padded) tokens."""
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask).logits
        gaps = []
        for i in range(ids.shape[0]):
            real = ids[i, mask[i].bool()][None]
            alone = model(input_ids=real).logits[0]
            padded = out[i, -alone.shape[0]:]
            gaps.append(((padded - alone).abs().max() / alone.abs().max()).item())
    return gaps


def random_left_padded(lengths: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    n = max(lengths)
    ids = torch.randint(1, VOCAB, (len(lengths), n), generator=gen)
    mask = torch.zeros(len(lengths), n, dtype=torch.long)
    for i, length in enumerate(lengths):
        mask[i, n - length:] = 1
        ids[i, : n - length] = 0
    return ids, mask


def tiny_gpt2(kernel: str) -> GPT2LMHeadModel:
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=2)
    model = GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():  # position embeddings large enough that a shift is visible in every kernel
        model.transformer.wpe.weight.normal_(0, 0.5)
        for block in model.transformer.h:  # peaked attention (random init is near-uniform)
            block.attn.c_attn.weight[:, :64].mul_(8)
    return hf_kernel_attn.patch(model, kernel=kernel)


def small_llama(kernel: str) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(8)
            layer.self_attn.k_proj.weight.mul_(8)
    return hf_kernel_attn.patch(model, kernel=kernel)


@pytest.mark.real_model
@pytest.mark.parametrize("kernel", CAUSAL)
def test_smollm2_left_padded_plain_forward(kernel, smollm2, smollm2_tok, fresh):
    fresh(smollm2)
    hf_kernel_attn.patch(smollm2, kernel=kernel)
    batch = smollm2_tok(TEXTS, return_tensors="pt", padding=True)
    assert not batch["attention_mask"].bool().all()
    gaps = relative_gaps(smollm2, batch["input_ids"], batch["attention_mask"])
    assert max(gaps) <= 1e-3, f"{kernel}: relative gaps per row {gaps}"


@pytest.mark.parametrize("kernel", CAUSAL)
def test_gpt2_left_padded_plain_forward(kernel):
    """Learned absolute positions: without derived positions even softmax differs."""
    model = tiny_gpt2(kernel)
    ids, mask = random_left_padded([9, 4, 1, 7])
    gaps = relative_gaps(model, ids, mask)
    assert max(gaps) <= 1e-3, f"{kernel}: relative gaps per row {gaps}"


def test_gpt2_shift_is_visible_without_the_hook():
    """The GPT-2 test above can fail: removing the hook brings the difference back."""
    model = tiny_gpt2("softmax")
    ids, mask = random_left_padded([9, 4])
    positions.remove(model)
    assert max(relative_gaps(model, ids, mask)) > 1e-2
    positions.install(model)
    assert max(relative_gaps(model, ids, mask)) <= 1e-3


def test_derived_positions_are_generates():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 1, 0, 1, 1]])
    expected = torch.tensor([[0, 0, 0, 1, 2], [0, 1, 2, 3, 4], [0, 0, 0, 1, 2]])
    assert torch.equal(positions.positions_from_mask(mask, 5), expected)
    assert torch.equal(positions.positions_from_mask(mask, 2), expected[:, 3:])


@pytest.mark.parametrize("kernel", ["elu", "cosformer", "softmax"])
def test_generate_is_unchanged_by_the_hook(kernel):
    """generate() passes its own position_ids: sequences and logits are identical with and without the hook."""
    model = small_llama(kernel)
    ids, mask = random_left_padded([6, 3, 5], seed=1)
    kw = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, return_dict_in_generate=True,
              output_logits=True, pad_token_id=0)
    with_hook = model.generate(ids, **kw)
    positions.remove(model)
    without = model.generate(ids, **kw)
    assert torch.equal(with_hook.sequences, without.sequences)
    assert torch.equal(torch.stack(with_hook.logits), torch.stack(without.logits))


@needs_state_cache
@pytest.mark.parametrize("kernel", ["dijiang", "performer"])
def test_manual_decoding_with_a_cache_and_full_mask(kernel):
    """A hand-written decode loop (mask covers past + new tokens, no position_ids) gives generate()'s logits."""
    model = small_llama(kernel)
    ids, mask = random_left_padded([6, 2], seed=2)
    gen = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, return_dict_in_generate=True,
                         output_logits=True, pad_token_id=0)
    cache = RecurrentStateCache(model)
    logits = []
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, **cache_arg(cache), use_cache=True)
        for step in range(4):
            logits.append(out.logits[:, -1])
            nxt = gen.sequences[:, ids.shape[1] + step][:, None]
            mask = torch.cat([mask, torch.ones_like(nxt)], 1)
            out = model(input_ids=nxt, attention_mask=mask, **cache_arg(cache), use_cache=True)
    torch.testing.assert_close(torch.stack(logits, 1), torch.stack(gen.logits, 1), atol=1e-5, rtol=1e-4)


@needs_state_cache
def test_mask_not_covering_the_past_raises():
    model = small_llama("elu")
    ids, mask = random_left_padded([5, 3], seed=3)
    cache = RecurrentStateCache(model)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, **cache_arg(cache), use_cache=True)
        with pytest.raises(ValueError, match="mask has 1 columns while the cache holds 5 past tokens"):
            model(input_ids=ids[:, -1:], attention_mask=torch.tensor([[1], [0]]), **cache_arg(cache), use_cache=True)


def test_positional_arguments_and_explicit_positions():
    """position_ids passed positionally as None is filled in; positions given by the caller are kept."""
    model = small_llama("relu")
    ids, mask = random_left_padded([7, 3], seed=4)
    with torch.no_grad():
        by_keyword = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
        positional = model.model(ids, mask, None).last_hidden_state
        torch.testing.assert_close(positional, by_keyword, atol=0, rtol=0)
        given = torch.arange(7)[None].expand(2, 7)  # the stock numbering, pads included
        stock = model.model(input_ids=ids, attention_mask=mask, position_ids=given).last_hidden_state
    assert (stock[1, -3:] - by_keyword[1, -3:]).abs().max() > 1e-3  # the caller's positions were used
    torch.testing.assert_close(stock[0], by_keyword[0], atol=0, rtol=0)  # unpadded row: same positions


def test_hook_installed_once_removed_by_unpatch_and_absent_on_encoders(tiny_llama, tiny_bert):
    from transformers import AutoModel, AutoModelForCausalLM

    def hooks(module):
        return sum(h is positions._hook for h in module._forward_pre_hooks.values())

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, attn_implementation="hedgehog")
    assert hooks(model.model) == 1
    hf_kernel_attn.patch(model, kernel="elu")
    hf_kernel_attn.patch(model, kernel="elu", layers=[1])
    assert hooks(model.model) == 1 and hooks(model) == 0
    hf_kernel_attn.unpatch(model)
    assert hooks(model.model) == 0
    bert = AutoModel.from_pretrained(tiny_bert, attn_implementation="elu")
    assert hooks(bert) == 0
