"""What a run trains, recorded with every checkpoint and summary, and the one comparison a resume or a re-run of a
finished run makes against it, in the ranks (checkpoint/resume.py) and in `hf-zero train`'s preflight
(preflight/check_io.py), so that no resume trains something else in silence.

`run_settings` takes the recipe's parsed values (model arguments, stages, TrainingArguments values): every field is
compared except those in NOT_COMPARED. A difference is refused in one line unless `--allow_changes KEY...` names
it; keys in FIXED (they change the set of parameters or the optimizer's state layout) are refused even then.
"""

from __future__ import annotations

import json
from dataclasses import asdict, fields, is_dataclass
from types import SimpleNamespace

from hf_zero.core.errors import UserError, flag_hint

__all__ = ["NOT_COMPARED", "FIXED", "run_settings", "differences", "allowed_changes", "check_resume_settings",
           "check_finished_settings", "check_resume_fits", "check_resume_reaches"]

# Not compared, deliberately: none of these changes what the optimizer sees at a given step.
NOT_COMPARED = frozenset({
    # The run plan's (profile, precision, ranks, batch): compared by resume.py's own checks (profile, ZeRO stage,
    # engine, global batch) or free to change (rank count, micro batch x accumulation at the same global batch).
    "per_device_train_batch_size", "gradient_accumulation_steps", "global_batch_size", "auto_find_batch_size",
    "bf16", "fp16", "bf16_full_eval", "fp16_full_eval", "tf32", "deepspeed", "fsdp", "fsdp_config", "use_cpu",
    "accelerator_config", "parallelism_config", "local_rank", "ddp_backend", "ddp_timeout", "ddp_bucket_cap_mb",
    "ddp_find_unused_parameters", "ddp_broadcast_buffers", "ddp_static_graph",
    # Set from the stages (which are compared); the curriculum's order is the sampler (plan/reconcile.py).
    "max_steps", "num_train_epochs", "train_sampling_strategy",
    # Same computation, other speed or memory.
    "activation_checkpointing", "activation_checkpointing_kwargs", "gradient_checkpointing",
    "gradient_checkpointing_kwargs", "torch_compile", "torch_compile_backend", "torch_compile_mode",
    "use_liger_kernel", "liger_kernel_config", "use_cache", "torch_empty_cache_steps", "fused_cross_entropy",
    "attn_implementation", "full_determinism", "dataloader_drop_last", "dataloader_num_workers",
    "dataloader_pin_memory", "dataloader_persistent_workers", "dataloader_prefetch_factor",
    "dataloader_multiprocessing_context", "dataloader_in_order",
    # Where and how often the run reports, evaluates and saves.
    "output_dir", "logging_strategy", "logging_steps", "logging_first_step", "log_on_each_node",
    "logging_nan_inf_filter", "include_num_input_tokens_seen", "log_level", "log_level_replica", "disable_tqdm",
    "report_to", "run_name", "project", "trackio_space_id", "trackio_bucket_id", "trackio_static_space_id",
    "skip_memory_metrics", "debug", "measure_memory", "eval_strategy", "eval_steps", "eval_delay",
    "per_device_eval_batch_size", "prediction_loss_only", "eval_on_start", "eval_do_concat_batches",
    "eval_use_gather_object", "eval_accumulation_steps", "include_for_metrics", "batch_eval_metrics",
    "sample_prompts", "sample_max_new_tokens", "do_train", "do_eval", "do_predict", "save_only_model",
    "save_strategy", "save_steps", "save_on_each_node", "save_total_limit", "enable_jit_checkpoint", "push_to_hub",
    "hub_token", "hub_private_repo", "hub_model_id", "hub_strategy", "hub_always_push", "hub_revision",
    "load_best_model_at_end", "metric_for_best_model", "greater_is_better", "save_final_model",
    "restore_callback_states_from_checkpoint",
    # How this run starts.
    "resume_from_checkpoint", "fresh_start", "allow_changes",
})

