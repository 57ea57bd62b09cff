"""The launch that fits a GPU: what `hf-zero estimate --config` recommends and the profile `hf-zero train` picks.

A plan keeps the recipe's global batch (hf_zero.estimate.recipe reads it as it will run): it tries profiles fastest
first and, in each, the largest micro-batch (accumulation making up the rest) whose estimated peak fits the GPU less
HEADROOM; where none fits, sequence parallelism at the smallest size that fits the longest stage.
A model with parts (a multimodal recipe's encoders and projectors, a stock VLM's vision tower: `recipe.parts`,
hf_zero.train.recipe_count) is sized whole, its encoders' activations included, as `hf-zero estimate`'s table sizes it.
"""

from __future__ import annotations

import shlex
from dataclasses import replace

from hf_zero.core.errors import UserError
from hf_zero.core.files import human_bytes
from hf_zero.data.model_names import get_model_config
from hf_zero.estimate.memory import QLORA_STRATEGIES, estimate
from hf_zero.estimate.model_count import count_model
from hf_zero.estimate.recipe import RecipeMemory, sp_sizes
from hf_zero.plan.profiles import gpu_count, load_profile
from hf_zero.plan.reconcile import resolve_batch
from hf_zero.plan.world import launch_shape

__all__ = ["HEADROOM", "plan", "candidates", "pick_profile"]

HEADROOM = 0.10
HEADROOM_WHY = ("10% of the GPU kept free: the estimate is within 10% of measured peak allocated memory "
                "(tests/data/calibration), and the CUDA context and the caching allocator's reserve come on top")



def candidates(world: int, lora: bool = False, load_in_4bit: bool = False) -> list[tuple]:
    """(profile, memory strategy[, "nf4" for a 4-bit base]), fastest first. One GPU: single_gpu, then ZeRO-2 (bf16
    weights: its activations are smaller than autocast's fp32 stream, measured 33.6 vs 37.0 GiB), then ZeRO-3 with
    everything offloaded. FSDP2 comes right after its ZeRO counterpart, so ZeRO (the established path) wins where
    both fit and FSDP2 is picked where only it does (it holds no separate fp32 master copy); at one GPU only its
    offload saves memory. `lora`: QLoRA (the base in 4 bits, as the run's own GPU computes it) before any
    offload, and on one GPU before a ZeRO profile on its one process; `load_in_4bit`: the recipe's own QLoRA, under
    the profiles that run it."""
    if world == 1:
        plain = [("single_gpu", "ddp"), ("zero2", "zero2"), ("zero3_offload", "zero3_offload"),
                 ("fsdp2_offload", "fsdp2_offload")]
        qlora = [("single_gpu", "ddp", "nf4")]
    else:
        plain = [("zero2", "zero2"), ("zero3", "zero3"), ("fsdp2", "fsdp2"), ("zero3_offload", "zero3_offload"),
                 ("fsdp2_offload", "fsdp2_offload")]
        qlora = [("zero2", "zero2", "nf4"), ("zero3", "zero3", "nf4"), ("fsdp2", "fsdp2", "nf4")]
    if load_in_4bit:
        return [(p, s, "nf4") for p, s in plain if s in QLORA_STRATEGIES]
    if not lora:
        return plain
    cut = 1 if world == 1 else 3
    return plain[:cut] + qlora + plain[cut:]


def _command(recipe: RecipeMemory, profile: str, gpn: int, nodes: int, precision: str, micro: int, accum: int,
             qlora: bool = False):
    """The `hf-zero train` line that runs this plan (None without a recipe file to run)."""
    if not recipe.path:
        return None
    cmd = ["hf-zero", "train", "--profile", profile, "--nproc", str(gpn)]
    cmd += ["--nodes", str(nodes)] if nodes > 1 else []
    cmd += ["--precision", precision] if load_profile(profile).precision != precision else []
    cmd += ["--config", recipe.path]
    cmd += ["--load_in_4bit", "true"] if qlora and not recipe.load_in_4bit else []
    for key, value in recipe.flags:
        if key not in ("per_device_train_batch_size", "gradient_accumulation_steps"):
            cmd += [f"--{key}", *(map(str, value) if isinstance(value, (list, tuple)) else [str(value)])]
    if micro != recipe.micro or recipe.global_batch is None and accum != recipe.accumulation:
        cmd += ["--per_device_train_batch_size", str(micro)]
        cmd += [] if recipe.global_batch else ["--gradient_accumulation_steps", str(accum)]
    return shlex.join(cmd)


