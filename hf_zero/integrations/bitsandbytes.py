"""bitsandbytes' behaviour hf_zero changes (an entry in registry.py's PATCHES)."""

from __future__ import annotations

__all__ = ["keep_4bit_layout_on_cpu"]


def keep_4bit_layout_on_cpu(model) -> int:
    """bitsandbytes, on a CPU with AVX512-BF16 (Intel Sapphire Rapids and later), repacks a 4-bit linear's weight in
    place for its fused kernel at the first forward in eval mode without gradients (a run's evaluation), and undoes
    that at every state_dict (a checkpoint). Both break in training: the repack takes only out_features a multiple
    of 32 and in_features a multiple of the quantization block (a reshape error on a small model), and the undo
    only the uint8 storage of a 4-bit base held whole (an assertion at the first checkpoint under ZeRO-3 or FSDP2,
    whose 4-bit weights are stored in 16-bit elements). A model hf_zero trains keeps bitsandbytes' storage layout:
    its evaluation takes the plain 4-bit path, as on every other CPU. Returns how many linears it set.

    Sets Linear4bit's `support_avx512bf16_for_cpu` (bitsandbytes 0.50.2) on each instance. Can go when bitsandbytes
    repacks only in inference mode (tests/train/test_qlora.py fails when the attribute goes)."""
    kept = 0
    for module in model.modules():
        if getattr(module, "support_avx512bf16_for_cpu", False):
            module.support_avx512bf16_for_cpu = False
            kept += 1
    return kept
