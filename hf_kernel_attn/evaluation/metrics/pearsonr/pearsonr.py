"""Pearson correlation coefficient between predictions and references (scipy.stats.pearsonr)."""

from __future__ import annotations

import datasets
import evaluate
import numpy as np
from scipy import stats

_DESCRIPTION = """
The Pearson correlation coefficient of predictions x and references y:
    r = sum_i (x_i - mean(x)) (y_i - mean(y)) / sqrt(sum_i (x_i - mean(x))^2 * sum_i (y_i - mean(y))^2)
It lies in [-1, 1] (NaN when either input is constant). The optional two-sided p-value tests r == 0 under the
assumption of normally distributed inputs. Computed with scipy.stats.pearsonr; no network access is needed to load
this module.
"""

_KWARGS_DESCRIPTION = """
Args:
    predictions (`list` of `float`): predicted scores.
    references (`list` of `float`): ground-truth scores, same length as predictions (at least 2).
    return_pvalue (`bool`, defaults to `False`): also return the two-sided p-value.
Returns:
    pearsonr (`float`): the correlation coefficient, in [-1, 1].
    p-value (`float`): only when return_pvalue is True.
Examples:
    >>> pearsonr = evaluate.load(metric_path("pearsonr"))
    >>> pearsonr.compute(predictions=[10, 9, 2.5, 6, 4], references=[1, 2, 3, 4, 5])["pearsonr"]
    -0.7426...
"""

_CITATION = """
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
class Pearsonr(evaluate.Metric):
    """r = cov(x, y) / (std(x) std(y))."""

    def _info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {"predictions": datasets.Value("float64"), "references": datasets.Value("float64")}
            ),
            reference_urls=["https://docs.scipy.org/doc/scipy/reference/generated/scipy.stats.pearsonr.html"],
        )

    def _compute(self, predictions, references, return_pvalue: bool = False) -> dict[str, float]:
        x = np.asarray(predictions, dtype=np.float64).reshape(-1)
        y = np.asarray(references, dtype=np.float64).reshape(-1)
        if x.shape != y.shape:
            raise ValueError(f"got {x.shape[0]} predictions but {y.shape[0]} references")
        if x.shape[0] < 2:
            raise ValueError(f"pearsonr needs at least 2 examples, got {x.shape[0]}")
        res = stats.pearsonr(x, y)
        out = {"pearsonr": float(res.statistic)}
        if return_pvalue:
            out["p-value"] = float(res.pvalue)
        return out
