"""A composed multimodal model: a causal LM (LoRA through peft on it alone, if asked) fed by one encoder per
modality through a projector per encoder.

    encoders:
      image:  {hf_config: {model_type: vit, image_size: 8, patch_size: 4, num_channels: 1, ...}}
      points: {class: my_pkg.encoders:PointNet, kwargs: {hidden: 64}, input_shape: [256, 3],
               projector: {type: mlp, hidden: 128}}

An encoder is a Hugging Face model built from a config (random weights; `input_shape` from its image_size and
num_channels unless given) or loaded by hub id or folder (`pretrained:`), or any `torch.nn.Module` named by import
path, taking (B, *input_shape) and returning (B, tokens, width) (or (B, width): one token); hf_zero.train.
composed_build builds and measures them and their projectors.

Every encoder and projector runs on every step, on every rank: a batch without an item of a modality runs its
encoder on one zero item and adds 0 x its output to the loss. Under ZeRO-3 (and FSDP) an encoder's forward gathers
its parameters in collectives; a rank that skipped it while another ran it would wait forever (the hang of
Qwen3-VL#126 and ms-swift#8171). 0 x a finite value is exactly 0, so the loss is unchanged to the bit.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from hf_zero.checkpoint.fsdp import gathered_state_dict
from hf_zero.data.chat_template import added_template_tokens
from hf_zero.integrations.transformers import no_split_modules
from hf_zero.train.composed_build import build_encoders, build_projector, encode

__all__ = ["ComposedModel", "save_composed", "CONFIG_NAME", "WEIGHTS_NAME", "ADAPTER_DIR", "freeze_unread_embeddings"]

CONFIG_NAME, WEIGHTS_NAME, ADAPTER_DIR = "composed_config.json", "model.safetensors", "llm_adapter"


def freeze_unread_embeddings(llm, tokenizer, placeholder_ids: dict) -> bool:
    """Under LoRA, a grown vocabulary makes the LLM's input embedding and LM head train (hf_zero.data.chat_template's
    train_embeddings): a new token's row would otherwise keep its initial value. A composed model never reads its
    placeholders' rows (`embed` fills their positions with projected items), so where the placeholders are the only
    tokens added (a model with its own chat tokens: SmolLM2) the embeddings are frozen again; for SmolLM2-135M that
    is 28M of 33M trainable parameters, their gradients, Adam moments and ZeRO's gradient traffic. True if frozen."""
    others = set(tokenizer.convert_tokens_to_ids(added_template_tokens(tokenizer))) - set(placeholder_ids.values())
    layers = [layer for layer in (llm.get_input_embeddings(), llm.get_output_embeddings()) if layer is not None]
    if others or not hasattr(llm, "peft_config") or not any(layer.weight.requires_grad for layer in layers):
        return False
    for layer in layers:
        layer.weight.requires_grad_(False)
    return True


