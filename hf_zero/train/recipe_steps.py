"""The steps every recipe takes around its own data and model, so a recipe reads parse -> data -> model -> trainer ->
train -> save top to bottom and holds only what is its own: resume before any engine, the curriculum's step order,
the measuring callbacks the tools ask for, the banner, train() with a clean stop, and the summary fields every
recipe records."""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

from hf_zero.checkpoint.compare import check_resume_fits
from hf_zero.checkpoint.resume import prepare_resume
from hf_zero.checkpoint.safe_load import safe_checkpoint_loading
from hf_zero.checkpoint.store import read_metadata
from hf_zero.checkpoint.write import best_metric_default
from hf_zero.core import startup
from hf_zero.core.console import say
from hf_zero.core.errors import UserError
from hf_zero.data.chat import FormatOptions
from hf_zero.data.curriculum import build_sample_order, build_schedule
from hf_zero.data.multimodal import load_multimodal_stage
from hf_zero.data.stages import check_stage_files
from hf_zero.estimate.measure import MemoryMeasureCallback, measure_requested
from hf_zero.launch.interrupt import raise_if_interrupted
from hf_zero.plan.arguments import CurriculumArguments, MultimodalArguments
from hf_zero.plan.vlm_args import VlmArguments
from hf_zero.train.bench_probe import BenchProbeCallback, StartupCallback, bench_requested
from hf_zero.train.loss_plot import LOSS_PLOT
from hf_zero.train.run import RunContext, print_banner
from hf_zero.train.samples import with_stage_exact_match
from hf_zero.train.trainer import step_losses

__all__ = ["start", "lay_out", "lay_out_multimodal",
           "final_training_args", "attach_probes", "announce", "train", "summary_fields",
           "loss_words", "exact_match_words", "next_steps"]


def start(ctx: RunContext, fresh_start: bool, example: str) -> str | None:
    """Seed, insist on stages, pick the checkpoint to resume from (checked against this run before any engine
    exists) and write run_plan.json. `example` is the YAML line the error suggests when the recipe has no stages."""
    from transformers import set_seed

    set_seed(ctx.training_args.seed)
    if not ctx.stages:
        raise UserError("stages", "the recipe has no stages", f"add a `stages:` list to the YAML, e.g. {example}")
    if not isinstance(ctx.training_args, (MultimodalArguments, VlmArguments)):  # parts would be silently ignored
        for stage in ctx.stages:
            for key in ("train", "learning_rates"):
                if getattr(stage, key) is not None:
                    raise UserError(f"stages[{stage.name}].{key}", "says what trains per part of a composed model or "
                                    "VLM, which only the multimodal and vlm recipes have",
                                    "remove it, or set `recipe: multimodal` (or `recipe: vlm`)")
    if isinstance(ctx.training_args, CurriculumArguments):  # its data as the preflight read it, before any write
        for stage in ctx.stages:
            check_stage_files(stage, ctx.training_args.eval_samples)
    resume = prepare_resume(ctx, fresh_start=fresh_start)
    if resume is not None:
        meta = read_metadata(resume)
        ctx.resumed = {"name": Path(resume).name, "step": meta.get("global_step"), "stage": meta.get("stage")}
    if ctx.training_args.process_index == 0:  # this run goes ahead: its plan beside its outputs
        ctx.plan.write()
    return resume


def lay_out(ctx: RunContext, pool_sizes: list[int], source_sizes: list[list[int]], has_eval: bool, **values):
    """The curriculum's schedule and its step-ordered sample indices, and the run's final TrainingArguments
    (ctx.training_args): the Trainer runs exactly the schedule's steps, and saves with a best metric when it has
    eval data. `values`: the recipe's own fields that only its data decides (eval_on_start, label_names)."""
    args = ctx.training_args
    schedule = build_schedule(ctx.stages, pool_sizes, ctx.plan.batch.global_batch, args.learning_rate)
    order = build_sample_order(schedule, source_sizes, [s.weights for s in ctx.stages], args.seed)
    # --max_steps stops the run early at that step; the stages, their LR schedules and data order stay as laid out
    # (a later resume with a larger --max_steps continues the same curriculum).
    cap = args.max_steps if args.max_steps and args.max_steps > 0 else None
    resumed = getattr(ctx, "resumed", None)
    if resumed is not None:
        check_resume_fits(resumed["name"], resumed["step"], resumed["stage"], schedule.spans, cap)
    if cap is not None and cap < schedule.total_steps:
        say(f"[hf_zero] --max_steps {cap}: stopping at step {cap} of the stages' {schedule.total_steps}")
    ctx.training_args = final_training_args(args, max_steps=min(cap or schedule.total_steps, schedule.total_steps),
                                            **best_metric_default(args, has_eval), **values)
    return schedule, order


