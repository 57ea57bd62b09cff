"""Recipe arguments: the dataclasses a recipe YAML and its flags fill (read by plan/parse.py), documented field by
field, in one module above core (core/ loads no transformers).

As in TRL (`SFTConfig`), a recipe's own arguments extend `TrainingArguments` (`CurriculumArguments`,
`ClassificationArguments` for the classifier, `MultimodalArguments`), each through `RecipeArguments`, which declares
once the keys every recipe has (the global batch, resuming); the model's are a separate class (`ModelArguments`,
TRL's `ModelConfig` names). `--config recipe.yaml` sets defaults, command-line flags override them, and an unknown
key in either is a one-line error naming the key (with the closest known key). The YAML's `stages:` list is the one
nested value, read into `hf_zero.core.config.Stage` objects with the same strictness. The TrainingArguments subclass
is built once, in each rank, after the run plan has settled precision, accumulation and the DeepSpeed config
(train/run.py): its `__post_init__` hands that config to DeepSpeed (arming zero.Init), so it must not be built
before.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hf_zero.integrations.lean_import import import_training_args

import_training_args()  # every process that parses a recipe; peft only where a LoRA model is built

from transformers import TrainingArguments  # noqa: E402

from hf_zero.core.errors import UserError  # noqa: E402

__all__ = ["ModelArguments", "RecipeArguments", "CurriculumArguments", "ClassificationArguments",
           "MultimodalArguments", "items_per_row_field", "check_items_per_row"]


@dataclass
class ModelArguments:
    """Model and LoRA. LoRA fields use TRL's names so recipes move between TRL and hf_zero unchanged."""

    model_name_or_path: str = field(
        default="tiny-llama",
        metadata={"help": "Local folder, hub id (online, or in the Hugging Face cache) or offline name: tiny-llama "
                          "(hf-zero/tiny-llama), smollm2-135m-instruct (HuggingFaceTB/SmolLM2-135M-Instruct), "
                          "minilm."},
    )
    tokenizer_name_or_path: str | None = field(default=None, metadata={"help": "Tokenizer if not the model's own."})
    attn_implementation: str | None = field(
        default=None,
        metadata={"help": "eager, sdpa or flash_attention_2 (GPU only); default: the model's choice, or "
                          "flash_attention_2 with packing on a GPU in bf16/fp16 when flash-attn is installed."},
    )
    use_peft: bool = field(
        default=False, metadata={"help": "Train LoRA adapters instead of all weights; in bf16/fp16 the frozen base is "
                                         "held in 16 bits, the adapters in fp32."}
    )
    lora_r: int = field(default=16, metadata={"help": "LoRA rank; higher = more trainable parameters and memory."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA scaling numerator (scale = alpha / r)."})
    lora_dropout: float = field(default=0.05,
                                metadata={"help": "Dropout on the LoRA input; 0 for exact parity tests."})
    lora_target_modules: list[str] | None = field(
        default=None, metadata={"help": "Module names to adapt (e.g. q_proj v_proj); default: peft's for the model."}
    )
    load_in_4bit: bool = field(
        default=False,
        metadata={"help": "QLoRA: hold the frozen base in 4 bits (bitsandbytes NF4, double quantization, computing "
                          "in the profile's precision); needs use_peft; any profile but zero3_nvme."},
    )


@dataclass
class RecipeArguments(TrainingArguments):
    """The keys every recipe has beside TrainingArguments' own: the global batch and how a run resumes."""

    global_batch_size: int | None = field(
        default=None,
        metadata={"help": "Fix the global batch: gradient accumulation = global / (micro batch x world size)."},
    )
    fresh_start: bool = field(
        default=False, metadata={"help": "Ignore checkpoints in output_dir and start from step 0."}
    )
    allow_changes: list[str] | None = field(
        default=None,
        metadata={"help": "Settings a resume may change (comma- or space-separated, e.g. learning_rate,seed,stages): "
                          "the new values apply from the checkpoint's step. Without it any difference is refused."},
    )

    @staticmethod
    def clean_values(values: dict) -> None:
        """A recipe's own checks and normalizations, run as soon as the YAML and flags are read (parse_recipe_args),
        so `hf-zero check` reports them too, and again when the arguments are built."""

    def __post_init__(self):
        self.clean_values(vars(self))
        super().__post_init__()


@dataclass
class CurriculumArguments(RecipeArguments):
    """The curriculum recipe's arguments: every TrainingArguments field, the keys every recipe has (RecipeArguments),
    then the data shared by all stages (the stages themselves come from the YAML's `stages:` list)."""

    max_seq_length: int = field(default=128, metadata={"help": "Tokens per sample unless a stage sets its own."})
    text_field: str = field(default="text", metadata={"help": "Column holding the text in every data file."})
    dataset_format: str = field(
        default="auto",
        metadata={"help": "auto (from the columns), text, prompt_completion or conversational (TRL's formats)."},
    )
    prompt_field: str = field(default="prompt", metadata={"help": "Column holding the prompt (string or messages)."})
    completion_field: str = field(
        default="completion", metadata={"help": "Column holding the completion (string or messages)."}
    )
    messages_field: str = field(
        default="messages", metadata={"help": "Column holding a conversation: a list of {role, content} messages."}
    )
    assistant_only_loss: bool = field(
        default=True, metadata={"help": "Conversations: loss on the assistant replies only (false: every token)."}
    )
    completion_only_loss: bool = field(
        default=True, metadata={"help": "Prompt/completion data: loss on the completion only (false: every token)."}
    )
    chat_template: str | None = field(
        default=None,
        metadata={"help": "A .jinja file, `chatml`, or a model whose template to use; default: the tokenizer's own, "
                          "else ChatML. Saved with the model or adapter."},
    )
    sample_prompts: int = field(
        default=4,
        metadata={"help": "Held-out prompts answered (greedy) at the start and at each stage end, logged to "
                          "samples.jsonl and TensorBoard with exact match (0: none)."},
    )
    sample_max_new_tokens: int = field(default=32, metadata={"help": "Longest generated answer, in tokens."})
    eval_samples: int = field(
        default=32, metadata={"help": "Samples held out per stage for per-stage eval loss/perplexity (0: none)."}
    )
    packing: bool = field(
        default=False,
        metadata={"help": "Pack each stage's documents whole into rows of max_seq_length tokens (less padding); "
                          "document boundaries are kept (positions restart, no attention or loss across them)."},
    )
    save_final_model: bool = field(
        default=True,
        metadata={"help": "Write the trained model (or LoRA adapter) to output_dir/final and verify it; false for "
                          "benchmarks and sweeps that only need the logs."},
    )
    measure_memory: bool = field(
        default=False,
        metadata={"help": "Write the parameter/gradient/optimizer bytes each rank holds at step 1 to "
                          "output_dir/memory_rank{R}.json and the activation bytes saved for backward per step to "
                          "output_dir/activations_rank{R}.json (also HF_ZERO_MEASURE_MEMORY=1)."},
    )
    fused_cross_entropy: str | bool = field(
        default="auto",
        metadata={"help": "Training loss without the full logits (chunks of tokens; Liger's kernel on CUDA when "
                          "installed): auto = on for models where it is exact, true = on or an error, false = off."},
    )
    use_liger_kernel: str | bool = field(
        default="auto",
        metadata={"help": "Liger's Triton RMSNorm, SwiGLU and RoPE kernels (the Trainer's switch): auto = on with a "
                          "CUDA GPU, liger-kernel installed and a model type Liger patches (measured 1.31x tokens/s "
                          "on an H100, hf_zero/plan/liger.py), true = on (CPU: off with one line), false = off."},
    )

    @staticmethod
    def clean_values(values: dict) -> None:
        """Checked and normalized as soon as the YAML and flags are read (parse_recipe_args), so `hf-zero check`
        reports it too: a YAML gives a bool or "auto", a flag a string."""
        for key in _AUTO_KEYS:
            value = values.get(key, "auto")
            mode = {"true": True, "false": False, "auto": "auto"}.get(value.lower()) if isinstance(value, str) \
                else value
            if mode not in ("auto", True, False):
                raise UserError(key, f"{value!r} is not auto, true or false", f"e.g. {key}: auto")
            values[key] = mode
        # A negative count would slice the held-out prompts from the end (sample_prompts: -1 = all but one)
        for key, least, example in (("sample_prompts", 0, "4 (0: none)"), ("sample_max_new_tokens", 1, "32")):
            value = values.get(key)
            try:
                count = int(value) if value is not None and not isinstance(value, bool) else None
            except (TypeError, ValueError):  # not a number: the argument parser's own message says so
                continue
            if count is not None and count < least:
                raise UserError(key, f"must be {least} or more, got {value}", f"e.g. {key}: {example}")

    def __post_init__(self):
        values = {key: getattr(self, key) for key in _AUTO_KEYS}
        self.clean_values(values)
        # the run's resolver (plan.reconcile) turns `auto` into a bool before the Trainer sees it; arguments built
        # without it run without Liger rather than pass the Trainer a truthy "auto"
        values["use_liger_kernel"] = values["use_liger_kernel"] is True
        for key, value in values.items():
            setattr(self, key, value)
        super().__post_init__()


_AUTO_KEYS = ("fused_cross_entropy", "use_liger_kernel")  # auto, true or false, from YAML bools or flag strings


@dataclass
class ClassificationArguments(RecipeArguments):
    """recipes/classify.py's arguments: every TrainingArguments field, the keys every recipe has, then the data (the
    stages come from the YAML's `stages:` list, e.g. data: builtin:bbc/train)."""

    max_seq_length: int = field(
        default=128, metadata={"help": "Tokens per text sample unless a stage sets its own; evaluation uses this."})
    text_field: str = field(default="text", metadata={"help": "Column holding the text in local data files."})
    label_field: str = field(default="label",
                             metadata={"help": "Column holding the label (int or name) in local files."})
    eval_data: str | None = field(
        default=None, metadata={"help": "Held-out data evaluated at each stage end; default: the validation split of "
                                        "the first stage's built-in data "
                                        "(builtin:bbc/train -> builtin:bbc/validation)."})
    validation_fraction: float = field(
        default=0.2, metadata={"help": "Share of a built-in data set held out as its validation split."})
    split_seed: int = field(
        default=0, metadata={"help": "Seed of the built-in train/validation split; apart from --seed, so the held-out "
                                     "set stays the same when the training seed changes."})
    max_eval_samples: int | None = field(
        default=None, metadata={"help": "Evaluate on at most this many held-out samples (quick runs); default: all."})
    augment: bool = field(
        default=True,
        metadata={"help": "Random rotation/shift/scale of training images (never of evaluation images)."})

    @staticmethod
    def clean_values(values: dict) -> None:
        """Checked as soon as the YAML and flags are read (parse_recipe_args), so `hf-zero check` reports it too."""
        fraction, seq = values.get("validation_fraction", 0.2), values.get("max_seq_length", 128)
        if not 0 < fraction < 1:
            raise UserError("validation_fraction", f"must be between 0 and 1, got {fraction}", "e.g. 0.2")
        if seq < 8:
            raise UserError("max_seq_length", f"{seq} tokens is too short to classify", "e.g. 128")
        if values.get("max_eval_samples") is not None and values["max_eval_samples"] < 1:
            raise UserError("max_eval_samples", "must be positive", "remove it to evaluate on the whole split")


def items_per_row_field():
    """`items_per_row`, a key of both multimodal recipes (recipes/multimodal.py's and recipes/vlm.py's)."""
    return field(
        default=1,
        metadata={"help": "The most items of one modality (images, point clouds, ...) a row holds: the estimate "
                          "counts this many of each per row, each at the size bound, for the encoders' activations; "
                          "`hf-zero check` warns when a row holds more."},
    )


def check_items_per_row(values: dict) -> None:
    n = values.get("items_per_row", 1)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise UserError("items_per_row", f"{n!r} is not a positive whole number",
                        "e.g. items_per_row: 2 for rows of up to two images")


@dataclass
class MultimodalArguments(CurriculumArguments):
    """The curriculum recipe's arguments and `encoders:`, one entry per modality (docs/multimodal.md)."""

    items_per_row: int = items_per_row_field()

    encoders: dict | None = field(
        default=None,
        metadata={"help": "One encoder per modality, keyed by the item type the rows use (image, points, ...): "
                          "{class: package.module:Class, kwargs: {...}, input_shape: [...]} or {hf_config: "
                          "{model_type: vit, ...}}, each with an optional projector: {type: mlp|linear, hidden: N}."},
    )

    @staticmethod
    def clean_values(values: dict) -> None:
        CurriculumArguments.clean_values(values)
        check_items_per_row(values)
