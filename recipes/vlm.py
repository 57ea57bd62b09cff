"""A stock vision-language model (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Idefics3/SmolVLM, LLaVA) fine-tuned on chat rows
with images, stage by stage, each stage saying which parts train (`train: [projector, lora]`: hf_zero.train.vlm).

    hf-zero train --model hf-zero/tiny-qwen2-vl --data rows.jsonl
    python recipes/vlm.py --config recipes/configs/tiny_vlm.yaml

Rows are chat conversations in TRL's multimodal form, read, checked and tokenized by hf_zero.data.multimodal (the
composed-model recipe's data path) with the model's own image token and processor (hf_zero.data.vlm); the loss is on
the assistant replies. docs/vlm.md says what works and what is not built yet.
"""

import sys

from hf_zero.launch.worker import recipe_entry
from hf_zero.plan.arguments import ModelArguments
from hf_zero.plan.vlm_args import VlmArguments
from hf_zero.train.recipe_count import count_parts
from hf_zero.train.vlm_check import check_vlm

# What the tools know of this recipe (`hf-zero check`): its argument classes and its data check (every image opened;
# per stage, what trains; per part, what each LoRA target matched) and how to count the model whole.
ARGUMENT_TYPES = (ModelArguments, VlmArguments)
CHECK_DATA = check_vlm
COUNT_PARTS = count_parts


@recipe_entry  # one line for a mistake, a clean stop on Ctrl-C, rank 0's console only
def main(argv=None):
    from hf_zero.core.console import say
    from hf_zero.data.chat_template import prepare_chat_template
    from hf_zero.data.curriculum import CurriculumDataset
    from hf_zero.data.model_names import get_tokenizer, resolve_model_path
    from hf_zero.data.multimodal import add_placeholders
    from hf_zero.data.vlm import VlmCollator, VlmProcessing
    from hf_zero.train import recipe_steps as steps
    from hf_zero.train.model import count_parameters, describe_weights
    from hf_zero.train.parts import PartsTrainer
    from hf_zero.train.run import setup_run, write_summary
    from hf_zero.train.trainer import eval_means, stage_table
    from hf_zero.train.vlm import build_vlm, plan_vlm_parts, rope_index_of
    from hf_zero.train.vlm_check import save_vlm

    # Parse: YAML + flags, reconciled with the profile before any engine exists; the checkpoint to resume from.
    ctx = setup_run(ARGUMENT_TYPES, argv, script=__file__)
    (model_args,), args = ctx.args, ctx.training_args
    resume = steps.start(ctx, args.fresh_start, "- {name: images, data: rows.jsonl, epochs: 1}")

    # Processing: the model's tokenizer and image processor; each image becomes the run its processor writes.
    tokenizer = get_tokenizer(model_args.model_name_or_path, model_args.tokenizer_name_or_path)
    prepare_chat_template(tokenizer, args.chat_template)
    processing = VlmProcessing(resolve_model_path(model_args.model_name_or_path), tokenizer, args.image_max_pixels)
    specs = processing.spec()
    placeholders = add_placeholders(tokenizer, specs)  # the image token is the model's own: nothing is added

    # Data: hf_zero's multimodal rows, every image opened and sized by the processor before anything trains.
    stage_data, eval_sets, schedule, order = steps.lay_out_multimodal(ctx, tokenizer, specs, placeholders)
    args = ctx.training_args

    # Model: per stage, what trains; the parts a stage trains get their weights (or their adapters) trainable.
    family = processing.family
    parts = plan_vlm_parts(ctx.stages, family, model_args.use_peft, args.learning_rate)
    model, _ = build_vlm(model_args, processing, ctx.profile, parts)
    sizes = {p: sum(getattr(t, "ds_numel", t.numel()) for _, t in ps) for p, ps in parts.parts_of(model).items()}
    trainable, total = count_parameters(model)

    trainer = PartsTrainer(
        model=model, args=args, train_dataset=CurriculumDataset([d.sources for d in stage_data], order),
        eval_dataset=eval_sets or None, processing_class=tokenizer, schedule=schedule, plan=ctx.plan,
        settings=ctx.settings, data_collator=VlmCollator(processing, rope_index_of(model)), fused_cross_entropy=False,
        parts=parts,
    )
    steps.attach_probes(trainer, ctx, args.measure_memory)
    steps.announce(ctx, schedule, trainable, total, f"model: {family.name}, image token {family.image_token}",
                   *parts.describe(sizes), weights=describe_weights(model, ctx.profile))

    # Train: one train() call for all stages.
    result = steps.train(trainer, resume)

    # Save: the adapter (with the parts trained in full) or the model, with the tokenizer and image processor.
    final_dir = save_vlm(trainer, ctx.output_dir / "final", processing) if args.save_final_model else None
    history = trainer.state.log_history
    before, after = eval_means(history, list(eval_sets))
    summary = write_summary(ctx, {
        **steps.summary_fields(model_args, trainable, total, schedule, result, history, resume, final_dir,
                               before, after, stage_table(schedule, history)),
        "model_path": resolve_model_path(model_args.model_name_or_path),
        "vlm_family": family.name,
        "parts": {name: dict(factors) for name, factors in zip(parts.names, parts.factors)},
    }, history)
    say(f"[hf_zero] done: {steps.loss_words(before, after, len(eval_sets))}"
        + (f"model in {final_dir}" if final_dir else "no model written (save_final_model: false)")
        + f", summary in {summary}")


if __name__ == "__main__":
    sys.exit(main())