# Cannot change on resume even with --allow_changes: another set of parameters (model, LoRA shape) or another
# optimizer whose state the checkpoint does not hold.
FIXED = {
    "model_name_or_path": "the checkpoint holds that model's weights",
    "tokenizer_name_or_path": "another vocabulary changes the embedding",
    "use_peft": "LoRA adapters change the set of trained parameters",
    "lora_r": "the LoRA rank is the shape of the adapter weights",
    "lora_target_modules": "the adapted modules are the set of adapter weights",
    "optim": "the checkpoint holds that optimizer's state",
}

_LORA = ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules")

def _plain(value):
    """JSON's view of a value (tuples as lists, enums as strings), so recorded and current values compare equal."""
    return json.loads(json.dumps(value, default=str))


def run_settings(instances, stages, training_values: dict) -> dict:
    """What this run trains: every recipe value except NOT_COMPARED, the stages in full; LoRA values only when
    LoRA is on (they do nothing otherwise)."""
    out = {}
    for inst in instances:
        values = inst if isinstance(inst, dict) else {f.name: getattr(inst, f.name) for f in fields(inst) if f.init}
        out.update(values)
    out.update(training_values)
    if not out.get("use_peft"):
        for key in _LORA:
            out.pop(key, None)
    settings = {k: _plain(v) for k, v in sorted(out.items()) if k not in NOT_COMPARED}
    settings["stages"] = [_plain(asdict(s) if is_dataclass(s) else dict(s)) for s in stages or []]
    return settings


