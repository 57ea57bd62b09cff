"""Model FLOPs per trained token and the dense peak FLOP/s of a device: the arithmetic behind MFU, for `hf-zero
bench`'s reports and the MFU a run logs on GPUs (hf_zero.train.throughput)."""

from __future__ import annotations

__all__ = ["flops_per_token", "device_peak_flops"]


def flops_per_token(count, config, seq_len: int) -> float:
    """Model FLOPs per trained token, 6N + 12·L·h·s as in PaLM's MFU (Chowdhery et al. 2022, appendix B): forward
    2 x matmul params, backward 2 x for input gradients plus 2 x trainable for weight gradients (6N for full
    fine-tuning, less for LoRA), and attention's score and value products over rows of s tokens (forward and backward
    alike for LoRA: nothing in them is trainable). The input embedding is a lookup, not a matmul: left out unless it
    is tied to the output layer."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    embed = 0 if getattr(text, "tie_word_embeddings", False) else \
        int(getattr(text, "vocab_size", 0) or 0) * int(getattr(text, "hidden_size", 0) or 0)
    matmul = count.total_params - embed
    trainable = count.trainable_params - (embed if count.trainable_params == count.total_params else 0)
    return float(4 * matmul + 2 * trainable + 12 * count.num_layers * count.hidden_size * seq_len)


# Dense peak FLOP/s per device (vendor data sheets), by precision; tf32 tensor cores for fp32 where they exist.
# The H200 is the H100's chip with more and faster memory: the same dense peak.
_PEAKS = {"H100": {"bf16": 989e12, "fp16": 989e12, "fp32": 494e12},
          "H200": {"bf16": 989e12, "fp16": 989e12, "fp32": 494e12}, "A100": {"bf16": 312e12, "fp16": 312e12,
          "fp32": 156e12}, "L40S": {"bf16": 362e12, "fp16": 362e12, "fp32": 183e12},
          "L40": {"bf16": 181e12, "fp16": 181e12, "fp32": 90.5e12}}


def device_peak_flops(device_name: str | None, precision: str) -> float | None:
    if not device_name:
        return None
    for key in sorted(_PEAKS, key=len, reverse=True):  # "L40S" before "L40"
        if key in device_name.upper():
            return _PEAKS[key].get(precision)
    return None