def lay_out_multimodal(ctx: RunContext, tokenizer, specs: dict, placeholders: dict):
    """The multimodal and VLM recipes' data: every stage's rows tokenized (each referenced file opened once, as the
    collator will open it), the held-out sets by stage, and `lay_out`'s schedule and order (the collator needs the
    rows' media columns, so none is removed). Returns (stage_data, eval_sets, schedule, order)."""
    args = ctx.training_args
    stage_data = [load_multimodal_stage(s, tokenizer, specs, placeholders, args.max_seq_length, args.eval_samples,
                                        args.seed, FormatOptions.from_args(args), args.packing) for s in ctx.stages]
    eval_sets = {s.name: d.eval_samples for s, d in zip(ctx.stages, stage_data) if d.eval_samples}
    schedule, order = lay_out(ctx, [d.pool_size for d in stage_data],
                              [[len(src) for src in d.sources] for d in stage_data], has_eval=bool(eval_sets),
                              eval_on_start=bool(eval_sets), remove_unused_columns=False)
    return stage_data, eval_sets, schedule, order


def final_training_args(args, **values):
    """`args` built once more with `values`, before any Trainer reads them: no code sets a TrainingArguments field
    after it is built (tests/train/test_training_args_final.py). Building them again runs __post_init__ again, which
    normalizes what it already normalized; the process group, set up by the first build, is only looked up (accelerate
    initializes one only where none exists)."""
    try:
        return dataclasses.replace(args, **values)
    except ValueError as err:  # TrainingArguments' own checks of combinations: still a mistake in the recipe
        raise UserError("TrainingArguments", str(err).strip().splitlines()[0],
                        "change the recipe YAML or flags it names") from None


def attach_probes(trainer, ctx: RunContext, measure_memory: bool = False) -> None:
    """The callbacks the tools switch on: bytes per rank at step 1 (`hf-zero estimate` checks) and step times,
    start-up and peak memory (`hf-zero bench`)."""
    if measure_requested(measure_memory):
        trainer.add_callback(MemoryMeasureCallback(ctx.output_dir, ctx.plan.world))
    if bench_requested():
        trainer.add_callback(BenchProbeCallback(ctx.output_dir, ctx.plan.world, trainer))
    trainer.add_callback(StartupCallback())


def announce(ctx: RunContext, schedule, trainable: int, total: int, *lines: str, weights: str = "") -> None:
    """The banner, the recipe's own lines, then each stage's steps and learning rate."""
    print_banner(ctx, trainable, total, weights)
    for line in lines:
        say(f"[hf_zero] {line}")
    say("[hf_zero] stages: " + " | ".join(
        f"{r['stage']}: steps {r['first_step']}-{r['last_step']} lr {r['lr']:g}" for r in schedule.table()))


def train(trainer, resume: str | None):
    """One train() for every stage, from `resume` when there is one; after Ctrl-C / SIGTERM every rank stops here
    with the one line that says where the run stands. Every checkpoint the Trainer or DeepSpeed loads meanwhile
    goes through the safe loader (hf_zero.checkpoint.safe_load)."""
    ops = " (DeepSpeed builds or loads its ops)" if getattr(trainer, "is_deepspeed_enabled", False) else ""
    startup.phase(f"initializing the engine{ops}")
    with safe_checkpoint_loading():
        result = trainer.train(resume_from_checkpoint=resume)
    raise_if_interrupted(trainer)
    return result


