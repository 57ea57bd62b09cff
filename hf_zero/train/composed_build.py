"""The parts a composed multimodal model is built from, one entry of the recipe's `encoders:` each: the encoder (a
`torch.nn.Module` by import path, a transformers model from a config with random weights, or a transformers model
by hub id or folder with its weights) measured by one forward, and its projector to the LLM's width
(hf_zero.train.composed puts them together)."""

from __future__ import annotations

import importlib
import inspect

import torch
from torch import nn

from hf_zero.core.errors import UserError
from hf_zero.data.multimodal import ModalitySpec
from hf_zero.data.multimodal_check import config_input_shape, pretrained_config
from hf_zero.integrations.transformers import without_zero3_init

__all__ = ["build_encoder", "build_encoders", "build_projector", "encode"]

_KINDS = ("class", "hf_config", "pretrained")  # what an encoder is built from: exactly one
_ENCODER_KEYS = {*_KINDS, "kwargs", "input_shape", "projector"}


def _import_class(path: str, where: str):
    module, _, name = path.partition(":")
    try:
        return getattr(importlib.import_module(module), name) if name else None
    except (ImportError, AttributeError) as err:
        raise UserError(where, f"cannot import {path!r} ({type(err).__name__}: {str(err).splitlines()[0][:100]})",
                        "give it as package.module:Class, importable from the run's folder or PYTHONPATH") from None


def build_encoder(modality: str, cfg: dict) -> tuple[nn.Module, tuple]:
    """(encoder, input_shape) from one entry of `encoders:`."""
    where = f"encoders.{modality}"
    kinds = [k for k in _KINDS if isinstance(cfg, dict) and k in cfg]
    if not isinstance(cfg, dict) or set(cfg) - _ENCODER_KEYS or len(kinds) != 1:
        raise UserError(where, "needs exactly one of `class` (package.module:Class), `hf_config` (a transformers "
                        "config, random weights) or `pretrained` (a transformers model's hub id or folder, with its "
                        f"weights), plus optional {', '.join(sorted(_ENCODER_KEYS - set(_KINDS)))}",
                        "e.g. {class: hf_zero.train.encoders:PointNet, input_shape: [256, 3]}")
    shape = cfg.get("input_shape")
    if "class" in cfg:
        cls = _import_class(str(cfg["class"]), f"{where}.class")
        if cls is None:
            raise UserError(f"{where}.class", f"{cfg['class']!r} names no class", "give it as package.module:Class")
        try:
            encoder = cls(**(cfg.get("kwargs") or {}))
        except TypeError as err:
            raise UserError(f"{where}.kwargs", str(err).splitlines()[0], "give the class's constructor arguments")
        return _checked(encoder, shape, where)
    if "pretrained" in cfg:
        encoder, config = _pretrained_encoder(str(cfg["pretrained"]), f"{where}.pretrained")
    else:
        from transformers import AutoConfig
        from transformers.models.auto.modeling_auto import MODEL_MAPPING

        hf = dict(cfg["hf_config"])
        try:
            config = AutoConfig.for_model(hf.pop("model_type"), **hf)
            cls = MODEL_MAPPING[type(config)]
        except (KeyError, ValueError) as err:
            raise UserError(f"{where}.hf_config", f"not a transformers model config ({err})",
                            "give model_type (e.g. vit, dinov2, siglip_vision_model) and its fields") from None
        # The class itself, not from_config: under ZeRO-3 transformers would build it partitioned (zero.Init), and
        # it is measured by a forward before any engine exists; the engine partitions it when it wraps the model.
        encoder = cls(config, **_no_pooler(cls))
    return _checked(encoder, shape if shape is not None else config_input_shape(config), where)


def _no_pooler(cls) -> dict:
    """A pooler's output is never used: its parameters would get no gradient (DDP refuses that)."""
    return {"add_pooling_layer": False} if "add_pooling_layer" in inspect.signature(cls.__init__).parameters else {}


def _pretrained_encoder(name: str, where: str):
    """(encoder, its config): a transformers model by hub id (offline cache) or folder, with its weights; of a
    vision-text pair (CLIP, SigLIP: a config with a vision_config) its vision tower. Built without weights on the
    meta device (hf-zero estimate and check count it there), and without zero.Init: it is measured by a forward
    before any engine exists, and the engine partitions it when it wraps the model."""
    from transformers.models.auto.modeling_auto import MODEL_MAPPING

    path, config = pretrained_config(name, where)
    cls = MODEL_MAPPING.get(type(config), None)
    if cls is None:
        raise UserError(where, f"{name!r} is a {config.model_type} model with no transformers base model class",
                        "give a vision encoder (ViT, DINOv2, SigLIP, CLIP, ...)")
    vision = getattr(config, "vision_config", None)
    if torch.empty(0).device.type == "meta":
        inner = MODEL_MAPPING[type(vision)] if vision is not None else cls
        return inner(vision or config, **_no_pooler(inner)), vision or config
    with without_zero3_init():
        model = cls.from_pretrained(path, **_no_pooler(cls))
    return (model.vision_model, vision) if vision is not None else (model, config)


def _checked(encoder: nn.Module, shape, where: str) -> tuple[nn.Module, tuple]:
    if not shape or not all(isinstance(n, int) and n > 0 for n in shape):
        raise UserError(f"{where}.input_shape", f"{shape!r} is not a list of positive sizes",
                        "e.g. input_shape: [1, 8, 8] for an image, [256, 3] for a point cloud")
    return encoder, tuple(shape)


def encode(encoder: nn.Module, values: torch.Tensor) -> torch.Tensor:
    """(items, tokens, width) from any encoder: an HF model's last_hidden_state, or a module's tensor."""
    dtype = next((p.dtype for p in encoder.parameters() if p.is_floating_point()), values.dtype)
    out = encoder(values.to(dtype))
    out = getattr(out, "last_hidden_state", out)
    if isinstance(out, (tuple, list)):
        out = out[0]
    return out.unsqueeze(1) if out.dim() == 2 else out


def build_encoders(encoders: dict) -> tuple[dict, dict]:
    """({modality: encoder}, {modality: ModalitySpec}): each encoder built and measured by one forward on a zero
    item, which gives the data its token count and the projector its input width."""
    if not isinstance(encoders, dict) or not encoders:
        raise UserError("encoders", "the multimodal recipe needs at least one encoder",
                        "e.g. encoders: {points: {class: hf_zero.train.encoders:PointNet, input_shape: [256, 3]}}")
    modules, specs = {}, {}
    for m, cfg in encoders.items():
        modules[m], shape = build_encoder(m, cfg)
        with torch.no_grad():
            probe = encode(modules[m], torch.zeros(1, *shape))
        if probe.dim() != 3:
            raise UserError(f"encoders.{m}", f"its output has shape {tuple(probe.shape)}",
                            "return (batch, tokens, width) or (batch, width)")
        specs[m] = ModalitySpec(m, shape, probe.shape[1], probe.shape[-1])
    return modules, specs


def build_projector(modality: str, cfg: dict | None, width: int, hidden_size: int) -> nn.Module:
    cfg = dict(cfg or {})
    kind = cfg.pop("type", "mlp")
    inner = cfg.pop("hidden", hidden_size)
    if cfg or kind not in ("mlp", "linear"):
        raise UserError(f"encoders.{modality}.projector", f"unknown type or keys ({kind!r}, {sorted(cfg)})",
                        "give {type: mlp, hidden: N} or {type: linear}")
    if kind == "linear":
        return nn.Linear(width, hidden_size)
    return nn.Sequential(nn.Linear(width, inner), nn.GELU(), nn.Linear(inner, hidden_size))
