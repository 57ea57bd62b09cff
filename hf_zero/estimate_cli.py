"""`hf-zero estimate`: memory per rank for DDP and every ZeRO strategy, before you pay for GPUs.

    hf-zero estimate --model smollm2-135m-instruct --gpus-per-node 4 --gpu-memory 48GiB
    hf-zero estimate --config recipes/configs/my_recipe.yaml --profile l40x4 --json

Model states follow DeepSpeed's own estimators (`--convention deepspeed`, the default) or the ZeRO paper's formulas
(`--convention paper`); activations and buffers are added to both (see hf_zero/memory.py for every formula).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from .errors import UserError

__all__ = ["add_arguments", "run", "parse_bytes"]

_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
RECIPE_KEYS = ("model_name_or_path", "use_peft", "lora_r", "lora_target_modules", "per_device_train_batch_size",
               "max_seq_length", "gradient_checkpointing")


def parse_bytes(text: str, flag: str) -> int:
    """"48GiB", "80 GB", "512MiB" -> bytes (GB = 10^9, GiB = 2^30)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]+)\s*", str(text))
    if not match or match.group(2).lower() not in _UNITS or float(match.group(1)) <= 0:
        raise UserError(flag, f"cannot read {text!r} as a memory size", "write it like 48GiB, 80GB or 512MiB")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def add_arguments(parser) -> None:
    from .memory import CONVENTIONS, PRECISIONS

    parser.add_argument("--model", help="tiny-llama, smollm2-135m-instruct, a local folder or config.json, a hub id")
    parser.add_argument("--config", help="recipe YAML: reads model_name_or_path, use_peft, lora_r, "
                        "lora_target_modules, per_device_train_batch_size, max_seq_length, gradient_checkpointing")
    parser.add_argument("--profile", default="all", help="a profile (its strategy, GPUs and precision), a strategy "
                        "name, or 'all' (default: every strategy)")
    parser.add_argument("--gpus-per-node", type=int, help="GPUs (ranks) per node (default: the profile's, else 1)")
    parser.add_argument("--nodes", type=int, help="number of nodes (default: the profile's, else 1)")
    parser.add_argument("--precision", choices=PRECISIONS, help="default: the profile's, else bf16")
    parser.add_argument("--use-peft", action="store_true", default=None, help="LoRA: train adapters only")
    parser.add_argument("--lora-r", type=int, metavar="R", help="LoRA rank (default: the recipe's, else 16)")
    parser.add_argument("--lora-target-modules", nargs="+", metavar="NAME", help="default: peft's for the model")
    parser.add_argument("--micro-batch", type=int, help="samples per rank per step (default: the recipe's, else 1)")
    parser.add_argument("--seq-len", type=int, help="tokens per sample (default: the recipe's max_seq_length, "
                        "else the model's context up to 2048)")
    parser.add_argument("--gradient-checkpointing", action="store_true", default=None)
    parser.add_argument("--flash-attention", action="store_true",
                        help="attention scores never materialized (flash/SDPA): drops that activation term")
    parser.add_argument("--gpu-memory", help="memory per GPU, e.g. 48GiB or 80GB: adds fits, a recommendation and "
                        "the largest micro batch")
    parser.add_argument("--cpu-memory", help="CPU RAM per node, e.g. 512GiB (offload strategies must fit it too)")
    parser.add_argument("--convention", choices=CONVENTIONS, default="deepspeed",
                        help="model states as DeepSpeed's estimators count them (default) or as the ZeRO paper")
    parser.add_argument("--json", action="store_true", help="machine-readable output, in bytes")


