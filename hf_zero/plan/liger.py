"""Where Liger's kernels run (`use_liger_kernel: auto`, the default): a CUDA GPU, liger-kernel installed, and a model
type Liger patches. Measured by `hf-zero bench --preset gpu-matrix` (1x H100 80GB, 1.1B Llama shape, 8 x 1024 packed
tokens, bf16, 2026-11-27): 45,316 tokens/s with them against 34,568 without (1.31x), 30,569 MiB peak against 35,384,
losses within 3.9e-4 over the measured steps. On CPU they cannot run, so `auto` is off there without a word.
"""

from __future__ import annotations

__all__ = ["LIGER_MODEL_TYPES", "liger_model_types", "liger_runs", "liger_installed"]

# liger-kernel 0.8.5's MODEL_TYPE_TO_APPLY_LIGER_FN, for machines without it (the estimate plans GPU runs on a CPU
# machine): where liger-kernel is installed its own table is read instead.
LIGER_MODEL_TYPES = frozenset((
    "deepseek_v2", "deepseek_v3", "deepseek_v4", "exaone4", "falcon_h1", "gemma", "gemma2", "gemma3", "gemma3_text",
    "gemma4", "gemma4_text", "glm4", "glm4v", "glm4v_moe", "gpt_oss", "granite", "hunyuan_v1_dense",
    "hunyuan_v1_moe", "internvl", "llama", "llama4", "llama4_text", "llava", "ministral", "mistral", "mixtral",
    "mllama", "mllama_text_model", "muse_glimmer", "nemotron", "olmo2", "olmo3", "paligemma", "phi3", "pixtral",
    "qwen2", "qwen2_5_vl", "qwen2_5_vl_text", "qwen2_vl", "qwen2_vl_text", "qwen3", "qwen3_5", "qwen3_5_moe",
    "qwen3_5_moe_text", "qwen3_5_text", "qwen3_moe", "qwen3_next", "qwen3_vl", "qwen3_vl_moe", "qwen3_vl_moe_text",
    "qwen3_vl_text", "smollm3", "smolvlm",
))


def liger_model_types() -> frozenset:
    try:
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except ImportError:  # not installed (the CPU machines), or its Triton missing
        return LIGER_MODEL_TYPES
    return frozenset(MODEL_TYPE_TO_APPLY_LIGER_FN)


def liger_runs(mode, model_type: str | None, has_gpu: bool = True) -> bool:
    """Whether a run with `use_liger_kernel: mode` (auto, True, False) on this model uses Liger's kernels (`true` on
    a type Liger does not patch changes nothing: the Trainer warns and goes on); the estimate plans GPU runs."""
    return has_gpu and mode in ("auto", True) and model_type in liger_model_types()


def liger_installed() -> bool:
    from transformers.utils import is_liger_kernel_available

    return is_liger_kernel_available()
