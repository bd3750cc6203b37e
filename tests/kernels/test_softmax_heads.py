"""Per-head hybrids (option ``softmax_heads``): the chosen query heads run exact softmax over every key, the
others their feature map (with or without the window and sinks). Against the float64 brute force of
tests/kernels/reference.py, gradients, decoding in pieces, and SmolLM2 cached generation after a 2k prompt."""

from __future__ import annotations

import re

import pytest
import torch

import hf_kernel_attn
from hf_kernel_attn.integration.cache import RecurrentStateCache
from hf_kernel_attn.kernels import LayerShape, build_kernel
from hf_kernel_attn.kernels.linear import PastKeys
from tests.compat import cache_arg, needs_state_cache
from tests.kernels import reference as ref
from tests.kernels.window_helpers import assert_gradients_match, compare, inputs, make, padding
from tests.paths import DATA


@pytest.mark.parametrize("name, params", [("elu", {}), ("hedgehog", {"window": 7}),
                                          ("dijiang", {"window": 5, "sinks": 2}), ("cosformer", {})])
@pytest.mark.parametrize("heads", [[0], [1, 2], [3, 0, 2]])
@pytest.mark.parametrize("causal", [True, False])
def test_softmax_heads_against_brute_force(name, params, heads, causal):
    params = dict(params)
    window_size = params.pop("window", 0)
    kern = make(name, window_size, mix=bool(window_size), softmax_heads=heads, **params)
    for n, m in [(70, 70), (9, 40)]:
        q, k, v = inputs(2, 4, 2, n, m)
        compare(kern, q, k, v, padding(2, m, causal), causal, 1e-10)
        compare(kern, q, k, v, None, causal, 1e-10)


def test_softmax_heads_are_exactly_softmax_and_the_others_untouched():
    q, k, v = inputs(1, 4, 2, 50, 50)
    plain = make("hedgehog", 8)
    mixed = make("hedgehog", 8, softmax_heads=[2])
    mixed.load_state_dict(plain.state_dict())
    a, b = plain(q, k, v, causal=True), mixed(q, k, v, causal=True)
    assert torch.equal(a[:, :, [0, 1, 3]], b[:, :, [0, 1, 3]])
    want = ref.softmax_ref(None, q, k, v, causal=True)
    assert (b[:, :, 2] - want[:, :, 2]).abs().max() < 1e-12


def test_softmax_heads_gradients_match_brute_force():
    assert_gradients_match(make("hedgehog", 5, softmax_heads=[1, 3], sinks=1), 30)


@pytest.mark.parametrize("window_size", [0, 4])
def test_softmax_heads_decoding_in_pieces_equals_one_pass(window_size):
    kern = make("hedgehog", window_size, mix=bool(window_size), softmax_heads=[0, 3], chunk_size=8)
    q, k, v = inputs(2, 4, 2, 33, 33, seed=5)
    mask = torch.ones(2, 33, dtype=torch.bool)
    mask[1, :9] = False
    full = kern(q, k, v, key_mask=mask, causal=True)
    state, start, pos, outs = None, 0, 0, []
    for piece in (7, 1, 1, 9, 1, 14):
        out, state = kern.forward_with_state(q[:, :, pos:pos + piece], k[:, :, start:pos + piece],
                                             v[:, :, start:pos + piece], key_mask=mask[:, start:pos + piece],
                                             causal=True, past=PastKeys(state, start))
        outs.append(out)
        pos += piece
        start = max(0, pos - (window_size - 1)) if window_size else pos
    assert state.exact.keys.shape == (2, 2, 33, 8)  # KV heads 0 and 1 (query heads 0 and 3), every key
    assert ((torch.cat(outs, 1) - full).abs() * mask[:, :, None, None]).max().item() <= 1e-12


def test_bad_softmax_heads():
    for params, message in [({"softmax_heads": [1, 1]}, "distinct query-head indices"),
                            ({"softmax_heads": [-1]}, "distinct query-head indices"),
                            ({"softmax_heads": "0"}, "must be a list"),
                            ({"softmax_heads": [4]}, r"head index \[4\] out of range, the layer has 4 query heads")]:
        with pytest.raises(ValueError, match=message):
            build_kernel("hedgehog", LayerShape(4, 2, 8, 0, 128), params)


