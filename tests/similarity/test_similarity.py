"""Kernel geometry, plot-kernels, the MQAR / ListOps-style generators and the synthetic runner."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from hf_kernel_attn.cli import main as cli_main
from hf_kernel_attn.similarity import synthetic as syn
from hf_kernel_attn.similarity import synthetic_tasks as seqs
from hf_kernel_attn.similarity.geometry import geometry, kernel_on_plane
from hf_kernel_attn.similarity.report import aggregate, render_leaderboard, table

# ------------------------------------------------------------------------------------------- ListOps


@pytest.mark.parametrize("expr, answer", [
    ("[MAX 2 9 [MIN 4 7 ] 0 ]", 9),           # max(2, 9, min(4, 7) = 4, 0)
    ("[SM 3 4 5 ]", 2),                       # 12 mod 10
    ("[MED 1 5 3 9 ]", 4),                    # sorted 1 3 5 9: (3 + 5) / 2
    ("[MED 1 2 3 4 ]", 2),                    # (2 + 3) / 2 = 2.5, truncated as LRA's int(np.median)
    ("[MED 7 1 4 ]", 4),                      # odd count: the middle value
    ("[SM [MAX 9 8 ] [MIN 5 6 ] 7 ]", 1),     # 9 + 5 + 7 = 21
    ("[MIN [MED 8 0 ] [SM 9 9 ] ]", 4),       # min(4, 18 mod 10 = 8)
    ("6", 6),
])
def test_listops_hand_examples(expr, answer):
    assert seqs.listops_value(expr.split()) == answer


def test_listops_example_layout():
    ids, targets = seqs.listops_example("[SM 3 4 5 ]".split(), 8)
    tok = seqs.LISTOPS_ID
    assert ids.tolist() == [tok["[SM"], tok["3"], tok["4"], tok["5"], tok["]"], tok["="], 0, 0]
    assert targets.tolist() == [-100] * 5 + [tok["2"]] + [-100] * 2


@pytest.mark.parametrize("bad", ["[MAX 1 2", "[MAX ]", "1 2", "[FOO 1 2 ]", "]"])
def test_listops_rejects_malformed(bad):
    with pytest.raises(ValueError):
        seqs.listops_value(bad.split())


def test_listops_generator_follows_the_rules():
    rng = np.random.default_rng(0)
    for _ in range(200):
        toks = seqs.random_tree(rng, 1, 4, 5)
        depth = max_depth = 0
        for t in toks:
            depth += t in seqs.OPERATORS
            depth -= t == "]"
            max_depth = max(max_depth, depth)
        assert max_depth <= 3  # operators only above max_depth = 4 (root at depth 1)
        # every operator has 2..5 direct arguments: count them with a stack
        stack = []
        for t in toks:
            if stack and t != "]":
                stack[-1] += 1
            if t in seqs.OPERATORS:
                stack.append(0)
            elif t == "]":
                assert 2 <= stack.pop() <= 5
        ids, targets = seqs.random_listops(rng, 16, 64, 4, 5)
        n = int((ids != 0).sum())
        assert 17 <= n <= 65 and ids[n - 1] == seqs.LISTOPS_ID["="] and (targets != -100).sum() == 1


# ---------------------------------------------------------------------------------------------- MQAR


def test_mqar_hand_example():
    ids, targets = seqs.mqar_example(keys=[5, 7, 9], values=[40, 50, 60], queries=[2, 0], positions=[8, 12],
                                    seq_len=16)
    assert ids.tolist() == [5, 40, 7, 50, 9, 60, 0, 0, 9, 60, 0, 0, 5, 40, 0, 0]
    expected = [-100] * 16
    expected[8], expected[12] = 60, 40
    assert targets.tolist() == expected
    with pytest.raises(ValueError):  # a query overlapping the pairs
        seqs.mqar_example([5, 7], [40, 50], [0], [2], 8)
    with pytest.raises(ValueError):  # two queries on the same slot
        seqs.mqar_example([5, 7], [40, 50], [0, 1], [4, 5], 8)


def test_random_mqar_answers_are_the_paired_values():
    rng = np.random.default_rng(3)
    for _ in range(50):
        ids, targets = seqs.random_mqar(rng, 64, 8, 64)
        pairs = {int(ids[2 * i]): int(ids[2 * i + 1]) for i in range(8)}
        assert len(pairs) == 8 and all(1 <= k < 32 for k in pairs) and all(32 <= v < 64 for v in pairs.values())
        pos = np.flatnonzero(targets != -100)
        assert len(pos) == 8 and pos.min() >= 16
        for p in pos:
            assert targets[p] == pairs[int(ids[p])] == ids[p + 1]


def test_shipped_settings_load_and_share_one_hyperparameter_set_per_setting():
    names = syn.available_settings()
    assert {"mqar-short", "mqar-long", "listops"} <= set(names)  # the names are the study's contract
    for name in ("mqar-short", "mqar-long", "listops"):
        st = syn.load_setting("listops" if name == "listops" else "mqar", name)
        # kernel_params may only set the kernels' own options, never the training hyperparameters
        assert all(set(p) <= {"length"} for p in st.kernel_params.values())
        if st.task == "mqar":
            rng = np.random.default_rng(0)
            ids, targets = st.sampler()(rng)
            assert ids.shape == (st.seq_len,) and (targets != -100).sum() == st.data["num_pairs"]


def _tiny_setting(task="mqar", **data):
    base = {"mqar": {"seq_len": 16, "num_pairs": 2, "vocab_size": 16},
            "listops": {"min_length": 1, "max_length": 4, "max_depth": 2, "max_args": 2}}[task]
    return syn.Setting("tiny", task, {**base, **data},
                       {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2},
                       {"steps": 3, "batch_size": 4, "lr": 1e-3, "weight_decay": 0.0, "warmup": 1},
                       {"num_examples": 40, "seed": 1_000_003}, {})


def test_generators_are_deterministic_per_seed_and_heldout_is_excluded():
    st = _tiny_setting("listops")  # only 410 distinct trees: training draws hit held-out ones often
    a_ids, _ = syn.heldout_set(st)
    b_ids, _ = syn.heldout_set(st)
    assert np.array_equal(a_ids, b_ids) and len({x.tobytes() for x in a_ids}) == len(a_ids) == 40
    held = {x.tobytes() for x in a_ids}
    first = next(syn.training_batches(st, 0, 8, held))[0]
    assert np.array_equal(first, next(syn.training_batches(st, 0, 8, held))[0])
    assert not np.array_equal(first, next(syn.training_batches(st, 1, 8, held))[0])
    gen = syn.training_batches(st, 0, 64, held)
    drawn = np.concatenate([next(gen)[0] for _ in range(10)])
    assert not {x.tobytes() for x in drawn} & held
    unfiltered = np.concatenate([next(syn.training_batches(st, 0, 64, set()))[0] for _ in range(1)])
    assert {x.tobytes() for x in unfiltered} & held  # so the exclusion above did something


# ------------------------------------------------------------------------------------------ runner


@pytest.fixture
def tiny_yaml(tmp_path):
    path = tmp_path / "tiny-mqar.yaml"
    path.write_text("task: mqar\ndata: {seq_len: 16, num_pairs: 2, vocab_size: 16}\n"
                    "model: {hidden_size: 16, intermediate_size: 32, num_hidden_layers: 1, num_attention_heads: 2}\n"
                    "train: {steps: 3, batch_size: 4, lr: 1.0e-3, weight_decay: 0.0, warmup: 1}\n"
                    "eval: {num_examples: 40, seed: 1000003}\nkernel_params: {cosine: {length: 16}}\n")
    return path


def test_synthetic_run_writes_leaderboard_records_and_resumes(tiny_yaml, tmp_path):
    out = tmp_path / "res" / "results.jsonl"
    recs = syn.run_many("mqar", ["softmax", "cosine"], [0, 1], settings=[str(tiny_yaml)], output=out, log=None)
    lines = [json.loads(ln) for ln in out.read_text().splitlines()]
    assert len(recs) == len(lines) == 4
    for r in lines:
        for key in ("model_name", "kernel_row", "model", "kernel", "layers", "task", "split", "metric", "value",
                    "stderr", "n", "seconds", "seed", "cpu_seconds"):
            assert key in r
        assert r["task"] == "tiny-mqar" and r["metric"] == "accuracy" and r["n"] == 80 and 0 <= r["value"] <= 100
    again = syn.run_synthetic("mqar", "softmax", 0, str(tiny_yaml), log=None)
    assert again["value"] == lines[0]["value"]  # deterministic per seed
    assert syn.run_many("mqar", ["softmax"], [0], settings=[str(tiny_yaml)], output=out, log=None) == []  # skipped
    agg = aggregate(lines)
    vals = [r["value"] for r in lines if r["kernel"] == "cosine"]
    assert agg[("tiny-mqar", "cosine")]["mean"] == pytest.approx(sum(vals) / 2)
    assert agg[("tiny-mqar", "cosine")]["std"] == pytest.approx(abs(vals[0] - vals[1]) / math.sqrt(2))
    assert "| cosine |" in table(lines)
    render_leaderboard(lines, tmp_path / "lb")
    md = (tmp_path / "lb" / "leaderboard.md").read_text()
    assert "tiny-llama seed 1 | cosine" in md


@pytest.mark.parametrize("argv, needle", [
    (["synthetic", "sorting", "--kernel", "softmax", "--seed", "0"], "valid tasks: ['mqar', 'listops']"),
    (["synthetic", "mqar", "--kernel", "softmaxx", "--seed", "0"], "available kernels"),
    (["synthetic", "mqar", "--kernel", "softmax", "--seed", "-1"], "seed must be"),
    (["synthetic", "mqar", "--kernel", "softmax", "--seed", "0", "--setting", "listops"], "valid settings"),
    (["synthetic", "listops", "--kernel", "softmax", "--seed", "0", "--setting", "nope"], "valid settings"),
    (["plot-kernels", "--output-dir", "X", "--converted", "gaussian"], "KERNEL=PATH"),
])
def test_cli_errors_name_valid_choices(argv, needle, capsys, tmp_path):
    argv = [str(tmp_path / a) if a == "X" else a for a in argv]
    assert cli_main(argv) == 2
    assert needle in capsys.readouterr().err


# ---------------------------------------------------------------------------------------- geometry


def test_geometry_matches_the_formulas():
    x0 = torch.tensor([1.0, 0.5], dtype=torch.float64)
    pts = torch.tensor([[0.3, -1.2], [2.0, 1.0], [-2.5, 0.7], [1.0, 0.5]], dtype=torch.float64)
    gauss = -((pts - x0) ** 2).sum(-1) / 2
    expo = pts @ x0
    cos = 2 * (pts @ x0) / (pts.norm(dim=-1) * x0.norm())
    elu = ((torch.nn.functional.elu(pts) + 1) @ (torch.nn.functional.elu(x0) + 1)).log()
    for name, want in [("gaussian", gauss), ("softmax", expo), ("cosine", cos), ("elu", elu)]:
        assert torch.allclose(kernel_on_plane(name, (1.0, 0.5), pts), want, atol=1e-6), name


def test_geometry_shapes():
    geo = geometry(points=61)
    k = geo["kernels"]
    assert k["gaussian"]["argmax"] == pytest.approx([1.0, 0.5]) and not k["gaussian"]["argmax_on_border"]
    assert k["softmax"]["argmax_on_border"] and k["elu"]["argmax_on_border"]
    ray = k["softmax"]["log_kappa_along_ray"]
    assert all(b > a for a, b in zip(ray[:-1], ray[1:], strict=True))  # grows without bound along x0
    assert max(k["cosine"]["log_kappa_along_ray"]) - min(k["cosine"]["log_kappa_along_ray"]) < 1e-9
    circle = k["cosine"]["log_kappa_on_circle"]
    assert max(circle) - min(circle) > 3  # ... but not constant across directions
    g_ray = k["gaussian"]["log_kappa_along_ray"]  # t = 0.25 .. 2.5: peak at t = 1
    assert g_ray.index(max(g_ray)) == geo["ray_t"].index(1.0)
    # performer estimates exp(x0·x) up to a constant near the origin
    diff = [p - e for p, e, t in zip(k["performer"]["log_kappa_along_ray"], ray, geo["ray_t"], strict=True) if t <= 1]
    assert max(diff) - min(diff) < 0.2


# ------------------------------------------------------------------------------------------- plots


def _head_output(model, layer: int, head: int, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's own forward at ``layer``: the attention output of query ``head`` (the o_proj input) and the
    values of its KV head, ``[N, D]`` each."""
    attn = model.model.layers[layer].self_attn
    got = {}
    hooks = [attn.o_proj.register_forward_pre_hook(lambda _m, a: got.__setitem__("o", a[0])),
             attn.v_proj.register_forward_hook(lambda _m, _a, out: got.__setitem__("v", out))]
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for h in hooks:
            h.remove()
    d = attn.head_dim
    kv = head // (model.config.num_attention_heads // model.config.num_key_value_heads)
    return got["o"][0, :, head * d:(head + 1) * d], got["v"][0, :, kv * d:(kv + 1) * d]


