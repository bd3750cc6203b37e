"""Matmul FLOP estimates of one kernel call (:func:`estimate_flops`): the work of the algorithm the kernel actually
runs, by its ``kind`` and the forms it picks (the same choices as the kernels' cost model,
:mod:`..kernels.linear.cost`); elementwise work (exp, softmax, feature products) is not counted, and backward counts
twice the forward (fwd + bwd = 3 × fwd, BACKWARD_FLOP_FACTOR)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..kernels import Kernel
from ..kernels.linear.cost import quadratic_block

BACKWARD_FLOP_FACTOR = 3.0  # forward + backward = 3 x forward matmul FLOPs


def feature_dim(kernel: Kernel) -> int:
    """F, the feature dimension of a linear kernel (measured by mapping one token)."""
    s = kernel.shape
    q = torch.zeros(1, s.num_heads, 1, s.head_dim)
    k = torch.zeros(1, s.num_kv_heads, 1, s.head_dim)
    device = next((t.device for t in kernel.state_dict().values()), torch.device("cpu"))
    with torch.no_grad():
        _, fk = kernel.features(q.to(device), k.to(device), s.head_dim**-0.5)
    return int(fk.shape[-1])


def _chunked_causal_flops(n: int, c: int, f: int, dv: int, hq: int, hkv: int, score_dim: int | None = None) -> float:
    """Matmul FLOPs of :func:`..kernels.linear.scan` for one sequence. Values carry an extra all-ones column (the
    denominator), so they are Dv + 1 wide. Per query head: the in-chunk scores (2·L²·F) and
    scores @ V (2·L²·(Dv + 1)) per chunk of length L, and φ(q) @ S (2·N·F·(Dv + 1)); per KV head the state
    updates φ(k)ᵀ @ V (2·N·F·(Dv + 1)). A kernel with a closed form (taylor) scores in-chunk pairs on
    ``score_dim`` = D coordinates instead of F."""
    full, rest = divmod(n, c)
    sum_sq = full * c * c + rest * rest
    per_q = 2.0 * sum_sq * ((score_dim or f) + dv + 1) + 2.0 * n * f * (dv + 1)
    per_kv = 2.0 * n * f * (dv + 1)
    return hq * per_q + hkv * per_kv


def gate_dim(kernel: Kernel) -> int:
    """Γ, the number of gates per token of a kernel with a decay (1 for a fixed decay), measured on one key."""
    s = kernel.shape
    device = next((t.device for t in kernel.state_dict().values()), torch.device("cpu"))
    k = torch.zeros(1, s.num_kv_heads, 1, s.head_dim, device=device)
    with torch.no_grad():
        return int(kernel.gates(k, s.head_dim**-0.5).shape[-1])


def _gated_scan_flops(lengths: Sequence[int], chunk: int, f: int, dv: int, hq: int, hkv: int, gates: int) -> float:
    """Matmul FLOPs of the gated scan (:func:`..kernels.linear.gated.gated_causal`), one call per entry of
    ``lengths``: chunks of C = min(chunk, L) positions (the last one padded), and per chunk and KV head with G query
    heads the in-chunk sums of the gates (2·C²·Γ), φ(q) S (2·G·C·F·E), the in-chunk scores (2·G·C²·F) times the
    values (2·G·C²·E) and the state update φ(k)ᵀ V (2·F·C·E), E = Dv + 1."""
    e, g = dv + 1, hq // hkv
    total = 0.0
    for length in lengths:
        if length == 0:
            continue
        c = min(chunk, length)
        per_chunk = 2.0 * c * c * gates + 2.0 * g * c * f * e + 2.0 * g * c * c * (f + e) + 2.0 * f * c * e
        total += hkv * -(-length // c) * per_chunk
    return total


def _quadratic_causal_flops(n: int, batch: int, hq: int, d: int, dv: int) -> float:
    """Matmul FLOPs of the closed-form causal quadratic path (taylor, short sequences): each block of L
    queries scores the keys up to its end E (2·L·E·d) and multiplies by V with its ones column
    (2·L·E·(Dv + 1)), per query head."""
    block = quadratic_block(n, batch * hq * n)
    pairs = sum((min(s + block, n) - s) * min(s + block, n) for s in range(0, n, block))
    return hq * 2.0 * pairs * (d + dv + 1)


def estimate_flops(kernel: Kernel, n: int, *, batch: int = 1, causal: bool, backward: bool = False) -> float:
    """Estimated matmul FLOPs of one call on ``batch`` sequences of ``n`` tokens (self-attention).

    * softmax-like: 2·B·H·P·(Dqk + Dv), P = N² pairs (N(N+1)/2 causal) — i.e. 4·B·H·N²·D, halved for causal
      (gaussian's q·k runs on D + 1 coordinates);
    * linear, causal: the chunked algorithm's matmuls with F features (:func:`_chunked_causal_flops`);
    * linear, bidirectional: 2·B·(Hkv + Hq)·N·F·(Dv + 1), i.e. ≈ 4·B·H·N·F·D (two causal scans
      instead when the kernel has a decay, fixed as DiJiang's or gated); at short N without autograd the
      closed form's score matrix, 2·B·Hq·N²·(D + Dv + 1) (taylor);
    * linear kernels add their feature projection (performer ω, hedgehog W, DiJiang DCT): 2·N·D·P per head
      for q and k;
    * skyformer: landmark Gram matrices, Newton–Schulz iterations and the right-to-left products; where it
      runs the exact Gaussian (``form``), the fused attention on D + 1 coordinates.
    """
    own = kernel.flops(n, batch=batch, causal=causal, backward=backward)
    if own is not None:
        return float(own)
    s = kernel.shape
    hq, hkv, d = s.num_heads, s.num_kv_heads, s.head_dim
    dv = d
    kind = kernel.kind
    if kind == "softmax-like":
        pairs = n * (n + 1) / 2 if causal else float(n * n)
        dqk = kernel.score_dim(d)
        fwd = 2.0 * batch * hq * pairs * (dqk + dv)
    elif kind in ("linear", "gated"):
        f = feature_dim(kernel)
        chunk = kernel.options.chunk_size
        closed = kernel.has_closed_form and not backward  # the no-grad path scores from q·k
        meta = [torch.empty(batch, h, n, d, device="meta") for h in (hq, hkv, hkv)]
        if causal and closed and kernel.quadratic_is_cheaper(*meta, False):
            per_seq = _quadratic_causal_flops(n, batch, hq, d, dv)
        elif causal and kernel.is_gated and not getattr(kernel.options, "window", 0):
            # without autograd a block of whole chunks at a time, with it one call
            block = n if backward else kernel.block_length(batch * hq)
            lengths = [min(block, n - start) for start in range(0, n, block)]
            per_seq = _gated_scan_flops(lengths, chunk, f, dv, hq, hkv, gate_dim(kernel))
        elif causal:
            per_seq = _chunked_causal_flops(n, chunk, f, dv, hq, hkv, d if closed else None)
        elif closed and kernel.quadratic_is_cheaper(*meta, False, causal=False):
            per_seq = hq * 2.0 * n * n * (d + dv + 1)  # closed-form scores on D coordinates, then V
        elif kernel.is_gated:  # two gated scans, forwards and backwards
            per_seq = 2 * _gated_scan_flops([n], chunk, f, dv, hq, hkv, gate_dim(kernel))
        else:
            per_seq = 2.0 * (hkv + hq) * n * f * (dv + 1)  # values with their ones column
        per_seq += 2.0 * n * d * kernel.projection_width(backward) * (hq + hkv)
        per_seq += kernel.gate_flops(n)
        fwd = batch * per_seq
    elif not backward and kernel.uses_exact(n, d, dv):  # skyformer's exact Gaussian: fused SDPA, D + 1 wide
        fwd = 2.0 * batch * hq * n * n * (2 * (d + 1))
    else:  # skyformer's Nyström (bidirectional only), after repeating K/V to the query heads
        opts = kernel.options
        lm = 2 * min(opts.num_landmarks // 2, n)
        per_head = (
            2 * 2.0 * n * lm * d  # κ(Q, L) and κ(L, K)
            + 2.0 * lm * lm * d  # κ(L, L)
            + opts.newton_iters * 4 * 2.0 * lm**3  # Newton–Schulz
            + 2.0 * lm * n * dv + 2.0 * lm * lm * dv + 2.0 * n * lm * dv  # left @ (W @ (right @ V))
        )
        if opts.normalize:
            per_head += 2.0 * lm * lm + 2.0 * n * lm
        fwd = batch * hq * per_head
    return fwd * (BACKWARD_FLOP_FACTOR if backward else 1.0)