@needs_state_cache
def test_smollm2_softmax_heads_generation_after_1k_prompt(smollm2, smollm2_tok, fresh):
    """hedgehog + window 64 + sinks 4 with two exact heads in layer 5 and one in layer 20 (per-layer options):
    cached greedy generation (16 tokens after 1,024) = recomputation; the exact heads' K/V grow with the context,
    nothing else does."""
    fresh(smollm2)
    base = {"window": 64, "sinks": 4}
    layers = {5: {"kernel": "hedgehog", "params": {**base, "softmax_heads": [0, 4]}},
              20: {"kernel": "hedgehog", "params": {**base, "softmax_heads": [8]}}}
    hf_kernel_attn.patch(smollm2, kernel="hedgehog", layers=layers, **base)
    text = open(DATA / "wikitext-2-raw" / "wiki.valid.raw").read()[30000:50000]
    ids = smollm2_tok(text, return_tensors="pt").input_ids[:, :1024]
    with torch.no_grad():
        seq = smollm2.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, min_new_tokens=16,
                               do_sample=False)
        logits = smollm2(seq[:, :-1], use_cache=False).logits
    assert torch.equal(logits[0, 1023:].argmax(-1), seq[0, 1024:])
    sizes = {}
    with torch.no_grad():
        for n in (512, 1024):
            cache = RecurrentStateCache(smollm2)
            smollm2(ids[:, :n], **cache_arg(cache), use_cache=True)
            sizes[n] = cache.nbytes()
    # layer 5 keeps KV heads 0 and 1, layer 20 KV head 2: 3 KV heads × 64 dims × (K + V) × fp32, + the real flags
    assert sizes[1024] - sizes[512] == 512 * (3 * 64 * 2 * 4 + 2)


def test_head_choice_errors_and_choice_against_a_per_head_brute_force(tiny_llama):
    """Per-head transfer errors equal mean (kernel - softmax)² of that head computed by hand from the layer's own
    q, k, v; the choice takes the K largest over the model; applying it keeps the trained feature maps and turns
    exactly those heads into softmax heads."""
    from transformers import AutoModelForCausalLM

    from hf_kernel_attn.integration.layer_choice import apply_head_choice, measure_head_choice
    from hf_kernel_attn.integration.patching import kernel_config

    model = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    hf_kernel_attn.patch(model, kernel="hedgehog", window=4)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.kernel_attn.weight_q.add_(0.3 * torch.randn_like(layer.self_attn.kernel_attn.weight_q))
    ids = torch.randint(5, 1000, (2, 24), generator=torch.Generator().manual_seed(0))
    seen = {}

    def spy(module, args, kwargs, output):
        seen[module.shape.layer_idx] = (args[0].detach(), args[1].detach(), args[2].detach())

    hooks = [layer.self_attn.kernel_attn.register_forward_hook(spy, with_kwargs=True) for layer in model.model.layers]
    record = measure_head_choice(model, 3, ids)
    for h in hooks:
        h.remove()
    for layer, (q, k, v) in seen.items():
        kern = model.model.layers[layer].self_attn.kernel_attn
        want = ((ref.reference(kern, q, k, v, causal=True) - ref.softmax_ref(None, q, k, v, causal=True)) ** 2
                ).mean((0, 1, 3))
        torch.testing.assert_close(torch.tensor(record["head_errors"][str(layer)], dtype=torch.float64), want,
                                   rtol=1e-4, atol=1e-9)
    flat = sorted(((e, int(layer), h) for layer, row in record["head_errors"].items() for h, e in enumerate(row)),
                  reverse=True)[:3]
    want_choice = {}
    for _, layer, h in flat:
        want_choice.setdefault(str(layer), []).append(h)
    assert record["softmax_heads"] == {key: sorted(v) for key, v in sorted(want_choice.items())}
    before = {n: p.detach().clone() for n, p in model.named_parameters() if ".kernel_attn." in n}
    apply_head_choice(model, record)
    after = dict(model.named_parameters())
    assert all(torch.equal(before[n], after[n]) for n in before)
    kcfg = kernel_config(model)
    for key, heads in record["softmax_heads"].items():
        assert model.model.layers[int(key)].self_attn.kernel_attn.options.softmax_heads == heads
        assert kcfg.for_layer(int(key)).params == {"window": 4, "softmax_heads": heads}
    assert kcfg.auto["keep_softmax_heads"] == 3


