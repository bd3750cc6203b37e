"""Softmax with retention slots (kernels/retention.py): against a brute-force simulation of the eviction rule
written here position by position; prefill in any chunks = token-by-token decoding; the gate does not see a key's
position (RoPE as transformers applies it); outputs before p do not depend on tokens after p; a trained gate keeps
the one early key a toy task needs where the untrained and a random gate do not; a tiny Llama with slots saves and
reloads exactly, and its cached greedy generation equals recomputation; bad options are refused by name."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

import hf_kernel_attn
from hf_kernel_attn.integration.cache import RecurrentStateCache, cache_bytes
from hf_kernel_attn.kernels import LayerShape, build_kernel
from hf_kernel_attn.kernels.retention import capacity_terms, future_attention, rope_pair_norms
from tests.compat import needs_state_cache
from tests.conftest import tiny_llama_model

SHAPE = LayerShape(num_heads=4, num_kv_heads=2, head_dim=16, layer_idx=1)


def _kernel(**params):
    return build_kernel("softmax", SHAPE, {"window": 6, "sinks": 2, "slots": 3, "retention_block": 4, **params}).eval()


def _randomise_gate(kernel, seed=0):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in kernel.retention_gate.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    return kernel


def brute_force(q, k, v, log_beta, real, *, window, sinks, slots, block, scale, decay=True):
    """The eviction rule simulated one position at a time with Python lists, then softmax over each query's
    visible keys: sinks (the first S real keys), the window, and the slots decided at the last boundary (by
    (t - j) ln β_j, or ln β_j without ``decay``)."""
    b, hq, n, _ = q.shape
    hkv = k.shape[1]
    out = torch.zeros(b, n, hq, v.shape[-1], dtype=torch.float64)
    for row in range(b):
        real_idx = [j for j in range(n) if real[row, j]]
        sink_set = set(real_idx[:sinks])
        for h in range(hkv):
            kept: list[int] = []
            decided = -1  # keys at positions ≤ decided have been offered to the slots
            for t in range(n):
                if t and t % block == 0:
                    cands = [j for j in range(decided + 1, t - window + 1) if real[row, j] and j not in sink_set]
                    pool = kept + cands
                    pool.sort(key=lambda j: ((t - j if decay else 1) * float(log_beta[row, h, j]), j), reverse=True)
                    kept = pool[:slots]
                    decided = max(decided, t - window)
                visible = {j for j in sink_set if j <= t} | {j for j in range(max(0, t - window + 1), t + 1)
                                                             if real[row, j]} | set(kept)
                idx = sorted(visible)
                for g in range(hq // hkv):
                    head = h * (hq // hkv) + g
                    if not idx:
                        continue
                    logits = torch.tensor([float(q[row, head, t] @ k[row, h, j]) * scale for j in idx],
                                          dtype=torch.float64)
                    w = logits.softmax(0)
                    out[row, t, head] = (w[:, None] * v[row, h, idx].double()).sum(0)
    return out


@pytest.mark.parametrize(("seed", "decay"), [(0, True), (1, True), (2, False)])
def test_the_hard_budget_equals_a_brute_force_simulation_of_the_eviction_rule(seed, decay):
    torch.manual_seed(seed)
    kernel = _randomise_gate(_kernel(retention_decay=decay), seed)
    n = 37
    q, k, v = torch.randn(2, 4, n, 16), torch.randn(2, 2, n, 16), torch.randn(2, 2, n, 16)
    real = torch.ones(2, n, dtype=torch.bool)
    real[1, :5] = False  # a left-padded row
    with torch.no_grad():
        got = kernel(q, k, v, key_mask=real, causal=True)
        log_beta = kernel.retention_gate(k, v)
    want = brute_force(q, k, v, log_beta, real, window=6, sinks=2, slots=3, block=4, scale=0.25, decay=decay)
    other = brute_force(q, k, v, log_beta, real, window=6, sinks=2, slots=3, block=4, scale=0.25, decay=not decay)
    assert not torch.allclose(want[0], other[0])  # the two rules keep different keys here
    assert log_beta.std() > 0.1  # the scores differ from key to key, so the ranking matters
    torch.testing.assert_close(got[0].double(), want[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[1, 5:].double(), want[1, 5:], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("decay", [True, False])
def test_a_prefill_in_any_chunks_equals_token_by_token_decoding(decay):
    torch.manual_seed(2)
    kernel = _randomise_gate(_kernel(retention_decay=decay), 3)
    n = 41
    q, k, v = torch.randn(1, 4, n, 16), torch.randn(1, 2, n, 16), torch.randn(1, 2, n, 16)
    with torch.no_grad():
        whole = kernel(q, k, v, causal=True)
        for cuts in ([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, *range(11, n + 1)], [0, 7, 19, 20, 33, n], [0, 16, 32, n]):
            state, outs = None, []
            for a, e in zip(cuts[:-1], cuts[1:], strict=True):
                out, state = kernel.retention_step(q[:, :, a:e], k[:, :, a:e], v[:, :, a:e], key_real=None,
                                                   scaling=None, state=state)
                outs.append(out)
            torch.testing.assert_close(torch.cat(outs, 1), whole, atol=1e-6, rtol=1e-6)
    # the cache holds at most S + (W - 1) + B + C keys per KV head, whatever the length
    assert state.sink_k.shape[2] + state.recent_k.shape[2] + state.slot_k.shape[2] <= 2 + 5 + 4 + 3


def test_the_gate_scores_a_key_the_same_wherever_rope_puts_it():
    torch.manual_seed(4)
    k = torch.randn(1, 2, 1, 16).expand(1, 2, 50, 16).contiguous()
    inv = 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))
    freqs = torch.arange(50).float()[:, None] * inv[None]
    emb = torch.cat([freqs, freqs], -1)
    _, rotated = apply_rotary_pos_emb(k, k, emb.cos()[None], emb.sin()[None])
    assert not torch.allclose(rotated[:, :, 0], rotated[:, :, 37])
    norms = rope_pair_norms(rotated)
    torch.testing.assert_close(norms, norms[:, :, :1].expand_as(norms), atol=1e-5, rtol=1e-5)
    gate = _randomise_gate(_kernel()).retention_gate
    v = torch.randn(1, 2, 1, 16).expand(1, 2, 50, 16)
    scores = gate(rotated, v)
    torch.testing.assert_close(scores, scores[:, :, :1].expand_as(scores), atol=1e-5, rtol=1e-5)


def test_outputs_before_p_do_not_depend_on_the_tokens_after_it():
    torch.manual_seed(5)
    kernel = _randomise_gate(_kernel(), 5)
    q, k, v = torch.randn(1, 4, 40, 16), torch.randn(1, 2, 40, 16), torch.randn(1, 2, 40, 16)
    q2, k2, v2 = q.clone(), k.clone(), v.clone()
    p = 23
    q2[:, :, p:], k2[:, :, p:], v2[:, :, p:] = torch.randn(1, 4, 17, 16), torch.randn(1, 2, 17, 16), torch.randn(
        1, 2, 17, 16)
    with torch.no_grad():
        a, b = kernel(q, k, v, causal=True), kernel(q2, k2, v2, causal=True)
        _, sa = kernel.retention_step(q[:, :, :p], k[:, :, :p], v[:, :, :p], key_real=None, scaling=None, state=None)
        _, sb = kernel.retention_step(q2[:, :, :p], k2[:, :, :p], v2[:, :, :p], key_real=None, scaling=None,
                                      state=None)
    torch.testing.assert_close(a[:, :p], b[:, :p], atol=0, rtol=0)
    assert not torch.allclose(a[:, p:], b[:, p:])
    for x, y in zip(sa.tensors(), sb.tensors(), strict=True):
        assert torch.equal(x, y)


def _toy_task(n=96, special=5, seed=0):
    """One early key the last queries look for (its value carries a marker) among random keys: a cache that
    drops it loses the answer."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(1, 2, n, 16, generator=gen)
    v = torch.randn(1, 2, n, 16, generator=gen)
    v[:, :, special, 0] = 6.0  # what makes the key worth keeping, visible to the gate at creation
    q = torch.randn(1, 4, n, 16, generator=gen) * 0.3
    target = k[:, :, special] / k[:, :, special].norm(dim=-1, keepdim=True)
    q[:, :, -8:] = 12.0 * target.repeat_interleave(2, 1)[:, :, None]  # the last queries read the special key
    return q, k, v


