"""`hf-zero generate` prompts a model the way its run trained it (summary.json's prompt_form beside final/), says
which base model and template answer, and says why an answer is empty (issue 41, items 1 and 8)."""

import json

import pytest
import torch

from hf_zero.cli import main


def _final(tmp_path, form, silent=False):
    """A run folder as a recipe leaves it: final/ (the tiny model, with a chat template) and summary.json with its
    prompt form. `silent`: the model's first token is always end of sequence (its final norm zeroed: every logit
    0, and token 0 is the tiny tokenizer's EOS)."""
    from transformers import AutoModelForCausalLM

    from hf_zero.data.chat_template import prepare_chat_template
    from hf_zero.data.model_names import get_model_config, get_tokenizer

    tokenizer = get_tokenizer("tiny-llama")
    prepare_chat_template(tokenizer)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(get_model_config("tiny-llama", vocab_size=len(tokenizer)))
    if silent:
        model.model.norm.weight.data.zero_()
    final = tmp_path / "run" / "final"
    model.save_pretrained(final)
    tokenizer.save_pretrained(final)
    if form is not None:
        (final.parent / "summary.json").write_text(json.dumps({"prompt_form": form}))
    return final


def _generate(capsys, *args):
    rc = main(["generate", *map(str, args), "--max-new-tokens", "2"])
    out = capsys.readouterr()
    return rc, out.out, [ln for ln in out.err.splitlines() if ln.startswith("[hf_zero] ")]


CHAT = {"format": "conversational", "chat": True, "example": "Which play is this from?"}
PROMPTS = {"format": "prompt_completion", "chat": False, "example": "Q: Which play?\nA:"}


@pytest.mark.parametrize("form, flag, template", [
    (CHAT, (), "the run trained on chat data"),  # the old default: no template, and an empty line
    (CHAT, ("--no-chat",), None),
    (PROMPTS, (), None),
    (None, ("--chat",), "--chat"),
])
def test_generate_formats_the_prompt_as_the_run_trained_it(tmp_path, capsys, monkeypatch, form, flag, template):
    final = _final(tmp_path, form)
    seen = []
    import hf_zero.commands.generate as command

    real = command.generate_answers
    monkeypatch.setattr(command, "generate_answers", lambda m, t, prompts, n: seen.extend(prompts) or real(
        m, t, prompts, n))
    rc, out, said = _generate(capsys, "--model", final, "--prompt", "Which play?", *flag)
    assert rc == 0 and out.strip()  # an answer (this model is untrained: any)
    assert said[0].startswith(f"[hf_zero] base model {final}; prompt ")
    if template:
        assert seen == ["<|im_start|>user\nWhich play?<|im_end|>\n<|im_start|>assistant\n"]
        assert f"user turn of {final}'s chat template ({template}; --no-chat sends it as it is)" in said[0]
    else:
        assert seen == ["Which play?"] and "prompt as given, no chat template (" in said[0]


def test_an_empty_answer_says_why(tmp_path, capsys):
    final = _final(tmp_path, PROMPTS, silent=True)
    rc, out, said = _generate(capsys, "--model", final, "--prompt", "Which play?")
    assert rc == 0 and out.splitlines()[-1] == ""  # the answer: an empty line
    assert said[-1].startswith("[hf_zero] the answer is empty: the model's first new token ended it")
    assert said[-1].endswith("the run's prompts looked like 'Q: Which play?\\nA:': prompt it the same way")
    (final.parent / "summary.json").unlink()  # no run beside it, a model with a chat template: --chat is the hint
    rc, out, said = _generate(capsys, "--model", final, "--prompt", "Which play?")
    assert said[-1].endswith("a model trained on chat answers a user turn: add --chat")


def test_system_without_the_template_is_one_line(tmp_path, capsys):
    final = _final(tmp_path, PROMPTS)
    rc = main(["generate", "--model", str(final), "--prompt", "x", "--system", "be brief"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err == ["hf-zero: error: --system: needs the chat template, which is off here (the run trained "
                               "on prompt-completion data); add --chat, or put the text in --prompt"]