def _read_recipe(path: str | None) -> dict:
    if not path:
        return {}
    import yaml

    file = Path(path)
    if not file.is_file():
        raise UserError("--config", f"{path} does not exist", "give the path to a recipe YAML")
    try:
        raw = yaml.safe_load(file.read_text()) or {}
    except yaml.YAMLError as err:
        raise UserError("--config", f"{file.name} is not valid YAML ({str(err).splitlines()[0]})") from None
    if not isinstance(raw, dict):
        raise UserError("--config", f"{file.name} is not a mapping of settings")
    recipe = {k: raw[k] for k in RECIPE_KEYS if raw.get(k) is not None}
    for key, value in recipe.items():
        ok = {"use_peft": isinstance(value, bool), "gradient_checkpointing": isinstance(value, bool),
              "model_name_or_path": isinstance(value, str),
              "lora_target_modules": isinstance(value, (str, list))}.get(key, type(value) is int and value >= 1)
        if not ok:
            raise UserError(f"{file.name}: {key}", f"unexpected value {value!r}", "fix it in the recipe")
    return recipe


def _strategy_of(name: str):
    """(strategy names, profile or None) for --profile."""
    from .memory import STRATEGIES
    from .profiles import list_profiles, load_profile

    if name == "all":
        return list(STRATEGIES), None
    if name in STRATEGIES and name not in list_profiles():
        return [name], None
    try:
        prof = load_profile(name)
    except UserError as err:
        raise UserError("--profile", err.problem, f"{err.fix}, a strategy ({', '.join(STRATEGIES)}) or all") from None
    if not prof.uses_deepspeed or not prof.zero_stage:
        return ["ddp"], prof
    devices = (prof.offload_optimizer, prof.offload_param)
    if prof.zero_stage == 3:
        strategy = ("zero3_nvme" if "nvme" in devices else "zero3_offload" if prof.offload_param == "cpu"
                    else "zero3_offload_optimizer" if prof.offload_optimizer == "cpu" else "zero3")
    else:
        strategy = f"zero{prof.zero_stage}" + ("_offload" if prof.zero_stage == 2 and "cpu" in devices else "")
    return [strategy], prof


def _positive(value, flag):
    if value is not None and int(value) < 1:
        raise UserError(flag, f"must be at least 1, got {value}")
    return value


def _human(b) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if b >= size:
            return f"{b / size:.2f} {unit}"
    return f"{int(b)} B"


