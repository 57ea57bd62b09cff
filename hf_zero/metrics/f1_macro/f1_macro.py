"""Macro-averaged F1 as an `evaluate` module that ships with hf_zero (loads offline by path).

Per class c: F1_c = 2 TP / (2 TP + FP + FN); the macro average is their unweighted mean over the classes that
occur in the references or the predictions (scikit-learn's `f1_score(average="macro")` with zero_division=0).
Unweighted, so a rare class counts as much as a frequent one: a classifier that ignores a topic is penalised even
when accuracy looks fine.
"""

import datasets
import evaluate

_DESCRIPTION = "Unweighted mean over classes of F1 = 2TP / (2TP + FP + FN)."
_KWARGS_DESCRIPTION = """
Args:
    predictions (list of int): predicted class ids.
    references (list of int): true class ids.
    labels (list of int, optional): classes to average over; default: those in references or predictions.
Returns:
    f1_macro (float): in [0, 1].
Example:
    >>> evaluate.load("hf_zero/metrics/f1_macro").compute(predictions=[0, 1, 1], references=[0, 1, 0])
    {'f1_macro': 0.6666666666666666}
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class F1Macro(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features({"predictions": datasets.Value("int64"),
                                        "references": datasets.Value("int64")}),
        )

    def _compute(self, predictions, references, labels=None):
        if len(predictions) == 0:
            raise ValueError("F1 of zero predictions is undefined")
        classes = sorted(set(labels) if labels is not None else set(predictions) | set(references))
        scores = []
        for c in classes:
            tp = sum(1 for p, r in zip(predictions, references) if p == c and r == c)
            fp = sum(1 for p, r in zip(predictions, references) if p == c and r != c)
            fn = sum(1 for p, r in zip(predictions, references) if p != c and r == c)
            scores.append(2 * tp / (2 * tp + fp + fn) if tp + fp + fn else 0.0)
        return {"f1_macro": sum(scores) / len(scores)}
