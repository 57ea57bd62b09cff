"""Memory per rank before launch: model states, activations and buffers for DDP and every ZeRO strategy.

Ψ all params, Ψt trainable (LoRA: peft's A/B), N world size, L / Lt largest (trainable) layer = one module's own
params as DeepSpeed counts it, p = 2 (bf16/fp16) or 4 (fp32), g = 4 (the flat fp32 gradient partition the
optimizer steps on, made one parameter group at a time: G is the largest group's Ψt, ModelCount.
largest_group_params; fp32 below), K = 12 mixed (fp32 master + 2 Adam moments) or 8 fp32, f = the frozen base's
bytes under the Trainer and FSDP2: p (hf_zero loads a LoRA base in the run's precision, hf_zero.train.model.
base_precision) unless `frozen_base="fp32"`. GPU bytes per rank, "deepspeed" | "paper":
  ddp            f(Ψ-Ψt) + 4Ψt + 4Ψt + 8Ψt (fp32 trainable weights)   | pΨ + pΨt + KΨt            (16Ψ)
  zero1          pΨ + pΨt + gG/N + 12Ψt/N                            | pΨ + pΨt + KΨt/N          (4Ψ+12Ψ/N)
  zero2          pΨ + (pΨt + gG)/N + 12Ψt/N                          | pΨ + pΨt/N + KΨt/N        (2Ψ+14Ψ/N)
  zero3          pΨ/N + pL + gG/N + pLt + 12Ψt/N                     | (pΨ + pΨt + KΨt)/N        (16Ψ/N)
  zero2_offload  pΨ;  zero3_offload_optimizer pΨ/N + pL + pLt;  zero3_offload / zero3_nvme  pL + pLt
ZeRO-3's pL + pLt (the largest layer gathered, and its gradient) is its own key, "gathered", inside model_states.
fp32 "deepspeed", measured on 2 CPU ranks (tests/estimate/test_estimate_measured.py, a composed model's one group per
part in tests/multimodal/test_multimodal_tools.py): gradients ZeRO-1 max(4Ψt, 4(Ψt+G)/N), ZeRO-2 4(Ψt+G)/N, ZeRO-3
4(Ψt+G)/N (its partition buffer + the step's flat copy; offloaded: CPU 20Ψt/N + 4Ψ/N).
"paper" is the ZeRO paper (arXiv:1910.02054). For "deepspeed" in bf16/fp16 without LoRA, ZeRO-2/3 (GPU and CPU)
are DeepSpeed's estimate_zero{2,3}_model_states_mem_needs, called directly; the formulas reproduce them and cover
the rest. The fp32 master (4) exists in fp32 too: DeepSpeed clones it (ZeRO-3's alias branch compares a
torch.device with a str and never fires). CPU per node, as DeepSpeed: 1.5 x GPUs per node x max(each rank loads
the fp32 model 4Ψ — under zero.Init one layer 4L —, offloaded 16Ψt/N [+ pΨ/N offloaded params]).
Peak on a GPU ("total", what torch.cuda.max_memory_allocated reports) = the larger of the optimizer step (model
states above + buffers) and the forward/backward peak: the states that stay allocated through a step ("resident":
ddp f(Ψ-Ψt) + 12Ψt, weights + Adam, gradients freed by zero_grad; ZeRO-1/2 pΨ + 12Ψt/N; ZeRO-3 pΨ/N + its
gradient buffer pΨt/N + 12Ψt/N + the layers it keeps gathered; offloaded states count on the host only; with
gradient accumulation the gradients too) + hf_zero/estimate/activations.py's saved activations, loss and autocast
copies. ZeRO-3 keeps a module gathered when it is used again within stage3_max_reuse_distance (1e9) elements: at the
turn from forward to backward that is the last ~distance/2 elements of the model, p bytes each; at one rank without
parameter offload "gathering" is a view of the partition (no copy).
Buffers: DDP gradient buckets (a 4Ψt copy, N > 1); ZeRO-1/2 one reduce bucket (p x reduce_bucket_size; allgather
is in place); ZeRO-3 reduce + prefetch buckets + persistent params (numel <= threshold), sized as the Trainer fills
hf_zero's "auto": h², 0.9·h², 10·h (DeepSpeed's defaults 5e8, 5e7, 1e5 when h is unknown).
fsdp2 / fsdp2_offload (torch FSDP2, one shard group per decoder layer): hf_zero/estimate/fsdp.py, 16Ψ/N at the step in
fp32 and bf16 (the sharded fp32 parameters are the master copy); its gathered layers exist only in forward/backward.
QLoRA (frozen_base="nf4"): the quantized linears as nf4_bytes, as the engines hold them (see `estimate`).
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import replace

from hf_zero.core.errors import UserError
from hf_zero.estimate import fsdp as fsdp_memory
from hf_zero.estimate.activations import ATTENTION, step_bytes
from hf_zero.estimate.model_count import ModelCount, nf4_bytes
from hf_zero.plan.liger import liger_installed
from hf_zero.plan.profiles import PRECISIONS, list_profiles, load_profile
from hf_zero.plan.world import launch_shape

__all__ = ["strategies_for", "STRATEGIES", "QLORA_STRATEGIES", "estimate", "largest_micro_batch"]

STRATEGIES = ("ddp", "zero1", "zero2", "zero2_offload", "zero3", "zero3_offload_optimizer", "zero3_offload",
              "zero3_nvme", "fsdp2", "fsdp2_offload")
# Where a 4-bit base (QLoRA) runs, as hf_zero.plan.quantization.verify_quantization allows it: not with NVMe offload
QLORA_STRATEGIES = tuple(s for s in STRATEGIES if s != "zero3_nvme")
CONVENTIONS = ("deepspeed", "paper")
_DS = {"zero2": ("zero2", dict(cpu_offload=False)), "zero2_offload": ("zero2", dict(cpu_offload=True)),
       "zero3": ("zero3", dict(cpu_offload=False, cpu_offload_params=False)),
       "zero3_offload_optimizer": ("zero3", dict(cpu_offload=True, cpu_offload_params=False)),
       "zero3_offload": ("zero3", dict(cpu_offload=True, cpu_offload_params=True))}


def _packed_shapes(count: ModelCount, p: int) -> tuple:
    """FSDP2's per-parameter shapes in 4-byte elements (its frozen bytes per element, fsdp.shard_states): each 4-bit
    weight the 1-column tensor that holds it (bitsandbytes' Params4bit, in p-byte elements), the embeddings in p
    bytes. A frozen parameter whose size a quantized linear has stands for it: the bytes are the same whichever it
    is."""
    from collections import Counter

    packed, tables, shapes = Counter(count.quantizable), Counter(count.embeddings), []
    for dim0, numel, trainable in count.param_shapes:
        if not trainable and packed[numel]:
            packed[numel] -= 1
            dim0 = -(-numel // (2 * p))
            dim0, numel = -(-dim0 * p // 4), -(-dim0 * p // 4)
        elif not trainable and tables[numel]:
            tables[numel] -= 1
            dim0, numel = dim0 * p // 4, numel * p // 4
        shapes.append((dim0, numel, trainable))
    return tuple(shapes)


def _deepspeed_estimators():
    with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed logs its accelerator choice to stdout on import
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
    return {"zero2": estimate_zero2_model_states_mem_needs, "zero3": estimate_zero3_model_states_mem_needs}


def _states(s, c: ModelCount, n, mixed, convention, f=4):
    """(params, grads, optimizer, gathered) per GPU, (cpu, nvme) bytes offloaded per rank: the accounting above;
    `f`: bytes per frozen parameter under the Trainer and FSDP2."""
    if s.startswith("fsdp"):  # both conventions: the paper has no FSDP2 row, and FSDP2 keeps no separate master
        return fsdp_memory.states(s, c, n, mixed, f)
    psi, t, L = c.total_params, c.trainable_params, c.largest_layer_params
    Lt = c.largest_trainable_layer_params or (L if t == psi else min(L, t))
    p = 2 if mixed else 4
    if convention == "paper":
        k = 12 if mixed else 8
        gpu = {"ddp": (p * psi, p * t, k * t), "zero1": (p * psi, p * t, k * t / n),
               "zero2": (p * psi, p * t / n, k * t / n), "zero3": (p * psi / n, p * t / n, k * t / n),
               "zero2_offload": (p * psi, 0, 0), "zero3_offload_optimizer": (p * psi / n, 0, 0)}.get(s, (0, 0, 0))
        gpu = (*gpu, 0)
        off = (p + k) * t / n
        cpu = {"zero3_offload": off + p * psi / n, "zero3_nvme": p * t / n}.get(s, off if "offload" in s else 0)
        return gpu, cpu, (k * t + p * psi) / n if s == "zero3_nvme" else 0
    # The optimizer steps on a flat fp32 copy of the gradient partition (g32): in 16-bit DeepSpeed's fp32 partition,
    # in fp32 flatten()'s own copy (measured: ZeRO-2/3 hold the partition twice at the step; ZeRO-1's whole fp32
    # gradients outweigh that for N >= 2). DeepSpeed makes that copy one parameter group at a time and frees it after
    # the group's step, so it is the largest group's, G: the Trainer's decay group (nearly all), a composed model's
    # or a VLM's largest part (one group per part: its 2-rank gradients were 15-24% below G = Ψt). ZeRO-3 also keeps
    # its partition buffer all run (offloaded with the optimizer): g3. DeepSpeed's 16-bit ZeRO-3 estimator leaves that
    # buffer out; we follow it there.
    g32, g3, group = 4, (0 if mixed else 4), c.largest_group_params or t
    gath = p * (L + Lt) if s.startswith("zero3") else 0  # ZeRO-3: the largest layer gathered + its gradient
    zero1_grads = p * t + g32 * group / n if mixed else max(4 * t, (4 * t + g32 * group) / n)
    gpu = {"ddp": (f * (psi - t) + 4 * t, 4 * t, 8 * t), "zero1": (p * psi, zero1_grads, 12 * t / n),
           "zero2": (p * psi, (p * t + g32 * group) / n, 12 * t / n), "zero2_offload": (p * psi, 0, 0),
           "zero3": (p * psi / n, (g3 * t + g32 * group) / n, 12 * t / n),
           "zero3_offload_optimizer": (p * psi / n, 0, 0)}
    gpu = (*gpu.get(s, (0, 0, 0)), gath)
    off = (12 + (g3 + g32 if s.startswith("zero3") else g32)) * t / n  # gradients + fp32 master + moments, on the CPU
    cpu = {"zero3_offload": off + p * psi / n, "zero3_nvme": 4 * t / n}.get(s, off if "offload" in s else 0)
    # On disk DeepSpeed also swaps fp32 gradient partitions (<id>_gradient_<offset>_<len>.tensor.swp, measured in
    # tests/train/test_nvme.py): up to 4 bytes per trainable parameter more than the optimizer state.
    return gpu, cpu, (16 * t + p * psi) / n if s == "zero3_nvme" else 0


def _resident(s, c: ModelCount, n, mixed, max_reuse_distance, f=4):
    """(states alive through forward and backward, gradients alive during backward) per GPU rank, deepspeed
    convention: what the forward/backward peak adds activations to."""
    if s.startswith("fsdp"):
        return fsdp_memory.resident(s, c, n, mixed, f)
    psi, t, p = c.total_params, c.trainable_params, (2 if mixed else 4)
    offload_params = s in ("zero3_offload", "zero3_nvme")
    gathered = p * min(psi, max_reuse_distance / 2) if s.startswith("zero3") and (n > 1 or offload_params) else 0
    states = {"ddp": f * (psi - t) + 12 * t, "zero1": p * psi + 12 * t / n, "zero2": p * psi + 12 * t / n,
              "zero2_offload": p * psi, "zero3": p * psi / n + p * t / n + 12 * t / n,
              "zero3_offload_optimizer": p * psi / n}.get(s, 0) + gathered
    grads = {"ddp": 4 * t, "zero1": p * t, "zero2": p * t / n}.get(s, 0)
    return states, grads


def _buffers(s, c: ModelCount, n, mixed, reduce_bucket, prefetch, persistence):
    h, p, rb = c.hidden_size, (2 if mixed else 4), reduce_bucket or (c.hidden_size ** 2 or 5e8)
    if s.startswith("fsdp"):
        return fsdp_memory.buffers(s, c, n, mixed)
    if not s.startswith("zero3"):
        return (4 * c.trainable_params if n > 1 else 0) if s == "ddp" else p * rb  # one GPU: no DDP wrapper
    pb = prefetch if prefetch is not None else (int(0.9 * h * h) if h else 5e7)
    pt = persistence if persistence is not None else (10 * h if h else 100_000)
    return p * (rb + pb + c.persistent_params(pt))


def estimate(count: ModelCount, strategy: str, world_size: int | None = None, gpus_per_node: int = 1,
             nodes: int | None = None, precision: str = "bf16", micro_batch: int = 1, seq_len: int = 2048,
             grad_checkpointing: bool = False, convention: str = "deepspeed", *, gpu_memory_bytes=None,
             cpu_memory_bytes=None, zero_init: bool = True, flash_attention: bool = False, reduce_bucket_size=None,
             prefetch_bucket_size=None, param_persistence_threshold=None, additional_buffer_factor: float = 1.5,
             use_deepspeed_estimators: bool = True, attn_implementation: str | None = None,
             grad_accumulation: int = 1, max_reuse_distance: float = 1e9, frozen_base: str | None = None,
             sp_size: int = 1, fused_cross_entropy="auto", extra_activations: int = 0,
             use_liger_kernel="auto", sequences_per_row: int = 1) -> dict:
    """Bytes per GPU rank, CPU bytes per node, NVMe bytes per node and checkpoint bytes for one strategy.
    `attn_implementation`: eager, sdpa or flash_attention_2 (default: the model's, as transformers picks it);
    `flash_attention=True` is the same as flash_attention_2. `frozen_base`: the precision frozen (LoRA base)
    weights are held in under ddp and FSDP2: default `precision`, as hf_zero loads them; "fp32" for a run that
    loads its base in fp32 (DeepSpeed casts the model itself: its rows do not depend on it); "nf4" for QLoRA
    (load_in_4bit) under QLORA_STRATEGIES: nf4_bytes for the linears, the rest fp32 under the Trainer (peft's
    prepare_model_for_kbit_training) and 16-bit under DeepSpeed and FSDP2, which shard the packed weights as
    16-bit elements (bnb_4bit_quant_storage) and hold every rank's constants whole; one linear at a time is
    dequantized to a 16-bit copy in forward and backward. `sp_size`: Ulysses sequence parallelism, each
    sequence's activations split over sp_size of the ranks (activations.step_bytes). `fused_cross_entropy`: the
    recipe's (auto, True, False); the loss without full logits where the run would use it (count.fused_loss).
    `use_liger_kernel`: the recipe's (auto, True, False); Liger's norms and SwiGLU for a model type they patch
    (count.liger), with `auto` only where liger-kernel is installed on this machine: counting savings a run
    without it would not have is how an estimate ends in an out-of-memory.
    `extra_activations`: bytes per sample kept for backward outside the LLM's layers (a multimodal recipe's encoders
    and projectors: hf_zero.train.composed_count), held through every phase of the step's forward and backward.
    `sequences_per_row`: 2 for a dpo stage, whose every row is its chosen and its rejected sequence in one batch
    (hf_zero.data.preference), with full logits: the activations of 2 x micro_batch sequences."""
    attn = "flash_attention_2" if flash_attention else attn_implementation
    frozen_base = frozen_base or precision
    quantized = frozen_base == "nf4"
    if quantized and (strategy not in QLORA_STRATEGIES or not count.quantizable or convention != "deepspeed"
                      or count.trainable_params == count.total_params):
        raise ValueError(f"no 4-bit base under {strategy=} / {convention=} without LoRA or linears")
    if strategy not in STRATEGIES or precision not in PRECISIONS or frozen_base not in (*PRECISIONS, "nf4") or \
            convention not in CONVENTIONS or micro_batch < 1 or seq_len < 1 or grad_accumulation < 1 or \
            sp_size < 1 or attn not in (None, *ATTENTION):
        raise ValueError(f"bad {strategy=} / {precision=} / {convention=} / {micro_batch=} / {seq_len=} / "
                         f"{grad_accumulation=} / {attn=} / {frozen_base=}")
    gpn = int(gpus_per_node or 1)
    # `world_size` without `nodes` (a bench's one machine, a test's paper table): machines of gpus_per_node each
    nodes = (1 if world_size is None else world_size // gpn) if nodes is None else int(nodes)
    n = launch_shape(nproc=gpn, nodes=max(nodes, 1)).world
    if gpn < 1 or nodes < 1 or world_size not in (None, n):
        raise ValueError(f"{world_size=} is not {gpus_per_node=} x {nodes=}")
    c, mixed = count, precision != "fp32"
    f = 4 if frozen_base == "fp32" else 2
    constants = dequantized = 0
    if quantized:  # the packed weights counted as elements of the dtype they are held in: the rows below apply
        packed, constants = nf4_bytes(c)
        # Elements of `unit` bytes: DeepSpeed casts everything to p bytes; the Trainer and FSDP2 hold the norms in
        # fp32 and the embeddings in p bytes (hf_zero.train.model.embeddings_in_16bit).
        unit = p16 = 2 if mixed else 4
        if not strategy.startswith("zero"):
            unit, tables = 4, sum(c.embeddings)
            c = replace(c, total_params=c.total_params - tables + tables * p16 // unit)
        c = replace(c, total_params=c.total_params - sum(c.quantizable) + packed // unit,
                    param_shapes=_packed_shapes(c, p16))
        f, dequantized = 4, (2 if mixed else 4) * max(c.quantizable)
    (params, grads, optim, gathered), cpu_rank, nvme_rank = _states(strategy, c, n, mixed, convention, f)
    # Each rank reads the model as it loads it: DeepSpeed in fp32, the Trainer and FSDP2 the base in f bytes.
    loaded = 4 * c.total_params if strategy.startswith("zero") else \
        f * (c.total_params - c.trainable_params) + 4 * c.trainable_params
    load = gpn * (4 * c.largest_layer_params if strategy.startswith("zero3") and zero_init else loaded)
    states = gpn * cpu_rank
    cpu = additional_buffer_factor * ((states or load) if strategy.startswith("zero3") and zero_init
                                      else max(load, states))
    source = f"hf_zero {convention} formula"
    if (use_deepspeed_estimators and convention == "deepspeed" and mixed and strategy in _DS
            and c.trainable_params == c.total_params):  # DeepSpeed's own figure; our params/grads split of it
        fn, kw = _DS[strategy]
        args = dict(total_params=c.total_params, num_gpus_per_node=gpn, num_nodes=nodes,
                    additional_buffer_factor=additional_buffer_factor, **kw)
        if fn == "zero3":
            args.update(largest_layer_params=c.largest_layer_params, zero_init=zero_init)
        cpu, gpu_ms = _deepspeed_estimators()[fn](**args)[:2]
        optim = gpu_ms - int(params) - int(grads) - int(gathered)
        source = f"deepspeed estimate_{fn}_model_states_mem_needs"
    gpu = {"params": int(params + constants), "grads": int(grads), "optimizer": int(optim),
           "gathered": int(gathered)}
    gpu["model_states"] = sum(gpu.values())
    gpu["buffers"] = int(_buffers(strategy, c, n, mixed, reduce_bucket_size, prefetch_bucket_size,
                                  param_persistence_threshold))
    resident, grads_bwd = _resident(strategy, c, n, mixed, max_reuse_distance, f)
    resident += constants
    if grad_accumulation > 1:  # gradients stay allocated between the micro-batches of one optimizer step
        resident, grads_bwd = resident + grads_bwd, 0
    # Autocast over fp32 weights keeps an fp32 residual stream and 16-bit weight copies; over a 16-bit frozen base
    # (LoRA) the stream is 16-bit and only the small fp32 adapters are cast, as under DeepSpeed.
    frozen16 = f == 2 and c.trainable_params < c.total_params
    mode = "fp32" if not mixed else "autocast" if strategy == "ddp" and not frozen16 else "half"
    phases = {} if c.layer is None else step_bytes(
        c.layer, c.num_layers, c.vocab_size, mode, micro_batch * sequences_per_row, seq_len, grad_checkpointing, attn,
        full=c.trainable_params == c.total_params, sp=sp_size, quantized=quantized,
        frozen_inputs=strategy.startswith("zero3") and not quantized,  # bitsandbytes' 4-bit matmul is its own
        fused_loss=fused_cross_entropy in count.fused_loss and sequences_per_row == 1,  # a dpo batch: full logits
        liger=count.liger and (use_liger_kernel is True or use_liger_kernel == "auto" and liger_installed()))
    phases = {name: act + dequantized + micro_batch * extra_activations for name, act in phases.items()}
    peaks = {name: resident + act + (grads_bwd if name == "recompute" else 0) for name, act in phases.items()}
    # FSDP2 reshards every group by the end of backward: nothing is gathered at its optimizer step.
    peaks["optimizer step"] = gpu["model_states"] - (gpu["gathered"] if strategy.startswith("fsdp") else 0)
    if convention == "paper":  # the textbook sum: every state and the largest activations at once
        peaks = {"sum": gpu["model_states"] + max(phases.values(), default=0)}
    phase = max(peaks, key=peaks.get)
    gpu["resident"] = int(resident)
    gpu["activations"] = int(phases.get(phase, max(phases.values(), default=0)))
    gpu["total"] = int(peaks[phase]) + gpu["buffers"]
    # On disk: weights (LoRA: adapter only) + fp32 master and Adam moments over all ranks; DDP and FSDP2: fp32 weights
    # + moments (FSDP2's fp32 shards are the master copy)
    saved = c.trainable_params if c.trainable_params < c.total_params else c.total_params
    ckpt = (4 * saved + 8 * c.trainable_params) if strategy == "ddp" or strategy.startswith("fsdp") else \
        ((2 if mixed else 4) * saved + 12 * c.trainable_params)
    fits = None if gpu_memory_bytes is None else \
        gpu["total"] <= gpu_memory_bytes and (cpu_memory_bytes is None or cpu <= cpu_memory_bytes)
    return {"name": strategy, "convention": convention, "source": source, "gpu_bytes_per_rank": gpu, "peak": phase,
            "frozen_base": frozen_base if c.trainable_params < c.total_params else None,
            "cpu_bytes_per_node": int(cpu), "offloaded_bytes_per_rank": int(cpu_rank),
            "nvme_bytes": int(gpn * nvme_rank), "checkpoint_bytes": int(ckpt),
            "fits": fits}


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
