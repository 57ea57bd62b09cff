"""The console's lines and the summary's numbers, from log entries as the Trainer writes them (no run needed)."""

import pytest

from hf_zero.core.console import eval_line, step_line
from hf_zero.data.curriculum import CurriculumSchedule, StageSpan
from hf_zero.train.trainer import eval_means, stage_table

SCHEDULE = CurriculumSchedule((StageSpan(0, "short", 0, 2, 1e-3, 0, "cosine", 0.1),
                               StageSpan(1, "long", 2, 2, 1e-3, 0, "cosine", 0.1)), global_batch=4)
# Each held-out set is logged on its own entry, as the Trainer does with a dict of eval datasets.
HISTORY = [
    {"eval_short_loss": 6.0, "step": 0}, {"eval_long_loss": 7.0, "step": 0},
    {"loss": 5.9, "learning_rate": 1e-3, "stage": 0, "tokens_per_second": 100.0, "step": 1},
    {"loss": 5.5, "learning_rate": 5e-4, "stage": 0, "tokens_per_second": 300.0, "step": 2},
    {"eval_short_loss": 5.0, "step": 2}, {"eval_long_loss": 6.5, "step": 2},
    {"loss": 5.2, "learning_rate": 1e-3, "stage": 1, "tokens_per_second": 200.0, "step": 3},
    {"loss": 5.1, "learning_rate": 1e-4, "stage": 1, "tokens_per_second": 200.0, "step": 4},
    {"eval_short_loss": 5.2, "step": 4}, {"eval_long_loss": 6.0, "step": 4},
]


def test_eval_means_are_over_every_stage_before_and_at_the_end():
    before, after = eval_means(HISTORY, ["short", "long"])
    assert before == pytest.approx(6.5) and after == pytest.approx(5.6)  # not short's 6.0 -> long's 6.0
    assert eval_means(HISTORY[2:], ["short", "long"]) == (None, pytest.approx(5.6))  # no eval before training


def test_stage_table_takes_each_stage_eval_at_its_own_end():
    short, long = stage_table(SCHEDULE, HISTORY)
    assert (short["eval_loss_before"], short["eval_loss"], short["eval_loss_after"]) == (6.0, 5.0, 5.2)
    assert (long["eval_loss_before"], long["eval_loss"], long["eval_loss_after"]) == (7.0, 6.0, 6.0)
    assert (short["first_loss"], short["last_loss"], long["first_loss"]) == (5.9, 5.5, 5.2)
    assert short["tokens_per_second"] == 200.0 and "mfu" not in short  # CPU logs carry no MFU


def test_step_line_cpu_and_gpu():
    logs = {"loss": 6.04999, "learning_rate": 0.00183, "tokens_per_second": 2113.6}
    assert step_line(logs, 7, 15, "2/3 medium") == \
        "step 7/15 | stage 2/3 medium | loss 6.0500 | lr 1.83e-03 | 2,114 tok/s"
    gpu = {**logs, "peak_memory_bytes": 3 * 2**30 + 2**29, "mfu": 0.4123}
    assert step_line(gpu, 7, 15, None).endswith("| 2,114 tok/s | peak mem 3.5 GiB | MFU 0.41")


def test_eval_line_one_line_per_evaluation():
    metrics = {"eval_short_loss": 5.0, "eval_short_perplexity": 148.4, "eval_short_runtime": 0.1,
               "eval_long_loss": 6.0, "epoch": 0.5}
    assert eval_line(metrics, "at step 2 (end of stage 'short')") == \
        "eval at step 2 (end of stage 'short'): short 5.0000 | long 6.0000 | mean 5.5000"
    assert eval_line({"eval_loss": 0.5, "eval_accuracy": 0.9}, "at step 30") == \
        "eval at step 30: loss 0.5000 | accuracy 0.9000"
