"""Classifier models for recipes/classify.py: an encoder with a sequence-classification head (text) or an image
classifier, from pretrained weights or built fresh from a transformers config, optionally with LoRA.

A model folder holding a config.json but no weights (e.g. recipes/models/digits_resnet, a small ResNet) is built
from its config with fresh weights seeded by --seed. Under ZeRO-3 both paths construct the model inside
`deepspeed.zero.Init` (transformers does it when TrainingArguments carries a stage-3 config), so no rank ever
holds the whole model.
"""

from __future__ import annotations

from pathlib import Path

from transformers import TrainerCallback

from hf_zero.core.distributed import waiting_for
from hf_zero.core.errors import UserError
from hf_zero.data.model_names import get_tokenizer, resolve_model_path
from hf_zero.integrations.torch import batch_norm_base
from hf_zero.integrations.transformers import model_mapping, set_attn_implementation
from hf_zero.plan.arguments import ModelArguments
from hf_zero.train.model import apply_lora, base_dtype, trainable_in_fp32
from hf_zero.train.trainer import stage_table

__all__ = ["build_processor", "build_classifier", "has_weights", "classification_stage_table", "sync_norm_stats",
           "SyncNormStatsCallback"]

_WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt", "*.pth")


def has_weights(path: str) -> bool:
    """False for a local folder with only a config (build from config); hub ids are assumed to carry weights."""
    folder = Path(path)
    return not folder.is_dir() or any(any(folder.glob(p)) for p in _WEIGHT_FILES)


def build_processor(model_args: ModelArguments, kind: str):
    """The tokenizer (text) or image processor (images) that belongs to the model."""
    if kind == "text":
        try:
            return get_tokenizer(model_args.model_name_or_path, model_args.tokenizer_name_or_path)
        except (OSError, ValueError) as err:
            raise UserError("tokenizer_name_or_path", f"no tokenizer for {model_args.model_name_or_path} "
                            f"({str(err).splitlines()[0][:100]})", "point it at a folder with a tokenizer") from None
    from transformers import AutoImageProcessor

    path = resolve_model_path(model_args.model_name_or_path)
    try:
        return AutoImageProcessor.from_pretrained(path)
    except (OSError, ValueError) as err:
        raise UserError("model_name_or_path", f"{path} has no usable preprocessor_config.json "
                        f"({str(err).splitlines()[0][:100]})",
                        "add the image processor's config to the folder") from None


def build_classifier(model_args: ModelArguments, kind: str, label_names: list[str], seed: int, profile=None):
    """A classifier with `len(label_names)` outputs in fp32 (DeepSpeed casts to the profile's precision itself); a
    LoRA text classifier under the run's `profile` (the plan's) with its frozen base in 16 bits, as
    hf_zero.train.model.base_precision says. Image models stay fp32: their BatchNorm running statistics are fp32
    buffers, and a 16-bit frozen BatchNorm weight beside them fails under autocast ("expected scalar type BFloat16
    but found Float").

    TrainingArguments must already exist so that ZeRO-3 construction runs under zero.Init (no rank holds the
    whole model)."""
    import torch
    from transformers import AutoConfig, AutoModelForImageClassification, AutoModelForSequenceClassification

    if model_args.load_in_4bit:
        raise UserError("load_in_4bit", "the classifier recipe has no 4-bit base (QLoRA is the causal-LM recipe's)",
                        "drop load_in_4bit")
    path = resolve_model_path(model_args.model_name_or_path)
    dtype = base_dtype(model_args.use_peft, profile) if profile is not None and kind == "text" else torch.float32
    auto = AutoModelForImageClassification if kind == "image" else AutoModelForSequenceClassification
    labels = {"num_labels": len(label_names), "id2label": dict(enumerate(label_names)),
              "label2id": {n: i for i, n in enumerate(label_names)}}
    config = AutoConfig.from_pretrained(path, **labels)
    if type(config) not in model_mapping(auto):
        raise UserError("model_name_or_path", f"a {config.model_type} model has no {kind}-classification head",
                        "use e.g. minilm for text or recipes/models/digits_resnet for images")
    if model_args.attn_implementation:
        set_attn_implementation(config, model_args.attn_implementation)
    with waiting_for("the other ranks to build the model (zero.Init under ZeRO-3)"):
        if has_weights(path):
            # The head is new (its size is the number of labels), hence ignore_mismatched_sizes for pretrained heads.
            model = auto.from_pretrained(path, config=config, dtype=dtype, ignore_mismatched_sizes=True)
        else:
            torch.manual_seed(seed)
            model = auto.from_config(config, dtype=dtype)
    # These heads take **kwargs but average their loss over the local batch, ignoring num_items_in_batch; the
    # Trainer would still multiply the loss by the world size (average_tokens_across_devices), doubling loss and
    # gradients on 2 ranks. Saying so makes it keep the plain per-rank mean, which DeepSpeed averages over ranks.
    model.accepts_loss_kwargs = False
    if model_args.use_peft:
        head = [n for n in ("classifier", "score") if hasattr(model, n)]
        if kind == "image" and not model_args.lora_target_modules:
            raise UserError("lora_target_modules", f"peft has no default LoRA targets for {config.model_type}",
                            "name the layers, e.g. lora_target_modules: [convolution]")
        # SEQ_CLS wraps the forward in input_ids/attention_mask; image models keep peft's generic forward.
        model = apply_lora(model, model_args, task_type="SEQ_CLS" if kind == "text" else None, modules_to_save=head)
        trainable_in_fp32(model)  # the head's trainable copy (modules_to_save) beside a 16-bit base
    return model


def classification_stage_table(schedule, log_history: list[dict]) -> list[dict]:
    """The curriculum's per-stage table plus the evaluation run at each stage's end (loss, accuracy, macro-F1)."""
    rows = stage_table(schedule, log_history)
    for row in rows:
        ev = next((h for h in log_history if h.get("step") == row["last_step"] and "eval_accuracy" in h), {})
        row["eval_loss"] = ev.get("eval_loss")
        row["eval_accuracy"] = ev.get("eval_accuracy")
        row["eval_f1_macro"] = ev.get("eval_f1_macro")
    return rows


def sync_norm_stats(model) -> int:
    """Average BatchNorm running mean/variance over the ranks (timm's `distribute_bn`); returns the tensors synced.

    DDP broadcasts rank 0's buffers at every forward, DeepSpeed never does: each rank's running statistics follow
    its own batches, so ranks would evaluate different models and the saved one (rank 0's) would match neither
    the evaluation nor the other ranks. A collective: every rank must call it."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return 0
    buffers = [b for m in model.modules() if isinstance(m, batch_norm_base())
               for b in (m.running_mean, m.running_var) if b is not None]
    if not buffers:
        return 0
    flat = torch.cat([b.detach().float().flatten() for b in buffers])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    offset = 0
    for b in buffers:
        b.copy_(flat[offset: offset + b.numel()].view_as(b))
        offset += b.numel()
    return len(buffers)


class SyncNormStatsCallback(TrainerCallback):
    """Runs `sync_norm_stats` before every evaluation, checkpoint and the final save. Add it after the callbacks
    that request evaluations (the curriculum's), so that it sees their request at the same step."""

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if model is not None and (control.should_evaluate or control.should_save
                                  or state.global_step >= state.max_steps):
            sync_norm_stats(model)
