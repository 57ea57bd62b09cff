"""`hf-zero generate --image PATH / --points PATH` on a composed multimodal model's folder: the items reach the
encoders exactly as the training collator gives them, the answer is the greedy continuation the training forward
gives, and a missing or unreadable file, a modality the model lacks, or an item for a text model is one line."""

import json

import numpy as np
import pytest
import torch

from hf_zero.cli import main
from hf_zero.data.chat_template import end_of_turn_ids
from hf_zero.data.multimodal import add_placeholders, load_media
from hf_zero.plan.arguments import ModelArguments
from hf_zero.train.composed import ADAPTER_DIR, ComposedModel
from hf_zero.train.composed_build import build_encoders

ENCODERS = {
    "points": {"class": "hf_zero.train.encoders:PointNet", "kwargs": {"hidden": 16, "width": 16, "tokens": 3},
               "input_shape": [12, 3]},
    "image": {"hf_config": {"model_type": "vit", "image_size": 8, "patch_size": 4, "num_channels": 1,
                            "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
                            "intermediate_size": 32}},
}


def save_composed_run(root, encoders):
    """A multimodal run's final/ as the recipe writes it (tokenizer with its placeholders, LoRA adapter beside)."""
    from types import SimpleNamespace

    from hf_zero.data.chat_template import prepare_chat_template
    from hf_zero.data.model_names import get_tokenizer
    from hf_zero.train.model import build_causal_lm

    torch.manual_seed(0)
    tok = get_tokenizer("tiny-llama")
    prepare_chat_template(tok)
    built = build_encoders(encoders)
    ids = add_placeholders(tok, built[1])
    cpu = SimpleNamespace(precision="fp32", uses_deepspeed=False, zero_stage=0)
    args = ModelArguments(model_name_or_path="tiny-llama", use_peft=True, lora_r=4, lora_dropout=0.0)
    model = ComposedModel(build_causal_lm(args, tok, cpu), encoders, ids, built)
    with torch.no_grad():  # LoRA's B starts at zero; every projector's output scaled up: the items steer the answer
        for name, p in model.named_parameters():
            if "lora_B" in name or name.startswith("projectors."):
                p.mul_(8) if name.startswith("projectors.") else p.normal_(0, 0.5)
    final = root / "final"
    model.save_pretrained(final, tok)
    return final


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from PIL import Image

    root = tmp_path_factory.mktemp("mm_generate")
    save_composed_run(root, ENCODERS)
    g = np.random.default_rng(0)
    Image.fromarray(g.integers(0, 255, (8, 8), dtype=np.uint8), mode="L").save(root / "digit.png")
    np.save(root / "shape.npy", g.normal(size=(20, 3)).astype(np.float32))
    (root / "bad.png").write_bytes(b"not an image")
    return root


def greedy_by_forward(model, tok, ids, values, steps):
    """The answer's tokens from the training forward (the collator's `<m>_values`/`<m>_rows`), one token a step."""
    stop, out = set(end_of_turn_ids(tok)), []
    for _ in range(steps):
        batch = {f"{m}_values": torch.from_numpy(v[None]) for m, v in values.items()}
        batch.update({f"{m}_rows": torch.tensor([0]) for m in values})
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids + out]), keep_ranks_in_step=False, **batch).logits
        nxt = int(logits[0, -1].argmax())
        if nxt in stop:
            break
        out.append(nxt)
    return tok.decode(out, skip_special_tokens=True).strip()