def _stage_changes(old: list, new: list) -> str:
    names = [s.get("name") for s in old], [s.get("name") for s in new]
    if names[0] != names[1]:
        return f"stages {names[0]} -> {names[1]}"
    parts = [f"stages[{a['name']}].{k} {_show(a.get(k))} -> {_show(b.get(k))}"
             for a, b in zip(old, new) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    return "; ".join(parts)


def _show(value) -> str:
    return "unset" if value is None else json.dumps(value) if isinstance(value, (list, dict)) else str(value)


def differences(recorded: dict, current: dict) -> dict[str, str]:
    """key -> "old -> new" for every setting that differs. A key only one side has is a setting the other's
    hf_zero did not know (or a LoRA value without LoRA): nothing to compare."""
    out = {}
    for key in sorted(set(recorded) & set(current)):
        if key in NOT_COMPARED:
            continue
        old, new = recorded.get(key), current.get(key)
        if old == new:
            continue
        if key in _LORA and not (recorded.get("use_peft") or current.get("use_peft")):
            continue
        out[key] = _stage_changes(old or [], new or []) if key == "stages" else f"{key} {_show(old)} -> {_show(new)}"
    return out


def allowed_changes(value) -> set[str]:
    """`--allow_changes learning_rate,seed` or `--allow_changes learning_rate seed` (or a YAML list)."""
    items = [value] if isinstance(value, str) else list(value or [])
    return {k.strip() for item in items for k in str(item).replace(",", " ").split() if k.strip()}


def check_resume_settings(name: str, recorded: dict | None, current: dict, allow) -> list[str]:
    """Raise UserError when this run would train something else than the checkpoint `name` did, unless every
    difference is in `allow`; returns the keys whose new values apply from the resumed step."""
    allow = allowed_changes(allow)
    known = set(current) | set(recorded or {}) | set(_LORA) | NOT_COMPARED  # NOT_COMPARED ones change freely
    unknown = sorted(allow - known)
    if unknown:
        raise UserError("allow_changes", f"unknown setting(s) {', '.join(unknown)}",
                        "name settings of the recipe, e.g. --allow_changes learning_rate,seed,stages")
    if recorded is None:  # a checkpoint written before settings were recorded: nothing to compare with
        return []
    diff = differences(recorded, current)
    _refuse_no_op_learning_rate(diff, current)
    fixed = [k for k in diff if k in FIXED]
    if fixed:
        raise UserError("resume", f"{name} cannot continue with other " + "; ".join(
            f"{diff[k]} ({FIXED[k]})" for k in fixed),
            f"train it with {flag_hint('--fresh_start true')} or another --output_dir")
    refused = [k for k in diff if k not in allow]
    if refused:
        raise UserError("resume", f"{name} was trained with other settings: " + "; ".join(diff[k] for k in refused),
                        f"pass {flag_hint('--allow_changes ' + ','.join(refused))} to apply them from this "
                        f"checkpoint's step, {flag_hint('--fresh_start true')} to start over, or another --output_dir")
    return sorted(diff)


def _refuse_no_op_learning_rate(diff: dict, current: dict) -> None:
    """A new --learning_rate where every stage sets its own changes nothing: said, not "applied"."""
    stages = current.get("stages") or []
    if "learning_rate" in diff and stages and all(s.get("learning_rate") is not None for s in stages):
        own = ", ".join(f"{s.get('name')}: {_show(s.get('learning_rate'))}" for s in stages)
        raise UserError("learning_rate", f"{diff['learning_rate']} changes nothing: every stage sets its own "
                        f"learning_rate ({own})", "change the stages' learning_rate in the recipe (and pass "
                        f"{flag_hint('--allow_changes stages')}), or leave --learning_rate as it was")


def check_resume_reaches(name: str, meta: dict, settings: dict | None, max_steps) -> None:
    """check_resume_fits before anything is laid out or moved (a resume, `hf-zero check`): --max_steps, and the
    stages when each gives its `steps` (an `epochs:` stage's length is known once its data is read: lay_out checks
    it then)."""
    stages = (settings or {}).get("stages") or []
    spans, start = [], 0
    for i, stage in enumerate(stages):
        steps = stage.get("steps") if isinstance(stage, dict) else None
        if not isinstance(steps, int) or isinstance(steps, bool):
            spans = None
            break
        spans.append(SimpleNamespace(index=i, name=stage.get("name"), steps=steps, end_step=start + steps))
        start += steps
    cap = max_steps if isinstance(max_steps, int) and not isinstance(max_steps, bool) and max_steps > 0 else None
    if spans:
        check_resume_fits(name, meta.get("global_step"), meta.get("stage"), spans, cap)
    elif cap is not None:
        check_resume_fits(name, meta.get("global_step"), None, [SimpleNamespace(end_step=1 << 62)], cap)


def check_resume_fits(name: str, step, stage: dict | None, spans, max_steps: int | None) -> None:
    """Refuse a resume that would train nothing or skip part of a stage: the stages (or --max_steps) now end at
    or before the checkpoint's step, or the stage the checkpoint is in now ends before the steps it has done.
    `spans`: the schedule's stages (index, name, steps, end_step), `stage`: the checkpoint's stage record."""
    if not isinstance(step, int) or isinstance(step, bool):
        return
    total = spans[-1].end_step if spans else 0
    if max_steps and 0 < max_steps <= step:
        raise UserError("max_steps", f"{name} is at step {step} and --max_steps {max_steps} ends the run there; "
                        "nothing would train", f"pass a --max_steps above {step} (the stages give {total}), or "
                        "leave it out")
    if stage and isinstance(stage.get("index"), int) and stage["index"] < len(spans):
        now = spans[stage["index"]]
        done = stage.get("steps_done")
        if isinstance(done, int) and now.steps < done:
            raise UserError(f"stages[{now.name}].steps", f"{name} is {done} steps into stage '{now.name}', which now "
                            f"has {now.steps} step{'' if now.steps == 1 else 's'}: resuming would skip or repeat "
                            "part of the curriculum",
                            f"keep at least {done} steps in that stage, or start over with "
                            f"{flag_hint('--fresh_start true')}")
    if step >= total:
        raise UserError("stages", f"{name} is at step {step} but the stages now end at step {total}; nothing would "
                        "train", f"give the stages more steps (with {flag_hint('--allow_changes stages')}), or start "
                        f"over with {flag_hint('--fresh_start true')}")


def check_finished_settings(where, recorded: dict | None, current: dict) -> None:
    """A finished run asked again: the same settings are a no-op; other settings are refused, naming each."""
    if recorded is None:
        return
    diff = differences(recorded, current)
    if diff:
        lines = "; ".join(_finished_words(k, recorded, current, diff[k]) for k in diff)
        raise UserError("output_dir", f"{where} holds a run that finished with other settings ({lines})",
                        f"{flag_hint('--fresh_start true')} trains again (the finished run moves to previous-run/), "
                        "or pass another --output_dir")


def _finished_words(key: str, recorded: dict, current: dict, line: str) -> str:
    if key == "stages":
        return line
    return f"{key}: finished with {_show(recorded.get(key))}, asked {_show(current.get(key))}"
