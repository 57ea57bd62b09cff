"""`hf-zero generate`: answer a prompt with a trained model or adapter, formatted by the chat template it was trained
with.

    hf-zero generate --adapter runs/smollm2_chat/final --chat --system "..." --prompt "..."
    hf-zero generate --model runs/tiny/final --prompt "The big hen"
"""

from __future__ import annotations

from hf_zero.core.errors import UserError
from hf_zero.train.generate import generate_answers, load_for_generation

__all__ = ["add_arguments", "run"]


def add_arguments(parser) -> None:
    parser.add_argument("--model", help="model folder, offline name or hub id (default: the adapter's base model)")
    parser.add_argument("--adapter", help="LoRA adapter folder (a run's final/ with use_peft); its tokenizer and chat "
                                          "template are used")
    parser.add_argument("--prompt", required=True, help="the text to continue, or with --chat the user's message")
    parser.add_argument("--chat", action="store_true", help="format the prompt with the chat template, as a user turn")
    parser.add_argument("--system", help="with --chat: a system turn before the user's")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="longest answer, in tokens (default 64)")


def run(args) -> int:
    if args.max_new_tokens < 1:
        raise UserError("--max-new-tokens", f"must be at least 1, got {args.max_new_tokens}")
    model, tokenizer = load_for_generation(args.model, args.adapter)
    prompt = args.prompt
    if args.chat:
        if not tokenizer.chat_template:
            raise UserError("--chat", "this tokenizer has no chat template",
                            "train with chat data (the template is saved with the model), or drop --chat")
        turns = [{"role": "system", "content": args.system}] if args.system else []
        prompt = tokenizer.apply_chat_template(turns + [{"role": "user", "content": prompt}], tokenize=False,
                                               add_generation_prompt=True)
    elif args.system:
        raise UserError("--system", "needs --chat", "add --chat, or put the text in --prompt")
    print(generate_answers(model, tokenizer, [prompt], args.max_new_tokens)[0], flush=True)
    return 0
