"""Linear (feature-map) attention: the evaluation orders of one formula.

    out_i = φ(q_i)ᵀ S_i / max(φ(q_i)ᵀ z_i, eps),  S_i = Σ_j w_ij φ(k_j) v_jᵀ,  z_i = Σ_j w_ij φ(k_j)

with w_ij = 1 (j visible), j ≤ i when causal (Katharopoulos et al., ICML 2020, "Transformers are RNNs"), or a
decay: w_ij = e^{b_i - b_j} per feature, b the running sum of per-token log-gates (:mod:`.gated`; a fixed decay
γ^(i-j), as DiJiang's, is the constant gate log γ: one decay implementation). The engine alone (math on feature
tensors, no kernel classes; those are in :mod:`..feature_maps`):

* :mod:`.state` — :class:`LinearState` (S, z and what rides along), the value/row layouts, :func:`normalize`;
* :mod:`.recurrent` — :func:`accumulate`: folds keys into a state (prefix keys, or one decode step);
* :mod:`.chunk` — :func:`scan` / :func:`causal_chunked`: the chunked causal form and its recomputing backward;
* :mod:`.bidirectional` — :func:`bidirectional`: O(N), one global state;
* :mod:`.cost` — the form-choice cost model: which evaluation order, what block sizes;
* :mod:`.window` — the sliding-window hybrid: exact softmax over the last W keys, the feature map beyond;
* :mod:`.sparse_cache` — the hybrid's bounded sparse cache: the C older pairs the state reproduces worst, exact;
* :mod:`.gated` — gated linear attention (a decay per token, per head or per feature): every form above and the
  window hybrid, with gates.

Shapes: ``fq`` ``[B, Hkv, G, N, F]`` (query heads grouped by KV head), ``fk`` ``[B, Hkv, M, F]``,
``v`` ``[B, Hkv, M, Dv]``. The state is ``S`` ``[B, Hkv, F, Dv]`` and ``z`` ``[B, Hkv, F]``.
"""

from __future__ import annotations

from . import cost
from .bidirectional import bidirectional
from .chunk import DEFAULT_CHUNK, CausalScan, ClosedForm, ScanLayout, causal_chunked, chunk_mask, scan
from .recurrent import accumulate
from .sparse_cache import recall_error, sparse_window
from .state import (
    ExactKV,
    LinearState,
    PastKeys,
    SinkSet,
    SparseCache,
    normalize,
    normalized_output,
    query_rows,
    with_ones,
)
from .window import branch_normalisers, chunk_length, hybrid_attention, update_sinks

__all__ = ["DEFAULT_CHUNK", "CausalScan", "ClosedForm", "ExactKV", "LinearState", "PastKeys", "ScanLayout", "SinkSet",
           "SparseCache", "accumulate", "bidirectional", "branch_normalisers", "causal_chunked", "chunk_length",
           "chunk_mask", "cost", "hybrid_attention", "normalize", "normalized_output", "query_rows", "recall_error",
           "scan", "sparse_window", "update_sinks", "with_ones"]
