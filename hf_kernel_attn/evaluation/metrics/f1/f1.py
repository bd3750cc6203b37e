"""F1 score (binary, micro, macro, weighted or per class) from the confusion matrix."""

from __future__ import annotations

import datasets
import evaluate
import numpy as np

_DESCRIPTION = """
The F1 score is the harmonic mean of precision and recall. Per class c, from the (optionally weighted)
confusion matrix C (rows: reference, columns: prediction):
    TP_c = C[c, c],   FP_c = sum_r C[r, c] - TP_c,   FN_c = sum_p C[c, p] - TP_c
    F1_c = 2 TP_c / (2 TP_c + FP_c + FN_c)        (zero_division when the denominator is 0)
Averages: "binary" reports F1 of the class pos_label (at most two distinct labels allowed); "micro" applies the
formula to TP, FP, FN summed over the classes; "macro" is the unweighted mean of F1_c; "weighted" is the mean of
F1_c weighted by the support TP_c + FN_c; None returns the list of F1_c. The conventions follow scikit-learn's
f1_score. Computed with numpy only; no network access is needed to load this module.
"""

_KWARGS_DESCRIPTION = """
Args:
    predictions (`list` of `int`): predicted labels.
    references (`list` of `int`): ground-truth labels, same length as predictions.
    labels (`list` of `int`, *optional*): the classes to report / average over when average is not "binary"
        (default: every label present in predictions or references, sorted).
    pos_label (`int`, defaults to 1): the positive class when average="binary".
    average (`str` or `None`, defaults to "binary"): one of "binary", "micro", "macro", "weighted", or None.
    sample_weight (`list` of `float`, *optional*): one non-negative weight per example.
    zero_division (`float`, defaults to 0.0): the value of F1_c when 2 TP_c + FP_c + FN_c == 0.
Returns:
    f1 (`float`, or `list` of `float` when average is None): in [0, 1].
Examples:
    >>> f1 = evaluate.load(metric_path("f1"))
    >>> f1.compute(predictions=[0, 1, 1, 0], references=[0, 1, 0, 1])
    {'f1': 0.5}
    >>> f1.compute(predictions=[0, 2, 1, 0], references=[0, 1, 2, 0], average="macro")
    {'f1': 0.3333333333333333}
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

_AVERAGES = ("binary", "micro", "macro", "weighted", None)


def _confusion_matrix(ref: np.ndarray, pred: np.ndarray, weights: np.ndarray, classes: np.ndarray) -> np.ndarray:
    """C[i, j] = sum of the weights of the examples with reference classes[i] and prediction classes[j];
    ``classes`` is sorted and holds every value of ``ref`` and ``pred``."""
    k = classes.shape[0]
    index = np.searchsorted(classes, ref) * k + np.searchsorted(classes, pred)
    return np.bincount(index, weights=weights, minlength=k * k).reshape(k, k)


def _ratio(num: np.ndarray, den: np.ndarray, zero_division: float) -> np.ndarray:
    """num / den elementwise, ``zero_division`` where den == 0."""
    safe = np.where(den == 0, 1.0, den)
    return np.where(den == 0, zero_division, num / safe)


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class F1(evaluate.Metric):
    """F1 = 2 TP / (2 TP + FP + FN), per class or averaged."""

    def _info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {"predictions": datasets.Value("int64"), "references": datasets.Value("int64")}
            ),
            reference_urls=["https://en.wikipedia.org/wiki/F-score"],
        )

    def _compute(
        self,
        predictions,
        references,
        labels=None,
        pos_label: int = 1,
        average: str | None = "binary",
        sample_weight=None,
        zero_division: float = 0.0,
    ) -> dict[str, float | list[float]]:
        if average not in _AVERAGES:
            raise ValueError(f"average must be one of {list(_AVERAGES)}, got {average!r}")
        pred = np.asarray(predictions).reshape(-1)
        ref = np.asarray(references).reshape(-1)
        if pred.shape != ref.shape:
            raise ValueError(f"got {pred.shape[0]} predictions but {ref.shape[0]} references")
        n = pred.shape[0]
        if sample_weight is None:
            weights = np.ones(n)
        else:
            weights = np.asarray(sample_weight, dtype=np.float64).reshape(-1)
            if weights.shape[0] != n:
                raise ValueError(f"sample_weight has {weights.shape[0]} entries but there are {n} predictions")

        present = np.unique(np.concatenate([ref, pred]))
        if average == "binary":
            if present.shape[0] > 2:
                raise ValueError(
                    f"average='binary' needs at most two distinct labels, got {present.tolist()}; "
                    "choose average='micro', 'macro', 'weighted' or None"
                )
            if pos_label not in present and present.shape[0] == 2:
                raise ValueError(f"pos_label={pos_label} is not one of the labels {present.tolist()}")
            selected = np.asarray([pos_label], dtype=present.dtype)
        elif labels is None:
            selected = present
        else:
            selected = np.asarray(labels).reshape(-1)

        classes = np.unique(np.concatenate([present, selected]))
        cm = _confusion_matrix(ref, pred, weights, classes)
        tp_all = np.diag(cm)
        fp_all = cm.sum(axis=0) - tp_all
        fn_all = cm.sum(axis=1) - tp_all
        idx = np.searchsorted(classes, selected)
        tp, fp, fn = tp_all[idx], fp_all[idx], fn_all[idx]

        if average == "micro":
            score = _ratio(2 * tp.sum(), 2 * tp.sum() + fp.sum() + fn.sum(), zero_division)
            return {"f1": float(score)}
        per_class = _ratio(2 * tp, 2 * tp + fp + fn, zero_division)
        if average is None:
            return {"f1": [float(v) for v in per_class]}
        if average == "binary":
            return {"f1": float(per_class[0])}
        if average == "macro":
            return {"f1": float(np.mean(per_class))}
        support = tp + fn  # weighted
        if support.sum() == 0:
            return {"f1": float(zero_division)}
        return {"f1": float(np.average(per_class, weights=support))}
