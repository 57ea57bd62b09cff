"""Curriculum fine-tuning of a causal LM (full or LoRA), one recipe for every profile.

    accelerate launch --config_file accelerate_configs/zero3.yaml recipes/curriculum.py \
        --config recipes/configs/tiny_curriculum.yaml

or `make train PROFILE=zero3 CONFIG=recipes/configs/tiny_curriculum.yaml`. Flags override the YAML; every
TrainingArguments field is a flag (--output_dir, --seed, --save_steps, ...).
"""

import sys

from hf_zero.launch.worker import recipe_entry
from hf_zero.plan.arguments import CurriculumArguments, ModelArguments

# What the YAMLs of this recipe are checked against (`hf-zero check`); the last class extends TrainingArguments.
ARGUMENT_TYPES = (ModelArguments, CurriculumArguments)


@recipe_entry  # one line for a mistake, a clean stop on Ctrl-C, rank 0's console only
def main(argv=None):
    from hf_zero.checkpoint.final import save_final_model
    from hf_zero.core.console import say
    from hf_zero.data.chat import FormatOptions
    from hf_zero.data.curriculum import CurriculumDataset
    from hf_zero.data.model_names import get_tokenizer, resolve_model_path
    from hf_zero.data.stages import build_collator, load_stage_data
    from hf_zero.train import recipe_steps as steps
    from hf_zero.train.generate import PROMPT_FORM_KEY, prompt_form
    from hf_zero.train.model import build_causal_lm, count_parameters, describe_weights, is_zero3_partitioned
    from hf_zero.train.preference import preference_stages
    from hf_zero.train.preference_report import preference_summary, preference_words
    from hf_zero.train.run import setup_run, write_summary
    from hf_zero.train.samples import SampleCallback, exact_match_summary
    from hf_zero.train.trainer import CurriculumTrainer, eval_means, stage_table

    # Parse: YAML + flags, reconciled with the profile before any engine exists; the checkpoint to resume from.
    ctx = setup_run(ARGUMENT_TYPES, argv, script=__file__)
    (model_args,), args = ctx.args, ctx.training_args  # args: CurriculumArguments, a TrainingArguments
    resume = steps.start(ctx, args.fresh_start, "- {name: short, data: short.jsonl, steps: 5}")

    # Data: every stage tokenized at its own length, a held-out slice per stage, one flat step-ordered dataset.
    tokenizer = get_tokenizer(model_args.model_name_or_path, model_args.tokenizer_name_or_path)
    stage_data = [load_stage_data(s, tokenizer, args.max_seq_length, args.text_field, args.eval_samples,
                                  args.seed, packing=args.packing, formats=FormatOptions.from_args(args))
                  for s in ctx.stages]
    # a dpo stage's held-out pairs are not a loss's: their reward accuracy is measured at its start and end
    eval_sets = {s.name: d.eval_samples for s, d in zip(ctx.stages, stage_data)
                 if d.eval_samples and s.objective != "dpo"}
    pref = preference_stages(ctx.stages, stage_data)  # the dpo stages and their rows (hf_zero.train.preference)
    schedule, order = steps.lay_out(ctx, [d.pool_size for d in stage_data],
                                    [[len(src) for src in d.sources] for d in stage_data], has_eval=bool(eval_sets),
                                    eval_on_start=bool(eval_sets),  # the "before" eval loss, with the real engine
                                    **({"remove_unused_columns": False} if pref else {}))  # dpo batches: their rows
    args = ctx.training_args  # final: with the schedule's steps

    # Model: under ZeRO-3 built with zero.Init; LoRA through peft.
    model = build_causal_lm(model_args, tokenizer, ctx.profile, packing=args.packing)
    trainable, total = count_parameters(model)
    partitioned = is_zero3_partitioned(model)

    # Trainer: the curriculum's schedule, the fused loss, held-out prompts answered at the start and each stage end.
    trainer = CurriculumTrainer(
        model=model, args=args, train_dataset=CurriculumDataset([d.sources for d in stage_data], order),
        eval_dataset=eval_sets or None, processing_class=tokenizer, schedule=schedule, plan=ctx.plan,
        settings=ctx.settings, data_collator=build_collator(tokenizer, packing=args.packing, model=model,
                                                               preference=bool(pref)),
        fused_cross_entropy=args.fused_cross_entropy, preference=pref,
    )
    steps.attach_probes(trainer, ctx, args.measure_memory)
    prompts = {i: d.eval_prompts[: args.sample_prompts] for i, d in enumerate(stage_data) if d.eval_prompts}
    if args.sample_prompts > 0 and prompts:
        trainer.add_callback(SampleCallback(trainer, schedule, prompts, ctx.output_dir, args.sample_max_new_tokens))
    steps.announce(ctx, schedule, trainable, total, f"cross-entropy: {trainer.fused_ce_status}",
                   weights=describe_weights(model, ctx.profile))

    # Train: one train() call for all stages.
    result = steps.train(trainer, resume)

    # Save: HF-format model (adapter for LoRA) read back and compared with the trained weights; summary.json.
    final_dir = save_final_model(trainer, ctx.output_dir / "final") if args.save_final_model else None
    history = trainer.state.log_history
    before, after = eval_means(history, list(eval_sets))  # over every stage's held-out set
    summary = write_summary(ctx, {
        **steps.summary_fields(model_args, trainable, total, schedule, result, history, resume, final_dir,
                               before, after, stage_table(schedule, history)),
        "model_path": resolve_model_path(model_args.model_name_or_path),
        "zero3_partitioned_at_build": partitioned,
        **(exact := exact_match_summary(history)),
        **(summary_pref := preference_summary(history, schedule, pref, trainer.reference_status)),
        PROMPT_FORM_KEY: (form := prompt_form(stage_data)),  # how `hf-zero generate` prompts the model
    }, history)
    held_out = sum(len(samples) for samples in eval_sets.values())
    done = (f"[hf_zero] done: {steps.loss_words(before, after, len(eval_sets), held_out)}"
            + steps.exact_match_words(exact.get("exact_match_before"), exact.get("exact_match_after"),
                                      exact.get("exact_match_prompts"))
            + preference_words(summary_pref)
            + (f"model in {final_dir}" if final_dir else "no model written (save_final_model: false)")
            + f", summary in {summary}")
    say("\n".join([done, *steps.next_steps(ctx.output_dir, final_dir, model_args.use_peft, form=form)]))

if __name__ == "__main__":
    sys.exit(main())
