"""The form-choice cost model: which evaluation order of linear attention runs, and how large its blocks are.

Pure arithmetic on sizes (N queries, M keys, head dims d / Dv, G query heads per KV head, F features, chunk C);
the kernels ask it (:class:`..feature_maps.LinearKernel`) and the FLOP estimates of ``speed/flops.py``
follow the same choices. The constants are read when a function runs, so patching them here takes effect.
"""

from __future__ import annotations

import dataclasses

BLOCK_FEATURE_VALUES = 1 << 18  # 1 MiB of fp32 features per block: measured fastest on CPU
QUADRATIC_SCORE_VALUES = 1 << 21  # scores per query block of the quadratic form (8 MiB in fp32)
# the scan's small per-chunk matmuls reach ~57 % of the GFLOP/s of the quadratic form's large ones (taylor,
# 2 CPU cores, MHA and GQA), so a FLOP of scan work counts 1.75×: measured crossovers ≈ 5k (G = 3), ≈ 8k (G = 1)
SCAN_COST_FACTOR = 1.75
# without autograd: query chunks per block sized so that one block's band scores stay at 4 MiB
BAND_SCORE_VALUES = 1 << 20


def block_length(rows: int, num_features: int, chunk_size: int) -> int:
    """Positions per block of the no-grad blocked paths: about BLOCK_FEATURE_VALUES features (``rows`` rows of
    ``num_features`` per position), whole chunks."""
    return max(chunk_size, BLOCK_FEATURE_VALUES // max(1, rows * num_features) // chunk_size * chunk_size)


def quadratic_block(n: int, score_columns: int) -> int:
    """Query positions per block of a quadratic (score-matrix) form whose block of one query position holds
    ``score_columns`` scores (B·Hq·M): scores of one block at most QUADRATIC_SCORE_VALUES, at least one query."""
    return min(n, max(1, QUADRATIC_SCORE_VALUES // max(1, score_columns)))


def band_block(chunk_scores: int) -> int:
    """Query chunks per block of the windowed hybrid without autograd, one chunk's band holding ``chunk_scores``
    scores (B·Hkv·G·C·W'): one block's band scores about BAND_SCORE_VALUES, at least one chunk."""
    return max(1, BAND_SCORE_VALUES // chunk_scores)


@dataclasses.dataclass(frozen=True)
class FormSizes:
    """The sizes a form choice weighs: N queries, M keys, head dims ``d`` (q·k) and ``dv`` (values), ``g`` = G query
    heads per KV head, ``f`` = F features and the chunk C of the causal scan (``chunk_size``)."""

    n: int
    m: int
    d: int
    dv: int
    g: int
    f: int
    chunk_size: int


def quadratic_is_cheaper(sizes: FormSizes, *, need_state: bool, causal: bool = True) -> bool:
    """For a kernel with a closed form (φ(q)·φ(k) from d-dim vectors): is the quadratic form (no features for
    the queries, none for the keys unless a state is wanted) less matmul work than the linear form? Per query
    row, causal: quadratic ≈ N·(d + Dv + 1) (half of 2N), the scan ≈ 2·C·(d + Dv + 1) + 2·F·(Dv + 1)·(1 + 1/G)
    weighted by SCAN_COST_FACTOR, and the state adds 2·F·(Dv + 1)/G; bidirectional: quadratic ≈
    2·M·(d + Dv + 1), linear ≈ 2·F·(Dv + 1)·(1 + M/(N·G)) + F·(1 + M/(N·G)) for the features."""
    n, m, d, dv, g, f = sizes.n, sizes.m, sizes.d, sizes.dv, sizes.g, sizes.f
    c = min(sizes.chunk_size, n)
    if not causal:
        keys_per_row = m / max(1, n * g)
        return 2 * m * (d + dv + 1) < (2 * f * (dv + 1) + f) * (1 + keys_per_row)
    quadratic = n * (d + dv + 1) + (2 * f * (dv + 1) / g if need_state else 0)
    return quadratic < SCAN_COST_FACTOR * (2 * c * (d + dv + 1) + 2 * f * (dv + 1) * (1 + 1 / g))
