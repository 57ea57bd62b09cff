"""Curriculum fine-tuning of a causal LM (full or LoRA), one recipe for every profile.

    accelerate launch --config_file accelerate_configs/zero3.yaml recipes/curriculum.py \
        --config recipes/configs/tiny_curriculum.yaml

or `make train PROFILE=zero3 CONFIG=recipes/configs/tiny_curriculum.yaml`. Flags override the YAML; every
TrainingArguments field is a flag (--output_dir, --seed, --save_steps, ...).
"""

import math
import sys

from hf_zero.core.config import CurriculumArguments, ModelArguments
from hf_zero.launch.worker import recipe_entry

# What the YAMLs of this recipe are checked against (`hf-zero check`); TrainingArguments comes on top.
ARGUMENT_TYPES = (ModelArguments, CurriculumArguments)


@recipe_entry  # one line for a mistake, a clean stop on Ctrl-C, rank 0's console only
def main(argv=None):
    # Parse: YAML + flags, reconciled with the profile before any engine exists.
    from hf_zero.train.run import setup_run

    ctx = setup_run(ARGUMENT_TYPES, argv, script=__file__)
    model_args, data_args = ctx.args
    args = ctx.training_args

    from transformers import set_seed

    from hf_zero.data.chat import FormatOptions
    from hf_zero.data.curriculum import CurriculumDataset, build_sample_order, build_schedule
    from hf_zero.data.stages import build_collator, load_stage_data
    from hf_zero.train.model import build_causal_lm, count_parameters, is_zero3_partitioned
    from hf_zero.data.model_names import get_tokenizer, resolve_model_path
    from hf_zero.train.run import main_process_print, print_banner, write_summary
    from hf_zero.checkpoint.final import save_final_model
    from hf_zero.train.trainer import CurriculumTrainer, eval_means, stage_table, step_losses

    set_seed(args.seed)
    if not ctx.stages:
        from hf_zero.core.errors import UserError

        raise UserError("stages", "the recipe has no stages", "add a `stages:` list to the YAML (see the README)")
    # Resume: the newest complete checkpoint unless fresh_start, checked against this run before any engine exists.
    from hf_zero.checkpoint.resume import prepare_resume

    resume = prepare_resume(ctx, fresh_start=data_args.fresh_start)

    # Data: every stage tokenized at its own length, a held-out slice per stage, one flat step-ordered dataset.
    tokenizer = get_tokenizer(model_args.model_name_or_path, model_args.tokenizer_name_or_path)
    stage_data = [
        load_stage_data(s, tokenizer, data_args.max_seq_length, data_args.text_field, data_args.eval_samples, args.seed,
                        packing=data_args.packing, formats=FormatOptions.from_args(data_args))
        for s in ctx.stages
    ]
    schedule = build_schedule(ctx.stages, [d.pool_size for d in stage_data], ctx.plan.global_batch, args.learning_rate)
    order = build_sample_order(
        schedule, [[len(src) for src in d.sources] for d in stage_data], [s.weights for s in ctx.stages], args.seed
    )
    train_dataset = CurriculumDataset([d.sources for d in stage_data], order)
    eval_sets = {s.name: d.eval_samples for s, d in zip(ctx.stages, stage_data) if d.eval_samples}
    args.max_steps = schedule.total_steps
    args.eval_on_start = bool(eval_sets)  # the "before" eval loss, measured with the real engine

    # Model: under ZeRO-3 built with zero.Init; LoRA through peft.
    model = build_causal_lm(model_args, tokenizer, packing=data_args.packing, half=args.bf16 or args.fp16)
    trainable, total = count_parameters(model)
    partitioned = is_zero3_partitioned(model)

    trainer = CurriculumTrainer(
        model=model,
        args=args,
        train_dataset=train_dataset,
        eval_dataset=eval_sets or None,
        data_collator=build_collator(tokenizer, packing=data_args.packing, model=model),
        processing_class=tokenizer,
        schedule=schedule,
        fused_cross_entropy=data_args.fused_cross_entropy,
    )
    from hf_zero.estimate.measure import MemoryMeasureCallback, measure_requested

    if measure_requested(data_args.measure_memory):  # bytes per rank at step 1, to check `hf-zero estimate`
        trainer.add_callback(MemoryMeasureCallback(ctx.output_dir))
    from hf_zero.bench.probe import BenchProbeCallback, bench_requested

    if bench_requested():  # step times, start-up and peak memory per rank, for `hf-zero bench`
        trainer.add_callback(BenchProbeCallback(ctx.output_dir, trainer))
    from hf_zero.train.samples import SampleCallback, exact_match_summary

    prompts = {i: d.eval_prompts[: data_args.sample_prompts] for i, d in enumerate(stage_data) if d.eval_prompts}
    if data_args.sample_prompts > 0 and prompts:  # held-out prompts answered at the start and at each stage end
        trainer.add_callback(SampleCallback(trainer, schedule, prompts, ctx.output_dir, data_args.sample_max_new_tokens))
    print_banner(ctx, trainable, total)
    main_process_print(f"[hf_zero] cross-entropy: {trainer.fused_ce_status}")
    main_process_print("[hf_zero] stages: " + " | ".join(
        f"{r['stage']}: steps {r['first_step']}-{r['last_step']} lr {r['lr']:g}" for r in schedule.table()))

    # Train: one train() call for all stages (from `resume` when there is one); Ctrl-C stops every rank here.
    result = trainer.train(resume_from_checkpoint=resume)
    from hf_zero.launch.interrupt import raise_if_interrupted

    raise_if_interrupted(trainer)

    # Save: HF-format model (adapter for LoRA) read back and compared with the trained weights; summary.json.
    final_dir = save_final_model(trainer, ctx.output_dir / "final") if data_args.save_final_model else None
    stages = stage_table(schedule, trainer.state.log_history)
    before, after = eval_means(trainer.state.log_history, list(eval_sets))  # over every stage's held-out set
    summary = write_summary(ctx, {
        "model": model_args.model_name_or_path,
        "model_path": resolve_model_path(model_args.model_name_or_path),
        "use_peft": model_args.use_peft,
        "trainable_params": trainable,
        "total_params": total,
        "zero3_partitioned_at_build": partitioned,
        "total_steps": schedule.total_steps,
        "train_loss": result.training_loss,
        "eval_loss_before": before,
        "eval_loss_after": after,
        "eval_perplexity_before": math.exp(before) if before is not None else None,
        "eval_perplexity_after": math.exp(after) if after is not None else None,
        **exact_match_summary(trainer.state.log_history),
        "resumed_from": resume,
        "final_dir": str(final_dir) if final_dir else None,
        "stages": stages,
        "losses": step_losses(trainer.state.log_history),
    }, trainer.state.log_history)
    result_words = f"eval loss {before:.4f} -> {after:.4f} (perplexity {math.exp(before):,.1f} -> " \
        f"{math.exp(after):,.1f}), mean over {len(eval_sets)} stages' held-out sets; " if before and after else ""
    model_line = f"model in {final_dir}" if final_dir else "no model written (save_final_model: false)"
    main_process_print(f"[hf_zero] done: {result_words}{model_line}, summary in {summary}")


if __name__ == "__main__":
    sys.exit(main())
