"""Perplexity (and bits per byte) from summed negative log-likelihoods; no model is loaded here."""

from __future__ import annotations

import math

import datasets
import evaluate
import numpy as np

_DESCRIPTION = """
Perplexity of a language model from natural-log negative log-likelihoods that were already computed, one row per
example or window i: nll_i is the NLL summed over the num_tokens_i tokens it scores (for a single token, that
token's NLL with num_tokens_i = 1). Then
    nll         = sum_i nll_i / sum_i num_tokens_i          (mean NLL per token, nats)
    perplexity  = exp(nll)
and, when the number of UTF-8 bytes num_bytes_i of the scored text is given,
    bits_per_byte = sum_i nll_i / (ln(2) * sum_i num_bytes_i).
Rows from add_batch / add are pooled, so windows of different lengths are weighted by their token counts.
Computed with math/numpy only; no network access is needed to load this module.
"""

_KWARGS_DESCRIPTION = """
Args:
    nll (`list` of `float`): summed negative log-likelihood (nats) of each example / window.
    num_tokens (`list` of `int`): number of scored tokens of each example / window (>= 0, positive in total).
    num_bytes (`list` of `int`, *optional*): number of bytes of the text scored by each example / window; give it for
        every row or for none.
Returns:
    perplexity (`float`): exp(sum(nll) / sum(num_tokens)).
    nll (`float`): mean negative log-likelihood per token, sum(nll) / sum(num_tokens), in nats.
    num_tokens (`int`): sum(num_tokens).
    bits_per_byte (`float`): sum(nll) / (ln 2 * sum(num_bytes)); only when num_bytes is given.
    num_bytes (`int`): sum(num_bytes); only when num_bytes is given.
Examples:
    >>> perplexity = evaluate.load(metric_path("perplexity"))
    >>> perplexity.compute(nll=[2.0, 4.0], num_tokens=[1, 2])
    {'perplexity': 7.38905609893065, 'nll': 2.0, 'num_tokens': 3}
"""

_CITATION = """
@article{jelinek1977perplexity,
  title={Perplexity--a measure of the difficulty of speech recognition tasks},
  author={Jelinek, Fred and Mercer, Robert L. and Bahl, Lalit R. and Baker, James K.},
  journal={The Journal of the Acoustical Society of America},
  volume={62},
  number={S1},
  pages={S63--S63},
  year={1977}
}
@article{gao2020pile,
  title={The {P}ile: An 800{GB} Dataset of Diverse Text for Language Modeling},
  author={Gao, Leo and Biderman, Stella and Black, Sid and others},
  journal={arXiv preprint arXiv:2101.00027},
  year={2020}
}
"""


def _exp(x: float) -> float:
    """exp(x), inf instead of OverflowError."""
    try:
        return math.exp(x)
    except OverflowError:
        return math.inf


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class Perplexity(evaluate.Metric):
    """perplexity = exp(sum(nll) / sum(num_tokens)); bits_per_byte = sum(nll) / (ln 2 sum(num_bytes))."""

    def _info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {
                    "nll": datasets.Value("float64"),
                    "num_tokens": datasets.Value("int64"),
                    "num_bytes": datasets.Value("int64"),  # null where not given
                }
            ),
            reference_urls=["https://huggingface.co/docs/transformers/perplexity"],
        )

    def add_batch(self, *, nll=None, num_tokens=None, num_bytes=None, **kwargs) -> None:
        """Add rows of summed NLL and token counts (num_bytes optional; stored as nulls when omitted)."""
        if nll is None or num_tokens is None:
            raise ValueError("perplexity needs both nll and num_tokens")
        if num_bytes is None:
            num_bytes = [None] * len(nll)
        super().add_batch(nll=nll, num_tokens=num_tokens, num_bytes=num_bytes, **kwargs)

    def add(self, *, nll=None, num_tokens=None, num_bytes=None, **kwargs) -> None:
        """Add one row: the summed NLL of an example / window and its token count (num_bytes optional)."""
        if nll is None or num_tokens is None:
            raise ValueError("perplexity needs both nll and num_tokens")
        super().add(nll=nll, num_tokens=num_tokens, num_bytes=num_bytes, **kwargs)

    def _compute(self, nll, num_tokens, num_bytes) -> dict[str, float | int]:
        nll = np.asarray(nll, dtype=np.float64).reshape(-1)
        tokens = np.asarray(num_tokens, dtype=np.int64).reshape(-1)
        if nll.shape != tokens.shape:
            raise ValueError(f"got {nll.shape[0]} nll values but {tokens.shape[0]} num_tokens values")
        if np.any(tokens < 0):
            raise ValueError("num_tokens must be >= 0")
        total_tokens = int(tokens.sum())
        if total_tokens <= 0:
            raise ValueError("perplexity is undefined: no scored tokens (sum(num_tokens) == 0)")
        total_nll = math.fsum(nll.tolist())
        mean_nll = total_nll / total_tokens
        out: dict[str, float | int] = {"perplexity": _exp(mean_nll), "nll": mean_nll, "num_tokens": total_tokens}

        given = [b is not None for b in num_bytes]
        if any(given):
            if not all(given):
                raise ValueError("num_bytes must be given for every row or for none")
            nbytes = np.asarray(num_bytes, dtype=np.int64).reshape(-1)
            if np.any(nbytes < 0):
                raise ValueError("num_bytes must be >= 0")
            total_bytes = int(nbytes.sum())
            if total_bytes <= 0:
                raise ValueError("bits_per_byte is undefined: sum(num_bytes) == 0")
            out["bits_per_byte"] = total_nll / (math.log(2) * total_bytes)
            out["num_bytes"] = total_bytes
        return out
