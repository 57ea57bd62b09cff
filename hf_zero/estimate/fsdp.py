"""Memory per rank of FSDP2 (torch's `fully_shard`, as accelerate 1.15 prepares a model for hf_zero's fsdp2 and
fsdp2_offload profiles), for `hf-zero estimate` beside ZeRO (hf_zero/estimate/memory.py holds the ZeRO arithmetic and
the strategy table; this module only the FSDP2 rows).

Ψ all params, Ψt trainable, N ranks, p the compute precision's bytes (4 fp32, 2 bf16/fp16). Each parameter is sharded
on dim 0; rank 0 holds ceil(dim0/N) rows of every one (FSDP2 pads the others' storage to that size), so "Ψ/N" below
is that padded share, exact for any shape. Per rank, at the optimizer step:
  params     4Ψ/N   the sharded parameters stay in the dtype the model was loaded in (fp32 for a full fine-tune, and
                    accelerate upcasts trainable ones under mixed precision); they are also Adam's master copy, so
                    there is no separate fp32 master as in DeepSpeed. A LoRA base loaded in 16 bits stays 16-bit:
                    2 bytes per frozen parameter (FSDP2 needs one dtype among a group's trainable parameters only)
  grads      4Ψt/N  reduce-scattered into the sharded parameters' dtype (bf16 reduce, fp32 shard gradient)
  optimizer  8Ψt/N  + 4 bytes per trainable parameter tensor (Adam's two moments, DTensors like the parameters, and
                    torch Adam's scalar `step` tensor for each parameter)
= 16Ψ/N in fp32 and in bf16 (ZeRO-3 in fp32: 4Ψ/N + 8Ψt/N + 12Ψt/N, its fp32 master is a clone of the weights).
fsdp2_offload (CPUOffloadPolicy) keeps all three in host RAM: the device holds only the working set below.

Working set (accelerate's wrapping: one shard group per decoder layer, resharded after forward; the input embeddings
their own group; the final norm and output head — with tied embeddings, the embeddings too — one "tail" group that
stays gathered from its forward to its backward; the root holds what is left, and stays gathered too — for a text
model usually nothing, for a composed model (hf_zero.train.composed) its encoders and projectors, and the LM head and
final norm, which accelerate finds no tail for there; T below is tail + root):
  gathered   pG + 2pGt   the largest group unsharded (G elements, in the compute precision), and in backward its
                         unsharded gradients plus the flat copy FSDP2 reduce-scatters from (Gt trainable elements)
  resident   sharded params + optimizer (+ grads with accumulation) + pT (kept) + 2pG: the running group and the
             one FSDP2 prefetches next, through forward and backward
  buffers    pG            the all-gather output, alive until copied out into the group's parameters
At the optimizer step every group is resharded: the step's peak is the sharded states alone. CPU per node: every
rank reads the whole model in fp32 before sharding it (4Ψ, no zero.Init), then holds its offloaded shards.
Checked against the bytes each rank holds after step 1 on 2 CPU ranks (tests/estimate/test_fsdp_memory.py): exact;
a composed model's (tests/multimodal/test_multimodal_tools.py): exact too. The working set is not measured: a CPU
has no allocator peak.
"""

from __future__ import annotations

from hf_zero.plan.fsdp import layer_classes

__all__ = ["FSDP_STRATEGIES", "describe_shards", "shard_states", "states", "resident", "buffers"]

FSDP_STRATEGIES = ("fsdp2", "fsdp2_offload")


