"""The console's lines and the summary's numbers, from log entries as the Trainer writes them (no run needed)."""

import logging

import numpy as np
import pytest

from hf_zero.core.console import QUIET_ENV, VERBOSE_ENV, quiet_environment
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
                                 (UserWarning, "torch.nn.modules"), (DeprecationWarning, "peft.tuners"),
                                 (UserWarning, "accelerate.state")):  # issue 41 (5): "OMP_NUM_THREADS ... unset"
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


def test_mean_tokens_per_stage_reads_the_scheduled_rows():
    from hf_zero.data.curriculum import CurriculumDataset

    short, long = [{"input_ids": [1] * 3}] * 4, [{"input_ids": [1] * 12}, {"input_ids": [1] * 20}]
    pairs = [{"prompt_ids": [1] * 2, "chosen_ids": [1] * 3, "rejected_ids": [1] * 5}]
    order = np.array([[0, 0, i % 4] for i in range(8)] + [[1, 0, i % 2] for i in range(8)] + [[2, 0, 0]] * 4)
    data = CurriculumDataset([[short], [long], [pairs]], order)
    assert data.mean_tokens_per_stage(3) == (3.0, 16.0, 12.0)  # a pair: the prompt twice and both answers
    # in micro-batches of 2 consecutive rows, each padded to its longest: 12 and 20 take 20 tokens each
    assert data.mean_tokens_per_stage(3, batch=2) == (3.0, 20.0, 12.0)
    assert CurriculumDataset([[[{"pixel_values": [0.0]}]]], order[:1]).mean_tokens_per_stage(1) is None


def test_sampling_answers_every_stage_with_prompts_before_and_after(tmp_path, monkeypatch):
    """Issue 41 (3, 10): the first stage has no prompts (plain text), the second has: its prompts are answered
    before the first step and after the last, on the tiny model; a fresh run's samples.jsonl holds its own rows
    only (an earlier life's "start" rows are gone)."""
    import json

    import torch
    from transformers import AutoModelForCausalLM, TrainerControl, TrainerState, TrainingArguments

    from hf_zero.data.model_names import get_model_config, get_tokenizer
    from hf_zero.train.samples import SampleCallback

    tokenizer = get_tokenizer("tiny-llama")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(get_model_config("tiny-llama"))

    class Trainer:  # what the callback uses of transformers' Trainer
        is_fsdp_enabled, model, processing_class, logs = False, None, None, []
        control = TrainerControl()
        callback_handler = type("Handler", (), {"callbacks": []})()

        def log(self, logs):
            self.logs.append(logs)

    trainer = Trainer()
    trainer.model, trainer.processing_class = model, tokenizer
    prompts = {1: [{"prompt": "Which play? ", "question": "Which play?", "reference": "Hamlet"}] * 2}
    (tmp_path / "samples.jsonl").write_text(json.dumps({"step": 0, "when": "start", "stage": "old"}) + "\n")
    callback = SampleCallback(trainer, SCHEDULE, prompts, tmp_path, max_new_tokens=2)
    said = []  # (9) the start-up heartbeat's progress while the answers are generated
    monkeypatch.setattr("hf_zero.core.startup.progress", said.append)
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], eval_on_start=True)
    state = TrainerState(max_steps=4, global_step=0)
    callback.on_train_begin(args, state, TrainerControl())
    for step in (1, 2, 3, 4):
        state.global_step = step
        callback.on_step_end(args, state, TrainerControl())
    rows = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [(r["step"], r["stage"], r["when"]) for r in rows] == [(0, "long", "start")] * 2 + [(4, "long", "end")] * 2
    assert said[0].startswith("batch 1/1 of this rank's, about ") and said[0].endswith("s left")
    assert [sorted(k for k in logs if k.startswith("samples_")) for logs in trainer.logs] == [
        ["samples_long_contains_reference", "samples_long_exact_match", "samples_long_prompts"]] * 2


def test_the_result_line_says_what_its_numbers_are_over():
    """Issue 41 (8): no "mean over 1 stages'"; the held-out samples and the prompts behind exact match counted."""
    from hf_zero.train.recipe_steps import loss_words

    assert loss_words(2.0, 1.0, 1, 50).endswith("(perplexity 7.4 -> 2.7), on 50 held-out samples; ")
    assert loss_words(2.0, 1.0, 3, 150).endswith("mean over 3 stages' held-out sets (150 samples); ")
    assert exact_match_words(0.1, 0.72, 50) == "exact match 0.10 -> 0.72 (50 prompts); "


def test_try_it_shows_a_prompt_completion_runs_prompt_form(tmp_path):
    """Issue 41 (1): the `try it:` line of a prompt-completion run shows one of its prompts, ready to paste."""
    out = tmp_path / "run"
    form = {"format": "prompt_completion", "chat": False, "example": "Question: Who wrote Hamlet?\nAnswer:"}
    assert next_steps(out, out / "final", True, form=form)[1] == \
        f"  try it: hf-zero generate --adapter {out}/final --prompt $'Question: Who wrote Hamlet?\\nAnswer:'"
    chat = {"format": "conversational", "chat": True, "example": "Which play?"}
    assert next_steps(out, out / "final", True, form=chat)[1].endswith('--prompt "..."')


