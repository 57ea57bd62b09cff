"""The lines a training run prints per step and per evaluation, and its time left (hf_zero.core.progress and
hf_zero.core.time_left), from callback events with a clock the test sets (no run needed)."""

from hf_zero.core.progress import EXACT_MATCH, MEAN_LOSS, console_callback, eval_line, step_line
from hf_zero.core.time_left import duration, eta_text, stage_time_left, step_passes
from hf_zero.data.curriculum import CurriculumSchedule, StageSpan

SCHEDULE = CurriculumSchedule((StageSpan(0, "short", 0, 2, 1e-3, 0, "cosine", 0.1),
                               StageSpan(1, "long", 2, 2, 1e-3, 0, "cosine", 0.1)), global_batch=4)


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


def _run_console(monkeypatch, events, schedule=SCHEDULE, eval_sets=3, max_steps=4, stage_tokens=None):
    """Feed a console callback (time, hook, step, logs) events with the clock at each event's time; its lines."""
    import io
    from contextlib import redirect_stdout

    from transformers import TrainerState, TrainingArguments

    clock = [0.0]
    monkeypatch.setattr("hf_zero.core.progress.time.monotonic", lambda: clock[0])
    args = TrainingArguments(output_dir="unused", disable_tqdm=True, report_to=[])
    state = TrainerState(max_steps=max_steps, global_step=0)
    console = console_callback(schedule, eval_sets=eval_sets, stage_tokens=stage_tokens)
    out = io.StringIO()
    with redirect_stdout(out):
        for at, hook, step, logs in events:
            clock[0], state.global_step = at, step
            if hook == "log":
                console.on_log(args, state, None, logs=logs)
            else:
                getattr(console, f"on_{hook}")(args, state, None)
    return out.getvalue().splitlines()


def test_eta_leaves_out_what_ran_before_the_first_step(monkeypatch):
    """Issue 41 (2): a minute of evaluation and answers before step 1 is no step's time: 6 steps of 10 s each
    leave 50 s after the first, not 5m50s (the old mean over the 70 s since train() began), and then the run's
    final evaluation, which does the work of the one before training (60 s)."""
    events = [(0, "train_begin", 0, None), (55, "log", 0, {"eval_chat_loss": 2.0}), (60, "step_begin", 0, None),
              (70, "step_end", 1, None), (70, "log", 1, {"loss": 2.0, "learning_rate": 1e-3, "stage": 0})]
    one = CurriculumSchedule((StageSpan(0, "chat", 0, 6, 1e-3, 0, "cosine", 0.1),), global_batch=4)
    lines = _run_console(monkeypatch, events, one, eval_sets=1, max_steps=6)
    assert lines[-1].endswith("| elapsed 1m10s | left 1m50s"), lines


def test_time_left_weighs_a_stage_of_longer_rows_by_its_tokens_then_by_its_own_steps(monkeypatch):
    """`make train` said "left 47s" at the end of its short-line stage where 4 minutes were left: the later stages'
    rows are longer. A stage not started yet takes the seconds per token so far times its rows' tokens; once it has
    run a step, its own mean step time."""
    events = [(0, "train_begin", 0, None), (0, "step_begin", 0, None), (5, "step_end", 1, None),
              (10, "step_end", 2, None), (10, "log", 2, {"loss": 2.0, "stage": 0}),
              (30, "step_end", 3, None), (30, "log", 3, {"loss": 2.0, "stage": 1})]
    lines = _run_console(monkeypatch, events, stage_tokens=(10.0, 40.0))
    # 2 steps of 10 tokens in 10 s: 0.5 s a token; the long stage's 2 steps of 40 tokens: 40 s (the mean: 10 s)
    assert lines[0].endswith("| elapsed 10s | left 40s"), lines
    assert lines[1].endswith("| elapsed 30s | left 20s"), lines  # its first step took 20 s
    assert _run_console(monkeypatch, events[:5])[0].endswith("| left 10s")  # no token counts: the mean step