def _first_fit(count, recipe, per_rank, estimate_kw, usable, cpu_memory, choices, only_own=False):
    """(profile, strategy, micro, accumulation, estimate, 4-bit base) of the fastest launch that fits, else None;
    `per_rank`: one data-parallel rank's samples per optimizer step (micro x accumulation, kept by every fit);
    `only_own`: at the recipe's own micro-batch only."""
    micros = [recipe.micro] if only_own else [m for m in range(per_rank, 0, -1) if per_rank % m == 0]
    for profile, strategy, *base in choices:
        qlora = bool(base) or recipe.load_in_4bit
        for micro in micros:
            est = estimate(count, strategy, micro_batch=micro, grad_accumulation=per_rank // micro,
                           gpu_memory_bytes=usable, cpu_memory_bytes=cpu_memory,
                           frozen_base="nf4" if qlora else None, **estimate_kw)
            if est["fits"]:
                return profile, strategy, micro, per_rank // micro, est, qlora
    return None


def plan(recipe: RecipeMemory, gpus_per_node: int, gpu_memory_bytes: int, nodes: int = 1, precision: str = "bf16",
         cpu_memory_bytes: int | None = None, choices: list | None = None, only_own: bool = False,
         sp_size: int = 1) -> dict:
    """The fastest profile (and micro-batch x accumulation keeping the global batch) that fits, its command, the
    headroom it leaves and why; "profile": None and what would fit when nothing does. `choices`: (profile,
    strategy) pairs to try in order (default: candidates(world)); `only_own`: keep the recipe's micro-batch;
    `sp_size`: the choices' sequence-parallel size (the batch then counts world / sp_size data-parallel ranks)."""
    world = launch_shape(nproc=gpus_per_node, nodes=nodes).world
    batch = resolve_batch({"per_device_train_batch_size": recipe.micro,
                           "gradient_accumulation_steps": recipe.accumulation,
                           "global_batch_size": recipe.global_batch}, world, sp=sp_size)
    per_rank = batch.global_batch // batch.dp  # the ranks that take their own micro-batches share the global batch
    recipe = replace(recipe, accumulation=batch.accumulation)
    count = recipe.parts.count if recipe.parts else _text_count(recipe)
    kw = dict(gpus_per_node=gpus_per_node, nodes=nodes, precision=precision, seq_len=recipe.seq_len,
              grad_checkpointing=recipe.gradient_checkpointing, attn_implementation=recipe.attn_implementation,
              sp_size=sp_size, fused_cross_entropy=recipe.fused_cross_entropy,
              use_liger_kernel=recipe.use_liger_kernel,
              sequences_per_row=recipe.sequences_per_row,  # a dpo stage's peak: chosen + rejected per row
              extra_activations=recipe.parts.activation_bytes(precision) if recipe.parts else 0)
    usable = int(gpu_memory_bytes * (1 - HEADROOM))
    any_profile = choices is None
    # QLoRA as an offer for a text model's LoRA only: a composed model's or VLM's 4-bit base is not estimated
    choices = choices or candidates(world, recipe.lora is not None and not recipe.parts, recipe.load_in_4bit)
    # Sequence parallelism (exact, its all-to-all on the GPUs' own links) before an offload or a 4-bit base
    cut = next((i for i, (name, _, *base) in enumerate(choices) if base or "offload" in name), len(choices))
    found = _first_fit(count, recipe, per_rank, kw, usable, cpu_memory_bytes, choices[:cut], only_own)
    if found is None and any_profile and sp_size == 1:
        fit = _sequence_parallel_fit(recipe, gpus_per_node, gpu_memory_bytes, nodes, precision, cpu_memory_bytes,
                                     only_own)
        if fit:
            return fit
    if found is None and cut < len(choices):
        found = _first_fit(count, recipe, per_rank, kw, usable, cpu_memory_bytes, choices[cut:], only_own)
    if found is None:
        return _what_would_fit(count, recipe, per_rank, kw, usable, gpu_memory_bytes, cpu_memory_bytes, choices,
                               only_own)
    profile, strategy, micro, accum, est, qlora = found
    peak = est["gpu_bytes_per_rank"]["total"]
    names = list(dict.fromkeys(p + (" (QLoRA)" if base else "") for p, _, *base in choices))
    switch = qlora and not recipe.load_in_4bit
    reason = ("QLoRA (add load_in_4bit: true: the frozen base in 4-bit NF4): " if switch else
              "") + (f"the fastest of {', '.join(names)} that fits: " if len(names) > 1 else f"{profile} fits: ") + (
              f"peak {human_bytes(peak)} in {precision} of {human_bytes(gpu_memory_bytes)} per GPU, "
              f"{human_bytes(gpu_memory_bytes - peak)} "
              f"({100 * (1 - peak / gpu_memory_bytes):.0f}%) left; {HEADROOM_WHY}")
    return {"profile": profile, "strategy": strategy, "nproc": gpus_per_node, "nodes": nodes, "micro_batch": micro,
            "accumulation": accum, "global_batch": batch.global_batch, "precision": precision,
            "peak_bytes": peak, "headroom_bytes": gpu_memory_bytes - peak, "reason": reason, "load_in_4bit": qlora,
            "command": _command(recipe, profile, gpus_per_node, nodes, precision, micro, accum, switch),
            "sp_size": sp_size}


