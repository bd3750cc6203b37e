"""``hf-kernel-attn diagnose``: does a sliding-window hybrid use its linear branch?

On blocks of real text it reports, per hybrid layer, the share of the attention normaliser carried by the
feature-map (linear) branch, and for the whole model the next-token loss as it is, with the linear branch
zeroed (λ = 0 inside the hybrid kernel), and as the window-only model of the same weights (every hybrid
layer re-patched as ``softmax`` with the same ``window``). The last two are the same function computed two
ways; their agreement is checked by the command.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..integration.branches import hybrid_layers, linear_branch_off, normaliser_shares, to_window_only
from .perplexity import block_nll


@torch.no_grad()
def mean_loss(model, blocks: torch.Tensor) -> float:
    """Mean next-token NLL over every predicted token of the ``[n, L]`` blocks."""
    total, count = block_nll(model, blocks)
    return total / count


def text_blocks(tokenizer, text: str, tokens: int, blocks: int) -> torch.Tensor:
    """The first ``blocks`` blocks of ``tokens`` tokens of ``text``; ValueError when the text is shorter."""
    ids = tokenizer(text, add_special_tokens=False).input_ids
    if len(ids) < tokens:
        raise ValueError(f"the data file has {len(ids)} tokens, fewer than one block of --tokens {tokens}")
    blocks = min(blocks, len(ids) // tokens)
    return torch.tensor(ids[: blocks * tokens]).view(blocks, tokens)


def diagnose(model, tokenizer, text: str, *, tokens: int = 2048, blocks: int = 2) -> dict[str, Any]:
    """Shares per hybrid layer and the three losses (see the module docstring); re-patches ``model`` to
    window-only at the end."""
    layers = hybrid_layers(model)
    if not layers:
        raise ValueError("the model has no sliding-window hybrid layer (a feature-map kernel with window=W > 0), "
                         "so it has no linear branch next to a window to diagnose")
    data = text_blocks(tokenizer, text, tokens, blocks)
    per_layer: dict[int, list[dict[str, float]]] = {}
    for row in data:
        for i, share in normaliser_shares(model, row[None]).items():
            per_layer.setdefault(i, []).append(share)
    shares = {i: {"window": rows[0]["window"],
                  "linear_share_beyond_window": sum(r["share_beyond_window"] for r in rows) / len(rows),
                  "linear_share_all_queries": sum(r["share_all_queries"] for r in rows) / len(rows)}
              for i, rows in per_layer.items()}
    loss = mean_loss(model, data)
    with linear_branch_off(model):
        zeroed = mean_loss(model, data)
    to_window_only(model)
    window_only = mean_loss(model, data)
    return {"tokens": tokens, "blocks": int(data.shape[0]), "layers": shares,
            "loss": loss, "perplexity": math.exp(loss),
            "loss_linear_zeroed": zeroed, "perplexity_linear_zeroed": math.exp(zeroed),
            "loss_window_only": window_only, "perplexity_window_only": math.exp(window_only),
            "delta_loss_linear_zeroed": zeroed - loss,
            "zeroed_equals_window_only": abs(zeroed - window_only) <= 1e-4 * max(1.0, abs(window_only))}


def format_report(res: dict[str, Any]) -> str:
    lines = [f"{res['blocks']} block(s) of {res['tokens']} tokens", "",
             "| layer | window | linear share (queries past the window) | linear share (all queries) |",
             "|---|---|---|---|"]
    def pct(x: float) -> str:
        return "– (delta rule: no shared normaliser)" if math.isnan(x) else f"{100 * x:.1f}%"

    for i, s in res["layers"].items():
        lines.append(f"| {i} | {s['window']} | {pct(s['linear_share_beyond_window'])} | "
                     f"{pct(s['linear_share_all_queries'])} |")
    lines += ["", f"loss {res['loss']:.4f} (perplexity {res['perplexity']:.2f})",
              f"loss with the linear branch zeroed {res['loss_linear_zeroed']:.4f} "
              f"(perplexity {res['perplexity_linear_zeroed']:.2f}; Δ {res['delta_loss_linear_zeroed']:+.4f})",
              f"window-only model (softmax, same window) {res['loss_window_only']:.4f} "
              f"(perplexity {res['perplexity_window_only']:.2f}); equal to the zeroed loss: "
              f"{res['zeroed_equals_window_only']}"]
    return "\n".join(lines)