def generate(capsys, *args):
    rc = main(["generate", *map(str, args), "--max-new-tokens", "6"])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_generate_with_an_image_and_points_is_the_training_forwards_greedy_answer(run, capsys, monkeypatch):
    from hf_zero.data.model_names import get_tokenizer
    from hf_zero.train.composed_generate import composed_prompt_ids

    final = run / "final"
    model, tok = ComposedModel.from_pretrained(final).eval(), get_tokenizer(str(final), str(final))
    values = {"image": load_media(model.specs["image"], run / "digit.png"),
              "points": load_media(model.specs["points"], run / "shape.npy")}
    ids = composed_prompt_ids(tok, model.specs, model.placeholder_ids, "What is this?", ["image", "points"])
    image, points = model.placeholder_ids["image"], model.placeholder_ids["points"]
    assert ids.count(image) == 5 and ids.count(points) == 3  # the encoders' token counts, the image's run first
    assert ids.index(image) < ids.index(points) < len(ids) - 3
    expected = greedy_by_forward(model, tok, ids, values, 6)
    without = greedy_by_forward(model, tok, ids, {"image": np.zeros_like(values["image"]),
                                                  "points": values["points"]}, 6)
    assert expected and expected != without  # this model's answer depends on the image

    seen = {}
    real = ComposedModel.embed

    def spy(self, input_ids, media, keep_ranks_in_step=False):
        seen.update({m: v for m, (v, _) in media.items() if v is not None})  # the first step's: the items
        return real(self, input_ids, media, keep_ranks_in_step)

    monkeypatch.setattr(ComposedModel, "embed", spy)
    # the LLM's adapter folder names the composed model around it (test_the_adapter_folder_is_found_...)
    rc, out, err = generate(capsys, "--adapter", final / ADAPTER_DIR, "--image", run / "digit.png", "--points",
                            run / "shape.npy", "--prompt", "What is this?")
    assert rc == 0 and out.strip() == expected, err
    assert torch.equal(seen["image"][0], torch.from_numpy(values["image"]))  # the collator's pixels, to the bit
    assert torch.equal(seen["points"][0], torch.from_numpy(values["points"]))
    assert f"[hf_zero] multimodal model {final} (points, image encoders); image {run / 'digit.png'}" in err


def test_generate_text_only_on_a_composed_model(run, capsys):
    rc, out, err = generate(capsys, "--model", run / "final", "--prompt", "Hello")
    assert rc == 0 and "no items (text only)" in err


@pytest.mark.parametrize("case", ["missing", "unreadable", "wrong_shape", "no_such_encoder", "text_model",
                                  "placeholder_in_text"])
def test_bad_items_are_one_line_exit_2(run, tmp_path, capsys, case):
    final = run / "final"
    args = {
        "missing": ["--model", final, "--image", tmp_path / "gone.png"],
        "unreadable": ["--model", final, "--image", run / "bad.png"],
        "wrong_shape": ["--model", final, "--points", run / "digit.png"],
        "no_such_encoder": ["--model", tmp_path / "image_only" / "final", "--points", run / "shape.npy"],
        "text_model": ["--model", "tiny-llama", "--image", run / "digit.png"],
        "placeholder_in_text": ["--model", final, "--image", run / "digit.png"],
    }[case]
    if case == "no_such_encoder":
        save_composed_run(tmp_path / "image_only", {"image": ENCODERS["image"]})
    prompt = "<image> twice?" if case == "placeholder_in_text" else "What is this?"
    rc, out, err = generate(capsys, *args, "--prompt", prompt)
    lines = err.strip().splitlines()
    assert rc == 2 and out == "" and len(lines) == 1 and "Traceback" not in err, err
    line = lines[0]
    expected = {
        "missing": f"hf-zero: error: --image: {tmp_path / 'gone.png'} is not a file; give the path of an image file",
        "unreadable": f"hf-zero: error: --image: cannot read {run / 'bad.png'} (",
        "wrong_shape": f"hf-zero: error: --points: cannot read {run / 'digit.png'} (",
        "no_such_encoder": "hf-zero: error: --points: this model has no points encoder (it reads: image); drop "
                           "--points, or use a model trained with a points encoder",
        "text_model": "hf-zero: error: --image: tiny-llama is not a multimodal model (no composed_config.json there)",
        "placeholder_in_text": "hf-zero: error: --prompt: the prompt's text holds a modality placeholder",
    }[case]
    assert line.startswith(expected), line


def test_the_adapter_folder_is_found_from_the_composed_folder(run):
    from hf_zero.train.composed_generate import composed_folder

    final = run / "final"
    assert composed_folder(str(final)) == composed_folder(str(run)) == composed_folder(str(final / ADAPTER_DIR))
    assert composed_folder(str(final)) == final
    assert composed_folder("tiny-llama") is None and composed_folder(None) is None
    assert json.loads((final / "composed_config.json").read_text())["lora"]["r"] == 4


