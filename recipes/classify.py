"""Fine-tune a classifier (text or images, full or LoRA) in curriculum stages, one recipe for every profile.

    accelerate launch --config_file accelerate_configs/zero2.yaml recipes/classify.py \
        --config recipes/configs/minilm_bbc.yaml

or `hf-zero train --profile zero2 --recipe recipes/classify.py --config recipes/configs/digits_cnn.yaml`.
Evaluates accuracy and macro-F1 (hf_zero's offline `evaluate` modules) on the held-out split at every stage end;
the results go to TensorBoard, log_history.json and summary.json.
"""

import math
import sys

from hf_zero.data.classification import ClassificationArguments, check_classification_data
from hf_zero.core.config import ModelArguments
from hf_zero.launch.worker import recipe_entry

# What the tools know of this recipe (`hf-zero check`): the argument classes its YAMLs set (TrainingArguments comes on
# top) and how to check their data.
ARGUMENT_TYPES = (ModelArguments, ClassificationArguments)
CHECK_DATA = check_classification_data


@recipe_entry  # one line for a mistake, a clean stop on Ctrl-C, rank 0's console only
def main(argv=None):
    # Parse: YAML + flags, reconciled with the profile before any engine exists.
    from hf_zero.train.run import setup_run

    ctx = setup_run(ARGUMENT_TYPES, argv, script=__file__)
    model_args, data_args = ctx.args
    args = ctx.training_args

    from transformers import DataCollatorWithPadding, default_data_collator, set_seed

    from hf_zero.data.classification import get_data_kind, load_classification_data
    from hf_zero.train.classifier import SyncNormStatsCallback, build_classifier, build_processor, classification_stage_table
    from hf_zero.data.curriculum import CurriculumDataset, build_sample_order, build_schedule
    from hf_zero.core.errors import UserError
    from hf_zero.metrics import build_compute_metrics
    from hf_zero.train.model import count_parameters
    from hf_zero.train.run import main_process_print, print_banner, write_summary
    from hf_zero.checkpoint.final import save_final_model
    from hf_zero.train.trainer import CurriculumTrainer, step_losses

    set_seed(args.seed)
    if not ctx.stages:
        raise UserError("stages", "the recipe has no stages", "add a `stages:` list, e.g. data: builtin:bbc/train")
    # Resume: the newest complete checkpoint unless fresh_start, checked against this run before any engine exists.
    from hf_zero.checkpoint.resume import prepare_resume

    resume = prepare_resume(ctx, fresh_start=data_args.fresh_start)

    # Data: one label numbering for all sources, a seeded held-out split, one flat step-ordered training set.
    kind = get_data_kind(ctx.stages, data_args)
    processor = build_processor(model_args, kind)
    data = load_classification_data(ctx.stages, data_args, processor, kind, args.seed)
    schedule = build_schedule(ctx.stages, data.pool_sizes, ctx.plan.global_batch, args.learning_rate)
    order = build_sample_order(
        schedule, [[len(src) for src in stage] for stage in data.sources], [s.weights for s in ctx.stages], args.seed
    )
    args.max_steps = schedule.total_steps
    args.label_names = ["labels"]  # peft's wrapper hides the forward signature the Trainer reads them from

    # Model: pretrained encoder + new head, or built from a config; under ZeRO-3 with zero.Init.
    model = build_classifier(model_args, kind, data.label_names, args.seed)
    trainable, total = count_parameters(model)

    trainer = CurriculumTrainer(
        model=model,
        args=args,
        train_dataset=CurriculumDataset(data.sources, order),
        eval_dataset=data.eval_samples,
        data_collator=DataCollatorWithPadding(processor) if kind == "text" else default_data_collator,
        processing_class=processor,
        compute_metrics=build_compute_metrics(args),
        schedule=schedule,
    )
    trainer.add_callback(SyncNormStatsCallback())  # BatchNorm statistics are per rank under DeepSpeed
    print_banner(ctx, trainable, total)
    main_process_print(f"[hf_zero] {kind} classification, {len(data.label_names)} classes "
                       f"({', '.join(data.label_names)}); {sum(data.pool_sizes)} training samples over the stages, "
                       f"{len(data.eval_samples)} held out")
    main_process_print("[hf_zero] stages: " + " | ".join(
        f"{r['stage']}: steps {r['first_step']}-{r['last_step']} lr {r['lr']:g}" for r in schedule.table()))

    # Train: one train() call for all stages (from `resume` when there is one), evaluated at each stage end.
    result = trainer.train(resume_from_checkpoint=resume)
    from hf_zero.launch.interrupt import raise_if_interrupted

    raise_if_interrupted(trainer)

    # Save: HF-format model (adapter for LoRA) with its tokenizer/image processor, verified; summary.json.
    final_dir = save_final_model(trainer, ctx.output_dir / "final")
    history = trainer.state.log_history
    evals = [h for h in history if "eval_accuracy" in h]
    before = evals[0] if evals and evals[0].get("step") == 0 else None  # only with --eval_on_start true
    after = evals[-1] if evals else {}
    loss_before, loss_after = (before or {}).get("eval_loss"), after.get("eval_loss")
    write_summary(ctx, {
        "model": model_args.model_name_or_path,
        "use_peft": model_args.use_peft,
        "trainable_params": trainable,
        "total_params": total,
        "total_steps": schedule.total_steps,
        "train_loss": result.training_loss,
        "eval_loss_before": loss_before,
        "eval_loss_after": loss_after,
        "eval_perplexity_before": math.exp(loss_before) if loss_before is not None else None,
        "eval_perplexity_after": math.exp(loss_after) if loss_after is not None else None,
        "resumed_from": resume,
        "final_dir": str(final_dir),
        "stages": classification_stage_table(schedule, history),
        "losses": step_losses(history),
        "labels": data.label_names,
        "eval_samples": len(data.eval_samples),
        "eval_accuracy": after.get("eval_accuracy"),
        "eval_f1_macro": after.get("eval_f1_macro"),
    }, history)
    main_process_print(f"[hf_zero] done: eval accuracy {after.get('eval_accuracy')}, macro-F1 {after.get('eval_f1_macro')}"
                       f"; model in {final_dir}, summary in {ctx.output_dir / 'summary.json'}")


if __name__ == "__main__":
    sys.exit(main())
