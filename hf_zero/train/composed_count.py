"""A multimodal recipe's composed model counted without weights, for `hf-zero estimate` and `hf-zero check`: the LLM,
its LoRA, the embedding rows grown for the chat template's and the placeholders' tokens, every encoder and projector,
all built on the meta device exactly as recipes/multimodal.py builds them, and the stages' part plan on top (parts
that train in no stage frozen, as plan_parts freezes them in the run).

What the encoders keep for backward is counted on the same meta model: one forward of one item per modality under
autograd's saved-tensor hooks, the bytes of every tensor saved that is not a parameter (nothing runs, no memory is
taken). The estimate counts `items_per_row` items of every modality per row (default 1, the most a row of the
shipped data holds); `hf-zero check` warns when a row holds more.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from hf_zero.core.errors import UserError
from hf_zero.core.files import human_bytes
from hf_zero.data.chat import FormatOptions
from hf_zero.data.chat_template import added_template_tokens, prepare_chat_template, train_embeddings
from hf_zero.data.model_names import get_model_config, get_tokenizer
from hf_zero.data.multimodal import add_placeholders, load_multimodal_stage
from hf_zero.data.multimodal_check import check_multimodal_data
from hf_zero.estimate.model_count import ModelCount, count_model
from hf_zero.integrations.torch import saved_bytes
from hf_zero.plan.arguments import CurriculumArguments
from hf_zero.plan.parse import parse_recipe_args, recipe_fields
from hf_zero.plan.shipped import load_recipe, recipe_argument_types, recipe_script
from hf_zero.train.composed import ComposedModel, freeze_unread_embeddings
from hf_zero.train.composed_build import build_encoders, encode
from hf_zero.train.model import lora_kwargs
from hf_zero.train.parts import group_sizes, part_sizes, plan_parts

__all__ = ["ComposedCount", "count_composed", "model_count_of", "composed_on_meta", "item_activation_bytes",
           "stage_lines", "estimate_summary", "estimate_lines", "check_multimodal", "multimodal_data"]


@dataclass(frozen=True)
class ComposedCount:
    model: object  # the ComposedModel on the meta device, parts that train in no stage frozen
    specs: dict  # {modality: ModalitySpec}: input shape, tokens per item, output width
    plan: object  # hf_zero.train.parts.PartPlan
    sizes: dict  # {part: parameters}
    item_bytes: dict  # {modality: bytes one item's encoder and projector keep for backward, fp32}
    items_per_row: int = 1  # the recipe's: items of each modality a row holds at most

    @property
    def tokens_per_row(self) -> int:
        return sum(s.tokens for s in self.specs.values())

    def activation_bytes_per_row(self, precision: str = "fp32") -> int:
        """Encoders' and projectors' saved tensors for one row (items_per_row items of each modality); 16-bit under
        mixed precision, as autocast runs their matmuls."""
        scale = 1 if precision == "fp32" else 0.5
        return int(scale * self.items_per_row * sum(self.item_bytes.values()))

    @property
    def final_params(self) -> int:
        """What `final/` holds: the whole composed model (LoRA included) and, beside it, the LLM's adapter."""
        return sum(p.numel() for p in self.model.parameters()) + self.sizes.get("lora", 0)

    @property
    def label(self) -> str:  # what the estimate adds to the model's name
        return f" + encoders {', '.join(self.specs)}"

    def summary(self, precision: str, micro_batch: int) -> dict:  # `hf-zero estimate`'s terms, as a VLM's count
        return estimate_summary(self, precision, micro_batch)

    def lines(self, precision: str, micro_batch: int) -> list[str]:
        return estimate_lines(self, precision, micro_batch)


