"""The console's lines and the summary's numbers, from log entries as the Trainer writes them (no run needed)."""

import logging

import pytest

from hf_zero.core.console import (
    EXACT_MATCH,
    MEAN_LOSS,
    QUIET_ENV,
    VERBOSE_ENV,
    console_callback,
    duration,
    eta_text,
    eval_line,
    quiet_environment,
    step_line,
)
from hf_zero.data.curriculum import CurriculumSchedule, StageSpan
from hf_zero.train.loss_plot import plot_losses
from hf_zero.train.recipe_steps import exact_match_words, next_steps
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


def test_step_line_in_a_log_file_ends_with_time_spent_and_left():
    logs = {"loss": 6.0, "learning_rate": 1e-3}
    # 5 steps of this process's life in 10 s: 10 more steps take 20 s
    assert step_line(logs, 5, 15, None, (10.0, 5)) == "step 5/15 | loss 6.0000 | lr 1.00e-03 | elapsed 10s | left 20s"
    assert step_line(logs, 12, 15, None, (100.0, 2)).endswith("| elapsed 1m40s | left 2m30s")  # resumed at step 10
    assert eta_text(0.4, 0, 10) == "elapsed 0s | left ?"
    assert [duration(s) for s in (59.4, 187, 7500)] == ["59s", "3m07s", "2h05m"]


def test_eval_line_shows_the_logged_mean_and_exact_match_before_and_after():
    metrics = {"eval_short_loss": 5.0, "eval_long_loss": 6.0, MEAN_LOSS: 5.5, "eval_mean_perplexity": 244.7}
    assert eval_line(metrics, "at step 4", (0.75, 0.25)) == \
        "eval at step 4: short 5.0000 | long 6.0000 | mean 5.5000 | exact match 0.75 (before training 0.25)"
    assert eval_line({"eval_chat_loss": 2.0, MEAN_LOSS: 2.0}, "before training", (0.0, None)) == \
        "eval before training: chat 2.0000 | exact match 0.00"


def test_console_callback_one_line_per_evaluation_with_its_exact_match(capsys):
    """The logs in the order the Trainer makes them: the answers' exact match, each set's loss, then their mean."""
    from transformers import TrainerState, TrainingArguments

    args = TrainingArguments(output_dir="unused", disable_tqdm=True, report_to=[])
    state = TrainerState(max_steps=4, global_step=0)
    console = console_callback(SCHEDULE, eval_sets=3)
    console.on_train_begin(args, state, None)
    for step, exact, losses in ((0, 0.0, (6.0, 7.0)), (2, 0.5, (5.0, 6.5))):
        state.global_step = step
        if step:
            console.on_log(args, state, None, logs={"loss": 5.5, "learning_rate": 1e-3, "stage": 0})
        console.on_log(args, state, None, logs={"samples_short_exact_match": exact, EXACT_MATCH: exact})
        console.on_log(args, state, None, logs={"eval_short_loss": losses[0]})
        console.on_log(args, state, None, logs={"eval_long_loss": losses[1]})
        console.on_log(args, state, None, logs={MEAN_LOSS: sum(losses) / 2})
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "eval before training: short 6.0000 | long 7.0000 | mean 6.5000 | exact match 0.00"
    assert lines[1].startswith("step 2/4 | stage 1/2 short | loss 5.5000 | lr 1.00e-03 | elapsed ")
    assert lines[2] == ("eval at step 2 (end of stage 'short'): short 5.0000 | long 6.5000 | mean 5.7500 | "
                        "exact match 0.50 (before training 0.00)")
    assert len(lines) == 3


def test_quiet_environment_uses_the_libraries_switches():
    import warnings

    from transformers.utils import logging as transformers_logging

    env = {"DS_ACCELERATOR": "cpu"}
    quiet_environment({**env, VERBOSE_ENV: "1"})  # --verbose: nothing changes (but the loggers, back to default)
    level = transformers_logging.get_verbosity()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        quiet_environment(env)
        assert {k: env[k] for k in QUIET_ENV} == QUIET_ENV  # for the libraries not loaded yet, and the ranks
        assert transformers_logging.get_verbosity() == logging.ERROR  # transformers is loaded here: switched now
        for category, module in ((UserWarning, "peft.utils.other"), (FutureWarning, "transformers.modeling_utils"),
                                 (UserWarning, "torch.nn.modules"), (DeprecationWarning, "peft.tuners")):
            warnings.warn_explicit("noise?", category, "f.py", 1, module=module)
    transformers_logging.set_verbosity(level)
    # PEFT's notes and the deprecations are silenced; any other warning still shows
    assert [(w.category, str(w.message)) for w in seen] == [(UserWarning, "noise?"), (DeprecationWarning, "noise?")]


def test_a_library_that_logs_as_it_loads_is_quiet_from_hf_zeros_first_import():
    """bitsandbytes (loaded with peft by a recipe's first import, before its entry sets up the console) warns as it
    loads on a CPU with AVX512-BF16: its logger is at ERROR from `import hf_zero` on (read in a fresh interpreter,
    this one has set it already), and back to the default with --verbose."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != VERBOSE_ENV}
    probe = ("import logging, sys, hf_zero; "
             "print(logging.getLogger('bitsandbytes').level, 'bitsandbytes' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=120)
    assert proc.stdout.split() == [str(logging.ERROR), "False"], proc.stderr[-2000:]
    try:
        quiet_environment({"DS_ACCELERATOR": "cpu", VERBOSE_ENV: "1"})
        assert logging.getLogger("bitsandbytes").getEffectiveLevel() == logging.WARNING
    finally:
        quiet_environment({"DS_ACCELERATOR": "cpu"})
    assert logging.getLogger("bitsandbytes").getEffectiveLevel() == logging.ERROR


def test_loss_plot_and_the_lines_after_the_result(tmp_path):
    path = plot_losses(HISTORY, tmp_path / "loss.png", ["short", "long"])
    assert path.stat().st_size > 10_000 and path.read_bytes()[:4] == b"\x89PNG"
    assert plot_losses([{"eval_short_loss": 6.0, "step": 0}], tmp_path / "none.png") is None
    out = tmp_path / "run"
    assert next_steps(out, out / "final", use_peft=True) == [
        f"  curves: {out}/loss.png, or tensorboard --logdir {out}/runs",
        f'  try it: hf-zero generate --adapter {out}/final --prompt "..."',
        f"  export: hf-zero export {out} --merge-lora --out {out}_hf"]
    assert next_steps(out, None, use_peft=False) == next_steps(out, out / "final", False, commands=False)
    assert exact_match_words(0.0, 0.75) == "exact match 0.00 -> 0.75; " and exact_match_words(None, None) == ""
