"""Chat templates: the tokenizer's own, a `chat_template` from the recipe, or hf_zero's ChatML-style default.

The template is set on the tokenizer, so `Trainer.save_model` writes it (chat_template.jinja) next to the model or
adapter, and inference formats prompts exactly as training did. A template may use markers such as `<|im_start|>`
that the tokenizer lacks: they are added as special tokens (one id each, never split into bytes or parsed out of
user text), the model's embedding and LM-head rows grow to match (`grow_embeddings`), and under LoRA those two
layers are trained and saved with the adapter (peft saves resized embedding layers itself).
"""

from __future__ import annotations

import re
from pathlib import Path

from hf_zero.core.errors import UserError
from hf_zero.data.model_names import get_tokenizer
from hf_zero.integrations.peft import always_save_embedding_layers
from hf_zero.integrations.transformers import compile_chat_template

__all__ = ["CHATML_TEMPLATE", "prepare_chat_template", "added_template_tokens", "grow_embeddings",
           "train_embeddings", "has_generation_markers", "end_of_turn_ids"]

# ChatML, as SmolLM2/Qwen use it, with `{% generation %}` around what an assistant turn trains (its content and the
# end-of-turn marker): transformers' return_assistant_tokens_mask, and TRL's assistant_only_loss, read those markers.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
    "{% else %}{{ message['content'] + '<|im_end|>' + '\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_MARKER = re.compile(r"<\|[A-Za-z0-9_]+\|>")
_ADDED = "_hf_zero_template_tokens"


def has_generation_markers(template: str | None) -> bool:
    return bool(template) and re.search(r"\{%-?\s*generation\s*-?%\}", template) is not None


def _load_template(value: str) -> str:
    if value.lower() == "chatml":
        return CHATML_TEMPLATE
    path = Path(value)
    if path.is_file():
        return path.read_text(encoding="utf-8")
    try:  # a tokenizer folder or model name: borrow its template
        source = get_tokenizer(value)
    except (OSError, ValueError, UserError):
        source = None
    if source is None or not source.chat_template:
        raise UserError("chat_template", f"{value!r} is neither a template file, 'chatml', nor a tokenizer with a "
                        "chat template", "give a .jinja file, chatml, or a model folder whose tokenizer has one")
    return source.chat_template


def prepare_chat_template(tokenizer, value: str | None = None) -> list[str]:
    """Give `tokenizer` its chat template (once) and return the marker tokens that had to be added for it."""
    if hasattr(tokenizer, _ADDED):
        return getattr(tokenizer, _ADDED)
    template = _load_template(value) if value else tokenizer.chat_template or CHATML_TEMPLATE
    from jinja2 import TemplateSyntaxError

    try:
        compile_chat_template(template)  # hf_zero/integrations/transformers.py
    except TemplateSyntaxError as err:
        raise UserError("chat_template", f"the template does not parse (line {err.lineno}: {err.message})",
                        "fix the Jinja syntax") from None
    tokenizer.chat_template = template
    vocab = tokenizer.get_vocab()
    missing = [m for m in dict.fromkeys(_MARKER.findall(template)) if m not in vocab]
    if missing:
        tokenizer.add_tokens(missing, special_tokens=True)
    setattr(tokenizer, _ADDED, missing)
    return missing


def added_template_tokens(tokenizer) -> list[str]:
    return list(getattr(tokenizer, _ADDED, []))


def grow_embeddings(model, tokenizer, vocab_size: int | None) -> bool:
    """Resize the embeddings for tokens a template added (ZeRO-3 aware: transformers gathers the shards)."""
    if not added_template_tokens(tokenizer) or vocab_size is None or len(tokenizer) <= vocab_size:
        return False
    model.resize_token_embeddings(len(tokenizer))
    from transformers.integrations import is_deepspeed_zero3_enabled

    if is_deepspeed_zero3_enabled():
        # transformers builds the resized layers whole on every rank; partition them again (rank 0's values are
        # broadcast first), so no rank keeps a full embedding matrix. mem_efficient_linear would patch F.linear for
        # good: an Init used on a module is never exited.
        import deepspeed
        from transformers.integrations.deepspeed import deepspeed_config

        for layer in {id(m): m for m in (model.get_input_embeddings(), model.get_output_embeddings())}.values():
            deepspeed.zero.Init(module=layer, config_dict_or_path=deepspeed_config(), mem_efficient_linear=False)
    return True


def train_embeddings(model) -> None:
    """Under LoRA, new token rows would otherwise stay at their initial values: train the input embedding and the
    LM head (tied or not), saved in the adapter with it."""
    for layer in (model.get_input_embeddings(), model.get_output_embeddings()):
        if layer is not None:
            layer.weight.requires_grad_(True)
    # peft saves them only if it sees the vocabulary differ from the base model's config, which it does not read for
    # a base named by a hub id it may not reach: say it outright, for every save.
    always_save_embedding_layers(model)  # hf_zero/integrations/peft.py


def end_of_turn_ids(tokenizer) -> list[int]:
    """Token ids that end an assistant turn: EOS, and the special token the template puts right after a reply
    (`<|im_end|>` for ChatML). Generation stops at any of them."""
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    if tokenizer.chat_template:
        probe = "hf_zero_probe"
        text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"},
                                              {"role": "assistant", "content": probe}], tokenize=False)
        after = text[text.rfind(probe) + len(probe):]
        first = tokenizer(after, add_special_tokens=False)["input_ids"][:1]
        added = tokenizer.added_tokens_decoder.get(first[0]) if first else None
        if first and (first[0] in tokenizer.all_special_ids or added is not None and added.special) \
                and first[0] not in ids:
            ids.append(first[0])
    return ids