def _text_count(recipe: RecipeMemory):
    """The recipe's text model counted from its config (with its LoRA)."""
    try:
        config = get_model_config(recipe.model) if isinstance(recipe.model, str) else recipe.model
        return count_model(config, lora=recipe.lora)
    except ValueError as err:  # peft: target modules not in the model
        raise UserError("lora_target_modules", str(err).splitlines()[0], "name modules the model has") from None


def _sequence_parallel_fit(recipe: RecipeMemory, gpus_per_node: int, gpu_memory_bytes: int, nodes: int,
                           precision: str, cpu_memory_bytes: int | None, only_own: bool) -> dict | None:
    """Where no profile fits without an offload or a 4-bit base: zero3_sp at the smallest sp_size that fits (None:
    none does, or SP cannot run).
    Smallest, because each doubling halves the data-parallel groups; the shipped zero3_sp runs its own sp_size,
    another needs a copy of it with that parallelism_config_sp_size (the command names it)."""
    world = launch_shape(nproc=gpus_per_node, nodes=nodes).world
    if world < 2 or recipe.load_in_4bit:
        return None
    shipped = load_profile("zero3_sp")
    for sp in sp_sizes(recipe, world):
        try:
            found = plan(recipe, gpus_per_node, gpu_memory_bytes, nodes, precision, cpu_memory_bytes,
                         choices=[("zero3_sp", "zero3")], only_own=only_own, sp_size=sp)
        except UserError:  # a global batch the world / sp data-parallel groups cannot share
            continue
        if not found["profile"]:
            continue
        copy = "" if sp == shipped.sp_size else (
            f" (zero3_sp{sp}.yaml: a copy of accelerate_configs/zero3_sp.yaml with parallelism_config_sp_size: {sp})")
        found["reason"] = (f"no profile fits without sequence parallelism, offload or a 4-bit base; zero3_sp at "
                           f"sp_size {sp}, the smallest that fits the longest stage {recipe.stage or recipe.seq_len}"
                           f"{copy}: {found['reason']}")
        if copy and found["command"]:
            found["command"] = found["command"].replace("--profile zero3_sp ", f"--profile zero3_sp{sp}.yaml ", 1)
        return found
    return None


def _what_would_fit(count, recipe, per_rank, kw, usable, gpu_memory, cpu_memory, choices, only_own) -> dict:
    """The smallest estimate tried (the last choice at the smallest micro-batch) and what would fit instead."""
    last, strategy, *base = choices[-1]
    micro = recipe.micro if only_own else 1
    need = estimate(count, strategy, micro_batch=micro, frozen_base="nf4" if base or recipe.load_in_4bit else None,
                    **kw)["gpu_bytes_per_rank"]["total"]
    hint = "use more GPUs, LoRA (use_peft: true) or a shorter max_seq_length"
    if not recipe.gradient_checkpointing:
        hit = _first_fit(count, recipe, per_rank, {**kw, "grad_checkpointing": True}, usable, cpu_memory, choices,
                         only_own)
        hint = (f"with gradient_checkpointing: true {hit[0]} fits at micro-batch {hit[2]} "
                f"({human_bytes(hit[4]['gpu_bytes_per_rank']['total'])})") if hit else hint
    return {"profile": None, "need_bytes": need, "need_profile": last, "need_micro_batch": micro, "hint": hint,
            "reason": f"nothing fits {human_bytes(gpu_memory)} per GPU less {HEADROOM:.0%} headroom: even {last} at "
                      f"micro-batch {micro} needs {human_bytes(need)}; {hint}"}