def _toy_loss(kernel, tasks, train: bool) -> torch.Tensor:
    teacher = build_kernel("softmax", SHAPE, {}).eval()
    kernel.train(train)
    total = 0.0
    for q, k, v in tasks:
        with torch.no_grad():
            want = teacher(q, k, v, causal=True)[:, -8:]
        total = total + (kernel(q, k, v, causal=True)[:, -8:] - want).square().mean()
    return total / len(tasks)


def test_training_the_gate_keeps_the_early_key_a_toy_task_needs_and_a_random_gate_does_not():
    """Fresh toy sequences every step (the special key anywhere in 2 … 12), judged with the hard budget on
    sequences never trained on: the untrained gate keeps the newest keys and loses the answer, a random gate too."""
    held_out = [_toy_task(seed=s, special=3 + s % 7) for s in range(1000, 1004)]
    params = {"window": 8, "sinks": 0, "slots": 4, "retention_block": 4}
    kernel = build_kernel("softmax", SHAPE, params)
    random_gate = _randomise_gate(build_kernel("softmax", SHAPE, params), 7)
    with torch.no_grad():
        before = _toy_loss(kernel, held_out, train=False)
        rand = _toy_loss(random_gate, held_out, train=False)
    opt = torch.optim.Adam(kernel.retention_gate.parameters(), lr=0.05)
    for step in range(40):
        tasks = [_toy_task(seed=2 * step + j, special=2 + (2 * step + j) % 11) for j in range(2)]
        with capacity_terms() as terms:
            loss = _toy_loss(kernel, tasks, train=True)
        loss = loss + 0.1 * torch.stack(terms).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        after = _toy_loss(kernel, held_out, train=False)
    assert after < 0.05 * before, (before, after)
    assert rand > 0.5 * before, (before, rand)


