"""Tokens per second in each logging step (hf_zero.train.throughput), with a clock the test sets."""


def test_tokens_per_second_ignore_a_log_made_inside_a_step(monkeypatch):
    """A dpo stage's last step logged its held-out rewards from a callback that ran before the throughput's step end:
    the clock restarted inside the step and the console said 6,113,750 tok/s. A log inside a step is its time; a
    log, evaluation or save between steps is not."""
    import torch
    from transformers import TrainerState

    from hf_zero.train.throughput import throughput_callback

    clock = [0.0]
    monkeypatch.setattr("hf_zero.train.throughput.time.perf_counter", lambda: clock[0])
    model = torch.nn.Linear(4, 4)
    model.config = None
    monkeypatch.setattr("hf_zero.train.throughput._flops_per_token", lambda m: 1.0)
    meter, state = throughput_callback(model, "fp32"), TrainerState()
    args = type("Args", (), {"device": torch.device("cpu")})()
    state.num_input_tokens_seen = 0
    meter.on_train_begin(args, state, None)
    meter.on_step_begin(args, state, None)
    clock[0] = 9.0
    meter.on_log(args, state, None)  # inside the step: another callback's log before this one's step end
    clock[0], state.num_input_tokens_seen = 10.0, 1000
    meter.on_step_end(args, state, None)
    meter.on_log(args, state, None)
    clock[0] = 40.0
    meter.on_evaluate(args, state, None)  # 30 s of evaluation between steps: no step's time
    meter.on_step_begin(args, state, None)
    clock[0], state.num_input_tokens_seen = 50.0, 2000
    meter.on_step_end(args, state, None)
    assert meter.metrics(state, args) == {"tokens_per_second": 100.0}  # 2,000 tokens in the steps' 20 s