def summary_fields(model_args, trainable: int, total: int, schedule, result, history: list, resume: str | None,
                   final_dir, before: float | None, after: float | None, stages: list) -> dict:
    """What every recipe's summary.json records beside its own results (write_summary puts the run's plan first;
    the recipe's own keys come after these, so every summary opens the same way). Each stage row gets its own
    held-out prompts' exact match (before, at its end, after) where it has prompts."""
    return {
        "model": model_args.model_name_or_path,
        "use_peft": model_args.use_peft,
        "trainable_params": trainable,
        "total_params": total,
        "total_steps": schedule.total_steps,
        "train_loss": result.training_loss,
        "eval_loss_before": before,
        "eval_loss_after": after,
        "eval_perplexity_before": math.exp(before) if before is not None else None,
        "eval_perplexity_after": math.exp(after) if after is not None else None,
        "resumed_from": resume,
        "final_dir": str(final_dir) if final_dir else None,
        "stages": with_stage_exact_match(stages, history),
        "losses": step_losses(history),
    }


def loss_words(before: float | None, after: float | None, stages: int, held_out: int | None = None) -> str:
    """The result in the last line: mean held-out loss before -> after, with perplexities; `held_out`: how many
    held-out samples the loss is over."""
    if not (before and after):
        return ""
    if stages > 1:
        over = f"mean over {stages} stages' held-out sets" + (f" ({held_out:,} samples)" if held_out else "")
    else:
        over = f"on {held_out:,} held-out samples" if held_out else "on the held-out set"
    return (f"eval loss {before:.4f} -> {after:.4f} (perplexity {math.exp(before):,.1f} -> {math.exp(after):,.1f}), "
            f"{over}; ")


def exact_match_words(before: float | None, after: float | None, prompts: int | None = None) -> str:
    """The answered held-out prompts in the last line: exact match before -> after training; `prompts`: how many
    prompts it is over."""
    if after is None:
        return ""
    over = f" ({prompts:,} prompts)" if prompts else ""
    return f"exact match {'?' if before is None else f'{before:.2f}'} -> {after:.2f}{over}; "


def next_steps(output_dir: Path, final_dir: Path | None, use_peft: bool, commands: bool = True,
               form: dict | None = None) -> list[str]:
    """The lines under the result: where the curves are, and (`commands`: a causal LM's run) the commands that use
    what the run wrote: answer a prompt with it, export it. `form` (train/generate.py's prompt_form): a run on
    prompt-completion data shows one of its held-out prompts, the form its model answers."""
    logdir = os.environ.get("TENSORBOARD_LOGGING_DIR") or output_dir / "runs"  # where the Trainer's writer puts them
    lines = [f"  curves: {output_dir / LOSS_PLOT}, or tensorboard --logdir {logdir}"]
    if final_dir is not None and commands:
        model = f"--adapter {final_dir}" if use_peft else f"--model {final_dir}"
        example = (form or {}).get("example") if (form or {}).get("format") == "prompt_completion" else None
        prompt = _shell_quoted(example) if example and len(example) <= _SHOWN_PROMPT else '"..."'
        lines.append(f"  try it: hf-zero generate {model} --prompt {prompt}")
        if example and prompt == '"..."':
            lines.append(f"    (its training prompts look like {example[:_SHOWN_PROMPT]!r}...)")
        merge = " --merge-lora" if use_peft else ""  # a model plain from_pretrained loads, without peft
        lines.append(f"  export: hf-zero export {output_dir}{merge} --out {output_dir}_hf")
    return lines


_SHOWN_PROMPT = 120  # characters of a held-out prompt the `try it:` line shows as the command's --prompt


def _shell_quoted(text: str) -> str:
    """`text` as one shell word: single quotes, or bash's $'...' where it holds a newline or a quote."""
    import shlex

    if "\n" not in text and "'" not in text:
        return shlex.quote(text)
    escaped = text.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n").replace("\t", "\\t")
    return f"$'{escaped}'"