@needs_state_cache
def test_a_tiny_llama_with_slots_saves_reloads_exactly_and_generates_as_it_recomputes(tmp_path):
    from transformers import AutoModelForCausalLM

    model = tiny_llama_model().eval()
    hf_kernel_attn.patch(model, kernel="softmax", window=8, sinks=2, slots=6, retention_block=4)
    gates = [m for m in model.modules() if type(m).__name__ == "RetentionGate"]
    assert len(gates) == model.config.num_hidden_layers
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for g in gates:
            for p in g.parameters():
                p.copy_(torch.randn(p.shape, generator=gen))
    ids = torch.randint(0, 128, (2, 45), generator=gen)
    with torch.no_grad():
        logits = model(ids).logits
    model.save_pretrained(tmp_path)
    again = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    for a, b in zip(model.state_dict().items(), again.state_dict().items(), strict=True):
        assert a[0] == b[0] and torch.equal(a[1], b[1]), a[0]
    with torch.no_grad():
        assert torch.equal(again(ids).logits, logits)
        again.generation_config.eos_token_id = None  # 12 tokens in every row
        out = again.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                             pad_token_id=0)
        rec = ids
        for _ in range(12):
            rec = torch.cat([rec, again(rec).logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(out, rec)
    cache = RecurrentStateCache(again)
    with torch.no_grad():
        again(ids[:, :40], past_key_values=cache, use_cache=True)
    short = cache_bytes(cache)
    cache = RecurrentStateCache(again)
    with torch.no_grad():
        again(torch.cat([ids, ids], 1)[:, :88], past_key_values=cache, use_cache=True)
    assert cache_bytes(cache) == short  # 40 and 88 tokens: the same bytes (both multiples of the block)


@pytest.mark.parametrize(("params", "match"), [
    ({"slots": 4}, "slots=4 needs a window > 0"),
    ({"window": 8, "slots": 4, "retention": "h2o"}, r"retention must be one of \['learned'\]"),
    ({"window": 8, "slots": 4, "retention_block": 0}, "retention_block"),
    ({"window": 8, "slots": -1}, "slots"),
    ({"window": 8, "slots": 4, "gate_bias": math.inf}, "gate_bias"),
])
def test_bad_retention_options_are_refused_by_name(params, match):
    with pytest.raises(ValueError, match=match):
        build_kernel("softmax", SHAPE, params)


def test_future_attention_is_the_largest_weight_a_key_gets_once_it_left_the_window():
    torch.manual_seed(6)
    q, k = torch.randn(2, 4, 20, 16), torch.randn(2, 2, 20, 16)
    real = torch.ones(2, 20, dtype=torch.bool)
    real[1, :3] = False
    got = future_attention(q, k, real, window=5, scale=0.25)
    want = torch.zeros(2, 2, 20)
    for row in range(2):
        for h in range(4):
            for i in range(20):
                keys = [j for j in range(i + 1) if real[row, j]]
                if not keys:
                    continue
                w = torch.tensor([float(q[row, h, i] @ k[row, h // 2, j]) * 0.25 for j in keys]).softmax(0)
                for j, wj in zip(keys, w, strict=True):
                    if i - j >= 5:
                        want[row, h // 2, j] = max(want[row, h // 2, j], wj)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_the_attention_objective_also_teaches_the_gate_to_keep_the_early_key():
    """Labels from the full softmax's future attention (the top C keys), binary cross-entropy on the gate's logit."""
    held_out = [_toy_task(seed=s, special=3 + s % 7) for s in range(1000, 1004)]
    params = {"window": 8, "sinks": 0, "slots": 4, "retention_block": 4}
    kernel = build_kernel("softmax", SHAPE, params)
    with torch.no_grad():
        before = _toy_loss(kernel, held_out, train=False)
    opt = torch.optim.Adam(kernel.retention_gate.parameters(), lr=0.05)
    for step in range(60):
        q, k, v = _toy_task(seed=step, special=2 + step % 11)
        target = future_attention(q, k, None, window=8, scale=0.25)
        eligible = torch.arange(k.shape[-2]) <= k.shape[-2] - 1 - 8
        labels = torch.zeros_like(target).scatter_(-1, target.masked_fill(~eligible, -1).topk(4, -1).indices, 1.0)
        z = kernel.retention_gate.logits(k, v)
        weight = torch.where(labels > 0, (int(eligible.sum()) - 4) / 4, 1.0)  # the positives count as the rest
        loss = (torch.nn.functional.binary_cross_entropy_with_logits(z, labels, reduction="none") * weight)[
            ..., eligible].mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        after = _toy_loss(kernel, held_out, train=False)
    assert after < 0.05 * before, (before, after)


@pytest.mark.parametrize("objective", ["kl", "attention", "attention+facts"])
def test_the_retention_stage_trains_only_the_gates(objective, tiny_llama, tmp_path, monkeypatch):
    from safetensors.torch import load_file

    from hf_kernel_attn.training import Trainer
    from hf_kernel_attn.training.config import load_config
    from tests.training.helpers import lm_config, read_log, write_config

    cfg = lm_config(tiny_llama, tmp_path / "o", kernel="softmax",
                    kernel_params={"window": 8, "sinks": 2, "slots": 4, "retention_block": 4,
                                   "retention_decay": objective == "kl"},
                    stages={"retention": {"steps": 3, "objective": objective.split("+")[0], "lr": 0.05,
                                          **({"read_distance": 16} if objective == "attention" else {}),
                                          **({"fact_labels": True} if objective.endswith("facts") else {})}},
                    save_every=0)
    cfg["data"]["seq_len"] = 128 if objective.endswith("facts") else 64  # room for a fact and its question
    from hf_kernel_attn.training.stages.retention import RetentionStage

    stated_tokens = []
    with_facts = RetentionStage._with_facts

    def spy(self, batch):
        new, stated = with_facts(self, batch)
        stated_tokens.append(int(stated.sum()))
        assert not torch.equal(new["input_ids"], batch["input_ids"])
        return new, stated

    monkeypatch.setattr(RetentionStage, "_with_facts", spy)
    Trainer(load_config(write_config(tmp_path / "c.yaml", cfg))).run()
    assert bool(stated_tokens) == objective.endswith("facts") and all(n > 0 for n in stated_tokens), stated_tokens
    log = read_log(tmp_path / "o")
    assert [r["stage"] for r in log if "loss" in r] == ["retention"] * 3
    saved = load_file(str(tmp_path / "o" / "final" / "model.safetensors"))
    original = load_file(str(tiny_llama / "model.safetensors"))
    gates = [n for n in saved if ".retention_gate." in n]
    assert len(gates) == 2 * 4  # w1, b1, w2, b2 per layer
    assert any(not torch.equal(saved[n], torch.zeros_like(saved[n])) for n in gates if n.endswith(".w2"))
    for name, tensor in original.items():  # the model's own weights did not move
        assert torch.equal(saved[name], tensor), name


def test_the_retention_stage_refuses_a_model_without_slots_and_a_bad_objective(tiny_llama, tmp_path):
    from hf_kernel_attn.configfile import ConfigError
    from hf_kernel_attn.training import Trainer
    from hf_kernel_attn.training.config import load_config
    from tests.training.helpers import lm_config, write_config

    cfg = lm_config(tiny_llama, tmp_path / "o", stages={"retention": {"steps": 1, "objective": "h2o"}})
    with pytest.raises(ConfigError, match=r"stages.retention.objective must be one of \['kl', 'attention'\]"):
        load_config(write_config(tmp_path / "c.yaml", cfg))
    cfg = lm_config(tiny_llama, tmp_path / "o", kernel="softmax", kernel_params={"window": 8},
                    stages={"retention": {"steps": 1}}, save_every=0)
    with pytest.raises(ConfigError, match="stages.retention trains the retention gates of softmax layers with slots"):
        Trainer(load_config(write_config(tmp_path / "c2.yaml", cfg))).run()
    # the attention objective's score does not age: slots that rank by age would throw old keys away
    cfg = lm_config(tiny_llama, tmp_path / "o", kernel="softmax", kernel_params={"window": 8, "slots": 4},
                    stages={"retention": {"steps": 1, "objective": "attention"}}, save_every=0)
    with pytest.raises(ConfigError, match="set kernel_params.retention_decay: false"):
        load_config(write_config(tmp_path / "c3.yaml", cfg))
    cfg["kernel_params"]["retention_decay"] = False
    cfg["stages"]["retention"]["read_distance"] = -1
    with pytest.raises(ConfigError, match="stages.retention.read_distance must be an integer >= 0, got -1"):
        load_config(write_config(tmp_path / "c4.yaml", cfg))
    cfg["stages"]["retention"] = {"steps": 1, "objective": "kl", "fact_labels": True}
    cfg["kernel_params"]["retention_decay"] = True
    with pytest.raises(ConfigError, match="fact_labels labels the keys of the attention objective"):
        load_config(write_config(tmp_path / "c5.yaml", cfg))


@pytest.mark.parametrize("decay", [True, False])
def test_the_soft_form_weighs_each_old_key_by_its_retention_inside_the_softmax(decay):
    """The training form against the formula written out per query and key with float64 loops: keys outside the
    window and the sinks get (t - j) ln β_j (ln β_j without decay) added to their logit; the capacity term is
    |Σ_j β_j^(t - j) - min(C, n_t)| / C averaged over queries."""
    torch.manual_seed(9)
    kernel = _randomise_gate(_kernel(retention_decay=decay), 9).train()
    n, window, sinks, slots = 23, 6, 2, 3
    q, k, v = torch.randn(1, 4, n, 16), torch.randn(1, 2, n, 16), torch.randn(1, 2, n, 16)
    with capacity_terms() as terms:
        got = kernel(q, k, v, causal=True)
    log_beta = kernel.retention_gate(k, v).detach().double()
    want = torch.zeros(1, n, 4, 16, dtype=torch.float64)
    gaps = []
    for h in range(4):
        g = h // 2
        for t in range(n):
            logits, expected, old = [], 0.0, 0
            for j in range(t + 1):
                x = float(q[0, h, t].double() @ k[0, g, j].double()) * 0.25
                if t - j >= window and j >= sinks:
                    bias = (t - j if decay else 1) * float(log_beta[0, g, j])
                    x += bias
                    expected += math.exp(bias)
                    old += 1
                logits.append(x)
            w = torch.tensor(logits, dtype=torch.float64).softmax(0)
            want[0, t, h] = (w[:, None] * v[0, g, :t + 1].double()).sum(0)
            if h % 2 == 0:
                gaps.append(abs(expected - min(slots, old)) / slots)
    torch.testing.assert_close(got.detach().double(), want, atol=1e-5, rtol=1e-5)
    assert len(terms) == 1
    assert float(terms[0]) == pytest.approx(sum(gaps) / len(gaps), rel=1e-4)