def composed_on_meta(model_args, encoders: dict, stages, learning_rate: float, chat_template=None):
    """(ComposedModel on meta, specs, PartPlan, part sizes) as recipes/multimodal.py builds them."""
    import torch
    from transformers import AutoModelForCausalLM


    tokenizer = get_tokenizer(model_args.model_name_or_path, model_args.tokenizer_name_or_path)
    prepare_chat_template(tokenizer, chat_template)
    config = get_model_config(model_args.model_name_or_path)
    with torch.device("meta"):
        built = build_encoders(encoders)
        placeholders = add_placeholders(tokenizer, built[1])
        llm = AutoModelForCausalLM._model_mapping[type(config)](config)
        vocab = getattr(config, "vocab_size", None)
        # as hf_zero.data.chat_template.grow_embeddings; mean_resizing draws from the old rows, which meta has not
        grown = bool(added_template_tokens(tokenizer)) and vocab is not None and len(tokenizer) > vocab
        if grown:
            llm.resize_token_embeddings(len(tokenizer), mean_resizing=False)
        if model_args.use_peft:
            from peft import LoraConfig, get_peft_model

            llm = get_peft_model(llm, LoraConfig(**lora_kwargs(model_args, "CAUSAL_LM")))
            if grown:
                train_embeddings(llm)
                freeze_unread_embeddings(llm, tokenizer, placeholders)  # as the recipe does
        model = ComposedModel(llm, encoders, placeholders, built)
    sizes = part_sizes(model)
    plan = plan_parts(model, stages, learning_rate)
    # What hf_zero.estimate reads of a model, on this counted instance only: the LLM's LM head (its logits are the
    # loss's activations) and its LoRA config (the adapters' activations)
    model.get_output_embeddings = llm.get_output_embeddings
    if model_args.use_peft:
        model.peft_config = llm.peft_config
    return model, built[1], plan, sizes


def item_activation_bytes(model, specs: dict) -> dict:
    """{modality: bytes} the encoder and projector save for backward on one item (saved tensors that are not
    parameters), counted on a meta model: shapes and dtypes only."""
    import torch

    out = {}
    for m, spec in specs.items():
        grads = [p.requires_grad for p in model.parameters()]
        for p in model.parameters():  # every part as if it trained: a frozen encoder's input needs nothing saved
            p.requires_grad_(True)
        try:
            out[m] = saved_bytes(lambda m=m, spec=spec: model.projectors[m](encode(
                model.encoders[m], torch.zeros(1, *spec.input_shape, device="meta"))), model.parameters())
        finally:
            for p, g in zip(model.parameters(), grads):
                p.requires_grad_(g)
    return out


def count_composed(path: str, overrides=()) -> ComposedCount | None:
    """A recipe YAML's composed model, counted; None when its recipe composes no encoders (a text recipe)."""

    types = recipe_argument_types(load_recipe(str(recipe_script(None, path))))
    if not any("encoders" in getattr(t, "__dataclass_fields__", {}) for t in types):
        return None
    model_args, *_, stages, training, _ = parse_recipe_args(types, ["--config", path, *overrides])
    if not training.get("encoders"):
        raise UserError("encoders", "the multimodal recipe needs at least one encoder",
                        "e.g. encoders: {points: {class: hf_zero.train.encoders:PointNet, input_shape: [256, 3]}}")
    model, specs, plan, sizes = composed_on_meta(model_args, training["encoders"], stages,
                                                 training.get("learning_rate", 5e-5), training.get("chat_template"))
    return ComposedCount(model, specs, plan, sizes, item_activation_bytes(model, specs),
                         training.get("items_per_row", 1))


def model_count_of(count) -> ModelCount:
    """The estimate's counts of a composed model or a stock VLM (a ComposedCount or hf_zero.train.vlm_count's
    VlmCount: its model on meta and its PartPlan), with the optimizer's groups as the run makes them: one pair per
    part (hf_zero.train.parts.param_groups), not the Trainer's one pair for the whole model."""
    return replace(count_model(count.model), trainable_groups=group_sizes(count.model, count.plan))


def stage_lines(count: ComposedCount) -> list[str]:
    """Per stage, what trains and what is frozen (the banner's lines, hf_zero.train.parts.PartPlan.describe), then
    the bytes of what trains: its fp32 weights, and their gradients and Adam moments, which every part that trains
    in some stage keeps in all stages (frozen ones at LR 0: docs/multimodal.md)."""
    ever = sum(count.sizes[p] for p in count.plan.ever_trained)
    lines = []
    for line, factors in zip(count.plan.describe(count.sizes), count.plan.factors):
        n = sum(count.sizes[p] for p, f in factors.items() if f > 0)
        lines.append(f"{line}; {n:,} parameters train, {human_bytes(4 * n, digits=2)} in fp32")
    lines.append(f"optimizer state and gradients: {', '.join(count.plan.ever_trained)} ({ever:,} parameters, every "
                 f"part that trains in some stage, kept in every stage: {human_bytes(12 * ever, digits=2)} of fp32 "
                 "gradients and Adam moments); parts that train in no stage have none")
    return lines


