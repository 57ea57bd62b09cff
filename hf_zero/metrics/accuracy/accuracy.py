"""Accuracy as an `evaluate` module that ships with hf_zero: `evaluate.load("accuracy")` needs the hub, this
loads offline by path (`hf_zero.metrics.load_metric("accuracy")`)."""

import datasets
import evaluate

_DESCRIPTION = "Fraction of predictions equal to their reference label: correct / total."
_KWARGS_DESCRIPTION = """
Args:
    predictions (list of int): predicted class ids.
    references (list of int): true class ids.
Returns:
    accuracy (float): in [0, 1].
Example:
    >>> evaluate.load("hf_zero/metrics/accuracy").compute(predictions=[0, 1, 1], references=[0, 1, 0])
    {'accuracy': 0.6666666666666666}
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class Accuracy(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features({"predictions": datasets.Value("int64"),
                                        "references": datasets.Value("int64")}),
        )

    def _compute(self, predictions, references):
        if len(predictions) == 0:
            raise ValueError("accuracy of zero predictions is undefined")
        correct = sum(int(p == r) for p, r in zip(predictions, references))
        return {"accuracy": correct / len(predictions)}