def test_exact_match_before_and_after_is_over_every_stage_with_prompts(monkeypatch):
    """Issue 41 (3, 8): stage 1 plain text (no prompts), stage 2 chat: the "before" is the chat stage's, answered
    before training; each line says how many prompts the number is over."""
    before = {"samples_long_exact_match": 0.25, "samples_long_prompts": 4, EXACT_MATCH: 0.25}
    after = {"samples_long_exact_match": 0.75, "samples_long_prompts": 4, EXACT_MATCH: 0.75}
    events = [(0, "train_begin", 0, None), (1, "log", 0, before), (1, "log", 0, {"eval_short_loss": 6.0}),
              (1, "log", 0, {"eval_long_loss": 7.0}), (1, "log", 0, {MEAN_LOSS: 6.5}),
              (9, "log", 4, after), (9, "log", 4, {"eval_short_loss": 5.0}),
              (9, "log", 4, {"eval_long_loss": 6.0}), (9, "log", 4, {MEAN_LOSS: 5.5})]
    first, last = _run_console(monkeypatch, events)
    assert first.endswith("| mean 6.5000 | exact match 0.25 of 4 prompts")
    assert last.endswith("| mean 5.5000 | exact match 0.75 of 4 prompts (before training 0.25)")
    from hf_zero.train.samples import exact_match_summary

    history = [{**before, "step": 0}, {**after, "step": 4}]
    assert exact_match_summary(history) == {"exact_match_before": 0.25, "exact_match_after": 0.75,
                                            "exact_match_prompts": 4}


def test_the_evaluation_before_training_says_how_far_it_has_come(monkeypatch):
    """Issue 41 (9): the heartbeat before step 1 said "evaluating before training" eight times over; it now says
    which held-out set, which batch, and about how long the set has left."""
    from hf_zero.core import startup

    startup.start_clock({})  # a command's clock of its own (this process's phases begun afresh)
    try:
        startup.phase("evaluating before training")
        batches = [(i, "prediction_step", 0, None) for i in (2, 4, 6)]
        console_events = [(0, "train_begin", 0, None), *batches]
        clock = [0.0]
        monkeypatch.setattr("hf_zero.core.progress.time.monotonic", lambda: clock[0])
        from transformers import TrainerState, TrainingArguments

        args = TrainingArguments(output_dir="unused", disable_tqdm=True, report_to=[])
        state = TrainerState(max_steps=4, global_step=0)
        console = console_callback(SCHEDULE, eval_sets=3)
        for at, hook, _, _ in console_events:
            clock[0] = at
            if hook == "prediction_step":
                console.on_prediction_step(args, state, None, eval_dataloader=list(range(10)))
            else:
                console.on_train_begin(args, state, None)
        # batches 2 and 3 in 4 s: 7 more take about 14 s
        assert startup.now_doing() == ("evaluating before training: held-out set 1/2, batch 3/10, about 14s left "
                                       "for this set")
        startup.phase("loading the first batch")
        assert startup.now_doing() == "loading the first batch"
        assert "evaluating before training" in dict(startup.phases())  # startup_s: the phase, whole
    finally:
        startup.finish()
        startup.start_clock({})


def test_a_stage_not_started_takes_a_fixed_cost_per_step_plus_its_tokens():
    """Seconds per token alone said 1.5-2x the time `make train` took: a step has a fixed cost. Two stages run
    (2 s a step at 10 tokens, 4 s at 30) give 1 s + 0.1 s a token: 6 s a step at 50 tokens, not 7.5 s."""
    measured, tokens = {0: (20.0, 10), 1: (40.0, 10)}, (10.0, 30.0, 50.0)
    assert stage_time_left(measured, {2: 10}, tokens) == 60.0
    assert stage_time_left(measured, {2: 10}, tokens, stage_ends=2, per_stage_end=5.0) == 70.0  # + 2 stage ends
    # a fit that comes out negative (longer rows, faster steps: noise) falls back on the seconds per token
    assert stage_time_left({0: (30.0, 10), 1: (20.0, 10)}, {2: 10}, tokens) == 62.5
    assert stage_time_left({0: (20.0, 10)}, {2: 10}, tokens) == 100.0  # one stage run: seconds per token
    assert stage_time_left({}, {2: 10}, tokens) is None


