"""What a memory estimate is asked about, besides the model's counts and the strategy: the launch, the batch and the
run's settings that change what a rank holds (hf_zero.estimate.memory.estimate reads one MemoryJob)."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["MemoryJob"]


def _field(default, help: str):
    """A field documented as the project's config dataclasses document theirs (metadata help)."""
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class MemoryJob:
    """One run as the estimate sees it: the defaults are a one-GPU bf16 run of one 2048-token sequence per step;
    `MemoryJob(**fields)` takes what estimate() took as keywords."""

    world_size: int | None = _field(None, "ranks in all; without `nodes`, machines of gpus_per_node each")
    gpus_per_node: int = _field(1, "ranks per machine")
    nodes: int | None = _field(None, "machines (default world_size / gpus_per_node, or 1)")
    precision: str = _field("bf16", "fp32, bf16 or fp16: the weights' and activations' bytes")
    micro_batch: int = _field(1, "sequences per rank per forward")
    seq_len: int = _field(2048, "tokens per sequence")
    grad_checkpointing: bool = _field(False, "gradient checkpointing: each layer's inputs kept, recomputed in "
                                                  "backward")
    convention: str = _field("deepspeed", "deepspeed (what the engines hold, measured) or paper (the ZeRO paper's "
                                          "sums, arXiv:1910.02054)")
    gpu_memory_bytes: int | None = _field(None, "the device's memory: `fits` says whether the peak is within it")
    cpu_memory_bytes: int | None = _field(None, "the machine's memory: `fits` also needs the host bytes within it")
    zero_init: bool = _field(True, "ZeRO-3 builds the model partitioned (zero.Init): each rank loads one layer at a "
                                   "time, not the whole fp32 model")
    flash_attention: bool = _field(False, "the same as attn_implementation flash_attention_2")
    reduce_bucket_size: float | None = _field(None, "DeepSpeed's reduce bucket, in elements (default: hidden size "
                                                    "squared, as hf_zero's `auto` fills it; 5e8 without one)")
    prefetch_bucket_size: float | None = _field(None, "ZeRO-3's prefetch bucket, in elements (default 0.9 x "
                                                      "hidden size squared; 5e7)")
    param_persistence_threshold: float | None = _field(None, "ZeRO-3 keeps parameters of at most this many "
                                                             "elements whole (default 10 x hidden size; 1e5)")
    additional_buffer_factor: float = _field(1.5, "DeepSpeed's margin on the host bytes of its own estimators")
    use_deepspeed_estimators: bool = _field(True, "in bf16/fp16 without LoRA, ZeRO-2/3's model states from "
                                                  "DeepSpeed's estimate_zero{2,3}_model_states_mem_needs")
    attn_implementation: str | None = _field(None, "eager, sdpa or flash_attention_2 (default: the model's, as "
                                                   "transformers picks it)")
    grad_accumulation: int = _field(1, "micro-batches per optimizer step: above 1 the gradients stay allocated "
                                       "between them")
    max_reuse_distance: float = _field(1e9, "ZeRO-3 keeps a module gathered when it is used again within this many "
                                            "elements: at the turn from forward to backward, the last half of it")
    frozen_base: str | None = _field(None, "the bytes frozen (LoRA base) weights are held in under ddp and FSDP2: "
                                           "default the precision, as hf_zero loads them; fp32 for a base loaded "
                                           "in fp32 (DeepSpeed casts the model itself); nf4 for QLoRA "
                                           "(load_in_4bit): nf4_bytes for the linears, one linear at a time "
                                           "dequantized to a 16-bit copy in forward and backward")
    sp_size: int = _field(1, "Ulysses sequence parallelism: each sequence's activations split over sp_size ranks")
    fused_cross_entropy: object = _field("auto", "the recipe's (auto, True, False): the loss without full logits "
                                                 "where the run would use it (ModelCount.fused_loss)")
    extra_activations: int = _field(0, "bytes per sample kept for backward outside the LLM's layers (a multimodal "
                                       "recipe's encoders and projectors, a VLM's vision tower), held through "
                                       "every phase of the step")
    use_liger_kernel: object = _field("auto", "the recipe's (auto, True, False): Liger's norms and SwiGLU for a "
                                              "model type they patch; `auto` only where liger-kernel is installed "
                                              "here (savings a run without it would not have end in an OOM)")
    sequences_per_row: int = _field(1, "2 for a dpo stage: each row is its chosen and its rejected sequence in one "
                                       "batch, with full logits")
