"""Brute-force float64 references for every attention kernel in ``hf_kernel_attn.kernels``.

Each reference is written from the paper formula (see docs/kernels.md and the kernel docstrings),
independently of the package: it never calls a kernel's feature functions, ``kernels/linear/`` or SDPA.
Only learnable / random *parameters* (hedgehog weights, performer ω, dijiang projection and
log γ, gaussian / cosine log gains and q/k projections) are read from the kernel module; the learnable
ones are read without detaching, so autograd through a reference gives their gradients too.

Every reference builds the explicit N×M score (or kernel) matrix per query head in float64, with
K/V repeated per query head explicitly (query head h reads KV head h // (Hq // Hkv)), applies the
visibility mask (bottom-right causal, key padding), normalises, multiplies by V and returns
``[B, N, Hq, Dv]`` float64.
"""

from __future__ import annotations

import math

import torch

from tests.kernels.delta_rule_reference import brute_force as delta_rule_brute_force

f64 = torch.float64


# --------------------------------------------------------------------------------------------- shared


def repeat_kv(x: torch.Tensor, num_q_heads: int) -> torch.Tensor:
    """``[B, Hkv, M, D] -> [B, Hq, M, D]``, head h taking KV head h // (Hq // Hkv), built head by head."""
    hkv = x.shape[1]
    group = num_q_heads // hkv
    return torch.stack([x[:, h // group] for h in range(num_q_heads)], dim=1)


def kv_head_of(num_q_heads: int, num_kv_heads: int) -> list[int]:
    group = num_q_heads // num_kv_heads
    return [h // group for h in range(num_q_heads)]


def query_positions(n: int, m: int) -> torch.Tensor:
    """Query i sits at key position M - N + i (bottom-right alignment)."""
    return torch.arange(m - n, m, dtype=f64)


def key_positions(m: int) -> torch.Tensor:
    return torch.arange(m, dtype=f64)


def visible(batch: int, n: int, m: int, causal: bool, key_mask: torch.Tensor | None) -> torch.Tensor:
    """Bool ``[B, 1, N, M]``: query i (position M - N + i) may attend key j."""
    i = torch.arange(n)[:, None]
    j = torch.arange(m)[None, :]
    vis = torch.ones(n, m, dtype=torch.bool)
    if causal:
        vis = j <= i + (m - n)
    vis = vis[None, None].expand(batch, 1, n, m).clone()
    if key_mask is not None:
        vis = vis & key_mask.bool()[:, None, None, :]
    return vis


def window_sink_visible(batch: int, n: int, m: int, causal: bool, key_mask: torch.Tensor | None, window: int,
                        sinks: int) -> torch.Tensor:
    """Bool ``[B, 1, N, M]`` of the sliding-window softmax with attention sinks, entry by entry: query i at
    position p = M - N + i sees real key j iff j <= p (causal) and p - j < W (|p - j| < W bidirectionally),
    or j is one of the first ``sinks`` real keys of its row (and j <= p when causal). window = 0: no window."""
    vis = torch.zeros(batch, 1, n, m, dtype=torch.bool)
    for b in range(batch):
        real = [True] * m if key_mask is None else [bool(x) for x in key_mask[b]]
        sink_keys, count = set(), 0
        for j in range(m):
            if real[j] and count < sinks:
                sink_keys.add(j)
                count += 1
        for i in range(n):
            p = m - n + i
            for j in range(m):
                if not real[j] or (causal and j > p):
                    continue
                near = (p - j < window) if causal else (abs(p - j) < window)
                if window == 0 or near or j in sink_keys:
                    vis[b, 0, i, j] = True
    return vis


def real_queries(batch: int, n: int, m: int, causal: bool, key_mask: torch.Tensor | None) -> torch.Tensor:
    """Bool ``[B, N]``: query rows that are real tokens and see at least one key (the rows to check)."""
    vis = visible(batch, n, m, causal, key_mask)[:, 0].any(-1)
    if key_mask is not None:
        vis = vis & key_mask[:, m - n:].bool()
    return vis


def softmax_from_logits(logits: torch.Tensor, v: torch.Tensor, vis: torch.Tensor) -> torch.Tensor:
    """logits ``[B, Hq, N, M]``, v ``[B, Hq, M, Dv]``; softmax over visible keys; rows without any
    visible key get 0. Returns ``[B, N, Hq, Dv]``."""
    logits = logits.masked_fill(~vis, float("-inf"))
    row_max = logits.amax(-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    w = torch.exp(logits - row_max) * vis
    den = w.sum(-1, keepdim=True)
    w = torch.where(den > 0, w / torch.where(den > 0, den, torch.ones_like(den)), torch.zeros_like(w))
    return (w @ v).transpose(1, 2)


def normalised_kernel(weights: torch.Tensor, v: torch.Tensor, vis: torch.Tensor, eps: float) -> torch.Tensor:
    """out_i = Σ_j w_ij v_j / max(Σ_j w_ij, eps) over visible j; returns ``[B, N, Hq, Dv]``.
    With eps = 0, rows whose weights sum to 0 (no visible key) give 0 instead of 0/0, so that a backward
    through the other rows stays finite."""
    w = weights * vis
    den = w.sum(-1, keepdim=True)
    den = den.clamp_min(eps) if eps > 0 else torch.where(den > 0, den, torch.ones_like(den))
    return ((w @ v) / den).transpose(1, 2)


def _inputs(q, k, v):
    hq = q.shape[1]
    return q.to(f64), repeat_kv(k.to(f64), hq), repeat_kv(v.to(f64), hq)


def _scale(q, scaling):
    return q.shape[-1] ** -0.5 if scaling is None else scaling


# ---------------------------------------------------------------------------------- softmax-like


def softmax_ref(kern, q, k, v, key_mask=None, causal=True, scaling=None):
    """softmax_j(s q_i·k_j) v; over :func:`window_sink_visible` for a softmax kernel with ``window`` > 0."""
    s = _scale(q, scaling)
    qd, kd, vd = _inputs(q, k, v)
    logits = s * torch.einsum("bhnd,bhmd->bhnm", qd, kd)
    opts = getattr(kern, "options", None) if getattr(kern, "name", None) == "softmax" else None
    window, sinks = getattr(opts, "window", 0), getattr(opts, "sinks", 0)
    if window:
        vis = window_sink_visible(q.shape[0], q.shape[-2], k.shape[-2], causal, key_mask, window, sinks)
    else:
        vis = visible(q.shape[0], q.shape[-2], k.shape[-2], causal, key_mask)
    return softmax_from_logits(logits, vd, vis)


def per_head_softmax_ref(q, k, v, scales, key_mask=None, causal=True):
    """softmax_j(s_h q_i·k_j) v with a per-query-head scale ``scales`` [Hq]."""
    qd, kd, vd = _inputs(q, k, v)
    logits = torch.einsum("bhnd,bhmd->bhnm", qd, kd) * scales.to(f64)[None, :, None, None]
    vis = visible(q.shape[0], q.shape[-2], k.shape[-2], causal, key_mask)
    return softmax_from_logits(logits, vd, vis)


def gaussian_inv_sigma_sq(kern, head_dim, scaling):
    """1/σ_h² = base · exp(log_gain_h), base = 1/sigma² or the softmax scale (default D^-1/2)."""
    sigma = kern.options.sigma
    base = 1.0 / sigma**2 if sigma is not None else (head_dim**-0.5 if scaling is None else scaling)
    return base * kern.log_gain.to(f64).exp()  # [Hq]; not detached: gradient tests compare d log_gain


def project_qk(kern, q, k):
    """The optional per-head map on q and k, head by head in float64: q_h A_h (full) or q_h ⊙ a_h."""
    proj = getattr(kern, "projection", None)
    if proj is None:
        return q, k
    out = []
    for x, w in ((q.to(f64), proj.q.to(f64)), (k.to(f64), proj.k.to(f64))):  # not detached (gradient tests)
        heads = [x[:, h] @ w[h] if proj.mode == "full" else x[:, h] * w[h] for h in range(x.shape[1])]
        out.append(torch.stack(heads, 1))
    return out[0], out[1]


def gaussian_ref(kern, q, k, v, key_mask=None, causal=True, scaling=None):
    """κ_ij = exp(-||q_i - k_j||² · inv_h / 2); row-normalised (normalize=True) or the raw sum."""
    inv = gaussian_inv_sigma_sq(kern, q.shape[-1], scaling)
    q, k = project_qk(kern, q, k)
    qd, kd, vd = _inputs(q, k, v)
    diff = qd[:, :, :, None, :] - kd[:, :, None, :, :]  # [B, Hq, N, M, D]
    dist2 = (diff * diff).sum(-1)
    kappa = torch.exp(-dist2 * inv[None, :, None, None] / 2)
    vis = visible(q.shape[0], q.shape[-2], k.shape[-2], causal, key_mask)
    if kern.options.normalize:
        return normalised_kernel(kappa, vd, vis, eps=0.0)
    return ((kappa * vis) @ vd).transpose(1, 2)


def gaussian_augment_ref(kern, q, k, v, key_mask=None, causal=True, scaling=None):
    """The exact identity: augmented Gaussian == softmax(inv_h q·k) (inv_h = s when log_gain = 0)."""
    inv = gaussian_inv_sigma_sq(kern, q.shape[-1], scaling)
    q, k = project_qk(kern, q, k)
    return per_head_softmax_ref(q, k, v, inv, key_mask=key_mask, causal=causal)


def cosine_ref(kern, q, k, v, key_mask=None, causal=True, scaling=None):
    """softmax_j(g_h cos(q_i, k_j)), g_h = exp(log_gain_h)."""
    g = kern.log_gain.to(f64).exp()  # not detached: gradient tests compare d log_gain
    q, k = project_qk(kern, q, k)
    qd, kd, vd = _inputs(q, k, v)
    cos = torch.einsum("bhnd,bhmd->bhnm", qd, kd) / (
        qd.norm(dim=-1)[..., :, None] * kd.norm(dim=-1)[..., None, :]
    )
    logits = g[None, :, None, None] * cos
    vis = visible(q.shape[0], q.shape[-2], k.shape[-2], causal, key_mask)
    return softmax_from_logits(logits, vd, vis)


# ------------------------------------------------------------------------------------ linear kinds


def _linear_from_scores(kern, q, k, scaling, causal, scores, vd, vis, decay=None):
    """Normalised kernel weights; with the option ``window`` W > 0 the sliding-window hybrid: weight
    exp(s q_i·k_j) where query position minus key position d is in [0, W) (causal) or |d| < W
    (bidirectional), or j is one of the first ``sinks`` real keys, λ_h · (kernel weight) elsewhere,
    λ_h = exp(window_log_mix[h]) or 1."""
    w = scores if decay is None else scores * decay
    window = getattr(kern.options, "window", 0)
    exact = list(getattr(kern.options, "softmax_heads", []))
    n, m, hq = q.shape[-2], k.shape[-2], q.shape[1]
    logits = _scale(q, scaling) * torch.einsum("bhnd,bhmd->bhnm", q.to(f64), repeat_kv(k.to(f64), hq))
    if exact:  # these query heads: exp(s q·k) over every visible key, whatever the rest does
        soft = softmax_from_logits(logits, vd, vis.expand(-1, hq, -1, -1))  # [B, N, Hq, Dv]
        plain = kern.options.__class__(**{**vars(kern.options), "softmax_heads": []})
        rest = _linear_from_scores(type("K", (), {"options": plain, "window_log_mix": getattr(
            kern, "window_log_mix", None)})(), q, k, scaling, causal, scores, vd, vis, decay)
        rest[:, :, exact] = soft[:, :, exact]
        return rest
    if not window:
        return normalised_kernel(w, vd, vis, eps=kern.options.eps)
    d = query_positions(n, m)[:, None] - key_positions(m)[None, :]
    in_window = ((d >= 0) & (d < window)) if causal else d.abs() < window
    sinks = getattr(kern.options, "sinks", 0)
    if sinks:  # the first S real keys of each row join the softmax part
        real = vis[:, 0, -1, :]  # the last query sees every real key
        is_sink = real & (real.long().cumsum(-1) <= sinks)
        in_window = in_window | is_sink[:, None, None, :]
    mix = getattr(kern, "window_log_mix", None)
    lam = torch.ones(hq, dtype=f64) if mix is None else mix.to(f64).exp()
    w = torch.where(in_window, torch.exp(logits), lam[None, :, None, None] * w)
    return normalised_kernel(w, vd, vis, eps=0.0)


def elu_ref(kern, q, k, v, key_mask=None, causal=True, scaling=None):
    """φ(x) = elu(x) + 1 (x + 1 for x > 0, eˣ otherwise); no scale."""
    qd, kd, vd = _inputs(q, k, v)

    def phi(x):
        return torch.where(x > 0, x + 1, torch.exp(torch.minimum(x, torch.zeros_like(x))))

    scores = torch.einsum("bhnf,bhmf->bhnm", phi(qd), phi(kd))
    vis = visible(q.shape[0], q.shape[-2], k.shape[-2], causal, key_mask)
    return _linear_from_scores(kern, q, k, scaling, causal, scores, vd, vis)


def relu_ref(kern, q, k, v, key_mask=None, causal=True, scaling=None):
    """φ(x) = max(x, 0); no scale."""
    qd, kd, vd = _inputs(q, k, v)
    scores = torch.einsum("bhnf,bhmf->bhnm", qd.clamp_min(0), kd.clamp_min(0))
    vis = visible(q.shape[0], q.shape[-2], k.shape[-2], causal, key_mask)
    return _linear_from_scores(kern, q, k, scaling, causal, scores, vd, vis)


def cosformer_ref(kern, q, k, v, key_mask=None, causal=True, scaling=None):
    """score_ij = relu(q_i)·relu(k_j) · cos(π/2 · (pos_i - pos_j) / H), H = horizon or max_positions."""
    horizon = kern.options.horizon or kern.shape.max_positions
    n, m = q.shape[-2], k.shape[-2]
    qd, kd, vd = _inputs(q, k, v)
    base = torch.einsum("bhnf,bhmf->bhnm", qd.clamp_min(0), kd.clamp_min(0))
    pi, pj = query_positions(n, m), key_positions(m)
    cos = torch.cos(math.pi / 2 * (pi[:, None] - pj[None, :]) / horizon)
    vis = visible(q.shape[0], n, m, causal, key_mask)
    return _linear_from_scores(kern, q, k, scaling, causal, base * cos, vd, vis)


def performer_features(omega, x, scaling, feature_eps, is_query):
    """FAVOR+ positive features from the formula: x' = s^1/2 x,
    φ(x) = m^-1/2 (exp(ω_lᵀx' - ||x'||²/2 - c) + ε), c = row max (queries) or max_l ||ω_l||²/2 (keys)."""
    omega = omega.to(f64)
    m = omega.shape[0]
    xs = x * math.sqrt(scaling)
    proj = torch.einsum("...d,ld->...l", xs, omega) - (xs * xs).sum(-1, keepdim=True) / 2
    if is_query:
        c = proj.amax(-1, keepdim=True)
    else:
        c = 0.0  # keys: no shift (the exponent is bounded by max_l ||ω_l||²/2)
    return (torch.exp(proj - c) + feature_eps) / math.sqrt(m)


def performer_ref(kern, q, k, v, key_mask=None, causal=True, scaling=None):
    s = _scale(q, scaling)
    qd, kd, vd = _inputs(q, k, v)
    omega = kern.omega.detach()
    fq = performer_features(omega, qd, s, kern.options.feature_eps, True)
    fk = performer_features(omega, kd, s, kern.options.feature_eps, False)
    scores = torch.einsum("bhnf,bhmf->bhnm", fq, fk)
    vis = visible(q.shape[0], q.shape[-2], k.shape[-2], causal, key_mask)
    return _linear_from_scores(kern, q, k, scaling, causal, scores, vd, vis)


def dijiang_ref(kern, q, k, v, key_mask=None, causal=True, scaling=None):
    """φ(x) = softmax_f((s^1/2 x) P); w_ij = γ_h^(pos_i - pos_j) (causal) or γ_h^|pos_i - pos_j|."""
    s = _scale(q, scaling)
    n, m, hq, hkv = q.shape[-2], k.shape[-2], q.shape[1], k.shape[1]
    qd, kd, vd = _inputs(q, k, v)
    proj = kern.projection.detach().to(f64)

    def phi(x):
        logits = (x * math.sqrt(s)) @ proj
        e = torch.exp(logits - logits.amax(-1, keepdim=True))
        return e / e.sum(-1, keepdim=True)

    scores = torch.einsum("bhnf,bhmf->bhnm", phi(qd), phi(kd))
    decay = None
    if kern.options.decay:
        log_gamma = kern.log_gamma.detach().to(f64)
        gam = torch.stack([log_gamma[kvh] for kvh in kv_head_of(hq, hkv)]).exp()  # [Hq]
        dist = (query_positions(n, m)[:, None] - key_positions(m)[None, :]).abs()  # causal keeps j <= i
        decay = gam[:, None, None] ** dist[None]  # [Hq, N, M]
        decay = decay[None]
    vis = visible(q.shape[0], n, m, causal, key_mask)
    return _linear_from_scores(kern, q, k, scaling, causal, scores, vd, vis, decay)


def _hedgehog_features(kern, q, k, s):
    """φ_h(x) = [softmax(p), softmax(-p)], p = s^1/2 x W_h + b_h: per query head ``[B, Hq, N, F]`` and per KV head
    ``[B, Hkv, M, F]``, with the kernel's weights not detached (gradient tests compare these too)."""
    wq, bq = kern.weight_q.to(f64), kern.bias_q.to(f64)
    wk, bk = kern.weight_k.to(f64), kern.bias_k.to(f64)

    def sm(p):
        e = torch.exp(p - p.amax(-1, keepdim=True))
        return e / e.sum(-1, keepdim=True)

    def phi(x, w, b):
        p = (x * math.sqrt(s)) @ w + b
        return torch.cat([sm(p), sm(-p)], -1)

    qd, kd = q.to(f64), k.to(f64)
    fq = torch.stack([phi(qd[:, h], wq[h], bq[h]) for h in range(q.shape[1])], 1)
    fk = torch.stack([phi(kd[:, h], wk[h], bk[h]) for h in range(k.shape[1])], 1)
    return fq, fk


def hedgehog_ref(kern, q, k, v, key_mask=None, causal=True, scaling=None):
    """φ_h(x) = [softmax(p), softmax(-p)], p = s^1/2 x W_h + b_h; separate maps for q (per query head)
    and k (per KV head)."""
    hq = q.shape[1]
    fq, fk_kv = _hedgehog_features(kern, q, k, _scale(q, scaling))
    fk = repeat_kv(fk_kv, hq)
    vd = repeat_kv(v.to(f64), hq)
    scores = torch.einsum("bhnf,bhmf->bhnm", fq, fk)
    vis = visible(q.shape[0], q.shape[-2], k.shape[-2], causal, key_mask)
    return _linear_from_scores(kern, q, k, scaling, causal, scores, vd, vis)


def _rope_partner(j, d, rope_pairs):
    """The pair of coordinate j under RoPE's pairing: (i, i + ⌈D/2⌉) ("half", rotate_half) or (2i, 2i+1)."""
    return j % -(-d // 2) if rope_pairs == "half" else j // 2


def _pair_norms_ref(x, rope_pairs="half"):
    """‖(x_a, x_b)‖ for each rotation pair, coordinate by coordinate (a coordinate without partner alone)."""
    d = x.shape[-1]
    members = {}
    for j in range(d):
        members.setdefault(_rope_partner(j, d, rope_pairs), []).append(j)
    cols = [torch.sqrt(torch.clamp(sum(x[..., j] ** 2 for j in members[i]), min=1e-12)) for i in sorted(members)]
    return torch.stack(cols, -1)


def _gated_scores(fq, fk, alpha, n, m):
    """Σ_f φ_f(q_i) φ_f(k_j) Π_s α_s,f with s over (j, p_i] for j ≤ p_i and (p_i, j] for j > p_i, p_i = M - N + i;
    fq ``[B, Hq, N, F]``, fk and α ``[B, Hq, M, F]`` (α per key position), the products as running products
    (cumprod) away from p_i, one query at a time."""
    rows = []
    for i in range(n):
        p = m - n + i
        # j < p: Π_{s=j+1..p} α_s, the running product of α_p, α_{p-1}, … read back to front
        before = torch.flip(torch.cumprod(torch.flip(alpha[:, :, 1:p + 1], [2]), 2), [2])
        # j = p: the empty product; α⁰ keeps the gates in the graph (zero gradient, as the kernel's), so a
        # one-key case compares parameter gradients instead of finding none on this side
        own = alpha[:, :, p:p + 1] ** 0
        after = torch.cumprod(alpha[:, :, p + 1:], 2)  # j > p: Π_{s=p+1..j} α_s
        w = torch.cat([before, own, after], 2)  # [B, Hq, M, F]
        rows.append((fq[:, :, i, None] * fk * w).sum(-1))
    return torch.stack(rows, 2)


def _clamped_gate(log_alpha):
    return torch.exp(torch.clamp(log_alpha, min=-1.25))


def liger_ref(kern, q, k, v, key_mask=None, causal=True, scaling=None):
    """φ(x) = [softmax(s^1/2 x), softmax(-s^1/2 x)], α_t,f = σ(gate_bias + s^1/2 ρ_t,pair(f mod D)) (ρ: RoPE-pair
    norms of k_t), log α clamped at -1.25."""
    s = _scale(q, scaling)
    hq, d = q.shape[1], q.shape[-1]

    def sm(p):
        e = torch.exp(p - p.amax(-1, keepdim=True))
        return e / e.sum(-1, keepdim=True)

    def phi(x):
        p = x * math.sqrt(s)
        return torch.cat([sm(p), sm(-p)], -1)

    qd, kd = q.to(f64), k.to(f64)
    pairs = kern.options.rope_pairs
    rho = _pair_norms_ref(kd, pairs) * math.sqrt(s)
    per_dim = torch.stack([rho[..., _rope_partner(j, d, pairs)] for j in range(d)], -1)
    alpha = _clamped_gate(torch.log(torch.sigmoid(kern.options.gate_bias + per_dim)))
    alpha = torch.cat([alpha, alpha], -1)
    scores = _gated_scores(phi(qd), repeat_kv(phi(kd), hq), repeat_kv(alpha, hq), q.shape[-2], k.shape[-2])
    vis = visible(q.shape[0], q.shape[-2], k.shape[-2], causal, key_mask)
    return _linear_from_scores(kern, q, k, scaling, causal, scores, repeat_kv(v.to(f64), hq), vis)


def gla_ref(kern, q, k, v, key_mask=None, causal=True, scaling=None):
    """Hedgehog's φ with a low-rank gate: α_t = σ(s^1/2 ρ_t W₁ W₂ + β)^(1/τ) per feature, log α clamped at -1.25."""
    s = _scale(q, scaling)
    hq, hkv = q.shape[1], k.shape[1]
    fq, fk = _hedgehog_features(kern, q, k, s)
    rho = _pair_norms_ref(k.to(f64), kern.options.rope_pairs) * math.sqrt(s)  # [B, Hkv, M, P]
    down, up, beta = kern.gate_down.to(f64), kern.gate_up.to(f64), kern.gate_bias.to(f64)
    logits = torch.stack([rho[:, h] @ down[h] @ up[h] + beta[h] for h in range(hkv)], 1)
    alpha = _clamped_gate(torch.log(torch.sigmoid(logits)) / kern.options.gate_temperature)
    scores = _gated_scores(fq, repeat_kv(fk, hq), repeat_kv(alpha, hq), q.shape[-2], k.shape[-2])
    vis = visible(q.shape[0], q.shape[-2], k.shape[-2], causal, key_mask)
    return _linear_from_scores(kern, q, k, scaling, causal, scores, repeat_kv(v.to(f64), hq), vis)


def taylor_ref(kern, q, k, v, key_mask=None, causal=True, scaling=None):
    """Closed form of the second-order Taylor kernel: 1 + t + t²/2, t = s q·k (no features)."""
    s = _scale(q, scaling)
    qd, kd, vd = _inputs(q, k, v)
    t = s * torch.einsum("bhnd,bhmd->bhnm", qd, kd)
    vis = visible(q.shape[0], q.shape[-2], k.shape[-2], causal, key_mask)
    return _linear_from_scores(kern, q, k, scaling, causal, 1 + t + t * t / 2, vd, vis)


# ------------------------------------------------------------------------------------- skyformer


def evenly_spaced_positions(real: torch.Tensor, count: int) -> list[int]:
    """``count`` indices spread evenly over the real positions: round(t · (R-1)/(count-1))-th real one."""
    idx = [i for i in range(real.numel()) if bool(real[i])]
    if not idx:
        idx = list(range(real.numel()))
    count = min(count, len(idx))
    if count == 1:
        return [idx[0]]
    # round half to even, like torch.round
    picks = [int(torch.tensor(t * (len(idx) - 1) / (count - 1), dtype=f64).round()) for t in range(count)]
    return [idx[p] for p in picks]


def _rbf(x, y):
    """exp(-||x_a - y_b||²/2) by explicit differences."""
    diff = x[:, None, :] - y[None, :, :]
    return torch.exp(-(diff * diff).sum(-1) / 2)


def skyformer_ref(kern, q, k, v, key_mask=None, causal=False, scaling=None):
    """Explicit Nyström with an exact inverse: C ≈ κ(Q', L) (κ(L, L) + ridge I)⁻¹ κ(L, K'), with
    q' = s^1/2 q, k' = s^1/2 k, landmarks L = evenly spaced real queries and keys (half each);
    pad keys dropped; row-normalised by C·1 when normalize=True."""
    assert not causal
    s = _scale(q, scaling)
    bsz, hq, n, _ = q.shape
    qd, kd, vd = _inputs(q, k, v)
    qd, kd = qd * math.sqrt(s), kd * math.sqrt(s)
    half = kern.options.num_landmarks // 2
    out = torch.zeros(bsz, n, hq, vd.shape[-1], dtype=f64)
    for b in range(bsz):
        real = key_mask[b].bool() if key_mask is not None else torch.ones(k.shape[-2], dtype=torch.bool)
        pick = evenly_spaced_positions(real, half)
        for h in range(hq):
            lm = torch.cat([qd[b, h, pick], kd[b, h, pick]], 0)
            gram = _rbf(lm, lm) + kern.options.ridge * torch.eye(lm.shape[0], dtype=f64)
            c_approx = _rbf(qd[b, h], lm) @ torch.linalg.inv(gram) @ _rbf(lm, kd[b, h])  # [N, M]
            c_approx = c_approx * real[None, :].to(f64)
            num = c_approx @ vd[b, h]
            if kern.options.normalize:
                num = num / c_approx.sum(-1, keepdim=True).clamp_min(kern.options.eps)
            out[b, :, h] = num
    return out


def exact_gaussian_ref(q, k, v, key_mask=None, scaling=None, normalize=True):
    """Exact bidirectional Gaussian attention with unit bandwidth on s^1/2-scaled q, k: row-normalised, or
    (normalize=False) Σ_j κ_ij v_j over the real keys."""
    s = _scale(q, scaling)
    qd, kd, vd = _inputs(q, k, v)
    diff = qd[:, :, :, None, :] - kd[:, :, None, :, :]
    kappa = torch.exp(-s * (diff * diff).sum(-1) / 2)
    vis = visible(q.shape[0], q.shape[-2], k.shape[-2], False, key_mask)
    if not normalize:
        return torch.einsum("bhnm,bhmd->bnhd", kappa * vis.to(f64), vd)
    return normalised_kernel(kappa, vd, vis, eps=0.0)


REFERENCES = {
    "softmax": softmax_ref,
    "gaussian": gaussian_ref,
    "cosine": cosine_ref,
    "elu": elu_ref,
    "relu": relu_ref,
    "cosformer": cosformer_ref,
    "performer": performer_ref,
    "dijiang": dijiang_ref,
    "hedgehog": hedgehog_ref,
    "taylor": taylor_ref,
    "skyformer": skyformer_ref,
    "liger": liger_ref,
    "gla": gla_ref,
}


def delta_rule_ref(kern, q, k, v, key_mask=None, causal=True, scaling=None):
    """DeltaNet / Gated DeltaNet: the token-by-token brute force of delta_rule_reference.py (causal only)."""
    assert causal, f"{kern.name} is causal only"
    return delta_rule_brute_force(kern, q, k, v, key_mask, scaling)


REFERENCES["deltanet"] = REFERENCES["gated_deltanet"] = delta_rule_ref


def reference(kern, q, k, v, key_mask=None, causal=True, scaling=None):
    """Dispatch on the kernel's name (and gaussian's augment option)."""
    if kern.name == "gaussian" and kern.options.augment:
        return gaussian_augment_ref(kern, q, k, v, key_mask=key_mask, causal=causal, scaling=scaling)
    return REFERENCES[kern.name](kern, q, k, v, key_mask=key_mask, causal=causal, scaling=scaling)
