"""A causal LM fed by encoders through projectors (hf_zero.train.composed), trained stage by stage: each stage says
what trains (`train: [projector.points, lora]`) and at what learning rate (`learning_rates: {projector: 1e-3}`).

    python recipes/multimodal.py --config recipes/configs/tiny_multimodal.yaml

Rows are chat conversations in TRL's multimodal form (hf_zero.data.multimodal); docs/multimodal.md says what works
and what is not built yet.
"""

import sys

from hf_zero.launch.worker import recipe_entry
from hf_zero.plan.arguments import ModelArguments, MultimodalArguments
from hf_zero.train.composed_count import check_multimodal
from hf_zero.train.recipe_count import count_parts

# What the tools know of this recipe (`hf-zero check`): the argument classes its YAMLs set (the last one extends
# TrainingArguments), how to check their data (every image and array opened; per stage, what trains) and how
# to count the model whole (its encoders and projectors with the LLM).
ARGUMENT_TYPES = (ModelArguments, MultimodalArguments)
CHECK_DATA = check_multimodal
COUNT_PARTS = count_parts


@recipe_entry  # one line for a mistake, a clean stop on Ctrl-C, rank 0's console only
def main(argv=None):
    from hf_zero.core.console import say
    from hf_zero.data.chat_template import prepare_chat_template
    from hf_zero.data.curriculum import CurriculumDataset
    from hf_zero.data.model_names import get_tokenizer, resolve_model_path
    from hf_zero.data.multimodal import add_placeholders
    from hf_zero.data.multimodal_collator import MultimodalCollator
    from hf_zero.train import recipe_steps as steps
    from hf_zero.train.composed import ComposedModel, freeze_unread_embeddings, save_composed
    from hf_zero.train.composed_build import build_encoders
    from hf_zero.train.composed_generate import answer_composed_prompts
    from hf_zero.train.model import build_causal_lm, count_parameters, describe_weights
    from hf_zero.train.parts import PartsTrainer, part_sizes, plan_parts
    from hf_zero.train.run import setup_run, write_summary
    from hf_zero.train.samples import SampleCallback, exact_match_summary
    from hf_zero.train.trainer import eval_means, stage_table

    # Parse: YAML + flags, reconciled with the profile before any engine exists; the checkpoint to resume from.
    ctx = setup_run(ARGUMENT_TYPES, argv, script=__file__)
    (model_args,), args = ctx.args, ctx.training_args
    resume = steps.start(ctx, args.fresh_start, "- {name: points, data: shapes.jsonl, steps: 10}")

    # Encoders first: their measured token counts decide how many placeholder positions each item takes.
    tokenizer = get_tokenizer(model_args.model_name_or_path, model_args.tokenizer_name_or_path)
    prepare_chat_template(tokenizer, args.chat_template)
    built = build_encoders(args.encoders)
    placeholders = add_placeholders(tokenizer, built[1])

    # Data: every stage's rows tokenized, every referenced file opened once as the collator will open it.
    stage_data, eval_sets, schedule, order = steps.lay_out_multimodal(ctx, tokenizer, built[1], placeholders)
    args = ctx.training_args

    # Model: the LLM as every hf_zero recipe builds it (LoRA on it alone), then the encoders and projectors.
    llm = build_causal_lm(model_args, tokenizer, ctx.profile)
    freeze_unread_embeddings(llm, tokenizer, placeholders)  # the placeholders' rows are never read
    model = ComposedModel(llm, args.encoders, placeholders, built)
    sizes = part_sizes(model)  # before plan_parts freezes the parts that train in no stage
    parts = plan_parts(model, ctx.stages, args.learning_rate)
    trainable, total = count_parameters(model)

    trainer = PartsTrainer(
        model=model, args=args, train_dataset=CurriculumDataset([d.sources for d in stage_data], order),
        eval_dataset=eval_sets or None, processing_class=tokenizer, schedule=schedule, plan=ctx.plan,
        settings=ctx.settings, data_collator=MultimodalCollator(tokenizer, built[1]), fused_cross_entropy=False,
        parts=parts,
    )
    steps.attach_probes(trainer, ctx, args.measure_memory)
    # Held-out answers (greedy, by the composed model itself) before training, at each stage end and after the last.
    prompts = {i: d.eval_prompts[: args.sample_prompts] for i, d in enumerate(stage_data) if d.eval_prompts}
    if args.sample_prompts > 0 and prompts:
        trainer.add_callback(SampleCallback(trainer, schedule, prompts, ctx.output_dir, args.sample_max_new_tokens,
                                            generate=answer_composed_prompts))
    tokens = ", ".join(f"{m}: {s.tokens} tokens/item" for m, s in built[1].items())
    steps.announce(ctx, schedule, trainable, total, f"modalities: {tokens}", *parts.describe(sizes),
                   weights=describe_weights(model, ctx.profile))

    # Train: one train() call for all stages.
    result = steps.train(trainer, resume)

    # Save: one folder (config + safetensors; the LLM's LoRA adapter alone beside them); summary.json.
    final_dir = save_composed(trainer, ctx.output_dir / "final", tokenizer) if args.save_final_model else None
    history = trainer.state.log_history
    before, after = eval_means(history, list(eval_sets))
    summary = write_summary(ctx, {
        **steps.summary_fields(model_args, trainable, total, schedule, result, history, resume, final_dir,
                               before, after, stage_table(schedule, history)),
        "model_path": resolve_model_path(model_args.model_name_or_path),
        "modalities": {m: {"tokens": s.tokens, "input_shape": list(s.input_shape)} for m, s in built[1].items()},
        "parts": {name: {p: f for p, f in factors.items()} for name, factors in zip(parts.names, parts.factors)},
        **(exact := exact_match_summary(history)),
    }, history)
    say(f"[hf_zero] done: {steps.loss_words(before, after, len(eval_sets))}"
        + steps.exact_match_words(exact.get("exact_match_before"), exact.get("exact_match_after"),
                                  exact.get("exact_match_prompts"))
        + (f"model in {final_dir}" if final_dir else "no model written (save_final_model: false)")
        + f", summary in {summary}")


if __name__ == "__main__":
    sys.exit(main())