def run(args) -> int:
    from . import memory
    from .models import get_model_config

    recipe = _read_recipe(args.config)
    model = args.model or recipe.get("model_name_or_path")
    if not model:
        raise UserError("--model", "no model given", "pass --model NAME or a --config recipe with model_name_or_path")
    strategies, prof = _strategy_of(args.profile)
    gpn = _positive(args.gpus_per_node, "--gpus-per-node") or (
        max(prof.num_processes // max(prof.num_machines, 1), 1) if prof else 1)
    nodes = _positive(args.nodes, "--nodes") or (prof.num_machines if prof else 1)
    precision = args.precision or (prof.precision if prof else "bf16")
    use_peft = bool(args.use_peft if args.use_peft is not None else recipe.get("use_peft", False))
    if not use_peft and (args.lora_r is not None or args.lora_target_modules):
        raise UserError("--lora-r/--lora-target-modules", "given without LoRA", "add --use-peft")
    lora_r = int(_positive(args.lora_r, "--lora-r") or recipe.get("lora_r") or 16)
    targets = args.lora_target_modules or recipe.get("lora_target_modules")
    micro = int(_positive(args.micro_batch, "--micro-batch") or recipe.get("per_device_train_batch_size") or 1)
    ckpt = bool(args.gradient_checkpointing if args.gradient_checkpointing is not None
                else recipe.get("gradient_checkpointing", False))
    gpu_mem = parse_bytes(args.gpu_memory, "--gpu-memory") if args.gpu_memory else None
    cpu_mem = parse_bytes(args.cpu_memory, "--cpu-memory") if args.cpu_memory else None

    config = get_model_config(str(model))
    lora = {"r": lora_r, "target_modules": targets} if use_peft else None
    try:
        count = memory.count_model(config, lora=lora)
    except ValueError as err:  # peft: target modules not in the model
        raise UserError("--lora-target-modules" if lora else "--model", str(err).splitlines()[0]) from None
    context = getattr(config.get_text_config(), "max_position_embeddings", None) or 2048
    seq = int(_positive(args.seq_len, "--seq-len") or recipe.get("max_seq_length") or min(context, 2048))
    kw = dict(gpus_per_node=gpn, nodes=nodes, precision=precision, micro_batch=micro, seq_len=seq,
              grad_checkpointing=ckpt, convention=args.convention, flash_attention=args.flash_attention)
    estimates = memory.estimate_all(count, strategies, gpu_memory_bytes=gpu_mem, cpu_memory_bytes=cpu_mem, **kw)
    rec = None
    if gpu_mem is not None:
        name, reason = memory.recommend(estimates, gpu_mem, cpu_mem)
        if name is None and micro > 1:  # maybe a smaller micro batch fits
            smaller = memory.estimate_all(count, strategies, **{**kw, "micro_batch": 1})
            name, reason = memory.recommend(smaller, gpu_mem, cpu_mem)
            reason = f"at micro-batch 1: {reason}" if name else reason
        kw.pop("micro_batch")
        best = memory.largest_micro_batch(count, name, gpu_mem, cpu_mem, **kw) if name else 0
        rec = {"strategy": name, "micro_batch": best, "reason": reason}

    summary = {"name": str(model), "params": count.total_params, "largest_layer_params": count.largest_layer_params,
               "trainable_params": count.trainable_params, "num_layers": count.num_layers,
               "hidden_size": count.hidden_size, "vocab_size": count.vocab_size}
    inputs = {"gpus_per_node": gpn, "nodes": nodes, "precision": precision, "micro_batch": micro, "seq_len": seq,
              "gradient_checkpointing": ckpt, "flash_attention": args.flash_attention,
              "lora_r": lora_r if lora else None, "lora_target_modules": targets if lora else None,
              "gpu_memory_bytes": gpu_mem, "cpu_memory_bytes": cpu_mem}
    if args.json:
        print(json.dumps({"model": summary, "convention": args.convention, "inputs": inputs, "strategies": estimates,
                          "recommendation": rec}, indent=2))
        return 0
    _print_table(summary, inputs, args.convention, estimates, rec, lora)
    return 0


def _print_table(summary, inputs, convention, estimates, rec, lora) -> None:
    out = sys.stdout
    trainable = (f", trainable {summary['trainable_params']:,} (LoRA r={inputs['lora_r']})" if lora else "")
    print(f"model {summary['name']}: {summary['params']:,} params{trainable}, largest layer "
          f"{summary['largest_layer_params']:,}; {inputs['precision']}, {inputs['nodes']} node(s) x "
          f"{inputs['gpus_per_node']} GPU(s), micro-batch {inputs['micro_batch']} x {inputs['seq_len']} tokens"
          f"{', gradient checkpointing' if inputs['gradient_checkpointing'] else ''}; convention {convention}",
          file=out)
    head = ("strategy", "params", "grads", "optimizer", "gathered", "activations", "buffers", "total/GPU", "CPU/node",
            "NVMe", "fits")
    rows = []
    for e in estimates:
        g = e["gpu_bytes_per_rank"]
        cells = [g[k] for k in ("params", "grads", "optimizer", "gathered", "activations", "buffers", "total")]
        rows.append([e["name"], *map(_human, cells), _human(e["cpu_bytes_per_node"]),
                     _human(e["nvme_bytes"]) if e["nvme_bytes"] else "-",
                     {None: "-", True: "yes", False: "no"}[e["fits"]]])
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    for r in [head, *rows]:
        print("  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(r, widths))),
              file=out)
    if any(e["source"].startswith("deepspeed") for e in estimates):
        print("model states of ZeRO-2/3 (+offload): DeepSpeed's estimate_zero{2,3}_model_states_mem_needs; "
              "activations: Korthikanti et al. 2022", file=out)
    if rec is not None:
        if rec["strategy"]:
            print(f"recommended: {rec['strategy']}, micro-batch {rec['micro_batch']} ({rec['reason']})", file=out)
        else:
            print(f"recommended: none ({rec['reason']})", file=out)