def pick_profile(gpus: int | None = None, model=None, gpu_memory_bytes: int | None = None,
                 lora_r: int | None = None, *, recipe=None, precision: str | None = None) -> tuple[str, str]:
    """The profile for this machine and the reason, as `make train` prints it.

    With GPUs and a known run (`recipe`: hf_zero.estimate.recipe.RecipeMemory, or just a `model` and LoRA rank at
    micro-batch 1 x 1024 tokens), hf_zero's estimator picks the fastest profile whose peak fits the device less 10%
    headroom, at the recipe's own micro-batch and length, in `precision` (default bf16): 1 GPU single_gpu, zero2,
    zero3_offload, fsdp2_offload; k GPUs zero2, zero3, fsdp2, then zero3_sp at the smallest sp_size that fits the
    longest stage (one other than the shipped profile's: a one-line error naming the copy to make), then
    zero3_offload, fsdp2_offload. Nothing fits: a one-line error with the estimate and what would fit. Without a
    known run: single_gpu on 1 GPU, ZeRO-2 on several.
    """
    gpus = gpu_count() if gpus is None else gpus
    if gpus == 0:
        return "cpu", "no GPU found: DeepSpeed on the CPU accelerator, 2 ranks, ZeRO-2 (the fastest stage on CPU)"
    if recipe is None and model is not None:
        lora = {"r": lora_r, "task_type": "CAUSAL_LM"} if lora_r else None
        recipe = RecipeMemory(model=model, micro=1, accumulation=1, seq_len=1024, lora=lora)
    if recipe is None:
        return (("single_gpu", "1 GPU found: no sharding needed for one device (run `hf-zero estimate` to check it "
                 "fits)") if gpus == 1 else
                ("zero2", f"{gpus} GPUs found: ZeRO-2 on {gpus} ranks (run `hf-zero estimate` to check it fits)"))
    if gpu_memory_bytes is None:
        import torch

        gpu_memory_bytes = torch.cuda.get_device_properties(0).total_memory
    # The recipe's own micro-batch: hf-zero train runs it as written. Every candidate, then sequence parallelism.
    found = plan(recipe, gpus, gpu_memory_bytes, precision=precision or "bf16", only_own=True)
    if found["profile"] and found["load_in_4bit"] and not recipe.load_in_4bit:  # its base, as for its micro-batch
        raise UserError("load_in_4bit", f"{gpus} GPU{'s' if gpus > 1 else ''} found: {found['reason']}",
                        f"run: {found['command']}" if found["command"] else "add load_in_4bit: true to the recipe")
    if found["profile"] and found["sp_size"] != load_profile(found["profile"]).sp_size:  # not the shipped profile's
        raise UserError("profile", f"{gpus} GPUs found: {found['reason']}",
                        f"make that copy, then run: {found['command']}" if found["command"] else
                        "a copy of accelerate_configs/zero3_sp.yaml with parallelism_config_sp_size: "
                        f"{found['sp_size']}")
    if found["profile"] and found["sp_size"] > 1:
        return found["profile"], f"{gpus} GPUs found: {found['reason']}"
    if found["profile"]:
        return found["profile"], f"{gpus} GPU{'s' if gpus > 1 else ''} found: {found['profile']} on {gpus} " \
            f"rank{'s' if gpus > 1 else ''} is {found['reason']}"
    smaller = plan(recipe, gpus, gpu_memory_bytes, precision=precision or "bf16")
    need = (f"micro-batch {recipe.micro} x {recipe.seq_len} tokens needs "
            f"{human_bytes(found['need_bytes'], unit='GiB')} per GPU even with {found['need_profile']}, over {gpus} x "
            f"{human_bytes(gpu_memory_bytes, unit='GiB')} less 10% headroom")
    if smaller["profile"]:
        raise UserError("profile", f"{need}; micro-batch {smaller['micro_batch']} x accumulation "
                        f"{smaller['accumulation']} (same global batch) fits {smaller['profile']} "
                        f"({human_bytes(smaller['peak_bytes'], unit='GiB')})", f"run: {smaller['command']}")
    raise UserError("profile", need, smaller["hint"])