class ComposedModel(nn.Module):
    """llm (a causal LM or a peft model of one) + encoders[m] + projectors[m] for each modality m."""

    def __init__(self, llm, encoders: dict, placeholder_ids: dict, built: tuple | None = None):
        """`encoders`: the recipe's `encoders:`; `built`: build_encoders' result for it, if already made."""
        super().__init__()
        self.llm = llm
        self.config = llm.config  # what the Trainer reads of a model (use_cache, ...): the LLM's
        hidden = llm.get_input_embeddings().weight.shape[-1] if not hasattr(llm.config, "hidden_size") \
            else llm.config.hidden_size
        modules, self.specs = built or build_encoders(encoders)
        self.encoder_configs, self.placeholder_ids = dict(encoders), dict(placeholder_ids)
        self.encoders = nn.ModuleDict(modules)
        self.projectors = nn.ModuleDict({m: build_projector(m, cfg.get("projector"), self.specs[m].width, hidden)
                                         for m, cfg in encoders.items()})

    @property
    def uses_lora(self) -> bool:
        return hasattr(self.llm, "peft_config")

    # What FSDP2's preparation reads of a model (hf_zero.plan.fsdp, accelerate): the LLM's input embeddings and
    # decoder layer classes; the encoders and projectors stay in the root's shard group.
    def get_input_embeddings(self):
        return self.llm.get_input_embeddings()

    @property
    def _no_split_modules(self) -> list:
        base = self.llm.get_base_model() if self.uses_lora else self.llm
        return list(no_split_modules(base) or [])

    def forward(self, input_ids, attention_mask=None, labels=None, keep_ranks_in_step: bool = True, **kwargs):
        media = {m: (kwargs.pop(f"{m}_values", None), kwargs.pop(f"{m}_rows", None)) for m in self.specs}
        embeds, in_step = self.embed(input_ids, media, keep_ranks_in_step)
        out = self.llm(inputs_embeds=embeds, attention_mask=attention_mask, labels=labels, **kwargs)
        if in_step is not None and getattr(out, "loss", None) is not None:
            out.loss = out.loss + in_step.to(out.loss.dtype)
        return out

    def embed(self, input_ids, media: dict, keep_ranks_in_step: bool = False):
        """(the LLM's input embeddings with every placeholder run filled by its projected item, the 0 x dummy
        outputs to add to the loss or None). `media`: {modality: (values, rows)}, a modality left out or with no
        items is text only."""
        embeds = self.llm.get_input_embeddings()(input_ids)
        in_step = None
        for m, spec in self.specs.items():
            values, rows = media.get(m, (None, None))
            if values is None or values.shape[0] == 0:
                if bool((input_ids == self.placeholder_ids[m]).any()):
                    raise ValueError(f"the batch has {m} placeholders but no {m}_values (a Trainer with "
                                     "remove_unused_columns dropped them?)")
                if keep_ranks_in_step:
                    dummy = self.projectors[m](encode(self.encoders[m], torch.zeros(1, *spec.input_shape,
                                                                                    device=embeds.device)))
                    in_step = dummy.sum() * 0 if in_step is None else in_step + dummy.sum() * 0
                continue
            feats = self.projectors[m](encode(self.encoders[m], values))
            at = input_ids == self.placeholder_ids[m]
            if rows is not None and not torch.equal(at.sum(1), torch.bincount(rows, minlength=len(input_ids))
                                                    * spec.tokens):
                raise ValueError(f"{m}: the placeholder runs of the batch do not match its items (a collator that "
                                 "is not hf_zero.data.multimodal.MultimodalCollator?)")
            # masked_scatter fills the positions in reading order: row by row, the order the collator stacks items.
            embeds = embeds.masked_scatter(at.unsqueeze(-1), feats.reshape(-1, feats.shape[-1]).to(embeds.dtype))
        return embeds, in_step

    # ------------------------------------------------------------------ one folder: config + safetensors

    def save_pretrained(self, folder, tokenizer=None, state_dict: dict | None = None) -> Path:
        """config + all weights in one folder; with LoRA, the LLM's adapter alone in folder/llm_adapter as well,
        for plain `peft.AutoPeftModelForCausalLM.from_pretrained`. `state_dict`: the full weights where this
        process's parameters are shards (FSDP2: the engine gathers them; save_composed)."""
        from safetensors.torch import save_file

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        base = self.llm.get_base_model() if self.uses_lora else self.llm
        lora = self.llm.peft_config["default"].to_dict() if self.uses_lora else None
        if lora is not None:
            lora["target_modules"] = sorted(lora["target_modules"]) if isinstance(lora["target_modules"], set) \
                else lora["target_modules"]
            lora = json.loads(json.dumps(lora, default=str))
        config = {"llm_config": base.config.to_dict(), "lora": lora, "encoders": self.encoder_configs,
                  "placeholder_ids": self.placeholder_ids}
        (folder / CONFIG_NAME).write_text(json.dumps(config, indent=1))
        # Copies: under DeepSpeed the parameters are views into its flat buffers, which safetensors refuses to
        # write; a tensor shared by two names (tied embeddings) is written once, the alias recorded.
        state, seen, tied = {}, {}, {}
        for name, tensor in (self.state_dict() if state_dict is None else state_dict).items():
            key = (tensor.data_ptr(), tuple(tensor.shape), tensor.stride())
            if tensor.numel() and key in seen:
                tied[name] = seen[key]
                continue
            seen[key] = name
            state[name] = tensor.detach().cpu().clone().contiguous()
        save_file(state, str(folder / WEIGHTS_NAME), metadata={"format": "pt", "tied": json.dumps(tied)})
        if tokenizer is not None:
            tokenizer.save_pretrained(folder)
        if self.uses_lora:
            llm_state = None if state_dict is None else {k[len("llm."):]: v for k, v in state_dict.items()
                                                         if k.startswith("llm.")}
            self.llm.save_pretrained(folder / ADAPTER_DIR, state_dict=llm_state)
            if tokenizer is not None:  # AutoPeftModel grows the base's embeddings to this tokenizer's size
                tokenizer.save_pretrained(folder / ADAPTER_DIR)
        return folder

    @classmethod
    def from_pretrained(cls, folder) -> "ComposedModel":
        from safetensors import safe_open
        from safetensors.torch import load_file
        from transformers import AutoConfig, AutoModelForCausalLM

        folder = Path(folder)
        config = json.loads((folder / CONFIG_NAME).read_text())
        llm_cfg = dict(config["llm_config"])
        llm = AutoModelForCausalLM.from_config(AutoConfig.for_model(llm_cfg.pop("model_type"), **llm_cfg))
        if config["lora"]:
            from peft import get_peft_config, get_peft_model

            llm = get_peft_model(llm, get_peft_config(config["lora"]))
        model = cls(llm, config["encoders"], config["placeholder_ids"])
        path = str(folder / WEIGHTS_NAME)
        with safe_open(path, "pt") as f:
            tied = json.loads((f.metadata() or {}).get("tied", "{}"))
        result = model.load_state_dict(load_file(path), strict=False)  # the tied aliases are tied by the model
        if result.unexpected_keys or set(result.missing_keys) - set(tied):
            raise ValueError(f"{path} does not match its config: missing {result.missing_keys[:3]}, unexpected "
                             f"{result.unexpected_keys[:3]}")
        return model


def save_composed(trainer, folder, tokenizer=None) -> Path | None:
    """The trained model written by the main process; under ZeRO-3 and FSDP2 every rank first takes part in
    gathering the full weights (the composed model is saved whole, so its parts are gathered together)."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    params = list(model.parameters())
    if getattr(trainer, "is_fsdp_enabled", False):
        state = gathered_state_dict(trainer.model, trainable_only=False)  # whole tensors on the main process
        if trainer.is_world_process_zero():
            model.save_pretrained(folder, tokenizer, state)
    elif any(hasattr(p, "ds_id") for p in params):
        import deepspeed

        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            if trainer.is_world_process_zero():
                model.save_pretrained(folder, tokenizer)
    elif trainer.is_world_process_zero():
        model.save_pretrained(folder, tokenizer)
    trainer.accelerator.wait_for_everyone()
    return Path(folder)
