"""What `hf-zero bench` runs, fixed before the first launch: the recipe made concrete (steps per stage, no evaluation,
no checkpoints), the samples of every step (for token counts, padding and the plain-Trainer baseline), the model's
parameter counts (for FLOPs and the memory estimate), and the spec the plain-Trainer script trains from."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from hf_zero.core.errors import UserError
from hf_zero.data.curriculum import build_sample_order, build_schedule
from hf_zero.data.model_names import get_model_config, get_tokenizer, resolve_model_path
from hf_zero.data.packing import padding_stats, real_tokens
from hf_zero.data.stages import load_stage_data
from hf_zero.estimate.flops import flops_per_token
from hf_zero.estimate.memory import estimate, strategies_for
from hf_zero.estimate.model_count import count_model
from hf_zero.plan.parse import load_yaml_config, parse_recipe_args, parse_stages, recipe_fields
from hf_zero.plan.profiles import Profile, gpu_count, load_profile, with_precision
from hf_zero.plan.reconcile import BatchPlan, reconcile_training_kwargs, resolve_batch
from hf_zero.plan.world import launch_shape

__all__ = ["BenchPlan", "build_plan", "run_profile", "recipe_types", "write_plain_spec", "estimate_bytes"]


@dataclass
class BenchPlan:
    recipe_yaml: Path  # the derived YAML every hf_zero run of the bench uses
    model: str
    model_path: str
    nproc: int
    micro: int
    accumulation: int
    global_batch: int
    seq_len: int
    learning_rates: list[float]
    packing: bool  # the recipe's own setting: what every strategy run and the plain baseline train
    text_tokens_per_step: list[int]  # of the rows trained (packed or not, as the recipe says)
    unpacked_text_tokens_per_step: list[int]
    packed_text_tokens_per_step: list[int]
    padding: dict  # {"unpacked": padding_stats, "packed": padding_stats} over the whole run
    count: object  # hf_zero.estimate.model_count.ModelCount
    flops_per_token: float
    model_args: object = field(repr=False, default=None)  # hf_zero.plan.arguments.ModelArguments
    training_kwargs: dict = field(repr=False, default_factory=dict)
    samples: list = field(repr=False, default_factory=list)  # the rows trained, in step order

    @property
    def total_steps(self) -> int:
        return len(self.learning_rates)

    @property
    def batch(self) -> BatchPlan:
        """Every strategy's batch (one rank count for all), as `hf-zero check` and the runs' banners show it."""
        return BatchPlan(self.micro, self.accumulation, self.nproc)


def run_profile(name: str, precision: str | None) -> Profile:
    """A strategy's profile as the bench runs it: in `--precision` when given, else in the profile's own."""
    return with_precision(load_profile(name), precision)


def recipe_types():
    from hf_zero.plan.arguments import CurriculumArguments, ModelArguments

    return ModelArguments, CurriculumArguments


def _truncate(stages, spans, steps: int | None) -> list[dict]:
    """Stages as YAML dicts with `steps` fixed: the first `steps` steps of the recipe (the last stage is lengthened
    when `steps` is more than the recipe has)."""
    from dataclasses import asdict

    out, left = [], steps if steps is not None else sum(s.steps for s in spans)
    for i, (stage, span) in enumerate(zip(stages, spans)):
        take = left if i == len(spans) - 1 else min(left, span.steps)
        if take <= 0:
            break
        d = {k: v for k, v in asdict(stage).items() if v is not None and k != "epochs"}
        d["steps"] = take
        d["warmup_steps"] = min(d.get("warmup_steps") or 0, take - 1)  # a warmup as long as the stage is refused
        out.append(d)
        left -= take
    return out


def build_plan(config: str, model: str | None, steps: int | None, nproc: int, extra: list[str], out: Path,
               min_steps: int = 1, keep_models: bool = False) -> BenchPlan:
    """Parse and check the recipe (a UserError before anything is launched or written), fix its steps, lay out its
    samples (as the recipe trains them, packed or not, and the other way for the packing comparison)."""
    import yaml

    from hf_zero.train.model import lora_kwargs

    raw = load_yaml_config(config)
    # A benchmark measures training: evaluation and checkpoints would land inside the timed steps.
    # Final models only when asked: four 1.1B runs would leave 13 GB behind.
    forced = {"eval_samples": 0, "save_strategy": "no", **({} if keep_models else {"save_final_model": False}),
              **({"model_name_or_path": model} if model else {})}
    argv = ["--config", config, *extra, *[x for k, v in forced.items() for x in (f"--{k}", str(v))]]
    model_args, stages, kwargs, _ = parse_recipe_args(recipe_types(), argv)
    data_args = recipe_fields(recipe_types()[-1], kwargs)
    if not stages:
        raise UserError("--config", f"{config} has no stages", "use a recipe with a `stages:` list")
    tokenizer = get_tokenizer(model_args.model_name_or_path, model_args.tokenizer_name_or_path)
    # every strategy's batch on `nproc` ranks of one machine, resolved as `hf-zero train` resolves it
    batch = resolve_batch({**kwargs, "global_batch_size": data_args.global_batch_size},
                          launch_shape(nproc=nproc).world)
    seed = int(kwargs["seed"])
    data = [load_stage_data(s, tokenizer, data_args.max_seq_length, data_args.text_field, 0, seed,
                            packing=data_args.packing) for s in stages]
    full = build_schedule(stages, [d.pool_size for d in data], batch.global_batch, kwargs["learning_rate"])
    if (steps or full.total_steps) < min_steps:
        raise UserError("--steps", f"the recipe has {full.total_steps} steps, fewer than {min_steps} (warm-up + 2)",
                        f"use --steps {min_steps} or more, or a smaller --warmup")
    stage_dicts = _truncate(stages, full.spans, steps)
    stages = parse_stages(stage_dicts, "bench")
    data = data[: len(stages)]
    schedule = build_schedule(stages, [d.pool_size for d in data], batch.global_batch, kwargs["learning_rate"])

    def lay_out(sources_per_stage):
        order = build_sample_order(schedule, [[len(s) for s in srcs] for srcs in sources_per_stage],
                                   [s.weights for s in stages], seed)
        return [sources_per_stage[st][src][int(i)] for st, src, i in order]

    def other_layout():
        return lay_out([load_stage_data(s, tokenizer, data_args.max_seq_length, data_args.text_field, 0, seed,
                                        packing=not data_args.packing).sources for s in stages])

    trained = lay_out([d.sources for d in data])
    unpacked, packed = (other_layout(), trained) if data_args.packing else (trained, other_layout())
    lengths = [s.max_seq_length or data_args.max_seq_length for s in stages]
    g = batch.global_batch

    def per_step(rows):
        return [sum(real_tokens(r) for r in rows[k * g:(k + 1) * g]) for k in range(schedule.total_steps)]

    out.mkdir(parents=True, exist_ok=True)
    recipe_yaml = out / "recipe.yaml"
    derived = {**raw, **forced, "stages": stage_dicts}
    recipe_yaml.write_text(f"# Written by `hf-zero bench` from {config}: steps fixed per stage, no eval or "
                           f"checkpoints.\n# Launch: hf-zero train --config {recipe_yaml}\n\n"
                           + yaml.safe_dump(derived, sort_keys=False))
    config_obj = get_model_config(model_args.model_name_or_path)
    count = count_model(config_obj, lora=lora_kwargs(model_args, "CAUSAL_LM") if model_args.use_peft else None)
    seq_len = max(lengths)
    return BenchPlan(
        recipe_yaml=recipe_yaml, model=model_args.model_name_or_path,
        model_path=resolve_model_path(model_args.model_name_or_path), nproc=nproc, micro=batch.micro,
        accumulation=batch.accumulation, global_batch=g, seq_len=seq_len,
        learning_rates=[schedule.lr_at(k) for k in range(schedule.total_steps)], packing=bool(data_args.packing),
        text_tokens_per_step=per_step(trained),
        unpacked_text_tokens_per_step=per_step(unpacked), packed_text_tokens_per_step=per_step(packed),
        padding={"unpacked": padding_stats(unpacked, batch.micro), "packed": padding_stats(packed, batch.micro)},
        count=count, flops_per_token=flops_per_token(count, config_obj, seq_len), model_args=model_args,
        training_kwargs=kwargs, samples=trained)


def write_plain_spec(plan: BenchPlan, profile_name: str, precision: str | None, folder: Path) -> Path:
    """spec.json, samples.jsonl and ds_config.json for benchmarks/plain_trainer.py: the training hf_zero runs for
    `profile_name`, spelled out for a script that imports no hf_zero code: TrainingArguments exactly as hf_zero
    reconciles them (only the values that differ from transformers' defaults), the model's `from_pretrained` arguments
    (dtype, attention), LoRA's settings, the seed it is built under, and the rows of every step as hf_zero's
    collator receives them (packed rows with their position_ids)."""
    import dataclasses

    from transformers import TrainingArguments

    from hf_zero.train.model import base_precision, causal_lm_load_kwargs, lora_kwargs

    prof = run_profile(profile_name, precision)
    kwargs, _ = reconcile_training_kwargs(dict(plan.training_kwargs), prof, plan.nproc, has_gpu=gpu_count() > 0,
                                          global_batch=plan.global_batch)
    kwargs.update(max_steps=plan.total_steps, train_sampling_strategy="sequential", disable_tqdm=True)
    ds = kwargs.pop("deepspeed", None)
    defaults = {f.name: f.default for f in dataclasses.fields(TrainingArguments) if f.init}
    training_args = {k: v for k, v in kwargs.items()
                     if k in defaults and k != "output_dir" and v != defaults[k]}
    folder.mkdir(parents=True, exist_ok=True)
    keys = ("input_ids", "labels", "position_ids")
    with open(folder / "samples.jsonl", "w") as fh:
        for s in plan.samples:
            fh.write(json.dumps({k: s[k] for k in keys if k in s}) + "\n")
    ds_path = None
    if ds:
        ds_path = folder / "ds_config.json"
        ds_path.write_text(json.dumps(ds, indent=2))
    load = causal_lm_load_kwargs(plan.model_args, plan.packing, bool(kwargs.get("bf16") or kwargs.get("fp16")),
                                 base_precision(plan.model_args.use_peft, prof))
    load["dtype"] = str(load["dtype"]).removeprefix("torch.")
    spec = {"model": plan.model_path, "samples": str(folder / "samples.jsonl"), "learning_rates": plan.learning_rates,
            "training_args": training_args, "deepspeed_config": str(ds_path) if ds_path else None,
            "from_pretrained": load, "seed": int(plan.training_kwargs["seed"]), "packing": plan.packing,
            "lora": lora_kwargs(plan.model_args, "CAUSAL_LM") if plan.model_args.use_peft else None}
    path = folder / "spec.json"
    path.write_text(json.dumps(spec, indent=2, default=str))
    return path


def estimate_bytes(plan: BenchPlan, profile_name: str, precision: str) -> dict:
    """`hf-zero estimate`'s model states per rank for this profile (params, grads, optimizer, gathered layer and the
    communication buffers, as bench measures them): {"device", "host" (offloaded, per rank), "source"}."""
    (strategy,), _ = strategies_for(profile_name)
    e = estimate(plan.count, strategy, world_size=plan.nproc, gpus_per_node=plan.nproc, precision=precision,
                 micro_batch=plan.micro, seq_len=plan.seq_len, additional_buffer_factor=1.0)
    g = e["gpu_bytes_per_rank"]
    device = g["model_states"] + g["buffers"]
    # the states moved to host RAM, per rank (no load-time buffer factor)
    host = e["cpu_bytes_per_node"] // plan.nproc if "offload" in strategy else 0
    if strategy.startswith("fsdp"):
        # FSDP2 has resharded every layer and freed its all-gather buffer by the optimizer step, where bench
        # measures; host: its shards alone (the fp32 model each rank reads before sharding is gone by then).
        device, host = g["model_states"] - g["gathered"], e["offloaded_bytes_per_rank"]
    return {"device": int(device), "host": int(host), "source": e["source"]}
