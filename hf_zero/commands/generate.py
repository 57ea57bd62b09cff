"""`hf-zero generate`: answer a prompt with a trained model or adapter, formatted the way its run trained it: a run
on chat data gets the prompt as a user turn of its chat template, other runs get it as it is (summary.json beside
the run's final/ folder says which; --chat / --no-chat decide instead).

    hf-zero generate --adapter runs/smollm2_chat/final --system "..." --prompt "..."
    hf-zero generate --model runs/tiny/final --prompt "The big hen"
    hf-zero generate --model runs/multimodal/final --image digit.png --prompt "What digit is this?"
    hf-zero generate --adapter runs/tiny_vlm/final --image digit.png --prompt "What digit is this?"  (a stock VLM)

The answer is stdout's one line; what was used (base model, adapter, template) and why an answer is empty go to
stderr, as [hf_zero] lines.
"""

from __future__ import annotations

import sys

from hf_zero.core.errors import UserError
from hf_zero.train.composed import CONFIG_NAME
from hf_zero.train.composed_generate import (
    composed_folder,
    composed_prompt_ids,
    generate_composed,
    load_composed,
    read_items,
)
from hf_zero.train.generate import base_model_of, generate_answers, load_for_generation, run_prompt_form
from hf_zero.train.vlm_generate import generate_vlm, vlm_source

__all__ = ["add_arguments", "run"]


def add_arguments(parser) -> None:
    parser.add_argument("--model", help="model folder, offline name or hub id (default: the adapter's base model)")
    parser.add_argument("--adapter", help="LoRA adapter folder (a run's final/ with use_peft); its tokenizer and chat "
                                          "template are used")
    parser.add_argument("--prompt", required=True, help="the text to continue, or with --chat the user's message")
    parser.add_argument("--chat", action="store_const", const=True, default=None,
                        help="format the prompt with the chat template, as a user turn (default: as the run trained "
                             "it: on for a run on chat data, off otherwise)")
    parser.add_argument("--no-chat", dest="chat", action="store_const", const=False,
                        help="send the prompt as it is, without the chat template")
    parser.add_argument("--system", help="a system turn before the user's (chat only)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="longest answer, in tokens (default 64)")
    parser.add_argument("--image", help="an image file for a multimodal model (a multimodal run's final/): it comes "
                                        "before the prompt in the user turn, as in the run's rows")
    parser.add_argument("--points", help="a .npy point cloud for a multimodal model with a points encoder")


def _say(line: str) -> None:
    print(f"[hf_zero] {line}", file=sys.stderr, flush=True)


def run(args) -> int:
    if args.max_new_tokens < 1:
        raise UserError("--max-new-tokens", f"must be at least 1, got {args.max_new_tokens}")
    folder = args.adapter or args.model
    items = {m: path for m, path in (("image", args.image), ("points", args.points)) if path is not None}
    if (composed := composed_folder(folder)) is not None:
        return _run_composed(args, composed, items)
    if args.image and (vlm := vlm_source(args.model, args.adapter)) is not None:  # a stock VLM (recipes/vlm.py)
        if args.points:
            raise UserError("--points", "a vision-language model reads images only", "drop --points")
        _say(f"base model {vlm[0]}" + (f", adapter {vlm[1]}" if vlm[1] else "") + ", chat template with the image")
        print(generate_vlm(*vlm, args.image, args.prompt, args.system, args.max_new_tokens))
        return 0
    if items:
        flag = f"--{next(iter(items))}"
        raise UserError(flag, f"{folder or 'no model'} is not a multimodal model (no {CONFIG_NAME} there)",
                        "give --model the final/ folder of a multimodal run (recipes/multimodal.py)")
    form = run_prompt_form(folder)
    chat = args.chat if args.chat is not None else bool(form and form.get("chat"))
    if args.system and not chat:
        raise UserError("--system", f"needs the chat template, which is off here ({_why(args.chat, form)})",
                        "add --chat, or put the text in --prompt")
    base = (args.model or base_model_of(args.adapter)) if args.adapter else args.model
    model, tokenizer = load_for_generation(args.model, args.adapter)
    prompt = args.prompt
    if chat:
        if not tokenizer.chat_template:
            raise UserError("--chat", "this tokenizer has no chat template",
                            "train with chat data (the template is saved with the model), or drop --chat")
        turns = [{"role": "system", "content": args.system}] if args.system else []
        prompt = tokenizer.apply_chat_template(turns + [{"role": "user", "content": prompt}], tokenize=False,
                                               add_generation_prompt=True)
    _say(_used_line(base, args.adapter, chat, args.chat, form, bool(tokenizer.chat_template)))
    answer = generate_answers(model, tokenizer, [prompt], args.max_new_tokens)[0]
    if not answer:
        _say(_empty_line(chat, form, bool(tokenizer.chat_template)))
    print(answer, flush=True)
    return 0


def _run_composed(args, folder, items: dict) -> int:
    """A composed multimodal model: its items read first (one line for a bad file or a modality it lacks), then the
    model; the prompt a user turn of its chat template unless --no-chat, as its rows were."""
    values = read_items(folder, items)
    chat = args.chat is not False
    if args.system and not chat:
        raise UserError("--system", "needs the chat template, which --no-chat turns off", "drop one of them")
    model, tokenizer = load_composed(folder)
    ids = composed_prompt_ids(tokenizer, model.specs, model.placeholder_ids, args.prompt, list(values), chat,
                              args.system)
    given = ", ".join(f"{m} {path}" for m, path in items.items()) or "no items (text only)"
    _say(f"multimodal model {folder} ({', '.join(model.specs)} encoders); {given}; prompt as "
         + ("a user turn of its chat template (--no-chat sends it as it is)" if chat else "given, no chat template"))
    answer = generate_composed(model, tokenizer, ids, values, args.max_new_tokens)
    if not answer:
        _say("the answer is empty: the model's first new token ended it (end of sequence or end of turn)")
    print(answer, flush=True)
    return 0


def _why(asked: bool | None, form: dict | None) -> str:
    """Why the chat template is on or off: the flag given, else what the model's run trained on."""
    if asked is not None:
        return "--chat" if asked else "--no-chat"
    if form is None:
        return "no hf_zero run beside the model: off unless --chat"
    if form.get("chat"):
        return "the run trained on chat data"
    return "the run trained on " + ("plain text" if form["format"] == "text" else
                                    f"{form['format'].replace('_', '-')} data")


def _used_line(base: str, adapter: str | None, chat: bool, asked: bool | None, form: dict | None,
               has_template: bool) -> str:
    """Which model and prompt format answer: the base model, the adapter, and why the template is used or not."""
    what = f"base model {base}" + (f" + adapter {adapter}" if adapter else "")
    why = _why(asked, form)
    if chat:
        # the tokenizer (and its template) is the adapter's when there is one: the one the run saved
        how = f"prompt as a user turn of {adapter or base}'s chat template ({why}; --no-chat sends it as it is)"
    else:
        how = f"prompt as given, no chat template ({why}" + ("; --chat uses the template)" if has_template else ")")
    return f"{what}; {how}"


def _empty_line(chat: bool, form: dict | None, has_template: bool) -> str:
    """Why the answer is empty, and what to try: the model ended its answer with its first token."""
    line = "the answer is empty: the model's first new token ended it (end of sequence or end of turn)"
    if not chat and has_template and (form is None or form.get("chat")):
        return line + "; a model trained on chat answers a user turn: add --chat"
    if form and form.get("example"):
        return line + f"; the run's prompts looked like {form['example'][:120]!r}: prompt it the same way"
    return line + "; try a prompt in the form it was trained on, or a longer one"