def test_export_merges_the_lora_and_the_folder_loads_back_with_the_same_logits(run, tmp_path, capsys):
    """`hf-zero export final/ --merge-lora`: one folder, the LLM without any adapter, the encoders and projectors
    as trained; ComposedModel.from_pretrained loads it and gives the LoRA model's logits; generate answers alike."""
    from safetensors.torch import load_file

    from hf_zero.data.model_names import get_tokenizer
    from hf_zero.train.composed_generate import composed_prompt_ids

    out = tmp_path / "merged"
    assert main(["export", str(run), "--out", str(out), "--merge-lora"]) == 0
    assert f"-> {out} (multimodal model, LoRA merged, " in capsys.readouterr().out
    config = json.loads((out / "composed_config.json").read_text())
    assert config["lora"] is None and not (out / ADAPTER_DIR).exists()
    keys = load_file(str(out / "model.safetensors")).keys()
    assert not [k for k in keys if "lora_" in k or "base_layer" in k]
    assert any(k.startswith("encoders.image.") for k in keys) and any(k.startswith("projectors.points.") for k in keys)

    source, merged = (ComposedModel.from_pretrained(f).eval() for f in (run / "final", out))
    assert not merged.uses_lora and source.uses_lora
    tok = get_tokenizer(str(out), str(out))
    ids = composed_prompt_ids(tok, source.specs, source.placeholder_ids, "What is this?", ["image", "points"])
    batch = {"input_ids": torch.tensor([ids]),
             "image_values": torch.from_numpy(load_media(source.specs["image"], run / "digit.png")[None]),
             "points_values": torch.from_numpy(load_media(source.specs["points"], run / "shape.npy")[None]),
             "image_rows": torch.tensor([0]), "points_rows": torch.tensor([0])}
    with torch.no_grad():
        a, b = (m(**batch, keep_ranks_in_step=False).logits for m in (source, merged))
        with source.llm.disable_adapter():  # the adapter matters here: an export that lost it would show
            bare = source(**batch, keep_ranks_in_step=False).logits
    assert (a - bare).abs().max() > 1e-2 and torch.allclose(a, b, atol=1e-6, rtol=1e-5), (a - b).abs().max()

    item = ["--image", run / "digit.png", "--points", run / "shape.npy", "--prompt", "What is this?"]
    answers = []
    for folder in (run / "final", out):
        rc, text, err = generate(capsys, "--model", folder, *item)
        assert rc == 0, err
        answers.append(text.strip())
    assert answers[0] and answers[0] == answers[1]


@pytest.mark.parametrize("case", ["merge_twice", "base_model", "out_not_empty", "linked_outside", "checkpoint_n"])
def test_export_refusals_are_one_line(run, tmp_path, capsys, case):
    import shutil

    from safetensors.torch import load_file, save_file

    merged = tmp_path / "merged"
    assert main(["export", str(run / "final"), "--out", str(merged), "--merge-lora"]) == 0
    capsys.readouterr()
    linked, checkpoint = tmp_path / "linked", tmp_path / "checkpoint-3"
    if case == "linked_outside":
        shutil.copytree(run / "final", linked)
        (tmp_path / "secret").write_text("PRIVATE KEY")
        (linked / "tokenizer.json").unlink()
        (linked / "tokenizer.json").symlink_to(tmp_path / "secret")
    if case == "checkpoint_n":  # as the Trainer writes a composed run's checkpoint: its weights, no composed config
        checkpoint.mkdir()
        save_file(load_file(str(run / "final" / "model.safetensors")), str(checkpoint / "model.safetensors"))
    args = {"merge_twice": [str(merged), "--out", str(tmp_path / "again"), "--merge-lora"],
            "base_model": [str(run / "final"), "--out", str(tmp_path / "b"), "--base-model", "tiny-llama"],
            "out_not_empty": [str(run / "final"), "--out", str(merged)],
            "linked_outside": [str(linked), "--out", str(tmp_path / "c")],
            "checkpoint_n": [str(checkpoint), "--out", str(tmp_path / "d")]}[case]
    assert main(["export", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    field = {"merge_twice": "--merge-lora", "base_model": "--base-model", "out_not_empty": "--out",
             "linked_outside": "checkpoint", "checkpoint_n": "CHECKPOINT"}[case]
    assert len(err) == 1 and err[0].startswith(f"hf-zero: error: {field}: "), err
    assert not (tmp_path / "c").exists() and not (tmp_path / "c.partial").exists()
    if case == "checkpoint_n":
        assert "is a checkpoint of a multimodal run" in err[0] and "export the run's final/ folder" in err[0]
