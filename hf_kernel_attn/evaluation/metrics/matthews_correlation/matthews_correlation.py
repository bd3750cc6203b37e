"""Matthews correlation coefficient (binary and multiclass) from the confusion matrix."""

from __future__ import annotations

import math

import datasets
import evaluate
import numpy as np

_DESCRIPTION = """
The Matthews correlation coefficient (MCC, the multiclass R_K statistic of Gorodkin 2004) of the (optionally
weighted) confusion matrix C (rows: reference, columns: prediction) with t_k = sum_j C[k, j] (reference counts),
p_k = sum_i C[i, k] (prediction counts), c = trace(C) and s = sum(C):
    MCC = (c s - sum_k t_k p_k) / sqrt((s^2 - sum_k p_k^2) (s^2 - sum_k t_k^2))
For two classes this is (TP TN - FP FN) / sqrt((TP + FP)(TP + FN)(TN + FP)(TN + FN)). It lies in [-1, 1]; when the
denominator is 0 (e.g. every reference, or every prediction, is one class) it is defined as 0, as in scikit-learn.
Computed with numpy only; no network access is needed to load this module.
"""

_KWARGS_DESCRIPTION = """
Args:
    predictions (`list` of `int`): predicted labels.
    references (`list` of `int`): ground-truth labels, same length as predictions.
    sample_weight (`list` of `float`, *optional*): one non-negative weight per example.
Returns:
    matthews_correlation (`float`): in [-1, 1]; 0 for a degenerate confusion matrix.
Examples:
    >>> mcc = evaluate.load(metric_path("matthews_correlation"))
    >>> mcc.compute(predictions=[1, 2, 2, 0, 3, 3], references=[1, 3, 2, 0, 3, 2])
    {'matthews_correlation': 0.5384615384615384}
"""

_CITATION = """
@article{matthews1975comparison,
  title={Comparison of the predicted and observed secondary structure of {T4} phage lysozyme},
  author={Matthews, Brian W.},
  journal={Biochimica et Biophysica Acta (BBA) - Protein Structure},
  volume={405},
  number={2},
  pages={442--451},
  year={1975}
}
@article{gorodkin2004comparing,
  title={Comparing two K-category assignments by a K-category correlation coefficient},
  author={Gorodkin, Jan},
  journal={Computational Biology and Chemistry},
  volume={28},
  number={5--6},
  pages={367--374},
  year={2004}
}
"""


def _confusion_matrix(ref: np.ndarray, pred: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """C[i, j] = sum of the weights of the examples with reference class i and prediction class j
    (classes: the sorted distinct values of ``ref`` and ``pred``)."""
    classes = np.unique(np.concatenate([ref, pred]))
    k = classes.shape[0]
    index = np.searchsorted(classes, ref) * k + np.searchsorted(classes, pred)
    return np.bincount(index, weights=weights, minlength=k * k).reshape(k, k)


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class MatthewsCorrelation(evaluate.Metric):
    """MCC = (c s - t.p) / sqrt((s^2 - p.p)(s^2 - t.t)) over the confusion matrix."""

    def _info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {"predictions": datasets.Value("int64"), "references": datasets.Value("int64")}
            ),
            reference_urls=["https://en.wikipedia.org/wiki/Phi_coefficient"],
        )

    def _compute(self, predictions, references, sample_weight=None) -> dict[str, float]:
        pred = np.asarray(predictions).reshape(-1)
        ref = np.asarray(references).reshape(-1)
        if pred.shape != ref.shape:
            raise ValueError(f"got {pred.shape[0]} predictions but {ref.shape[0]} references")
        n = pred.shape[0]
        if n == 0:
            raise ValueError("matthews_correlation needs at least one example")
        if sample_weight is None:
            weights = np.ones(n)
        else:
            weights = np.asarray(sample_weight, dtype=np.float64).reshape(-1)
            if weights.shape[0] != n:
                raise ValueError(f"sample_weight has {weights.shape[0]} entries but there are {n} predictions")
        cm = _confusion_matrix(ref, pred, weights)
        t = cm.sum(axis=1)
        p = cm.sum(axis=0)
        c = np.trace(cm)
        s = cm.sum()
        cov_tp = c * s - np.dot(t, p)
        cov_pp = s * s - np.dot(p, p)
        cov_tt = s * s - np.dot(t, t)
        if cov_pp * cov_tt <= 0:  # exactly 0 up to rounding: one class only in references or predictions
            return {"matthews_correlation": 0.0}
        return {"matthews_correlation": float(cov_tp / math.sqrt(cov_tt * cov_pp))}
