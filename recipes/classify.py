"""Fine-tune a classifier (text or images, full or LoRA) in curriculum stages, one recipe for every profile.

    accelerate launch --config_file accelerate_configs/zero2.yaml recipes/classify.py \
        --config recipes/configs/minilm_bbc.yaml

or `hf-zero train --profile zero2 --config recipes/configs/digits_cnn.yaml` (the YAML names this recipe).
Evaluates accuracy and macro-F1 (hf_zero's offline `evaluate` modules) on the held-out split at every stage end;
the results go to TensorBoard, log_history.json and summary.json.
"""

import sys

from hf_zero.data.classification import check_classification_data
from hf_zero.launch.worker import recipe_entry
from hf_zero.plan.arguments import ClassificationArguments, ModelArguments

# What the tools know of this recipe (`hf-zero check`): the argument classes its YAMLs set (the last one extends
# TrainingArguments) and how to check their data.
ARGUMENT_TYPES = (ModelArguments, ClassificationArguments)
CHECK_DATA = check_classification_data


@recipe_entry  # one line for a mistake, a clean stop on Ctrl-C, rank 0's console only
def main(argv=None):
    from transformers import DataCollatorWithPadding, default_data_collator

    from hf_zero.checkpoint.final import save_final_model
    from hf_zero.core.console import say
    from hf_zero.data.classification import get_data_kind, load_classification_data
    from hf_zero.data.curriculum import CurriculumDataset
    from hf_zero.metrics import build_compute_metrics
    from hf_zero.train import recipe_steps as steps
    from hf_zero.train.classifier import (
        SyncNormStatsCallback,
        build_classifier,
        build_processor,
        classification_stage_table,
    )
    from hf_zero.train.model import count_parameters, describe_weights
    from hf_zero.train.run import setup_run, write_summary
    from hf_zero.train.trainer import CurriculumTrainer

    # Parse: YAML + flags, reconciled with the profile before any engine exists; the checkpoint to resume from.
    ctx = setup_run(ARGUMENT_TYPES, argv, script=__file__)
    (model_args,), args = ctx.args, ctx.training_args  # args: ClassificationArguments, a TrainingArguments
    resume = steps.start(ctx, args.fresh_start, "- {name: news, data: builtin:bbc/train, steps: 30}")

    # Data: one label numbering for all sources, a seeded held-out split, one flat step-ordered training set.
    kind = get_data_kind(ctx.stages, args)
    processor = build_processor(model_args, kind)
    data = load_classification_data(ctx.stages, args, processor, kind, args.seed)
    # label_names: peft's wrapper hides the forward signature the Trainer reads them from.
    schedule, order = steps.lay_out(ctx, data.pool_sizes, [[len(src) for src in stage] for stage in data.sources],
                                    has_eval=data.eval_samples is not None, label_names=["labels"])
    args = ctx.training_args  # final: with the schedule's steps

    # Model: pretrained encoder + new head, or built from a config; under ZeRO-3 with zero.Init.
    model = build_classifier(model_args, kind, data.label_names, args.seed, ctx.profile)
    trainable, total = count_parameters(model)

    # Trainer: the curriculum's schedule, accuracy and macro-F1 at each stage end.
    trainer = CurriculumTrainer(
        model=model, args=args, train_dataset=CurriculumDataset(data.sources, order),
        eval_dataset=data.eval_samples, processing_class=processor, schedule=schedule, plan=ctx.plan,
        data_collator=DataCollatorWithPadding(processor) if kind == "text" else default_data_collator,
        compute_metrics=build_compute_metrics(args), settings=ctx.settings,
    )
    trainer.add_callback(SyncNormStatsCallback())  # BatchNorm statistics are per rank under DeepSpeed
    steps.attach_probes(trainer, ctx)
    steps.announce(ctx, schedule, trainable, total,
                   f"{kind} classification, {len(data.label_names)} classes ({', '.join(data.label_names)}); "
                   f"{sum(data.pool_sizes)} training samples over the stages, {len(data.eval_samples)} held out",
                   weights=describe_weights(model, ctx.profile))

    # Train: one train() call for all stages, evaluated at each stage end.
    result = steps.train(trainer, resume)

    # Save: HF-format model (adapter for LoRA) with its tokenizer/image processor, verified; summary.json.
    final_dir = save_final_model(trainer, ctx.output_dir / "final")
    history = trainer.state.log_history
    evals = [h for h in history if "eval_accuracy" in h]
    before = evals[0] if evals and evals[0].get("step") == 0 else {}  # only with --eval_on_start true
    after = evals[-1] if evals else {}
    summary = write_summary(ctx, {
        **steps.summary_fields(model_args, trainable, total, schedule, result, history, resume, final_dir,
                               before.get("eval_loss"), after.get("eval_loss"),
                               classification_stage_table(schedule, history)),
        "labels": data.label_names,
        "eval_samples": len(data.eval_samples),
        "eval_accuracy": after.get("eval_accuracy"),
        "eval_f1_macro": after.get("eval_f1_macro"),
    }, history)
    say("\n".join([f"[hf_zero] done: eval accuracy {after.get('eval_accuracy')}, macro-F1 "
                   f"{after.get('eval_f1_macro')}; model in {final_dir}, summary in {summary}",
                   *steps.next_steps(ctx.output_dir, final_dir, model_args.use_peft, commands=False)]))


if __name__ == "__main__":
    sys.exit(main())