def describe_shards(model) -> tuple[tuple, tuple]:
    """(param_shapes, shard_groups) of a model (meta is fine) as accelerate 1.15 would wrap it for FSDP2.
    param_shapes: (dim0, numel, trainable) per parameter, tied ones once; shard_groups: (largest group elements, its
    trainable elements, elements kept gathered from forward to backward — the tail group and the root's leftovers —,
    their trainable elements)."""
    shapes = tuple((int(p.shape[0]) if p.dim() else 1, p.numel(), bool(p.requires_grad)) for p in model.parameters())
    classes = set(layer_classes(model))

    def size(modules):
        seen, total, trainable = set(), 0, 0
        for m in modules:
            for p in m.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    total, trainable = total + p.numel(), trainable + p.numel() * p.requires_grad
        return total, trainable

    embed, head = _get(model, "get_input_embeddings"), _get(model, "get_output_embeddings")
    # accelerate shards the input embeddings in a group of their own, so a class holding them gets none (fsdp.py)
    holders = {type(m).__name__ for m in model.modules()
               if embed is not None and m is not embed and any(x is embed for x in m.modules())}
    layers = [m for m in model.modules() if type(m).__name__ in classes - holders]
    groups = [size([m]) for m in layers]
    tied = embed is not None and head is not None and getattr(embed, "weight", None) is getattr(head, "weight", 0)
    if embed is not None and not tied:
        groups.append(size([embed]))
    tail_modules = [m for m in (_final_norm(model), head, embed if tied else None) if m is not None]
    if not groups:  # no layer class and no embeddings: the root gathers the whole model at once
        return shapes, (*size([model]), 0, 0)
    # The root group holds what no other group took (a composed model's encoders and projectors, a vision tower
    # whose blocks are no layer class); like the tail it stays gathered from its forward to its backward
    # (reshard_after_forward resolves to False for the root), so both count as kept.
    grouped = {id(p) for m in (*layers, *([embed] if embed is not None and not tied else []), *tail_modules)
               for p in m.parameters()}
    root = [p for p in model.parameters() if id(p) not in grouped]
    kept = size(tail_modules)
    kept = (kept[0] + sum(p.numel() for p in root), kept[1] + sum(p.numel() for p in root if p.requires_grad))
    return shapes, (*max(groups), *kept)


def _get(model, method: str):
    try:
        return getattr(model, method, lambda: None)()
    except NotImplementedError:  # e.g. a vision model: no input embeddings (FSDP2 refuses it; the estimate need not)
        return None


def _final_norm(model):
    """The last norm outside the decoder layers (accelerate's _find_final_norm looks for `norm` / `final_layernorm`
    on the base model)."""
    base = getattr(model, "get_decoder", lambda: None)() or getattr(model, "model", None) or model
    for name in ("norm", "final_layernorm", "ln_f", "final_layer_norm"):
        found = getattr(base, name, None)
        if found is not None and hasattr(found, "parameters"):
            return found
    return None


def shard_states(count, n: int, frozen: int = 4) -> tuple[int, int, int]:
    """(params, grads, optimizer) bytes on rank 0, the rank with the largest shards; `frozen`: bytes per frozen
    parameter (2 for a LoRA base loaded in 16 bits; accelerate upcasts only what trains to fp32)."""
    if count.param_shapes:
        share = [(-(-dim0 // n) * (numel // dim0), trainable) for dim0, numel, trainable in count.param_shapes]
        params, trainable = sum(x for x, _ in share), sum(x for x, t in share if t)
        tensors = sum(1 for _, t in share if t)
    else:  # a hand-made count: shares of the totals, the step counters unknown
        params, trainable, tensors = -(-count.total_params // n), -(-count.trainable_params // n), 0
    return frozen * (params - trainable) + 4 * trainable, 4 * trainable, 8 * trainable + 4 * tensors


def _groups(count) -> tuple[int, int, int]:
    if count.shard_groups:
        g, gt, tail, _ = count.shard_groups
        return g, gt, tail
    # A hand-made count: the largest module's own parameters as the largest group, nothing kept gathered.
    return count.largest_layer_params, count.largest_trainable_layer_params or min(
        count.largest_layer_params, count.trainable_params), 0


def states(s: str, count, n: int, mixed: bool, frozen: int = 4):
    """memory._states for FSDP2: ((params, grads, optimizer, gathered) per device, offloaded bytes per rank, nvme)."""
    p = 2 if mixed else 4
    params, grads, optim = shard_states(count, n, frozen)
    g, gt, _ = _groups(count)
    gathered = p * g + 2 * p * gt
    if s == "fsdp2_offload":
        return (0, 0, 0, gathered), params + grads + optim, 0
    return (params, grads, optim, gathered), 0, 0


def resident(s: str, count, n: int, mixed: bool, frozen: int = 4) -> tuple[int, int]:
    """memory._resident for FSDP2: (states alive through forward and backward, gradients alive during backward)."""
    p = 2 if mixed else 4
    params, grads, optim = shard_states(count, n, frozen)
    g, _, tail = _groups(count)
    working = p * (tail + 2 * g)
    if s == "fsdp2_offload":
        return working, 0
    return params + optim + working, grads


def buffers(s: str, count, n: int, mixed: bool) -> int:
    return (2 if mixed else 4) * _groups(count)[0]
