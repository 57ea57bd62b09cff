"""One recipe + profile + rank count: `hf-zero check`, `hf-zero estimate`, `hf-zero bench` and the run's banner
(`hf-zero train`) show the same batch line (BatchPlan.line) and the same precision (the profile's, with_precision).
No launch of its own: the run is the session's zero2 run through `hf-zero train` (tests/conftest.py)."""

import re

import pytest
from testing_utils import STRATEGY_FLAGS, TINY

from hf_zero.bench.plan import build_plan, run_profile
from hf_zero.cli import main

BATCH = re.compile(r"batch: (\d+ micro x \d+ accum x \d+ ranks = \d+ global)")
PRECISION = re.compile(r"precision: (fp32|bf16|fp16)\b")


def _plan_words(text: str) -> tuple[str, str]:
    batch, precision = BATCH.findall(text), PRECISION.findall(text)
    assert len(set(batch)) == 1 and len(set(precision)) == 1, text
    return batch[0], precision[0]


@pytest.mark.multiproc
def test_check_estimate_bench_and_train_show_the_same_batch_and_precision(strategy_runs, capsys, tmp_path):
    assert main(["check", "--profile", "zero2", "--nproc", "2", "--config", str(TINY), *STRATEGY_FLAGS]) == 0
    check = _plan_words(capsys.readouterr().out)
    assert main(["estimate", "--config", str(TINY), "--profile", "zero2", "--gpus-per-node", "2"]) == 0
    estimate = _plan_words(capsys.readouterr().out)
    plan = build_plan(str(TINY), None, None, 2, list(STRATEGY_FLAGS), tmp_path)
    bench = (plan.batch.line(), run_profile("zero2", None).precision)
    train = _plan_words(strategy_runs["zero2"].stdout)  # its banner
    assert check == estimate == bench == train == ("2 micro x 1 accum x 2 ranks = 4 global", "fp32")


def test_precision_flag_overrides_the_profile_in_one_place():
    assert run_profile("zero2", "bf16").precision == "bf16" and run_profile("zero2", None).precision == "fp32"
