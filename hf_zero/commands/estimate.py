"""`hf-zero estimate`: memory per rank for DDP, every ZeRO strategy and FSDP2, before you pay for GPUs.

    hf-zero estimate --model smollm2-135m-instruct --gpus-per-node 4 --gpu-memory 48GiB
    hf-zero estimate --config recipes/configs/my_recipe.yaml --gpus-per-node 1 --gpu-memory 24GiB

Model states follow DeepSpeed's own estimators (`--convention deepspeed`, the default) or the ZeRO paper's formulas
(`--convention paper`); the peak per GPU adds what a step keeps on the device (hf_zero/estimate/memory.py,
hf_zero/estimate/activations.py). A recipe is estimated as it will run (hf_zero/estimate/recipe.py) and
`--gpu-memory` plans its launch (hf_zero/estimate/pick.py).
"""

from __future__ import annotations

import json
import re
from dataclasses import replace

from hf_zero.core.console import quiet_environment
from hf_zero.core.errors import UserError
from hf_zero.core.validate import at_least
from hf_zero.data.model_names import get_model_config
from hf_zero.data.preference import reference_cache_bytes
from hf_zero.estimate import memory
from hf_zero.estimate.activations import ATTENTION
from hf_zero.estimate.memory import CONVENTIONS, PRECISIONS, strategies_for
from hf_zero.estimate.model_count import count_model
from hf_zero.estimate.pick import HEADROOM, plan
from hf_zero.estimate.recipe import RecipeMemory, lora_fields, read_recipe, sp_by_stage, sp_sizes
from hf_zero.estimate.table import print_sequence_parallel, print_table
from hf_zero.plan.profiles import with_precision
from hf_zero.plan.reconcile import resolve_batch
from hf_zero.plan.run_plan import resolve_plan
from hf_zero.plan.shipped import recipe_script
from hf_zero.plan.world import launch_shape

__all__ = ["add_arguments", "run", "parse_bytes"]

