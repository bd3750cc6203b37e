"""Learned retention for a bounded softmax cache: sinks + a sliding window + C slots kept by a learned score.

The score follows TRIM-KV (Bui et al. 2025, "Cache What Lasts: Token Retention for Memory-Bounded KV Cache in
LLMs", arXiv 2512.03324): a small gate per KV head gives each key j, once, when it is created, a retention
β_j = σ(g(k_j, v_j)) ∈ (0, 1); at time t the key's score is its retention decayed with age,

    r_j(t) = (t - p_j) · ln β_j                      (the log of β_j^(t - p_j))

or, with ``decay`` off, r_j = ln β_j: a keep score fixed when the key is created, as Locret's retaining heads give
(Huang et al. 2024, arXiv 2410.01805), so that an old key with a high score outranks a recent one with a lower.

Gate input: the key's RoPE pair norms ‖(k_i, k_{i + D/2})‖ (a rotation leaves them unchanged, so the score does
not depend on where the key sits) and the value, RMS-normalised; a two-layer MLP per KV head, its output weights
starting at 0 (every β the same: the score is then the age alone, a longer window).

Inference (the hard budget), the same in a prefill and in token-by-token decoding: query t attends to the S sinks,
the keys p with t - W < p ≤ t, and the C slots. At every boundary t (t > 0 a multiple of the block B, before query t
is answered) the real, non-sink keys that left the window since the last boundary (t - B - W < p ≤ t - W) join
the slots' pool and the C keys of the pool with the highest r_j(t) stay; the others are dropped. Between two
boundaries a key that leaves the window is not attended. The cache after a prompt depends on the prompt alone, its
bytes on S, W, B and C alone. A prefill runs one eviction per block of B queries: O(N·(S + W + B + C)).

Training (soft): a key outside window and sinks is weighed by β_j^(t - p_j) inside the softmax,

    logit_tj = s q_t·k_j + (t - p_j) ln β_j        (s q_t·k_j + ln β_j without decay),

and E_t = Σ_j β_j^(t - p_j) (Σ_j β_j) over those keys (the soft cache's expected size) gives the capacity term
mean_t |E_t - min(C, n_t)| / C (n_t: the keys there are to keep) that holds the soft cache at the slots' size:
above it the soft form keeps more than the hard budget can, below it every retention fades towards 0 and the KL
term's gradient with it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .slots import gather_keys, grow_slots, sink_slot_count, sink_slots

# queries per chunk of the soft (training) form: its [B, Hq, chunk, M] logits are recomputed in the backward pass
SOFT_QUERY_CHUNK = 512


def rope_pair_norms(k: torch.Tensor) -> torch.Tensor:
    """‖(k_i, k_{i + D/2})‖ for i < D/2 ``[..., D/2]``: RoPE (the half-split layout) rotates each such pair, so
    these do not change with the key's position."""
    half = k.shape[-1] // 2
    return (k[..., :half].square() + k[..., half:2 * half].square()).sqrt()