def estimate_summary(count: ComposedCount, precision: str, micro_batch: int) -> dict:
    """The multimodal terms of `hf-zero estimate` (its --json `multimodal`), in parameters and bytes."""
    kinds = {k: {p: n for p, n in count.sizes.items() if p.startswith(f"{k}.")} for k in ("encoder", "projector")}
    return {"encoders": kinds["encoder"], "projectors": kinds["projector"],
            "modality_tokens_per_row": {m: s.tokens for m, s in count.specs.items()},
            "activation_bytes_per_item": {m: int((1 if precision == "fp32" else 0.5) * n)
                                          for m, n in count.item_bytes.items()},
            "items_per_row": count.items_per_row,
            "activation_bytes_per_row": count.activation_bytes_per_row(precision),
            "activation_bytes": micro_batch * count.activation_bytes_per_row(precision),
            "trainable_params": sum(count.sizes[p] for p in count.plan.ever_trained),
            "stages": [{"stage": name, "trains": [p for p, f in factors.items() if f > 0],
                        "frozen": [p for p, f in factors.items() if f == 0]}
                       for name, factors in zip(count.plan.names, count.plan.factors)]}


def estimate_lines(count: ComposedCount, precision: str, micro_batch: int) -> list[str]:
    s = estimate_summary(count, precision, micro_batch)
    parts = ", ".join(f"{p} {n:,}" for p, n in {**s["encoders"], **s["projectors"]}.items())
    tokens = ", ".join(f"{m} {n}" for m, n in s["modality_tokens_per_row"].items())
    return [f"multimodal: encoders and projectors {parts} parameters (in the params above); modality tokens per "
            f"row {tokens} (placeholder positions, inside max_seq_length); the encoders and projectors keep "
            f"{human_bytes(s['activation_bytes_per_row'], digits=2)} per row for backward, {count.items_per_row} "
            f"item{'s' if count.items_per_row > 1 else ''} of each modality (items_per_row) "
            f"({human_bytes(s['activation_bytes'], digits=2)} per micro-batch, in the activations below)",
            *(f"  {line}" for line in stage_lines(count))]


def check_multimodal(stages, args, model_args=None) -> str:
    """`hf-zero check`'s data check for recipes/multimodal.py (its CHECK_DATA): every image and array opened
    (hf_zero.data.multimodal_check.check_multimodal_data), then, given the model's arguments (not in the light check
    `hf-zero train` runs before a launch), per stage what trains: parts, parameters and bytes."""

    line = check_multimodal_data(stages, args)
    if model_args is None:
        return line
    model, specs, plan, sizes = composed_on_meta(model_args, args.encoders, stages, 5e-5,
                                                 getattr(args, "chat_template", None))
    tokens = ", ".join(f"{m} {s.tokens}" for m, s in specs.items())
    stages_ = []
    for name, factors in zip(plan.names, plan.factors):
        trains = [p for p, f in factors.items() if f > 0]
        n = sum(sizes[p] for p in trains)
        stages_.append(f"stage {name} trains {', '.join(f'{p} ({sizes[p]:,})' for p in trains)}: {n:,} parameters, "
                       f"{human_bytes(4 * n, digits=2)} in fp32")
    ever = sum(sizes[p] for p in plan.ever_trained)
    # one line, as every check's: the stages side by side
    return (f"{line}; modality tokens per item: {tokens}; {'; '.join(stages_)}; gradients and optimizer state for "
            f"every part that trains in some stage ({ever:,} parameters), frozen ones at LR 0")


def multimodal_data(model_args, training: dict, stages):
    """(tokenizer, specs, placeholder ids, [StageData]) of a multimodal recipe's stages, tokenized as the run
    tokenizes them (`hf-zero preview`): the encoders built on meta for their token counts, no weights."""
    import torch


    args = recipe_fields(CurriculumArguments, training)
    tokenizer = get_tokenizer(model_args.model_name_or_path, model_args.tokenizer_name_or_path)
    prepare_chat_template(tokenizer, getattr(args, "chat_template", None))
    with torch.device("meta"):
        specs = build_encoders(training.get("encoders"))[1]
    placeholders = add_placeholders(tokenizer, specs)
    data = [load_multimodal_stage(s, tokenizer, specs, placeholders, args.max_seq_length, args.eval_samples,
                                  training.get("seed", 42), FormatOptions.from_args(args)) for s in stages]
    return tokenizer, specs, placeholders, data
