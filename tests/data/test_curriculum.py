"""The stage schedule: exact switch steps, per-stage LR, and a reproducible step-ordered sample layout."""

import math

import numpy as np
import pytest

from hf_zero.core.config import Stage
from hf_zero.data.curriculum import build_sample_order, build_schedule

STAGES = [
    Stage(name="a", data=["x"], steps=4, learning_rate=1e-3, warmup_steps=1),
    Stage(name="b", data=["y"], epochs=2, learning_rate=5e-4, lr_schedule="linear", min_lr_ratio=0.0),
    Stage(name="c", data=["z", "w"], weights=[3, 1], steps=3, lr_schedule="constant"),
]


def test_steps_from_steps_and_epochs():
    sched = build_schedule(STAGES, [100, 10, 50], global_batch=4, base_lr=1e-4)
    assert [(s.start_step, s.steps) for s in sched.spans] == [(0, 4), (4, 5), (9, 3)]  # ceil(2*10/4) = 5
    assert sched.total_steps == 12
    assert [sched.stage_at(k).name for k in range(12)] == list("aaaabbbbbccc")
    assert sched.table()[1] == {"stage": "b", "first_step": 5, "last_step": 9, "lr": 5e-4}


def test_lr_warmup_decay_per_stage():
    sched = build_schedule(STAGES, [100, 10, 50], global_batch=4, base_lr=1e-4)
    assert sched.lr_at(0) == pytest.approx(1e-3 / 2)  # warmup step 1 of 1
    assert sched.lr_at(1) == pytest.approx(1e-3)  # cosine starts at the peak
    assert sched.lr_at(3) < sched.lr_at(2) < 1e-3
    assert sched.lr_at(4) == pytest.approx(5e-4)  # stage b restarts at its own peak
    assert sched.lr_at(8) == pytest.approx(5e-4 * (1 - 4 / 5))  # linear to 0
    assert sched.lr_at(9) == sched.lr_at(11) == pytest.approx(1e-4)  # constant at the recipe's LR


def test_sample_order_owns_whole_steps_and_is_reproducible():
    sched = build_schedule(STAGES, [100, 10, 50], global_batch=4, base_lr=1e-4)
    sizes = [[100], [10], [40, 10]]
    order = build_sample_order(sched, sizes, [None, None, [3, 1]], seed=1)
    assert order.shape == (12 * 4, 3)
    for k in range(12):  # every sample of step k comes from the stage that owns step k
        assert set(order[k * 4:(k + 1) * 4, 0]) == {sched.stage_at(k).index}
    assert np.array_equal(order, build_sample_order(sched, sizes, [None, None, [3, 1]], seed=1))
    assert not np.array_equal(order, build_sample_order(sched, sizes, [None, None, [3, 1]], seed=2))
    b = order[order[:, 0] == 1, 2]  # two epochs of 10 samples: each seen twice
    assert sorted(np.bincount(b, minlength=10)) == [2] * 10


def test_mixture_weights_are_respected():
    stages = [Stage(name="m", data=["p", "q"], weights=[3, 1], steps=250)]
    sched = build_schedule(stages, [1000], global_batch=4, base_lr=1e-3)
    order = build_sample_order(sched, [[500, 500]], [[3, 1]], seed=0)
    share = (order[:, 1] == 0).mean()
    assert math.isclose(share, 0.75, abs_tol=0.03)