_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str, flag: str) -> int:
    """"48GiB", "80 GB", "512MiB" -> bytes (GB = 10^9, GiB = 2^30)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]+)\s*", str(text))
    if not match or match.group(2).lower() not in _UNITS or float(match.group(1)) <= 0:
        raise UserError(flag, f"cannot read {text!r} as a memory size", "write it like 48GiB, 80GB or 512MiB")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def add_arguments(parser) -> None:
    parser.add_argument("--model", help="tiny-llama, smollm2-135m-instruct, a local folder or config.json, a hub id")
    parser.add_argument("--config", help="recipe YAML, estimated as it will run: the longest stage's max_seq_length, "
                        "its micro-batch, accumulation, LoRA, checkpointing and attention (hf_zero's defaults where "
                        "it is silent); with --gpu-memory, the `hf-zero train` command that fits")
    parser.add_argument("--profile", default="all", help="a profile (its strategy, GPUs and precision), a strategy "
                        "name, or 'all' (default: every strategy)")
    parser.add_argument("--gpus-per-node", type=int, help="GPUs (ranks) per node (default: the profile's, else 1)")
    parser.add_argument("--nodes", type=int, help="number of nodes (default: the profile's, else 1)")
    parser.add_argument("--precision", choices=PRECISIONS, help="default: the profile's, else bf16")
    parser.add_argument("--use-peft", action="store_true", default=None, help="LoRA: train adapters only")
    parser.add_argument("--load-in-4bit", action="store_true", default=None,
                        help="QLoRA: LoRA on a 4-bit NF4 base (the recipe's load_in_4bit)")
    parser.add_argument("--lora-r", type=int, metavar="R", help="LoRA rank (default: the recipe's, else 16)")
    parser.add_argument("--lora-target-modules", nargs="+", metavar="NAME", help="default: peft's for the model")
    parser.add_argument("--micro-batch", type=int, help="samples per rank per step (default: the recipe's, else 1)")
    parser.add_argument("--gradient-accumulation", type=int, metavar="N",
                        help="micro-batches per optimizer step (default: the recipe's, else 1); above 1 the gradients "
                        "stay allocated through the next forward")
    parser.add_argument("--seq-len", type=int, help="tokens per sample (default: the recipe's max_seq_length, "
                        "else the model's context up to 2048)")
    parser.add_argument("--gradient-checkpointing", action="store_true", default=None)
    parser.add_argument("--attn-implementation", choices=ATTENTION,
                        help="attention as the model will run it (default: the recipe's, else the model's own, "
                        "transformers' sdpa for most): eager keeps the s x s probabilities")
    parser.add_argument("--flash-attention", action="store_true",
                        help="same as --attn-implementation flash_attention_2")
    parser.add_argument("--gpu-memory", help="memory per GPU, e.g. 48GiB or 80GB: adds fits (with 10%% headroom), "
                        "the profile to use with its micro-batch x accumulation and command, and the largest micro "
                        "batch")
    parser.add_argument("--cpu-memory", help="CPU RAM per node, e.g. 512GiB (offload strategies must fit it too)")
    parser.add_argument("--convention", choices=CONVENTIONS, default="deepspeed",
                        help="model states as DeepSpeed's estimators count them (default) or as the ZeRO paper")
    parser.add_argument("--json", action="store_true", help="machine-readable output, in bytes")


def _recipe(args):
    """The run to estimate: the recipe as it will run (with these flags as its overrides), or a bare model."""

    if args.flash_attention and args.attn_implementation not in (None, "flash_attention_2"):
        raise UserError("--flash-attention", f"contradicts --attn-implementation {args.attn_implementation}",
                        "give one of them")
    use_peft = args.use_peft
    flags = {"model_name_or_path": args.model, "use_peft": "true" if use_peft else None,
             "load_in_4bit": "true" if args.load_in_4bit else None,
             "lora_r": at_least("--lora-r", args.lora_r),
             "per_device_train_batch_size": at_least("--micro-batch", args.micro_batch),
             "gradient_accumulation_steps": at_least("--gradient-accumulation", args.gradient_accumulation),
             "gradient_checkpointing": "true" if args.gradient_checkpointing else None,
             "attn_implementation": "flash_attention_2" if args.flash_attention else args.attn_implementation}
    flags["max_seq_length"] = at_least("--seq-len", args.seq_len)
    overrides = [str(x) for k, v in flags.items() if v is not None for x in (f"--{k}", v)]
    if args.config:
        recipe = read_recipe(args.config, overrides)
    else:
        if not args.model:
            raise UserError("--model", "no model given", "pass --model NAME or a --config recipe")
        from hf_zero.plan.arguments import ModelArguments
        context = getattr(get_model_config(str(args.model)).get_text_config(), "max_position_embeddings", 0) or 2048
        margs = ModelArguments(model_name_or_path=str(args.model), use_peft=bool(use_peft),
                               load_in_4bit=bool(args.load_in_4bit),
                               **({"lora_r": args.lora_r} if args.lora_r else {}))
        recipe = RecipeMemory(model=str(args.model), micro=args.micro_batch or 1,
                              accumulation=args.gradient_accumulation or 1, seq_len=min(context, 2048),
                              lora=lora_fields(margs), gradient_checkpointing=bool(args.gradient_checkpointing),
                              attn_implementation=flags["attn_implementation"],
                              load_in_4bit=bool(args.load_in_4bit and use_peft))
    if recipe.lora is not None and args.lora_target_modules:
        recipe = replace(recipe, lora={**recipe.lora, "target_modules": args.lora_target_modules},
                         flags=recipe.flags + (("lora_target_modules", tuple(args.lora_target_modules)),))
    if recipe.lora is None and args.load_in_4bit:
        raise UserError("--load-in-4bit", "a 4-bit base cannot be trained, only adapters on it", "add --use-peft")
    if recipe.lora is None and (args.lora_target_modules or args.lora_r):
        raise UserError("--lora-r/--lora-target-modules", "given without LoRA", "add --use-peft")
    if args.seq_len and recipe.seq_len != args.seq_len:  # stages with their own lengths: this estimate only
        recipe = replace(recipe, seq_len=args.seq_len, stage=None)
    return recipe


def run(args) -> int:
    quiet_environment()  # DeepSpeed's accelerator probe would print into stdout, which --json must keep clean
    recipe = _recipe(args)
    strategies, prof = strategies_for(args.profile)
    run_plan = _run_plan(recipe, prof, args)
    shape = launch_shape(prof, nproc=at_least("--gpus-per-node", args.gpus_per_node),
                         nodes=at_least("--nodes", args.nodes))
    gpn, nodes = shape.per_machine, shape.nodes
    precision = run_plan.precision if run_plan else with_precision(prof, args.precision).precision if prof else \
        args.precision or "bf16"
    gpu_mem = parse_bytes(args.gpu_memory, "--gpu-memory") if args.gpu_memory else None
    cpu_mem = parse_bytes(args.cpu_memory, "--cpu-memory") if args.cpu_memory else None
    sp = prof.sp_size if prof else 1  # a sequence-parallel profile: activations split over sp ranks
    batch = run_plan.batch if run_plan else resolve_batch(
        {"per_device_train_batch_size": recipe.micro, "gradient_accumulation_steps": recipe.accumulation,
         "global_batch_size": recipe.global_batch}, shape.world)
    try:
        # a multimodal or VLM recipe: the LLM with its encoders and projectors or vision tower, counted once for the
        # table and the recommendation alike
        composed, parts = _composed(recipe) or (None, None)
        recipe = replace(recipe, parts=parts)
        count = parts.count if parts else count_model(get_model_config(recipe.model), lora=recipe.lora)
    except ValueError as err:  # peft: target modules not in the model
        raise UserError("--lora-target-modules" if recipe.lora else "--model", str(err).splitlines()[0]) from None
    usable = int(gpu_mem * (1 - HEADROOM)) if gpu_mem else None
    kw = dict(gpus_per_node=gpn, nodes=nodes, precision=precision, seq_len=recipe.seq_len,
              grad_checkpointing=recipe.gradient_checkpointing, convention=args.convention,
              attn_implementation=recipe.attn_implementation, sp_size=sp,
              fused_cross_entropy=recipe.fused_cross_entropy, use_liger_kernel=recipe.use_liger_kernel,
              extra_activations=parts.activation_bytes(precision) if parts else 0,
              sequences_per_row=recipe.sequences_per_row)  # a dpo stage's peak: chosen + rejected per row
    # LoRA over every strategy: QLoRA's 4-bit base as rows of their own where it is most used; a 4-bit recipe: only
    # those, under every strategy that runs it
    rows = [(s, None) for s in strategies if not recipe.load_in_4bit]
    if recipe.lora is not None and args.convention == "deepspeed" and (composed is None or recipe.load_in_4bit):
        rows += [(s, "nf4") for s in strategies if s in memory.QLORA_STRATEGIES and (
            recipe.load_in_4bit or len(strategies) > 1 and s in ("ddp", "zero3", "fsdp2"))]
    if not rows:
        raise UserError("load_in_4bit", f"no {args.convention}-convention estimate of a 4-bit base under "
                        f"{', '.join(strategies)}", "use the deepspeed convention and a profile without NVMe")
    estimates = [memory.estimate(count, s, frozen_base=base, micro_batch=batch.micro,
                                 grad_accumulation=batch.accumulation, gpu_memory_bytes=usable,
                                 cpu_memory_bytes=cpu_mem, **kw) for s, base in rows]
    rec = None
    if gpu_mem is not None:
        choices = [(prof.name, strategies[0])] if prof else None
        rec = plan(recipe, gpn, gpu_mem, nodes=nodes, precision=precision, cpu_memory_bytes=cpu_mem, choices=choices,
                   sp_size=sp)
        if rec["profile"]:
            rec["largest_micro_batch"] = memory.largest_micro_batch(
                count, rec["strategy"], usable, cpu_mem, frozen_base="nf4" if rec["load_in_4bit"] else None,
                **{**kw, "sp_size": rec["sp_size"]})
    seq_par = _sequence_parallel(recipe, count, shape.world, usable, args, batch, kw)
    layer = count.layer
    name = recipe.model + (parts.label if parts else "")
    summary = {"name": name, "params": count.total_params, "largest_layer_params": count.largest_layer_params,
               "trainable_params": count.trainable_params, "num_layers": count.num_layers,
               "hidden_size": count.hidden_size, "vocab_size": count.vocab_size,
               "autocast_params": count.autocast_params}
    inputs = {"gpus_per_node": gpn, "nodes": nodes, "precision": precision, "micro_batch": batch.micro,
              "gradient_accumulation": batch.accumulation, "seq_len": recipe.seq_len, "longest_stage": recipe.stage,
              "packing": recipe.packing, "gradient_checkpointing": recipe.gradient_checkpointing,
              "attn_implementation": recipe.attn_implementation or (layer.attn_implementation if layer else None),
              "lora": recipe.lora, "gpu_memory_bytes": gpu_mem, "cpu_memory_bytes": cpu_mem, "recipe": recipe.path,
              "sp_size": sp, "world_size": shape.world, "batch": batch.line(),
              "sequences_per_row": recipe.sequences_per_row, "preference": _preference(recipe),
              # the cpu profile's ranks are processes on the CPU: the table names them so, not GPUs
              "device": "CPU rank" if prof is not None and (prof.name == "cpu" or prof.raw.get("use_cpu")) else "GPU"}
    multimodal = composed.summary(precision, batch.micro) if composed else None
    if args.json:
        print(json.dumps({"model": summary, "convention": args.convention, "inputs": inputs, "strategies": estimates,
                          "recommendation": rec, "sequence_parallel": seq_par, "multimodal": multimodal,
                          "plan": run_plan.record() if run_plan else None}, indent=2))
        return 0
    print_table(summary, inputs, args.convention, estimates, rec,
                 composed.lines(precision, batch.micro) if composed else ())
    if seq_par:
        print_sequence_parallel(seq_par, inputs["gpus_per_node"], precision)
    return 0


def _preference(recipe) -> list[dict]:
    """Each dpo stage: its rows' reference cache on disk (hf_zero.train.reference_cache), none when reference-free."""
    return [{"stage": name, "loss_type": loss, "reference_rows": rows, "sequences_per_row": 2,
             "cache": f"output_dir/reference_logps/{name}.safetensors",
             "cache_bytes": None if rows is None else reference_cache_bytes(rows)}
            for name, loss, rows in recipe.preference]