class RetentionGate(nn.Module):
    """ln β ``[B, Hkv, M]`` of keys ``k`` ``[B, Hkv, M, D]`` and values ``v`` ``[B, Hkv, M, Dv]``: per KV head,
    ln σ(w₂·silu(W₁ x + b₁) + b₂) with x = RMS-normalised [pair norms of k, v]."""

    def __init__(self, num_kv_heads: int, head_dim: int, value_dim: int, hidden: int, bias: float) -> None:
        super().__init__()
        width = head_dim // 2 + value_dim
        self.bias_init = float(bias)
        self.w1 = nn.Parameter(torch.empty(num_kv_heads, width, hidden))
        self.b1 = nn.Parameter(torch.zeros(num_kv_heads, hidden))
        self.w2 = nn.Parameter(torch.zeros(num_kv_heads, hidden))
        self.b2 = nn.Parameter(torch.full((num_kv_heads,), self.bias_init))

    def reset_parameters(self, generator: torch.Generator) -> None:
        with torch.no_grad():
            width = self.w1.shape[1]
            self.w1.copy_(torch.randn(self.w1.shape, generator=generator) * width ** -0.5)
            self.b1.zero_()
            self.w2.zero_()
            self.b2.fill_(self.bias_init)

    def logits(self, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """z ``[B, Hkv, M]``, with ln β = ln σ(z)."""
        x = torch.cat([rope_pair_norms(k.float()), v.float()], -1)
        x = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-6)
        h = F.silu(torch.einsum("bhmd,hdr->bhmr", x, self.w1.float()) + self.b1.float()[:, None])
        return torch.einsum("bhmr,hr->bhm", h, self.w2.float()) + self.b2.float()[:, None]

    def forward(self, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.logsigmoid(self.logits(k, v))


def future_attention(q: torch.Tensor, k: torch.Tensor, key_mask: torch.Tensor | None, *, window: int, scale: float,
                     chunk: int = 256) -> torch.Tensor:
    """How much each key is read once it has left the window: max over the queries i ≥ p_j + W (and the query
    heads of its KV group) of the causal softmax weight a_ij, ``[B, Hkv, M]`` (queries at the last N of M
    positions; 0 for a key no such query sees). The target of the ``attention`` objective: Locret's retaining
    heads learn each key's future attention (Huang et al. 2024, arXiv 2410.01805); here its maximum."""
    b, hq, n, d = q.shape
    hkv, m = k.shape[1], k.shape[-2]
    real = torch.ones(b, m, dtype=torch.bool, device=q.device) if key_mask is None else key_mask.bool()
    qg = q.float().reshape(b, hkv, hq // hkv, n, d)
    best = torch.zeros(b, hkv, m, device=q.device)
    kpos = torch.arange(m, device=q.device)
    for a in range(0, n, chunk):
        e = min(n, a + chunk)
        qpos = torch.arange(m - n + a, m - n + e, device=q.device)
        age = qpos[:, None] - kpos[None, :]
        logits = torch.einsum("bhgcd,bhmd->bhgcm", qg[:, :, :, a:e], k.float()) * scale
        logits = logits.masked_fill(~((age >= 0)[None] & real[:, None, :])[:, None, None], float("-inf"))
        weights = logits.softmax(-1).nan_to_num(0.0).masked_fill(~(age >= window)[None, None, None], 0.0)
        best = torch.maximum(best, weights.amax(dim=(2, 3)))
    return best


# ---------------------------------------------------------------------------------------------- capacity record
_capacity: list[list[torch.Tensor]] = []


@contextlib.contextmanager
def capacity_terms() -> Iterator[list[torch.Tensor]]:
    """Collect the capacity term of every soft retention call run inside (one scalar per layer)."""
    terms: list[torch.Tensor] = []
    _capacity.append(terms)
    try:
        yield terms
    finally:
        _capacity.pop()


def record_capacity(term: torch.Tensor) -> None:
    if _capacity:
        _capacity[-1].append(term)


# ---------------------------------------------------------------------------------------------- shared pieces
def sink_flags(real: torch.Tensor, sinks: int, seen: torch.Tensor | None = None) -> torch.Tensor:
    """Which of the keys with real flags ``real`` ``[B, M]`` are among the row's first ``sinks`` real tokens
    (counting ``seen`` ``[B]`` real tokens before them)."""
    rank = real.long().cumsum(-1)
    if seen is not None:
        rank = rank + seen[:, None]
    return real & (rank <= sinks)


def soft_retention_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_beta: torch.Tensor,
    *,
    budget: RetentionBudget,
    key_mask: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """The soft form (module docstring) for queries at the last N of M positions: ``q`` ``[B, Hq, N, D]``, ``k``,
    ``v`` ``[B, Hkv, M, ·]``, ``log_beta`` ``[B, Hkv, M]``. Returns ``[B, N, Hq, Dv]`` and records the capacity
    term (:func:`capacity_terms`). Chunks of queries are recomputed in the backward pass, so memory holds one
    chunk's logits at a time."""
    b, hq, n, d = q.shape
    hkv, m = k.shape[1], k.shape[-2]
    real = torch.ones(b, m, dtype=torch.bool, device=q.device) if key_mask is None else key_mask.bool()
    window, slots = budget.window, budget.slots
    forgettable = real & ~sink_flags(real, budget.sinks)  # [B, M]
    qg = q.reshape(b, hkv, hq // hkv, n, d)
    outs, gaps = [], []
    for a in range(0, n, SOFT_QUERY_CHUNK):
        e = min(n, a + SOFT_QUERY_CHUNK)
        o, x = checkpoint(_soft_chunk, qg[:, :, :, a:e], k, v, log_beta, real, forgettable,
                          torch.tensor([m - n + a, window, slots, int(budget.decay)]), scale, use_reentrant=False)
        outs.append(o)
        gaps.append(x)
    record_capacity(torch.cat(gaps, -1).mean())
    out = torch.cat(outs, -2)  # [B, Hkv, G, N, Dv]
    return out.reshape(b, hq, n, -1).transpose(1, 2).contiguous()


def _soft_chunk(qc, k, v, log_beta, real, forgettable, where: torch.Tensor, scale: float):
    first, window, slots, decay = (int(x) for x in where)
    c, m = qc.shape[-2], k.shape[-2]
    qpos = torch.arange(first, first + c, device=qc.device)
    age = qpos[:, None] - torch.arange(m, device=qc.device)[None, :]  # [c, M]
    visible = (age >= 0)[None] & real[:, None, :]  # [B, c, M]
    decays = (age >= window)[None] & forgettable[:, None, :]  # [B, c, M]: keys outside window and sinks
    weight = age.clamp_min(0).to(log_beta.dtype) if decay else torch.ones_like(age, dtype=log_beta.dtype)
    bias = (weight[None, None] * log_beta[:, :, None, :]) * decays[:, None]
    logits = torch.einsum("bhgcd,bhmd->bhgcm", qc.float(), k.float()) * scale + bias[:, :, None]
    logits = logits.masked_fill(~visible[:, None, None], float("-inf"))
    out = torch.einsum("bhgcm,bhmd->bhgcd", logits.softmax(-1), v.float()).to(v.dtype)
    kept = (bias.exp() * decays[:, None]).sum(-1)  # [B, Hkv, c]: expected keys held besides window and sinks
    target = decays.sum(-1).clamp_max(slots).to(kept.dtype)[:, None]  # min(C, the keys there are to keep)
    return out, (kept - target).abs() / max(slots, 1)


# ---------------------------------------------------------------------------------------------- hard budget
@dataclasses.dataclass
class RetentionState:
    """A retention cache between calls. ``recent_*``: the keys at positions ``end - R`` … ``end - 1`` not decided
    yet (inside the window, or out of it since the last boundary); ``slot_*``: the kept keys ``[B, Hkv, C', ·]``
    (C' ≤ C, growing with use) with their positions and ln β; ``sink_*``: the S sinks ``[B, Hkv, S', ·]`` with
    positions and filled flags ``[B, S']``; ``real_seen`` ``[B]`` real tokens so far; ``end`` the next position;
    ``boundary`` the last boundary passed."""

    recent_k: torch.Tensor
    recent_v: torch.Tensor
    recent_logb: torch.Tensor  # [B, Hkv, R]
    recent_real: torch.Tensor  # [B, R]
    recent_sink: torch.Tensor  # [B, R]
    slot_k: torch.Tensor
    slot_v: torch.Tensor
    slot_pos: torch.Tensor  # [B, Hkv, C']
    slot_logb: torch.Tensor
    slot_valid: torch.Tensor
    sink_k: torch.Tensor
    sink_v: torch.Tensor
    sink_pos: torch.Tensor  # [B, S']
    sink_valid: torch.Tensor  # [B, S']
    real_seen: torch.Tensor  # [B]
    end: int = 0
    boundary: int = 0

    TENSORS = ("recent_k", "recent_v", "recent_logb", "recent_real", "recent_sink", "slot_k", "slot_v", "slot_pos",
               "slot_logb", "slot_valid", "sink_k", "sink_v", "sink_pos", "sink_valid", "real_seen")

    @classmethod
    def empty(cls, k: torch.Tensor, v: torch.Tensor) -> RetentionState:
        b, h, dev = k.shape[0], k.shape[1], k.device

        def none(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype, device=dev)

        kk, vv = k.new_zeros(b, h, 0, k.shape[-1]), v.new_zeros(b, h, 0, v.shape[-1])
        return cls(kk, vv, none(b, h, 0, dtype=torch.float32), none(b, 0, dtype=torch.bool),
                   none(b, 0, dtype=torch.bool), kk, vv, none(b, h, 0, dtype=torch.long),
                   none(b, h, 0, dtype=torch.float32), none(b, h, 0, dtype=torch.bool), kk, vv,
                   none(b, 0, dtype=torch.long), none(b, 0, dtype=torch.bool), none(b, dtype=torch.long))

    def tensors(self) -> list[torch.Tensor]:
        return [getattr(self, name) for name in self.TENSORS]

    def map(self, fn) -> None:
        """Apply ``fn`` to every tensor (beam reordering, batch selection)."""
        for name in self.TENSORS:
            setattr(self, name, fn(getattr(self, name)))

    @property
    def start(self) -> int:
        """The position of the first recent key."""
        return self.end - self.recent_k.shape[-2]


def _fill_sinks(st: RetentionState, k: torch.Tensor, v: torch.Tensor, real: torch.Tensor, sinks: int,
               offset: int) -> None:
    """Fill the sink slots whose rank among each row's real tokens falls among the new keys."""
    size = sink_slot_count(sinks, offset + k.shape[-2])
    if st.sink_k.shape[-2] < size:
        st.sink_k, st.sink_v = grow_slots(st.sink_k, 2, size), grow_slots(st.sink_v, 2, size)
        st.sink_pos, st.sink_valid = grow_slots(st.sink_pos, 1, size), grow_slots(st.sink_valid, 1, size, False)
    if not size:
        return
    idx, pos, fresh = sink_slots(real, size, offset=offset, seen=st.real_seen)
    if bool(fresh.any()):
        sel = fresh[:, None, :, None]
        st.sink_k = torch.where(sel, gather_keys(k, idx).to(st.sink_k.dtype), st.sink_k)
        st.sink_v = torch.where(sel, gather_keys(v, idx).to(st.sink_v.dtype), st.sink_v)
        st.sink_pos = torch.where(fresh, pos, st.sink_pos)
        st.sink_valid = st.sink_valid | fresh


def _boundary(st: RetentionState, t: int, window: int, capacity: int, decay: bool = True) -> None:
    """Boundary t: the recent keys at positions ≤ t - W (real, no sink) join the pool with the slots; the
    ``capacity`` with the highest (t - p) ln β (ln β without ``decay``) stay (ties: the newer key); the recent ones
    leave ``recent``."""
    stop = max(0, t - window + 1 - st.start)
    st.boundary = t
    if not stop:
        return
    b, h = st.recent_k.shape[:2]
    pos = torch.arange(st.start, st.start + stop, device=st.recent_k.device)
    ok = (st.recent_real[:, :stop] & ~st.recent_sink[:, :stop])[:, None, :].expand(b, h, -1)
    pool_k = torch.cat([st.slot_k, st.recent_k[:, :, :stop]], 2)
    pool_v = torch.cat([st.slot_v, st.recent_v[:, :, :stop]], 2)
    pool_pos = torch.cat([st.slot_pos, pos.expand(b, h, -1)], 2)
    pool_logb = torch.cat([st.slot_logb, st.recent_logb[:, :, :stop]], 2)
    pool_ok = torch.cat([st.slot_valid, ok], 2)
    score = (t - pool_pos).to(pool_logb.dtype) * pool_logb if decay else pool_logb.clone()
    score = score.masked_fill(~pool_ok, float("-inf"))
    # order: the score, then the newer key (every β is the same at a gate's start: the score is the age alone)
    order = torch.argsort(pool_pos, dim=-1, descending=True, stable=True)
    ranked = torch.argsort(score.gather(2, order), dim=-1, descending=True, stable=True)
    pick = order.gather(2, ranked[..., :min(capacity, pool_ok.shape[-1])])
    st.slot_k = pool_k.gather(2, pick[..., None].expand(-1, -1, -1, pool_k.shape[-1]))
    st.slot_v = pool_v.gather(2, pick[..., None].expand(-1, -1, -1, pool_v.shape[-1]))
    st.slot_pos, st.slot_logb = pool_pos.gather(2, pick), pool_logb.gather(2, pick)
    st.slot_valid = pool_ok.gather(2, pick)
    st.recent_k, st.recent_v = st.recent_k[:, :, stop:], st.recent_v[:, :, stop:]
    st.recent_logb = st.recent_logb[:, :, stop:]
    st.recent_real, st.recent_sink = st.recent_real[:, stop:], st.recent_sink[:, stop:]


def _attend_segment(q: torch.Tensor, st: RetentionState, first: int, window: int, scale: float) -> torch.Tensor:
    """Queries ``q`` ``[B, Hq, c, D]`` at positions first … first + c - 1 over the sinks outside their window, the
    slots and the recent keys inside their window; returns ``[B, c, Hq, Dv]``."""
    b, hq, c, _ = q.shape
    h = st.recent_k.shape[1]
    lo = max(st.start, first - window + 1)
    a, e = lo - st.start, first + c - st.start  # the band: positions lo … first + c - 1
    qpos = torch.arange(first, first + c, device=q.device)
    age = qpos[:, None] - torch.arange(lo, first + c, device=q.device)[None, :]
    band = ((age >= 0) & (age < window))[None] & st.recent_real[:, None, a:e]  # [B, c, L]
    sinks = ((qpos[None, :, None] - st.sink_pos[:, None, :]) >= window) & st.sink_valid[:, None, :]
    mask = torch.cat([sinks[:, None].expand(b, h, c, -1), st.slot_valid[:, :, None, :].expand(b, h, c, -1),
                      band[:, None].expand(b, h, c, -1)], -1)
    keys = torch.cat([st.sink_k, st.slot_k, st.recent_k[:, :, a:e]], 2).to(q.dtype)
    values = torch.cat([st.sink_v, st.slot_v, st.recent_v[:, :, a:e]], 2).to(q.dtype)
    mask = mask | ~mask.any(-1, keepdim=True)  # a row with nothing to see (all padding) stays finite
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask.repeat_interleave(hq // h, dim=1),
                                         scale=scale, enable_gqa=hq != h)
    return out.transpose(1, 2)


def retention_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_beta: torch.Tensor,
    *,
    budget: RetentionBudget,
    key_real: torch.Tensor | None,
    scale: float,
    state: RetentionState | None = None,
) -> tuple[torch.Tensor, RetentionState]:
    """The hard budget (module docstring) for N new queries and keys at positions ``state.end`` … (0 without a
    state): ``q`` ``[B, Hq, N, D]``, ``k``/``v`` ``[B, Hkv, N, ·]``, ``log_beta`` ``[B, Hkv, N]``, ``key_real``
    ``[B, N]`` (None = all real). Returns ``[B, N, Hq, Dv]`` and the state after them (``state`` is not changed)."""
    b, _, n, _ = q.shape
    real = torch.ones(b, n, dtype=torch.bool, device=q.device) if key_real is None else key_real.bool()
    st = RetentionState.empty(k, v) if state is None else dataclasses.replace(state)
    offset = st.end
    is_sink = sink_flags(real, budget.sinks, st.real_seen)
    if budget.sinks:
        _fill_sinks(st, k, v, real, budget.sinks, offset)
    st.real_seen = st.real_seen + real.long().sum(-1)
    st.recent_k, st.recent_v = torch.cat([st.recent_k, k], 2), torch.cat([st.recent_v, v], 2)
    st.recent_logb = torch.cat([st.recent_logb, log_beta.float()], 2)
    st.recent_real, st.recent_sink = torch.cat([st.recent_real, real], 1), torch.cat([st.recent_sink, is_sink], 1)
    st.end = offset + n
    outs, first = [], offset
    while first < offset + n:
        if first % budget.block == 0 and first > st.boundary:
            _boundary(st, first, budget.window, budget.slots, budget.decay)
        last = min(offset + n, (first // budget.block + 1) * budget.block)
        outs.append(_attend_segment(q[:, :, first - offset:last - offset], st, first, budget.window, scale))
        first = last
    if n > budget.block:  # copies, so that a prefill's whole K/V is not kept alive through a view
        st.map(lambda t: t.clone())
    return torch.cat(outs, 1), st


@dataclasses.dataclass(frozen=True)
class RetentionBudget:
    """What a retention cache holds: ``sinks`` S, ``window`` W, ``slots`` C, decided every ``block`` B positions
    by the score with (``decay``) or without the key's age."""

    window: int
    sinks: int
    slots: int
    block: int
    decay: bool = True

    def tokens(self) -> int:
        """Keys held at most besides the C slots' growth: S + (W - 1) + B + C."""
        return self.sinks + self.window - 1 + self.block + self.slots