def test_plot_kernels_on_a_tiny_llama(tiny_llama, tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import hf_kernel_attn

    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    hf_kernel_attn.patch(model, kernel="hedgehog", layers=[1])  # layer 0 stays softmax: same q, k at layer 1
    with torch.no_grad():  # a "converted" kernel that differs from the untrained (identity-initialised) one
        for p in model.model.layers[1].self_attn.kernel_attn.parameters():
            p.add_(0.5 * torch.randn(p.shape, generator=torch.Generator().manual_seed(3)))
    model.save_pretrained(tmp_path / "hh")
    text = tmp_path / "text.txt"
    text.write_text("= Title =\n" + "The cat sat on the mat and looked at the dog. " * 12 + "\n")
    out = tmp_path / "plots"
    rc = cli_main(["plot-kernels", "--model", str(tiny_llama), "--layer", "1", "--head", "2", "--tokens", "24",
                   "--data-file", str(text), "--converted", f"hedgehog={tmp_path / 'hh'}", "--output-dir", str(out)])
    assert rc == 0
    for f in ("geometry.png", "geometry.json", "attention_maps.png", "kernel_values.png", "real_attention.json"):
        assert (out / f).stat().st_size > 0
    real = json.loads((out / "real_attention.json").read_text())
    assert real["layer"] == 1 and real["head"] == 2 and real["tokens"] == 24
    assert real["augment_identity_max_abs_diff"] < 1e-4 < real["gaussian_without_augment_max_abs_diff"]
    # each plotted map, times the head's values, is what the model's own forward computes at that head: the
    # original model (transformers' attention) for softmax, the saved converted model for the converted map
    ids = torch.tensor([AutoTokenizer.from_pretrained(tiny_llama).convert_tokens_to_ids(real["text_tokens"])])
    original = AutoModelForCausalLM.from_pretrained(tiny_llama, attn_implementation="eager")
    converted = AutoModelForCausalLM.from_pretrained(tmp_path / "hh")
    for name, m in (("softmax", original), ("hedgehog (converted)", converted)):
        o, v = _head_output(m, 1, 2, ids)
        w = torch.tensor(real["maps"][name])
        assert w.triu(1).abs().max() < 1e-6 and torch.allclose(w.sum(-1), torch.ones(24), atol=1e-3)
        assert (w @ v - o).abs().max() < 2e-3 * v.abs().max(), name  # the maps are rounded to 4 decimals
    # ... and the converted map is the trained kernel's, not the untrained one's
    gap = (torch.tensor(real["maps"]["hedgehog (converted)"]) - torch.tensor(real["maps"]["hedgehog"])).abs().max()
    assert gap > 0.01
    assert "augment identity" in capsys.readouterr().out
    assert cli_main(["plot-kernels", "--model", str(tiny_llama), "--layer", "7", "--output-dir", str(out),
                     "--data-file", str(text)]) == 2