def test_finetune_heads_auto_saves_and_reloads_the_choice(tiny_llama, tmp_path):
    """heads: auto:2 after transfer (with recall text), then distillation: auto_heads.json holds the choice, the
    final model runs it and reloads to the same logits."""
    import json

    from transformers import AutoModelForCausalLM

    from hf_kernel_attn.training import load_config
    from hf_kernel_attn.training.trainer import Trainer
    from tests.training.helpers import lm_config, write_config

    cfg = lm_config(tiny_llama, tmp_path / "o", heads="auto:2", kernel_params={"window": 8, "sinks": 2},
                    **{"stages.transfer.steps": 2, "stages.distill.steps": 2, "stages.lora.steps": 0,
                       "data.recall_fraction": 0.5, "save_every": 0})
    trainer = Trainer(load_config(write_config(tmp_path / "c.yaml", cfg)))
    final = trainer.run()
    record = json.loads((tmp_path / "o" / "auto_heads.json").read_text())
    assert sum(len(h) for h in record["softmax_heads"].values()) == 2
    model = AutoModelForCausalLM.from_pretrained(final).eval()
    for key, heads in record["softmax_heads"].items():
        assert model.model.layers[int(key)].self_attn.kernel_attn.options.softmax_heads == heads
    ids = torch.randint(5, 1000, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # the saved model runs what the trainer ran (LoRA merged)
        torch.testing.assert_close(model(ids).logits, trainer.model.eval()(input_ids=ids).logits, rtol=1e-4,
                                   atol=1e-5)


def test_heads_config_errors(tiny_llama, tmp_path):
    from hf_kernel_attn.training import ConfigError, load_config
    from tests.training.helpers import lm_config, write_config

    for extra, message in [({"heads": "auto:0"}, "heads must be null, 'auto:K'"),
                           ({"heads": "top:3"}, "heads must be null, 'auto:K' .* or 'retrieval:K'"),
                           ({"heads": "retrieval:x"}, "heads must be null, 'auto:K'"),
                           ({"heads": "auto:2", "kernel": "gaussian"}, "not a feature-map kernel"),
                           ({"heads": "retrieval:2", "heads_share_kv": "yes"}, "heads_share_kv must be true or false")]:
        with pytest.raises(ConfigError, match=message):
            load_config(write_config(tmp_path / "c.yaml", lm_config(tiny_llama, tmp_path / "o", **extra)))


# ------------------------------------------------------------------------------- retrieval-head choice
def _eager_probabilities(model_dir, ids):
    """The stock model's attention probabilities ``[layers][B, Hq, N, N]`` from transformers' eager attention
    (output_attentions), the independent reference of the retrieval scores."""
    from transformers import AutoModelForCausalLM

    stock = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager").eval()
    with torch.no_grad():
        return stock(input_ids=ids, output_attentions=True).attentions


def test_retrieval_scores_match_the_stock_models_attention(tiny_llama):
    """head_retrieval_scores of a converted model = the mean (over targets) attention mass of the *stock* model's
    eager attention on each target span: the teacher is the original softmax, whatever the layers run."""
    from transformers import AutoModelForCausalLM

    from hf_kernel_attn.integration.layer_choice import head_retrieval_scores

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(5, 1000, (2, 40), generator=g)
    targets = [[[(30, 3, 9), (35, 12), (39, 0, 40)], [(20, 5, 6), (25, 10, 21)]]]
    probs = _eager_probabilities(tiny_llama, ids)
    model = hf_kernel_attn.from_pretrained(tiny_llama, kernel="hedgehog", window=4).eval()
    got = head_retrieval_scores(model, [{"input_ids": ids}], targets)
    assert sorted(got) == [0, 1]
    for layer, attn in enumerate(probs):
        want = torch.zeros(attn.shape[1], dtype=torch.float64)
        count = 0
        for b, row in enumerate(targets[0]):
            for target in row:
                t, s, e = target if len(target) == 3 else (*target, target[1] + 1)
                want += attn[b, :, t, s:e].double().sum(-1)
                count += 1
        torch.testing.assert_close(torch.tensor(got[layer], dtype=torch.float64), want / count, rtol=1e-4, atol=1e-6)
    # teacher=False scores the model's own queries and keys: a stock softmax model gives the same numbers
    stock = AutoModelForCausalLM.from_pretrained(tiny_llama, attn_implementation="softmax").eval()
    own = head_retrieval_scores(stock, [{"input_ids": ids}], targets, teacher=False)
    for layer in got:
        torch.testing.assert_close(torch.tensor(own[layer]), torch.tensor(got[layer]), rtol=1e-4, atol=1e-6)


def test_grouped_head_choice_against_enumeration():
    """choose_softmax_heads with group=3: the K KV groups whose best query head scores highest, each whole;
    checked against scoring every K-subset of groups by brute force."""
    import itertools

    from hf_kernel_attn.integration.layer_choice import choose_softmax_heads

    g = torch.Generator().manual_seed(3)
    scores = {layer: torch.rand(9, generator=g).tolist() for layer in (2, 5, 7)}
    groups = [(layer, j) for layer in scores for j in range(3)]
    best = {(layer, j): max(scores[layer][3 * j:3 * j + 3]) for layer, j in groups}
    for k in (1, 2, 4):
        top = max(itertools.combinations(groups, k), key=lambda c: sum(best[x] for x in c))
        want: dict[int, list[int]] = {}
        for layer, j in sorted(top):
            want.setdefault(layer, []).extend(range(3 * j, 3 * j + 3))
        assert choose_softmax_heads(scores, k, group=3) == want


def test_finetune_heads_retrieval_keeps_the_teachers_retrieval_heads(tiny_llama, tmp_path):
    """heads: retrieval:1 with heads_share_kv: auto_heads.json holds every head's retrieval score (the stock
    model's attention mass on the stated fact while the answer is produced, recomputed here from the calibration
    blocks' own text) and keeps the best KV group with both its query heads; the saved model runs that choice."""
    import json
    import random

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_kernel_attn.training import load_config
    from hf_kernel_attn.training.trainer import Trainer
    from tests.training.helpers import lm_config, write_config

    cfg = lm_config(tiny_llama, tmp_path / "o", heads="retrieval:1", heads_share_kv=True,
                    kernel_params={"window": 8},
                    **{"stages.transfer.steps": 2, "stages.distill.steps": 1, "stages.lora.steps": 0,
                       "data.recall_max_facts": 2, "data.seq_len": 256, "save_every": 0})
    trainer = Trainer(load_config(write_config(tmp_path / "c.yaml", cfg)))
    final = trainer.run()
    record = json.loads((tmp_path / "o" / "auto_heads.json").read_text())
    assert record["head_criterion"] == "retrieval" and record["head_group"] == 2
    scores = record["head_scores"]
    # the reference: find each fact and its answer in the calibration blocks by decoding, score with eager attention
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    rows = trainer.setup.calibration_batches()
    from hf_kernel_attn.training.recall_data import recall_block

    want = torch.zeros(2, 4, dtype=torch.float64)
    count = 0
    for b in rows:
        for j, row in enumerate(b["input_ids"]):
            block = recall_block(row.tolist(), lambda t: tok(t, add_special_tokens=False)["input_ids"],
                                 random.Random((trainer.config["seed"] + 1) * 1_000_003 + j), 2)
            ids = torch.tensor([block])
            probs = _eager_probabilities(tiny_llama, ids)
            text_at = [len(tok.decode(block[:i])) for i in range(len(block) + 1)]
            text = tok.decode(block)
            for m in re.finditer(r"Answer:( (\w+)'s (\w+) number is \d+\.)", text):
                fact = re.search(rf"\n{m.group(2)}'s {m.group(3)} number is \d+\.\n", text)
                span = [i for i in range(len(block)) if fact.start() <= text_at[i] and text_at[i + 1] <= fact.end()]
                answer = [i for i in range(len(block)) if m.start(1) <= text_at[i] and text_at[i + 1] <= m.end(1)]
                for t in range(answer[0] - 1, answer[-1]):
                    for layer in range(2):
                        want[layer] += probs[layer][0, :, t, span[0]:span[-1] + 1].double().sum(-1)
                    count += 1
    assert count > 0
    for layer in range(2):
        torch.testing.assert_close(torch.tensor(scores[str(layer)], dtype=torch.float64), want[layer] / count,
                                   rtol=1e-3, atol=1e-5)
    best = max(((layer, g) for layer in range(2) for g in range(2)),
               key=lambda x: float(want[x[0], 2 * x[1]:2 * x[1] + 2].max()))
    assert record["softmax_heads"] == {str(best[0]): [2 * best[1], 2 * best[1] + 1]}
    model = AutoModelForCausalLM.from_pretrained(final).eval()
    assert model.model.layers[best[0]].self_attn.kernel_attn.options.softmax_heads == [2 * best[1], 2 * best[1] + 1]
