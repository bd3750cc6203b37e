"""Accuracy: the (optionally weighted) fraction of predictions equal to their reference."""

from __future__ import annotations

import datasets
import evaluate
import numpy as np

_DESCRIPTION = """
Accuracy is the proportion of correct predictions among all examples:
    accuracy = sum_i w_i * [pred_i == ref_i] / sum_i w_i      (w_i = 1 without sample_weight)
With normalize=False the (weighted) number of correct predictions sum_i w_i * [pred_i == ref_i] is returned.
Computed with numpy only; no network access is needed to load this module.
"""

_KWARGS_DESCRIPTION = """
Args:
    predictions (`list` of `int`): predicted labels.
    references (`list` of `int`): ground-truth labels, same length as predictions.
    normalize (`bool`, defaults to `True`): if False, return the (weighted) number of correct predictions
        instead of the fraction.
    sample_weight (`list` of `float`, *optional*): one non-negative weight per example.
Returns:
    accuracy (`float`): in [0, 1] when normalize is True, otherwise the (weighted) count of correct predictions.
Examples:
    >>> accuracy = evaluate.load(metric_path("accuracy"))
    >>> accuracy.compute(predictions=[0, 1, 1, 0], references=[0, 1, 0, 0])
    {'accuracy': 0.75}
"""

_CITATION = """
@article{scikit-learn,
  title={Scikit-learn: Machine Learning in {P}ython},
  author={Pedregosa, F. and Varoquaux, G. and Gramfort, A. and Michel, V. and Thirion, B. and Grisel, O. and
          Blondel, M. and Prettenhofer, P. and Weiss, R. and Dubourg, V. and Vanderplas, J. and Passos, A. and
          Cournapeau, D. and Brucher, M. and Perrot, M. and Duchesnay, E.},
  journal={Journal of Machine Learning Research},
  volume={12},
  pages={2825--2830},
  year={2011}
}
"""


def _weights(sample_weight, n: int) -> np.ndarray:
    """One float weight per example (all ones when ``sample_weight`` is None); raises on a length mismatch."""
    if sample_weight is None:
        return np.ones(n)
    w = np.asarray(sample_weight, dtype=np.float64).reshape(-1)
    if w.shape[0] != n:
        raise ValueError(f"sample_weight has {w.shape[0]} entries but there are {n} predictions")
    return w


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class Accuracy(evaluate.Metric):
    """accuracy = sum_i w_i [pred_i == ref_i] / sum_i w_i."""

    def _info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {"predictions": datasets.Value("int64"), "references": datasets.Value("int64")}
            ),
            reference_urls=["https://en.wikipedia.org/wiki/Accuracy_and_precision"],
        )

    def _compute(self, predictions, references, normalize: bool = True, sample_weight=None) -> dict[str, float]:
        pred = np.asarray(predictions).reshape(-1)
        ref = np.asarray(references).reshape(-1)
        if pred.shape != ref.shape:
            raise ValueError(f"got {pred.shape[0]} predictions but {ref.shape[0]} references")
        w = _weights(sample_weight, pred.shape[0])
        correct = float(np.sum(w * (pred == ref)))
        if not normalize:
            return {"accuracy": correct}
        total = float(np.sum(w))
        if total == 0:
            raise ValueError("accuracy is undefined: no examples or all sample weights are zero")
        return {"accuracy": correct / total}