def _run_plan(recipe, prof, args):
    """A recipe under a profile: the run plan `hf-zero train` would resolve for these flags (hf_zero.plan.run_plan);
    None for a bare model or a strategy name, which no launch runs as given."""
    if prof is None or not recipe.path:
        return None
    return resolve_plan(prof, str(recipe_script(None, recipe.path)), ["--config", recipe.path, *_overrides(recipe)],
                        nproc=at_least("--gpus-per-node", args.gpus_per_node), nodes=at_least("--nodes", args.nodes),
                        precision=args.precision, env={})


def _overrides(recipe) -> list[str]:
    """The recipe's flags as `hf-zero train` takes them after the YAML."""
    return [x for k, v in recipe.flags for x in (f"--{k}", *(v if isinstance(v, tuple) else (v,)))]


def _composed(recipe):
    """(A multimodal recipe's composed model or a stock VLM's, counted on the meta device with the estimate's flags
    as its overrides; its CountedParts): hf_zero.train.recipe_count. None for any other recipe or a bare model."""
    if not recipe.path:
        return None
    from hf_zero.train.recipe_count import count_recipe_model

    return count_recipe_model(recipe.path, _overrides(recipe))


def _sequence_parallel(recipe, count, world: int, usable, args, batch, kw) -> dict | None:
    """A recipe on several GPUs: each stage's ZeRO-3 peak without and with Ulysses sequence parallelism at every
    size that can run (zero3_sp), and the smallest size that fits the longest stage; None where SP cannot apply
    (one GPU, a bare model, a 4-bit base, the paper's convention)."""
    if world < 2 or not recipe.path or recipe.load_in_4bit or args.convention != "deepspeed":
        return None
    sizes = sp_sizes(recipe, world)
    if not sizes:
        return None
    rows = sp_by_stage(recipe, count, sizes, usable, micro_batch=batch.micro, grad_accumulation=batch.accumulation,
                       **{k: v for k, v in kw.items() if k not in ("seq_len", "sp_size", "sequences_per_row")})
    longest = max(rows, key=lambda r: r["seq_len"] * r["sequences_per_row"])  # a dpo row: chosen + rejected
    return {"sizes": sizes, "stages": rows, "longest_stage": longest["stage"], "fitted": usable is not None,
            "recommended_sp_size": longest["fits_at_sp"], "config": recipe.path}
