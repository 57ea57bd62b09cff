"""Greedy generation from a trained model or adapter, formatted by the chat template it was trained with: what
`hf-zero generate` answers a prompt with, and what the stage-end samples use (hf_zero.train.samples)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from hf_zero.core.errors import UserError
from hf_zero.core.safetensors_header import verify_safetensors
from hf_zero.data.chat_template import end_of_turn_ids
from hf_zero.data.model_names import get_tokenizer, resolve_model_path

__all__ = ["load_for_generation", "base_model_of", "generate_answers", "exact_match", "contains", "prompt_form",
           "run_prompt_form", "PROMPT_FORM_KEY"]

PROMPT_FORM_KEY = "prompt_form"  # in summary.json: how the run's model was prompted in training (prompt_form)


def prompt_form(stage_data: list) -> dict:
    """How the trained model expects its prompts, from the last stage's data (what it learned last): the format
    (text, prompt_completion, conversational, conversational_prompt_completion), whether a chat template wrapped
    them, and one held-out prompt as the person wrote it. `hf-zero generate` formats its prompt by it and the run's
    `try it:` line shows it (summary.json keeps it beside the final model)."""
    last = stage_data[-1] if stage_data else None
    fmt = last.reports[-1].format if last is not None and last.reports else "text"
    example = next((p["question"] for p in (last.eval_prompts if last is not None else [])
                    if p.get("question")), None)
    return {"format": fmt, "chat": fmt.startswith("conversational"), "example": example}


def run_prompt_form(folder: str | None) -> dict | None:
    """The prompt form of the run whose model `folder` is (its final/ folder: summary.json is beside it); None
    for a model hf_zero did not train, or a summary without one."""
    if not folder or not Path(folder).expanduser().is_dir():  # a model's name: no run folder around it
        return None
    summary = Path(folder).expanduser().resolve().parent / "summary.json"
    try:
        form = json.loads(summary.read_text()).get(PROMPT_FORM_KEY)
    except (OSError, ValueError, AttributeError):
        return None
    return form if isinstance(form, dict) and "format" in form else None


def base_model_of(adapter: str) -> str:
    """The base model an adapter folder was trained on (its adapter_config.json)."""
    config = Path(adapter) / "adapter_config.json"
    if not config.is_file():
        raise UserError("--adapter", f"{adapter} has no adapter_config.json", "point it at a run's final/ folder")
    return json.loads(config.read_text())["base_model_name_or_path"]


def load_for_generation(model: str | None, adapter: str | None = None):
    """(model, tokenizer) in eval mode: the adapter's tokenizer when there is one (it holds the training template and
    any tokens the template added), the base model's embeddings grown to match, then the adapter on top."""
    import torch
    from transformers import AutoModelForCausalLM

    if adapter is not None:
        base = base_model_of(adapter)  # read even beside --model: a folder without it is no adapter
        model = model or base
    if not model:
        raise UserError("--model", "no model given", "pass --model DIR (or --adapter DIR)")
    path = resolve_model_path(model)
    verify_safetensors(Path(path), "--model")  # a crafted header: one line, not a library's traceback
    if adapter is not None:
        verify_safetensors(Path(adapter), "--adapter")
    tokenizer = get_tokenizer(path, adapter) if adapter else get_tokenizer(path)
    lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if len(tokenizer) > lm.get_input_embeddings().num_embeddings:
        lm.resize_token_embeddings(len(tokenizer))
    if adapter is not None:
        from peft import PeftModel

        lm = PeftModel.from_pretrained(lm, adapter)
    return lm.eval(), tokenizer


def generate_answers(model, tokenizer, prompts: list[str], max_new_tokens: int, synced_gpus: bool = False,
                     batch_size: int = 8, progress=None) -> list[str]:
    """Greedy answers to already formatted prompts, stopping at EOS or the template's end of turn. Prompts are
    left-padded in batches; the model's train/eval mode and the tokenizer's padding side are restored after.
    `progress(batches done, batches)`: called after each batch (a long round of answers says how far it is)."""
    import torch

    was_training, side = model.training, tokenizer.padding_side
    model.eval()
    tokenizer.padding_side = "left"
    answers = []
    try:
        with torch.no_grad():
            for start in range(0, len(prompts), batch_size):
                enc = tokenizer(prompts[start:start + batch_size], return_tensors="pt", padding=True,
                                add_special_tokens=False).to(model.device)
                out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, temperature=None,
                                     top_p=None, top_k=None, eos_token_id=end_of_turn_ids(tokenizer),
                                     pad_token_id=tokenizer.pad_token_id, synced_gpus=synced_gpus)
                answers += [tokenizer.decode(row, skip_special_tokens=True).strip()
                            for row in out[:, enc["input_ids"].shape[1]:]]
                if progress is not None:
                    progress(start // batch_size + 1, -(-len(prompts) // batch_size))
    finally:
        tokenizer.padding_side = side
        model.train(was_training)
    return answers


def _normal(text: str) -> str:
    return " ".join(re.sub(r"^[\s\"'“‘(]+|[\s\"'”’).!?,;:]+$", "", text).casefold().split())


def exact_match(answer: str, reference: str) -> bool:
    """Equal after case, surrounding quotes and final punctuation are set aside ("Hamlet." matches "hamlet")."""
    return _normal(answer) == _normal(reference)


def contains(answer: str, reference: str) -> bool:
    """The reference appears in the answer (same normalisation), e.g. 'It is from "Hamlet".' for Hamlet."""
    words = re.sub(r"[\"“”.,;:!?()]", " ", answer)
    return f" {_normal(reference)} " in f" {_normal(words)} "
