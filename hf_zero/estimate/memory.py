"""Memory per rank before launch: model states, activations and buffers for DDP, every ZeRO strategy and FSDP2.

`estimate(count, strategy, job)`: a model's counts (hf_zero.estimate.model_count), a strategy (STRATEGIES) and what
the run is (hf_zero.estimate.memory_job.MemoryJob: the launch, the batch, the settings that change what a rank
holds), in four steps: the counts as the engine holds the weights (held_counts: a 4-bit base's packed linears),
the model states and host bytes (hf_zero.estimate.model_states, whose docstring has the accounting per strategy),
the peak of the step's phases (forward/backward activations from hf_zero.estimate.activations, or the optimizer
step), and what a checkpoint writes.

Peak on a GPU ("total", what torch.cuda.max_memory_allocated reports) = the larger of the optimizer step (model
states + buffers) and the forward/backward peak: the states that stay allocated through a step
(model_states.resident) + the saved activations, loss and autocast copies.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from hf_zero.core.errors import UserError
from hf_zero.estimate import model_states
from hf_zero.estimate.activations import ATTENTION, step_bytes
from hf_zero.estimate.memory_job import MemoryJob
from hf_zero.estimate.model_count import ModelCount, nf4_bytes
from hf_zero.plan.liger import liger_installed
from hf_zero.plan.profiles import PRECISIONS, list_profiles, load_profile
from hf_zero.plan.world import launch_shape

__all__ = ["strategies_for", "STRATEGIES", "QLORA_STRATEGIES", "estimate", "largest_micro_batch", "MemoryJob",
           "held_counts"]

STRATEGIES = ("ddp", "zero1", "zero2", "zero2_offload", "zero3", "zero3_offload_optimizer", "zero3_offload",
              "zero3_nvme", "fsdp2", "fsdp2_offload")
# Where a 4-bit base (QLoRA) runs, as hf_zero.plan.quantization.verify_quantization allows it: not with NVMe offload
QLORA_STRATEGIES = tuple(s for s in STRATEGIES if s != "zero3_nvme")
CONVENTIONS = ("deepspeed", "paper")


@dataclass(frozen=True)
class _Held:
    """The counts as the engine holds the weights, and what a 4-bit base adds."""

    count: ModelCount
    frozen_bytes: int  # bytes per frozen parameter under the Trainer and FSDP2
    constants: int = 0  # a 4-bit base's quantization constants, whole on every rank
    dequantized: int = 0  # the one linear dequantized to 16 bits in forward and backward


def estimate(count: ModelCount, strategy: str, job: MemoryJob | None = None, **fields) -> dict:
    """Bytes per GPU rank, CPU bytes per node, NVMe bytes per node and checkpoint bytes for one strategy. `job`
    describes the run (MemoryJob's fields, each documented there); `fields` build one, or change the job's."""
    job = replace(job, **fields) if job is not None else MemoryJob(**fields)
    per_node, nodes, world = _launch(job)
    attention, frozen_base = _checked(count, strategy, job)
    mixed = job.precision != "fp32"
    held = held_counts(count, strategy, mixed, frozen_base)
    c = held.count
    (params, grads, optim, gathered), cpu_rank, nvme_rank = model_states.states(
        strategy, c, world, mixed, job.convention, held.frozen_bytes, job.reduce_bucket_size)
    cpu = _host_bytes(c, strategy, job, per_node, cpu_rank, held.frozen_bytes)
    source = f"hf_zero {job.convention} formula"
    if (job.use_deepspeed_estimators and job.convention == "deepspeed" and mixed
            and strategy in model_states.DEEPSPEED_ESTIMATORS and c.trainable_params == c.total_params):
        cpu, optim, source = _deepspeed_figures(c, strategy, job, per_node, nodes, (params, grads, gathered))
    gpu = {"params": int(params + held.constants), "grads": int(grads), "optimizer": int(optim),
           "gathered": int(gathered)}
    gpu["model_states"] = sum(gpu.values())
    gpu["buffers"] = int(model_states.buffers(strategy, c, world, mixed, job.reduce_bucket_size,
                                              job.prefetch_bucket_size, job.param_persistence_threshold))
    phase, resident, activations, peak = _peak(count, held, strategy, job, world, attention, frozen_base, gpu)
    gpu.update(resident=int(resident), activations=int(activations), total=int(peak) + gpu["buffers"])
    fits = None if job.gpu_memory_bytes is None else \
        gpu["total"] <= job.gpu_memory_bytes and (job.cpu_memory_bytes is None or cpu <= job.cpu_memory_bytes)
    return {"name": strategy, "convention": job.convention, "source": source, "gpu_bytes_per_rank": gpu,
            "peak": phase, "frozen_base": frozen_base if c.trainable_params < c.total_params else None,
            "cpu_bytes_per_node": int(cpu), "offloaded_bytes_per_rank": int(cpu_rank),
            "nvme_bytes": int(per_node * nvme_rank), "checkpoint_bytes": int(_checkpoint_bytes(c, strategy, mixed)),
            "fits": fits}


def _launch(job: MemoryJob) -> tuple[int, int, int]:
    """(ranks per machine, machines, world): `world_size` without `nodes` (a bench's one machine, a test's paper
    table) is machines of gpus_per_node each."""
    per_node = int(job.gpus_per_node or 1)
    nodes = (1 if job.world_size is None else job.world_size // per_node) if job.nodes is None else int(job.nodes)
    world = launch_shape(nproc=per_node, nodes=max(nodes, 1)).world
    if per_node < 1 or nodes < 1 or job.world_size not in (None, world):
        raise ValueError(f"world_size={job.world_size!r} is not gpus_per_node={job.gpus_per_node!r} x {nodes=}")
    return per_node, nodes, world


def _checked(count: ModelCount, strategy: str, job: MemoryJob) -> tuple[str | None, str]:
    """(the attention kernel, the frozen base's precision) once the job is one the estimate knows."""
    attention = "flash_attention_2" if job.flash_attention else job.attn_implementation
    frozen_base = job.frozen_base or job.precision
    if frozen_base == "nf4" and (strategy not in QLORA_STRATEGIES or not count.quantizable
                                 or job.convention != "deepspeed" or count.trainable_params == count.total_params):
        raise ValueError(f"no 4-bit base under {strategy=} / convention={job.convention!r} without LoRA or linears")
    if strategy not in STRATEGIES or job.precision not in PRECISIONS or frozen_base not in (*PRECISIONS, "nf4") or \
            job.convention not in CONVENTIONS or job.micro_batch < 1 or job.seq_len < 1 or \
            job.grad_accumulation < 1 or job.sp_size < 1 or attention not in (None, *ATTENTION):
        raise ValueError(f"bad {strategy=} / precision={job.precision!r} / convention={job.convention!r} / "
                         f"micro_batch={job.micro_batch!r} / seq_len={job.seq_len!r} / "
                         f"grad_accumulation={job.grad_accumulation!r} / {attention=} / {frozen_base=}")
    return attention, frozen_base


def held_counts(count: ModelCount, strategy: str, mixed: bool, frozen_base: str) -> _Held:
    """The counts as the engine holds the weights. A 4-bit base (frozen_base "nf4"): its packed weights counted as
    elements of the dtype they are held in, so that the strategies' rows apply: DeepSpeed casts everything to 16
    bits (fp32 runs: 4 bytes); the Trainer and FSDP2 hold the norms in fp32 and the embeddings in 16 bits
    (hf_zero.train.model.embeddings_in_16bit), and every rank's quantization constants whole."""
    if frozen_base != "nf4":
        return _Held(count, 4 if frozen_base == "fp32" else 2)
    packed, constants = nf4_bytes(count)
    unit = weight_bytes = 2 if mixed else 4
    if not strategy.startswith("zero"):
        unit, tables = 4, sum(count.embeddings)
        count = replace(count, total_params=count.total_params - tables + tables * weight_bytes // unit)
    count = replace(count, total_params=count.total_params - sum(count.quantizable) + packed // unit,
                    param_shapes=model_states.packed_shapes(count, weight_bytes))
    return _Held(count, 4, constants, weight_bytes * max(count.quantizable))


def _host_bytes(count: ModelCount, strategy: str, job: MemoryJob, per_node: int, offloaded: float,
                frozen_bytes: int) -> float:
    """CPU bytes per machine, as DeepSpeed counts them: each rank reads the model as it loads it (DeepSpeed in fp32,
    under zero.Init one layer at a time; the Trainer and FSDP2 the base in its bytes), or holds what is offloaded,
    times additional_buffer_factor."""
    zero3_init = strategy.startswith("zero3") and job.zero_init
    loaded = 4 * count.total_params if strategy.startswith("zero") else \
        frozen_bytes * (count.total_params - count.trainable_params) + 4 * count.trainable_params
    load = per_node * (4 * count.largest_layer_params if zero3_init else loaded)
    held = per_node * offloaded
    return job.additional_buffer_factor * ((held or load) if zero3_init else max(load, held))


def _deepspeed_figures(count: ModelCount, strategy: str, job: MemoryJob, per_node: int, nodes: int, ours: tuple):
    """(host bytes, optimizer bytes, source) from DeepSpeed's own estimator: its model-state total, of which `ours`
    (params, grads, gathered) are the split, the rest the optimizer's."""
    name, offload = model_states.DEEPSPEED_ESTIMATORS[strategy]
    args = dict(total_params=count.total_params, num_gpus_per_node=per_node, num_nodes=nodes,
                additional_buffer_factor=job.additional_buffer_factor, **offload)
    if name == "zero3":
        args.update(largest_layer_params=count.largest_layer_params, zero_init=job.zero_init)
    cpu, gpu_model_states = model_states.deepspeed_estimators()[name](**args)[:2]
    return cpu, gpu_model_states - sum(int(x) for x in ours), f"deepspeed estimate_{name}_model_states_mem_needs"


def _peak(count: ModelCount, held: _Held, strategy: str, job: MemoryJob, world: int, attention, frozen_base: str,
          gpu: dict) -> tuple[str, float, float, float]:
    """(the phase at the peak, the states resident through it, its activations, its bytes without buffers): each
    forward/backward phase's activations (activations.step_bytes) on top of the states that stay allocated, against
    the optimizer step's model states; under "paper" the textbook sum of every state and the largest activations.
    `count`: as the model is, for what its kernels decide (the fused loss, Liger); `held`: as the engine holds it."""
    c, mixed, quantized = held.count, job.precision != "fp32", frozen_base == "nf4"
    resident, grads_in_backward = model_states.resident(strategy, c, world, mixed, job.max_reuse_distance,
                                                        held.frozen_bytes, job.reduce_bucket_size)
    resident += held.constants
    if job.grad_accumulation > 1:  # gradients stay allocated between the micro-batches of one optimizer step
        resident, grads_in_backward = resident + grads_in_backward, 0
    # Autocast over fp32 weights keeps an fp32 residual stream and 16-bit weight copies; over a 16-bit frozen base
    # (LoRA) the stream is 16-bit and only the small fp32 adapters are cast, as under DeepSpeed.
    frozen16 = held.frozen_bytes == 2 and c.trainable_params < c.total_params
    mode = "fp32" if not mixed else "autocast" if strategy == "ddp" and not frozen16 else "half"
    liger = count.liger and (job.use_liger_kernel is True or job.use_liger_kernel == "auto" and liger_installed())
    phases = {} if c.layer is None else step_bytes(
        c.layer, c.num_layers, c.vocab_size, mode, job.micro_batch * job.sequences_per_row, job.seq_len,
        job.grad_checkpointing, attention, full=c.trainable_params == c.total_params, sp=job.sp_size,
        quantized=quantized, frozen_inputs=strategy.startswith("zero3") and not quantized,  # bnb's matmul is its own
        fused_loss=job.fused_cross_entropy in count.fused_loss and job.sequences_per_row == 1,  # dpo: full logits
        liger=liger)
    # Autocast over a 16-bit frozen base casts only the fp32 weights that train (adapters, and a composed model's or a
    # VLM's encoders and projectors): one cached 16-bit copy of each, which the matmuls save for backward.
    casts = 2 * c.autocast_params if mode == "half" and strategy == "ddp" and mixed else 0
    phases = {name: act + held.dequantized + casts + job.micro_batch * job.extra_activations
              for name, act in phases.items()}
    peaks = {name: resident + act + (grads_in_backward if name == "recompute" else 0) for name, act in phases.items()}
    # FSDP2 reshards every group by the end of backward: nothing is gathered at its optimizer step.
    peaks["optimizer step"] = gpu["model_states"] - (gpu["gathered"] if strategy.startswith("fsdp") else 0)
    if job.convention == "paper":
        peaks = {"sum": gpu["model_states"] + max(phases.values(), default=0)}
    phase = max(peaks, key=peaks.get)
    return phase, resident, phases.get(phase, max(phases.values(), default=0)), peaks[phase]


def _checkpoint_bytes(count: ModelCount, strategy: str, mixed: bool) -> float:
    """On disk: the weights (LoRA: the adapter only) + fp32 master and Adam moments over all ranks; DDP and FSDP2:
    fp32 weights + moments (FSDP2's fp32 shards are the master copy)."""
    saved = count.trainable_params if count.trainable_params < count.total_params else count.total_params
    if strategy == "ddp" or strategy.startswith("fsdp"):
        return 4 * saved + 8 * count.trainable_params
    return (2 if mixed else 4) * saved + 12 * count.trainable_params


def largest_micro_batch(count: ModelCount, strategy: str, gpu_memory_bytes: int, cpu_memory_bytes=None,
                        limit: int = 1024, **kwargs) -> int:
    """The largest micro batch in 1..limit whose total fits (0: not even 1). Memory grows with the micro batch."""
    kwargs.pop("micro_batch", None)

    def fits(mb):
        return estimate(count, strategy, micro_batch=mb, gpu_memory_bytes=gpu_memory_bytes,
                        cpu_memory_bytes=cpu_memory_bytes, **kwargs)["fits"]

    lo, hi = 0, limit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def strategies_for(name: str):
    """(strategy names, profile or None) for --profile."""
    if name == "all":
        return list(STRATEGIES), None
    if name in STRATEGIES and name not in list_profiles():
        return [name], None
    try:
        prof = load_profile(name)
    except UserError as err:
        raise UserError("--profile", err.problem, f"{err.fix}, a strategy ({', '.join(STRATEGIES)}) or all") from None
    if prof.uses_fsdp:
        return ["fsdp2_offload" if prof.offload_param == "cpu" else "fsdp2"], prof
    if not prof.uses_deepspeed or not prof.zero_stage:
        return ["ddp"], prof
    devices = (prof.offload_optimizer, prof.offload_param)
    if prof.zero_stage == 3:
        strategy = ("zero3_nvme" if "nvme" in devices else "zero3_offload" if prof.offload_param == "cpu"
                    else "zero3_offload_optimizer" if prof.offload_optimizer == "cpu" else "zero3")
    else:
        strategy = f"zero{prof.zero_stage}" + ("_offload" if prof.zero_stage == 2 and "cpu" in devices else "")
    return [strategy], prof
