"""A recipe's memory as it will run (the launch that fits a GPU is hf_zero.estimate.pick).

As it will run: the longest stage's `max_seq_length` (each stage's own, else the recipe's, else hf_zero's default)
sets the peak; micro-batch, accumulation, global batch, LoRA, gradient checkpointing, packing and attention come from
the recipe, else from the defaults of hf_zero's argument dataclasses and TrainingArguments; and the sequence-parallel
sizes the recipe can run with, and each stage's peak at those sizes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from hf_zero.core.errors import UserError
from hf_zero.data.model_names import get_model_config
from hf_zero.data.stages import check_stage_files
from hf_zero.estimate.memory import estimate
from hf_zero.estimate.model_count import ModelCount
from hf_zero.plan.parse import parse_recipe_args
from hf_zero.plan.reconcile import resolve_batch
from hf_zero.plan.sequence_parallel import verify_sequence_parallel
from hf_zero.plan.shipped import load_recipe, recipe_argument_types, recipe_script

__all__ = ["RecipeMemory", "CountedParts", "read_recipe", "lora_fields", "sp_sizes", "sp_by_stage"]

@dataclass(frozen=True)
class RecipeMemory:
    """What the memory of a run depends on, read from a recipe YAML (+ command-line overrides)."""

    model: str
    micro: int
    accumulation: int
    seq_len: int
    lora: dict | None = None
    global_batch: int | None = None
    stage: str | None = None  # the stage whose length sets the peak
    packing: bool = False
    gradient_checkpointing: bool = False
    attn_implementation: str | None = None
    path: str | None = None
    flags: tuple = field(default=(), compare=False)  # overrides a train command must repeat
    load_in_4bit: bool = False  # QLoRA: the frozen base in 4 bits
    stages: tuple = ()  # (name, max_seq_length) of each stage, in order
    stage_sequences: tuple = ()  # sequences per row of each stage, in order: 2 for a dpo stage (chosen + rejected)
    fused_cross_entropy: object = "auto"  # the recipe's: auto, True or False (the loss without full logits)
    use_liger_kernel: object = "auto"  # the recipe's: auto, True or False (Liger's norm and SwiGLU kernels)
    sequences_per_row: int = 1  # 2 when the stage setting the peak is a dpo stage: its chosen + rejected sequences
    preference: tuple = ()  # per dpo stage: (name, loss_type, rows of its reference; None: reference-free or unread)
    # A model with parts besides its language model (a multimodal recipe's encoders and projectors, a stock VLM's
    # vision tower), counted by the layer that builds it (hf_zero.train.recipe_count): None for a text model,
    # counted here from its config alone. The recommendation and the automatic profile size this, not the LLM.
    parts: CountedParts | None = field(default=None, compare=False)


@dataclass(frozen=True)
class CountedParts:
    """A model counted part by part on the meta device (hf_zero.train.recipe_count), as the estimate sizes it."""

    count: ModelCount  # every part's parameters, what trains in some stage, one optimizer group per part
    activation_bytes: Callable[[str], int]  # at a precision: what the encoders or vision tower keep per row
    label: str = ""  # what the estimate adds to the model's name (" + encoders points, image")
    trains: tuple = ()  # the parts that train in some stage, which hold gradients and optimizer state
    # What the final folder holds, in parameters, where it is not the usual (the adapter under LoRA, else the whole
    # model): a composed model saves itself whole and its LLM's adapter beside it (hf_zero.train.composed_export)
    final_params: int | None = None


def lora_fields(model_args) -> dict | None:
    """The LoraConfig fields hf_zero.train.model builds for a causal LM, from ModelArguments (None without LoRA)."""
    if not model_args.use_peft:
        return None
    return {"r": model_args.lora_r, "lora_alpha": model_args.lora_alpha, "lora_dropout": model_args.lora_dropout,
            "target_modules": model_args.lora_target_modules, "task_type": "CAUSAL_LM"}


def read_recipe(path: str, overrides: list[str] | tuple = ()) -> RecipeMemory:
    """The recipe YAML as it will run, parsed as its recipe parses it (`parse_recipe_args`, its own argument
    classes); `overrides`: `--key value` flags given to `hf-zero train` after the recipe."""
    types = recipe_argument_types(load_recipe(str(recipe_script(None, path))))
    model_args, *_, stages, training, _ = parse_recipe_args(types, ["--config", path, *overrides])
    seq = training["max_seq_length"]
    # the peak's stage: the most tokens a row puts through the model (a dpo row: its chosen and rejected sequences)
    longest = max(stages, key=lambda s: (s.max_seq_length or seq) * _sequences(s), default=None)
    micro, accum = training["per_device_train_batch_size"], training["gradient_accumulation_steps"]
    if training.get("global_batch_size"):  # one rank's share must divide it, as on any number of ranks
        resolve_batch(training, 1)
    flags, rest = [], list(overrides)  # as given, for the `hf-zero train` line a recommendation prints
    while rest:
        key, _, value = rest.pop(0).removeprefix("--").partition("=")
        value = value or (rest.pop(0) if rest and not rest[0].startswith("--") else "true")
        flags.append((key, value))
    return RecipeMemory(
        model=model_args.model_name_or_path, micro=micro, accumulation=accum,
        global_batch=training.get("global_batch_size"),
        seq_len=longest.max_seq_length if longest and longest.max_seq_length else seq,
        stage=longest.name if longest else None, lora=lora_fields(model_args), packing=bool(training.get("packing")),
        gradient_checkpointing=bool(training.get("gradient_checkpointing")),
        attn_implementation=model_args.attn_implementation, path=path, flags=tuple(flags),
        load_in_4bit=bool(model_args.load_in_4bit and model_args.use_peft),
        stages=tuple((s.name, s.max_seq_length or seq) for s in stages),
        stage_sequences=tuple(_sequences(s) for s in stages),
        fused_cross_entropy=training.get("fused_cross_entropy", "auto"),
        use_liger_kernel=training.get("use_liger_kernel", "auto"),
        sequences_per_row=_sequences(longest) if longest else 1,
        preference=tuple((s.name, s.loss_type, None if s.loss_type == "simpo" else _reference_rows(s, training))
                         for s in stages if s.objective == "dpo"))


def _sequences(stage) -> int:
    return 2 if stage.objective == "dpo" else 1


def _reference_rows(stage, training: dict) -> int | None:
    """The rows a dpo stage's reference cache holds: its data's rows (the held-out pairs drawn from them) and at
    most eval_samples of its eval_data; None when its files cannot be read here."""
    try:
        rows = sum(check_stage_files(stage, 0, light=True))
    except UserError:
        return None
    return rows + (training.get("eval_samples", 0) if stage.eval_data else 0)


def sp_sizes(recipe: RecipeMemory, world: int) -> list[int]:
    """The Ulysses sizes this recipe can run with on `world` ranks, smallest first: those hf-zero check passes (each
    divides the world, the attention heads and every stage's length; sdpa or flash attention; no packing on sdpa)."""
    config = get_model_config(recipe.model) if isinstance(recipe.model, str) else recipe.model
    lengths = [("max_seq_length", recipe.seq_len), *((f"stages[{n}].max_seq_length", s) for n, s in recipe.stages)]
    sizes = []
    for sp in range(2, world + 1):
        try:
            verify_sequence_parallel(sp, world, config, lengths, recipe.attn_implementation, recipe.packing)
        except UserError:
            continue
        sizes.append(sp)
    return sizes


def sp_by_stage(recipe: RecipeMemory, count, sizes: list[int], usable: int | None, **estimate_kw) -> list[dict]:
    """Per stage: the ZeRO-3 peak per GPU without sequence parallelism and at each size, and the smallest size
    that fits `usable` bytes (0: it fits without; None: none does, or no GPU memory was given). ZeRO-3 because
    the sequence-parallel profile (zero3_sp) is ZeRO-3: the model states stay sharded over every rank."""
    rows = []
    stages = recipe.stages or ((recipe.stage, recipe.seq_len),)
    sequences = recipe.stage_sequences or (recipe.sequences_per_row,) * len(stages)
    for (name, seq), per_row in zip(stages, sequences):  # a dpo stage's row: its chosen and rejected sequences
        peaks = {sp: estimate(count, "zero3", **{**estimate_kw, "seq_len": seq, "sp_size": sp,
                                                  "sequences_per_row": per_row})["gpu_bytes_per_rank"]["total"]
                 for sp in (1, *sizes)}
        fits = None if usable is None else next((sp for sp, b in peaks.items() if b <= usable), None)
        rows.append({"stage": name, "seq_len": seq, "sequences_per_row": per_row, "peak_bytes": peaks,
                     "fits_at_sp": None if fits is None else (0 if fits == 1 else fits)})
    return rows
