"""Spearman rank correlation coefficient between predictions and references (scipy.stats.spearmanr)."""

from __future__ import annotations

import datasets
import evaluate
import numpy as np
from scipy import stats

_DESCRIPTION = """
The Spearman rank correlation coefficient is the Pearson correlation of the ranks of predictions x and references y
(ties get their average rank):
    rho = pearson(rank(x), rank(y))
which without ties equals 1 - 6 sum_i d_i^2 / (n (n^2 - 1)) with d_i = rank(x_i) - rank(y_i).
It lies in [-1, 1] (NaN when either input is constant). The optional two-sided p-value tests rho == 0 (t-distribution
with n - 2 degrees of freedom). Computed with scipy.stats.spearmanr; no network access is needed to load this module.
"""

_KWARGS_DESCRIPTION = """
Args:
    predictions (`list` of `float`): predicted scores.
    references (`list` of `float`): ground-truth scores, same length as predictions (at least 2).
    return_pvalue (`bool`, defaults to `False`): also return the two-sided p-value.
Returns:
    spearmanr (`float`): the rank correlation coefficient, in [-1, 1].
    spearmanr_pvalue (`float`): only when return_pvalue is True.
Examples:
    >>> spearmanr = evaluate.load(metric_path("spearmanr"))
    >>> spearmanr.compute(predictions=[10, 9, 2.5, 6, 4], references=[1, 2, 3, 4, 5])
    {'spearmanr': -0.7}
"""

_CITATION = """
@book{kokoska2000crc,
  title={CRC Standard Probability and Statistics Tables and Formulae},
  author={Kokoska, Stephen and Zwillinger, Daniel},
  year={2000},
  publisher={Chapman \\& Hall/CRC},
  note={Section 14.7}
}
@article{2020SciPy-NMeth,
  author  = {Virtanen, Pauli and Gommers, Ralf and Oliphant, Travis E. and others},
  title   = {{SciPy} 1.0: Fundamental Algorithms for Scientific Computing in Python},
  journal = {Nature Methods},
  year    = {2020},
  volume  = {17},
  pages   = {261--272},
  doi     = {10.1038/s41592-019-0686-2},
}
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class Spearmanr(evaluate.Metric):
    """rho = pearson(rank(x), rank(y)) with average ranks for ties."""

    def _info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {"predictions": datasets.Value("float64"), "references": datasets.Value("float64")}
            ),
            reference_urls=["https://docs.scipy.org/doc/scipy/reference/generated/scipy.stats.spearmanr.html"],
        )

    def _compute(self, predictions, references, return_pvalue: bool = False) -> dict[str, float]:
        x = np.asarray(predictions, dtype=np.float64).reshape(-1)
        y = np.asarray(references, dtype=np.float64).reshape(-1)
        if x.shape != y.shape:
            raise ValueError(f"got {x.shape[0]} predictions but {y.shape[0]} references")
        if x.shape[0] < 2:
            raise ValueError(f"spearmanr needs at least 2 examples, got {x.shape[0]}")
        res = stats.spearmanr(x, y)
        out = {"spearmanr": float(res.statistic)}
        if return_pvalue:
            out["spearmanr_pvalue"] = float(res.pvalue)
        return out
