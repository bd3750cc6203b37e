"""`diagnose`: the linear branch's share of the hybrid normaliser (against a loop-by-loop float64 brute force),
and the loss with that branch zeroed against the window-only model computed through the softmax kernel."""

from __future__ import annotations

import json
import math

import pytest
import torch

import hf_kernel_attn
from hf_kernel_attn.integration.branches import linear_branch_off, normaliser_shares, window_only_config
from hf_kernel_attn.kernels.base import group_queries
from hf_kernel_attn.kernels.linear.spec import HybridCall, HybridSpec
from hf_kernel_attn.kernels.linear.window import branch_normalisers
from tests.paths import DATA


def brute_shares(q, k, window, scaling, lam, causal=True, sinks=0):
    """far / (window + far) per query head and query, by explicit loops; φ = elu + 1; keys 0 … sinks - 1 (no
    padding here) are softmax keys wherever they are visible."""
    def phi(x):
        return torch.where(x > 0, x + 1, torch.exp(x.clamp_max(0)))

    b, hq, n, _ = q.shape
    hkv, m = k.shape[1], k.shape[2]
    out = torch.zeros(b, hq, n, dtype=torch.float64)
    for bi in range(b):
        for h in range(hq):
            kh = h // (hq // hkv)
            for i in range(n):
                p = i + m - n
                win = far = 0.0
                for j in range(m):
                    d = p - j
                    if causal and d < 0:
                        continue
                    if abs(d) < window or j < sinks:
                        win += math.exp(scaling * float(q[bi, h, i] @ k[bi, kh, j]))
                    else:
                        far += lam[h] * float(phi(q[bi, h, i]) @ phi(k[bi, kh, j]))
                out[bi, h, i] = far / (win + far)
    return out


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("n,m", [(12, 12), (5, 12)])
@pytest.mark.parametrize("sinks", [0, 2])
def test_branch_normaliser_shares_match_brute_force(causal, n, m, sinks):
    if not causal and n != m:
        pytest.skip("bidirectional layers have N = M")
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, n, 6, generator=gen, dtype=torch.float64)
    k = torch.randn(1, 2, m, 6, generator=gen, dtype=torch.float64)
    log_mix = torch.randn(2, 2, generator=gen, dtype=torch.float64)
    kern = hf_kernel_attn.kernels.build_kernel("elu", hf_kernel_attn.kernels.LayerShape(4, 2, 6), {"window": 3})
    fq, fk = kern.features(q, k, 0.4)
    win, far = branch_normalisers(group_queries(q, 2), k, fq, fk, HybridSpec(window=3, scaling=0.4, sinks=sinks),
                                  HybridCall(causal=causal, log_mix=log_mix), block=4)
    got = (far / (win + far)).reshape(1, 4, n)
    want = brute_shares(q, k, 3, 0.4, log_mix.exp().flatten().tolist(), causal, sinks)
    assert torch.allclose(got, want, atol=1e-10)


def test_zeroed_branch_equals_window_only_on_smollm2(smollm2, smollm2_tok, fresh):
    from hf_kernel_attn.evaluation.diagnose import mean_loss
    from hf_kernel_attn.evaluation.tasks import read_text_task

    fresh(smollm2)
    text = read_text_task("wikitext2", "validation", DATA)[:4000]
    ids = torch.tensor([smollm2_tok(text, add_special_tokens=False).input_ids[:160]])
    hf_kernel_attn.patch(smollm2, kernel="hedgehog", window=16, window_mix=True, layers={0: "softmax"})
    with torch.no_grad():
        for name, p in smollm2.named_parameters():
            if name.endswith("window_log_mix"):
                p.fill_(0.7)  # a trained-looking λ = e^0.7
    full = mean_loss(smollm2, ids)
    shares = normaliser_shares(smollm2, ids)
    assert sorted(shares) == list(range(1, 30))
    assert all(0 < s["share_beyond_window"] < 1 for s in shares.values())
    with linear_branch_off(smollm2) as switched:
        zeroed = mean_loss(smollm2, ids)
    assert switched == list(range(1, 30))
    assert mean_loss(smollm2, ids) == full  # switched back on
    cfg = window_only_config(smollm2)
    assert cfg.for_layer(0).kernel == "softmax" and cfg.for_layer(0).params == {}
    assert cfg.for_layer(5).kernel == "softmax" and cfg.for_layer(5).params == {"window": 16}
    hf_kernel_attn.integration.branches.to_window_only(smollm2)
    window_only = mean_loss(smollm2, ids)
    assert abs(zeroed - window_only) <= 1e-5 * window_only
    assert abs(zeroed - full) > 1e-3  # the branch did matter


@pytest.mark.parametrize("sinks", [0, 4])
def test_delta_rule_memory_switched_off_equals_window_only_on_smollm2(sinks, smollm2, smollm2_tok, fresh):
    """diagnose on a delta-rule hybrid: the memory has no normaliser share (NaN, shown as "–"), and with its
    read-out switched off the model equals softmax over the same window and sinks (an independent model:
    re-patched)."""
    from hf_kernel_attn.evaluation.diagnose import mean_loss

    fresh(smollm2)
    ids = torch.randint(100, 40000, (1, 96), generator=torch.Generator().manual_seed(1))
    hf_kernel_attn.patch(smollm2, kernel="deltanet", window=16, sinks=sinks, layers={0: "softmax"})
    full = mean_loss(smollm2, ids)
    shares = normaliser_shares(smollm2, ids)
    assert sorted(shares) == list(range(1, 30)) and all(math.isnan(s["share_beyond_window"]) for s in shares.values())
    with linear_branch_off(smollm2):
        zeroed = mean_loss(smollm2, ids)
    hf_kernel_attn.integration.branches.to_window_only(smollm2)
    window_only = mean_loss(smollm2, ids)
    assert abs(zeroed - window_only) <= 1e-5 * window_only
    assert abs(zeroed - full) > 1e-3  # the memory did matter


def test_diagnose_command(smollm2_dir, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from hf_kernel_attn.cli import main

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir)
    hf_kernel_attn.patch(model, kernel="elu", window=32)
    model.save_pretrained(tmp_path / "m")
    import shutil

    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (smollm2_dir / f).exists():
            shutil.copy(smollm2_dir / f, tmp_path / "m" / f)
    out = tmp_path / "d.json"
    rc = main(["diagnose", "--model", str(tmp_path / "m"), "--data-file",
               str(DATA / "wikitext-2-raw" / "wiki.valid.raw"), "--tokens", "96", "--blocks", "1",
               "--output", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert len(res["layers"]) == 30 and res["zeroed_equals_window_only"] is True
    assert "linear share" in capsys.readouterr().out
    # a model without a hybrid layer is refused with a clear message
    assert main(["diagnose", "--model", str(smollm2_dir), "--data-file",
                 str(DATA / "wikitext-2-raw" / "wiki.valid.raw"), "--tokens", "96"]) == 2
    assert "no sliding-window hybrid layer" in capsys.readouterr().err