def test_the_stage_end_evaluation_and_the_first_step_are_booked_apart(monkeypatch):
    """`make train`'s time left jumped to 7m52s at the first step of a stage, which carried the previous stage's
    evaluation, and began high from the first step's one-time costs. The first step is in no mean; the seconds
    between a stage's last step and the next one's first are a stage end's, counted once per stage end to come,
    as long as the evaluation before training until one has been measured."""
    events = [(0, "train_begin", 0, None), (30, "step_begin", 0, None), (40, "step_end", 1, None),
              (40, "step_begin", 1, None), (45, "step_end", 2, None), (45, "log", 2, {"loss": 2.0, "stage": 0}),
              (65, "step_begin", 2, None), (71, "step_end", 3, None), (71, "log", 3, {"loss": 2.0, "stage": 1})]
    lines = _run_console(monkeypatch, events)
    # step 2: 2 steps at 5 s (not the first's 10 s) + 2 stage ends at the 30 s before the first step
    assert lines[0].endswith("| elapsed 45s | left 1m10s"), lines
    # step 3: the long stage's own 6 s + its end at the 20 s the short stage's end took
    assert lines[1].endswith("| elapsed 1m11s | left 26s"), lines


def test_while_one_stage_has_run_a_longer_stage_takes_the_passes_the_batches_before_training_show(monkeypatch):
    """Issue 41 (2): during `make train`'s first stage (short lines) the seconds per token said 2-3x the time its
    longer stages took: a step there is mostly the optimizer and the gradients' exchange. The held-out batches
    before training (one set per stage, 4 rows a batch) cost 0.4 s + 0.01 s a token: 0.8 s at 10 tokens a row,
    2.0 s at 40. A step of 2 rows then runs forward and backward (3.5 forwards) in 3.5 x (0.4 + 0.02 t): 2.1 s at
    10 tokens, so of the short stage's 3 s steps 0.9 s are the rest; the long stage's steps take 0.9 + 4.2 = 5.1 s,
    not the 12 s of seconds per token."""
    from transformers import TrainerState, TrainingArguments

    from hf_zero.core import startup

    clock = [0.0]
    monkeypatch.setattr("hf_zero.core.progress.time.monotonic", lambda: clock[0])
    args = TrainingArguments(output_dir="unused", disable_tqdm=True, report_to=[], per_device_eval_batch_size=4,
                             per_device_train_batch_size=2)
    state = TrainerState(max_steps=4, global_step=0)
    lines = []
    monkeypatch.setattr("hf_zero.core.progress.say", lines.append)

    def left_at_step_2(eval_tokens):
        console = console_callback(SCHEDULE, eval_sets=3, stage_tokens=(10.0, 40.0), eval_tokens=eval_tokens)
        startup.start_clock({})
        try:
            startup.phase("evaluating before training")
            clock[0], state.global_step = 0.0, 0
            console.on_train_begin(args, state, None)
            for at, what in ((1.0, "batch"), (1.8, "batch"), (1.8, {"eval_short_loss": 6.0}), (3.8, "batch"),
                             (5.8, "batch"), (5.8, {"eval_long_loss": 7.0}), (5.8, {MEAN_LOSS: 6.5})):
                clock[0] = at
                if what == "batch":
                    console.on_prediction_step(args, state, None, eval_dataloader=[0, 1])
                else:
                    console.on_log(args, state, None, logs=what)
        finally:
            startup.finish()
            startup.start_clock({})
        for at, hook, step in ((6, "step_begin", 0), (9, "step_end", 1), (9, "step_begin", 1), (12, "step_end", 2)):
            clock[0], state.global_step = at, step
            getattr(console, f"on_{hook}")(args, state, None)
        console.on_log(args, state, None, logs={"loss": 2.0, "stage": 0})
        return lines[-1]

    passes = step_passes({0: [0.8], 1: [2.0, 2.0]}, (10.0, 40.0), eval_rows=4, train_rows=2, micro_batches=1)
    assert abs(passes(10.0) - 2.1) < 1e-9 and abs(passes(40.0) - 4.2) < 1e-9
    accumulating = step_passes({0: [0.8], 1: [2.0]}, (10.0, 40.0), 4, 2, micro_batches=2, checkpointing=True)
    assert abs(accumulating(10.0) - 2 * 4.5 * 0.6) < 1e-9  # 2 micro-batches, the forward run again
    assert step_passes({0: [0.8]}, (10.0, 40.0), 4, 2, 1) is None  # one set timed: nothing parts a and b
    # 2 steps of 5.1 s, and 2 stage ends like the 6 s before the first step
    assert left_at_step_2((10.0, 40.0)).endswith("| elapsed 12s | left 22s"), lines
    assert left_at_step_2(None).endswith("| elapsed 12s | left 36s"), lines  # seconds per token: 2 x 12 s + 12 s
