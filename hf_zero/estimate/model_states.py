"""The model states, host bytes and buffers a rank holds under each strategy, the arithmetic behind
hf_zero.estimate.memory.estimate. In the code: Ψ all_params, Ψt trainable, N world, L / Lt layer / trainable_layer,
p weight_bytes, g copy_bytes, G group, K optimizer_bytes, f frozen_bytes.

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
part in tests/multimodal/test_multimodal_tools.py, a VLM's in tests/vlm/test_vlm_ranks.py): gradients ZeRO-1
max(4Ψt, 4(Ψt+G)/N), ZeRO-2 about 4(Ψt+G)/N (exactly: zero2_gradient_moments), ZeRO-3 4(Ψt+G)/N (its partition
buffer + the step's flat copy; offloaded: CPU 20Ψt/N + 4Ψ/N).
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
QLoRA (frozen_base="nf4"): the quantized linears as nf4_bytes, as the engines hold them (memory.held_counts).
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import itertools
import sys
from collections import Counter

from hf_zero.estimate import fsdp as fsdp_memory
from hf_zero.estimate.model_count import ModelCount

__all__ = ["DEEPSPEED_ESTIMATORS", "packed_shapes", "deepspeed_estimators", "states", "resident", "buffers",
           "reduce_bucket_elements", "zero2_gradient_moments", "zero2_slices"]

# memory.estimate's strategies DeepSpeed's own estimators cover: (its function, its offload arguments)
DEEPSPEED_ESTIMATORS = {
    "zero2": ("zero2", dict(cpu_offload=False)), "zero2_offload": ("zero2", dict(cpu_offload=True)),
    "zero3": ("zero3", dict(cpu_offload=False, cpu_offload_params=False)),
    "zero3_offload_optimizer": ("zero3", dict(cpu_offload=True, cpu_offload_params=False)),
    "zero3_offload": ("zero3", dict(cpu_offload=True, cpu_offload_params=True))}


def packed_shapes(count: ModelCount, weight_bytes: int) -> tuple:
    """FSDP2's per-parameter shapes in 4-byte elements (its frozen bytes per element, fsdp.shard_states): each 4-bit
    weight the 1-column tensor that holds it (bitsandbytes' Params4bit, in weight_bytes elements), the embeddings
    in weight_bytes. A frozen parameter whose size a quantized linear has stands for it: the bytes are the same
    whichever it is."""
    packed, tables, shapes = Counter(count.quantizable), Counter(count.embeddings), []
    for dim0, numel, trainable in count.param_shapes:
        if not trainable and packed[numel]:
            packed[numel] -= 1
            dim0 = -(-numel // (2 * weight_bytes))
            dim0, numel = -(-dim0 * weight_bytes // 4), -(-dim0 * weight_bytes // 4)
        elif not trainable and tables[numel]:
            tables[numel] -= 1
            dim0, numel = dim0 * weight_bytes // 4, numel * weight_bytes // 4
        shapes.append((dim0, numel, trainable))
    return tuple(shapes)


def deepspeed_estimators():
    """DeepSpeed's estimate_zero{2,3}_model_states_mem_needs, by DEEPSPEED_ESTIMATORS' names."""
    with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed logs its accelerator choice to stdout on import
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
    return {"zero2": estimate_zero2_model_states_mem_needs, "zero3": estimate_zero3_model_states_mem_needs}


def reduce_bucket_elements(count: ModelCount, reduce_bucket=None) -> float:
    """DeepSpeed's reduce bucket in elements: the job's, else what the Trainer fills hf_zero's "auto" with (h²),
    else DeepSpeed's default."""
    return reduce_bucket or (count.hidden_size ** 2 or 5e8)


def zero2_gradient_moments(count: ModelCount, world: int, mixed: bool, reduce_bucket=None) -> list[tuple]:
    """ZeRO-2's gradient bytes per rank (contiguous_gradients, as hf_zero's profiles set it) at its two moments,
    (optimizer step, backward), read from DeepSpeed 0.19.8's stage_1_and_2. Each reduced gradient a rank owns is
    copied into one buffer (copy_grads_in_partition) sized by the whole parameters that overlap the rank's slice of
    each group (zero2_slices: a parameter straddling a slice's end counts whole on both ranks), kept through the
    step. In backward a parameter larger than the reduce bucket bypasses the bucket and keeps its whole gradient
    until the next one arrives: the largest such one on top of the buffer. At the step each group in turn gets a
    flat fp32 copy of its slice, freed after the group's step; none in fp32 where the slice lies inside one
    parameter (flattening one tensor is a view). Measured on 2 ranks, each rank to the byte: a VLM (its projector
    weight straddles and is 16 times the bucket: the backward moment) in tests/vlm/test_vlm_ranks.py, a composed
    model (the step's) in tests/multimodal/test_multimodal_tools.py. Without the groups' sizes (a synthetic count):
    one group, the slice alone."""
    weight_bytes = 2 if mixed else 4
    if not count.trainable_groups:
        partition = count.trainable_params / world
        return [(weight_bytes * partition + 4 * partition, weight_bytes * partition)]
    bucket = reduce_bucket_elements(count, reduce_bucket)
    over_bucket = max((n for group in count.trainable_groups for n in group if n > bucket), default=0)
    moments = []
    for slices in zero2_slices(count.trainable_groups, world):
        held = weight_bytes * sum(overlap for overlap, _, _ in slices)
        copy = max((4 * size for _, size, copied in slices if copied or mixed), default=0)
        moments.append((held + copy, held + weight_bytes * over_bucket))
    return moments


@functools.lru_cache(maxsize=64)
def zero2_slices(groups: tuple, world: int) -> tuple[tuple[tuple[int, int, bool], ...], ...]:
    """Per rank, per group: (elements of the whole parameters overlapping its slice, the slice's elements, whether
    flattening the slice copies). DeepSpeed pads each group's flat buffer to a multiple of 2 x world
    (nccl_start_alignment_factor) and gives each rank an equal slice; a parameter is in a rank's partition when it
    starts inside the slice or straddles its start (stage_1_and_2.get_partition_info). The last slice's padding
    is appended as a tensor of zeros, and a slice of padding alone is a buffer of zeros: both copies."""
    ranks = [[] for _ in range(world)]
    for group in groups:
        starts = list(itertools.accumulate(group, initial=0))  # starts[i]: offset of parameter i; starts[-1]: total
        size = -(-starts[-1] // (2 * world)) * 2 * world // world
        for rank in range(world):
            begin, end = rank * size, min((rank + 1) * size, starts[-1])
            if begin >= end:
                ranks[rank].append((0, size, True))
                continue
            first = bisect.bisect_right(starts, begin) - 1  # the parameter holding the slice's first element
            last = bisect.bisect_left(starts, end) - 1  # the one holding its last
            ranks[rank].append((starts[last + 1] - starts[first], size, first != last or end - begin < size))
    return tuple(tuple(r) for r in ranks)


def states(strategy: str, count: ModelCount, world: int, mixed: bool, convention: str, frozen_bytes: int = 4,
           reduce_bucket=None):
    """(params, grads, optimizer, gathered) per GPU, (cpu, nvme) bytes offloaded per rank: the accounting above;
    `frozen_bytes`: bytes per frozen parameter under the Trainer and FSDP2; `reduce_bucket`: DeepSpeed's, in
    elements (None: "auto")."""
    if strategy.startswith("fsdp"):  # both conventions: the paper has no FSDP2 row, and FSDP2 keeps no master copy
        return fsdp_memory.states(strategy, count, world, mixed, frozen_bytes)
    all_params, trainable, layer = count.total_params, count.trainable_params, count.largest_layer_params
    trainable_layer = count.largest_trainable_layer_params or (
        layer if trainable == all_params else min(layer, trainable))
    weight_bytes = 2 if mixed else 4
    if convention == "paper":
        return _paper_states(strategy, all_params, trainable, world, mixed)
    # The optimizer steps on a flat fp32 copy of the gradient partition (copy_bytes): in 16-bit DeepSpeed's fp32
    # partition, in fp32 flatten()'s own copy (measured: ZeRO-2/3 hold the partition twice at the step; ZeRO-1's
    # whole fp32 gradients outweigh that for N >= 2). DeepSpeed makes that copy one parameter group at a time and
    # frees it after the group's step, so it is the largest group's: the Trainer's decay group (nearly all), a
    # composed model's or a VLM's largest part (one group per part: its 2-rank gradients were 15-24% below G = Ψt).
    # ZeRO-3 also keeps its partition buffer all run (offloaded with the optimizer): buffer_bytes. DeepSpeed's
    # 16-bit ZeRO-3 estimator leaves that buffer out; we follow it there.
    copy_bytes, buffer_bytes, group = 4, (0 if mixed else 4), count.largest_group_params or trainable
    gathered = weight_bytes * (layer + trainable_layer) if strategy.startswith("zero3") else 0  # + its gradient
    zero1_grads = (weight_bytes * trainable + copy_bytes * group / world if mixed
                   else max(4 * trainable, (4 * trainable + copy_bytes * group) / world))
    weights, sharded = weight_bytes * all_params, weight_bytes * all_params / world
    adam = 12 * trainable / world
    gpu = {"ddp": (frozen_bytes * (all_params - trainable) + 4 * trainable, 4 * trainable, 8 * trainable),
           "zero1": (weights, zero1_grads, adam),
           "zero2": (weights, max(max(m) for m in zero2_gradient_moments(count, world, mixed, reduce_bucket)),
                     adam),
           "zero2_offload": (weights, 0, 0),
           "zero3": (sharded, (buffer_bytes * trainable + copy_bytes * group) / world, adam),
           "zero3_offload_optimizer": (sharded, 0, 0)}
    gpu = (*gpu.get(strategy, (0, 0, 0)), gathered)
    # gradients + fp32 master + moments, on the CPU
    offloaded = (12 + (buffer_bytes + copy_bytes if strategy.startswith("zero3") else copy_bytes)) * trainable / world
    cpu = {"zero3_offload": offloaded + sharded, "zero3_nvme": 4 * trainable / world}.get(
        strategy, offloaded if "offload" in strategy else 0)
    # On disk DeepSpeed also swaps fp32 gradient partitions (<id>_gradient_<offset>_<len>.tensor.swp, measured in
    # tests/train/test_nvme.py): up to 4 bytes per trainable parameter more than the optimizer state.
    return gpu, cpu, (16 * trainable + weight_bytes * all_params) / world if strategy == "zero3_nvme" else 0


def _paper_states(strategy: str, all_params: int, trainable: int, world: int, mixed: bool):
    """states() under the "paper" convention: the ZeRO paper's sums, which know no gathered layer, no flat gradient
    copy and no FSDP2, so that its table can be checked term by term."""
    weight_bytes, optimizer_bytes = (2, 12) if mixed else (4, 8)
    gpu = {"ddp": (weight_bytes * all_params, weight_bytes * trainable, optimizer_bytes * trainable),
           "zero1": (weight_bytes * all_params, weight_bytes * trainable, optimizer_bytes * trainable / world),
           "zero2": (weight_bytes * all_params, weight_bytes * trainable / world, optimizer_bytes * trainable / world),
           "zero3": (weight_bytes * all_params / world, weight_bytes * trainable / world,
                     optimizer_bytes * trainable / world),
           "zero2_offload": (weight_bytes * all_params, 0, 0),
           "zero3_offload_optimizer": (weight_bytes * all_params / world, 0, 0)}.get(strategy, (0, 0, 0))
    offloaded = (weight_bytes + optimizer_bytes) * trainable / world
    cpu = {"zero3_offload": offloaded + weight_bytes * all_params / world,
           "zero3_nvme": weight_bytes * trainable / world}.get(strategy, offloaded if "offload" in strategy else 0)
    nvme = (optimizer_bytes * trainable + weight_bytes * all_params) / world if strategy == "zero3_nvme" else 0
    return (*gpu, 0), cpu, nvme


def resident(strategy: str, count: ModelCount, world: int, mixed: bool, max_reuse_distance: float,
             frozen_bytes: int = 4, reduce_bucket=None):
    """(states alive through forward and backward, gradients alive during backward) per GPU rank, deepspeed
    convention: what the forward/backward peak adds activations to."""
    if strategy.startswith("fsdp"):
        return fsdp_memory.resident(strategy, count, world, mixed, frozen_bytes)
    all_params, trainable, weight_bytes = count.total_params, count.trainable_params, (2 if mixed else 4)
    offload_params = strategy in ("zero3_offload", "zero3_nvme")
    gathered = (weight_bytes * min(all_params, max_reuse_distance / 2)
                if strategy.startswith("zero3") and (world > 1 or offload_params) else 0)
    weights, adam = weight_bytes * all_params, 12 * trainable / world
    alive = {"ddp": frozen_bytes * (all_params - trainable) + 12 * trainable, "zero1": weights + adam,
             "zero2": weights + adam, "zero2_offload": weights,
             "zero3": weights / world + weight_bytes * trainable / world + adam,
             "zero3_offload_optimizer": weights / world}.get(strategy, 0) + gathered
    grads = {"ddp": 4 * trainable, "zero1": weight_bytes * trainable,
             "zero2": max(b for _, b in zero2_gradient_moments(count, world, mixed, reduce_bucket))}.get(strategy, 0)
    return alive, grads


def buffers(strategy: str, count: ModelCount, world: int, mixed: bool, reduce_bucket, prefetch, persistence):
    """DDP's gradient buckets, ZeRO's reduce (and ZeRO-3's prefetch) buckets and its persistent parameters."""
    hidden, weight_bytes = count.hidden_size, (2 if mixed else 4)
    reduce_bucket = reduce_bucket_elements(count, reduce_bucket)
    if strategy.startswith("fsdp"):
        return fsdp_memory.buffers(strategy, count, world, mixed)
    if not strategy.startswith("zero3"):  # one GPU: no DDP wrapper
        return (4 * count.trainable_params if world > 1 else 0) if strategy == "ddp" else weight_bytes * reduce_bucket
    prefetch = prefetch if prefetch is not None else (int(0.9 * hidden * hidden) if hidden else 5e7)
    persistence = persistence if persistence is not None else (10 * hidden if hidden else 100_000)
    return weight_bytes * (reduce_bucket + prefetch + count.persistent_params(persistence))
