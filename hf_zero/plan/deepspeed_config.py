"""The DeepSpeed config hf_zero hands the Trainer for a DeepSpeed profile: the profile's ZeRO stage, offload and
precision, with ZeRO-3's gather/release settings sized from the model's shape (hf_zero.plan.reconcile calls it once,
when the run plan is resolved)."""

from __future__ import annotations

import json
import os

from hf_zero.core.errors import UserError
from hf_zero.plan.profiles import Profile

__all__ = ["build_deepspeed_config", "zero3_speed_settings", "BENCH_DEEPSPEED_ENV"]

# `hf-zero bench --preset gpu-matrix` measures DeepSpeed settings hf_zero does not choose itself (ZeRO-3's persistence
# threshold, live parameters, prefetch bucket; DeepCompile): a JSON object merged over the config built here, its
# "zero_optimization" key by key. A bench switch, not a recipe key: what the matrix finds fastest becomes the default
# in zero3_speed_settings, measured, instead of a knob every recipe must set.
BENCH_DEEPSPEED_ENV = "HF_ZERO_BENCH_DEEPSPEED"
ONE_RANK_PERSISTENCE = 10**12  # elements: above any one parameter, so ZeRO-3 on one GPU keeps every one whole


def zero3_speed_settings(model_config=None, lora_targets=None) -> dict:
    """ZeRO-3's gather/release settings, chosen for speed from the model's shape (all model-dependent values here).

    - max reuse distance = one decoder layer's parameters. DeepSpeed's default (1e9) makes every release walk the
      rest of the recorded module order (quadratic in modules; measured on CPU: a 17-45 s stall on SmolLM2-135M),
      and 0 re-gathers a layer that gradient checkpointing recomputes right before its backward.
    - prefetch bucket = one decoder layer, so the next layer's all-gather overlaps this layer's compute (the
      Trainer's "auto", 0.9 h^2, is smaller than one MLP matrix: it prefetches one weight ahead).
    - persistence threshold = 10 h (as "auto"): norms and biases stay whole instead of hundreds of tiny gathers.
    - max live parameters >= 3 layers, so the prefetch is never throttled.
    - the MLP as a leaf module (one gather for its three matrices, fewer hooks) unless LoRA adapts one of them
      (DeepSpeed crashes in backward on a leaf module holding LoRA weights).
    Without a model config (e.g. a run not started by a recipe), "auto" sizes and DeepSpeed's defaults otherwise.
    """
    if model_config is None:
        return {"stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto",
                "stage3_max_reuse_distance": 0}
    hidden = getattr(model_config, "hidden_size", None) or 768
    layer, mlp = _decoder_layer(model_config)
    layer = layer or 12 * hidden * hidden
    settings = {
        "stage3_prefetch_bucket_size": layer,
        "stage3_param_persistence_threshold": 10 * hidden,
        "stage3_max_live_parameters": max(10**9, 3 * layer),
        "stage3_max_reuse_distance": layer,
    }
    # a string is peft's "all-linear" or a regex: it may match inside the MLP
    targets = {"all-linear"} if isinstance(lora_targets, str) else set(lora_targets or [])
    if mlp is not None and not targets & mlp[1] and "all-linear" not in targets:
        from deepspeed.runtime.zero.leaf_module_config import DEFAULT_LEAF_MODULE_CLASSES  # MoE blocks

        settings["leaf_module"] = {"classes": [*DEFAULT_LEAF_MODULE_CLASSES, mlp[0]]}
    return settings


def _decoder_layer(model_config) -> tuple[int, tuple[str, set] | None]:
    """(parameters of one decoder layer, (its MLP's class name, the MLP's submodule names) or None), from the model
    built on the meta device (no weights, no memory)."""
    import torch
    from transformers import AutoModel, AutoModelForCausalLM

    with torch.device("meta"):
        try:
            model = AutoModelForCausalLM.from_config(model_config)
        except ValueError:  # not a causal LM (e.g. an encoder)
            model = AutoModel.from_config(model_config)
    n = getattr(model_config, "num_hidden_layers", None)
    stack = next((m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == n), None)
    if not stack:
        return 0, None
    first = stack[0]
    mlp = getattr(first, "mlp", None)
    names = {name.rsplit(".", 1)[-1] for name, _ in mlp.named_modules() if name} if mlp is not None else set()
    return sum(p.numel() for p in first.parameters()), (type(mlp).__name__, names) if names else None


def build_deepspeed_config(profile: Profile, on_cpu: bool, model_config=None, lora_targets=None,
                           world: int | None = None) -> dict:
    """The DeepSpeed config handed to TrainingArguments(deepspeed=...).

    Batch sizes, accumulation, clipping and precision stay "auto": the Trainer fills them from TrainingArguments,
    which hf_zero has already reconciled with the profile, so the two can never disagree. ZeRO-3's gather settings
    come from the model (`zero3_speed_settings`).
    """
    stage = profile.zero_stage or 0
    zero: dict = {"stage": stage}
    if stage == 1:
        # Measured by `hf-zero bench`: with DeepSpeed's default (5e8 elements) ZeRO-1 allocates a 2 GB fp32 reduce
        # bucket every step whatever the model's size; "auto" is hidden_size^2, as for ZeRO-2/3.
        zero["reduce_bucket_size"] = "auto"
    if stage >= 2:
        zero.update(overlap_comm=False, contiguous_gradients=True, reduce_bucket_size="auto")
    if stage == 3:
        zero.update(stage3_gather_16bit_weights_on_model_save=profile.zero3_save_16bit_model,
                    **zero3_speed_settings(model_config, lora_targets))
        if not on_cpu:
            # DeepSpeed's own ZeRO-3 default: gradients are reduce-scattered while backward goes on, for buckets of
            # h^2 elements; on the CPU accelerator there are no streams to overlap on.
            zero["overlap_comm"] = True
        if not on_cpu and world == 1:
            # One rank's partition is the whole model, so releasing a parameter after use frees nothing: every
            # parameter persistent skips the gather/release hooks' work. Measured (hf-zero bench --preset gpu-matrix,
            # 1x H100 80GB, 1.1B Llama shape, 8 x 1024 tokens, 2026-11-27): 19,503 tokens/s against 15,126 (1.29x),
            # the same peak (33,963 MiB). Not on CPU, where it was not measured.
            zero["stage3_param_persistence_threshold"] = ONE_RANK_PERSISTENCE
    for kind, device in (("optimizer", profile.offload_optimizer), ("param", profile.offload_param)):
        if device in ("cpu", "nvme") and (kind == "optimizer" or stage == 3):
            section = {"device": device}
            if device == "nvme":
                section["nvme_path"] = profile.nvme_path or "/local_nvme"
            if device == "cpu" and not on_cpu:
                section["pin_memory"] = True
            zero[f"offload_{kind}"] = section
    config = {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "bf16": {"enabled": "auto"},
        "fp16": {"enabled": "auto"},
        "zero_optimization": zero,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    return _with_bench_overrides(config, os.environ.get(BENCH_DEEPSPEED_ENV))


def _with_bench_overrides(config: dict, raw: str | None) -> dict:
    if not raw:
        return config
    try:
        extra = json.loads(raw)
    except ValueError as err:
        extra = err
    if not isinstance(extra, dict):
        raise UserError(BENCH_DEEPSPEED_ENV, f"is not a JSON object ({extra})",
                        'e.g. {"zero_optimization": {"stage3_param_persistence_threshold": 1e9}}')
    zero = {**config["zero_optimization"], **(extra.pop("zero_optimization", None) or {})}
    return {**config, **extra, "zero_optimization": zero}
