"""recipes/vlm.py on recipes/configs/tiny_vlm.yaml in one process, for each tiny family: image chat rows train
(the held-out loss falls), a stage trains only the parts it names (LoRA untouched while the projector aligns), the
final folder is an adapter with the projector trained in full and the processor's files, and packed rows train."""

import sys
from pathlib import Path

import pytest
import yaml
from testing_utils import REPO, read_summary, run_cmd

RECIPE = REPO / "recipes" / "vlm.py"
CONFIG = REPO / "recipes" / "configs" / "tiny_vlm.yaml"
MODELS = ("hf-zero/tiny-qwen2-vl", "hf-zero/tiny-smolvlm", "hf-zero/tiny-llava", "hf-zero/tiny-qwen3-vl")
# the projector's modules, each kept whole by peft's modules_to_save (Qwen3-VL: its merger and its DeepStack merger)
PROJECTOR = {"hf-zero/tiny-qwen2-vl": ("visual.merger",), "hf-zero/tiny-smolvlm": ("connector",),
             "hf-zero/tiny-llava": ("multi_modal_projector",),
             "hf-zero/tiny-qwen3-vl": ("visual.merger", "visual.deepstack_merger_list.0")}

# Each test here runs the recipe: `make test`, not `make test-fast`.
pytestmark = pytest.mark.recipe_run


def short_config(dst: Path, steps: int = 3, **overrides) -> Path:
    data = yaml.safe_load(CONFIG.read_text())
    for stage in data["stages"]:
        stage.update(steps=steps, data=str((CONFIG.parent / stage["data"]).resolve()))
    data.update(eval_samples=8, **overrides)
    dst.write_text(yaml.safe_dump(data, sort_keys=False))
    return dst


@pytest.fixture(scope="module", params=MODELS)
def run(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("vlm")
    out = root / "run"
    proc = run_cmd([sys.executable, RECIPE, "--config", short_config(root / "tiny.yaml"), "--output_dir", out,
                    "--model_name_or_path", request.param, "--disable_tqdm", "true", "--save_strategy", "steps",
                    "--save_steps", "3"])
    return request.param, out, proc.stdout


def adapter(folder: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(folder / "adapter_model.safetensors")


def test_image_rows_train_and_the_loss_falls(run):
    name, out, console = run
    s = read_summary(out)
    assert s["vlm_family"] == {"hf-zero/tiny-qwen2-vl": "qwen2_vl", "hf-zero/tiny-smolvlm": "idefics3",
                               "hf-zero/tiny-llava": "llava", "hf-zero/tiny-qwen3-vl": "qwen3_vl"}[name]
    assert len(s["losses"]) == 6 and s["eval_loss_after"] < s["eval_loss_before"]
    assert s["parts"]["align"] == {"vision_tower": 0.0, "projector": 1.0, "lora": 0.0}
    assert s["parts"]["tune"]["projector"] == 0.5 and s["parts"]["tune"]["lora"] == 1.0
    assert "stage align: trains projector" in console and "LoRA targets matched per part:" in console


def test_a_stage_trains_only_the_parts_it_names(run):
    """After `align` (train: [projector]) every LoRA B matrix is still its initial zero and the projector moved;
    after `tune` the adapters moved too."""
    import torch

    name, out, _ = run
    boundary, final = adapter(out / "checkpoint-3"), adapter(out / "final")
    lora_b = [k for k in final if "lora_B" in k]
    assert lora_b
    assert all(torch.count_nonzero(boundary[k]) == 0 for k in lora_b)
    assert any(torch.count_nonzero(final[k]) > 0 for k in lora_b)
    for module in PROJECTOR[name]:
        projector = [k for k in final if f".{module}." in k]
        assert projector and any(not torch.equal(boundary[k], final[k]) for k in projector), module


def test_the_final_folder_is_an_adapter_with_the_processor(run):
    import json

    name, out, _ = run
    final = out / "final"
    config = json.loads((final / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == name
    assert config["modules_to_save"] == [f"model.{m}" for m in PROJECTOR[name]]
    for file in ("preprocessor_config.json", "tokenizer.json", "chat_template.jinja"):
        assert (final / file).is_file(), file


@pytest.mark.parametrize("model", MODELS)
def test_packed_image_rows_train(tmp_path, model):
    """`packing: true`: conversations with images packed whole into rows of max_seq_length (the losses per
    conversation are those it has alone: tests/vlm/test_vlm_data.py); the run trains and evaluates unpacked rows."""
    import math

    out = tmp_path / "o"
    proc = run_cmd([sys.executable, RECIPE, "--config", short_config(tmp_path / "c.yaml", steps=2, max_seq_length=96),
                    "--output_dir", out, "--model_name_or_path", model, "--packing", "true", "--disable_tqdm", "true",
                    "--save_final_model", "false"])
    s = read_summary(out)
    assert s["settings"]["packing"] is True and len(s["losses"]) == 4 and all(map(math.isfinite, s["losses"]))
    assert math.isfinite(s["eval_loss_after"]) and "Traceback" not in proc.stderr


def test_export_merges_lora_and_generate_answers_as_plain_transformers(run, tmp_path, capsys):
    """`hf-zero export --merge-lora` of the run: a folder plain AutoModelForImageTextToText loads, with the adapter's
    outputs; `hf-zero generate --image` on the adapter answers what plain transformers generates from that folder
    (with AutoProcessor where this machine can build it: Qwen2-VL's needs torchvision, for its video processor)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    from hf_zero.cli import main
    from hf_zero.data.model_names import get_tokenizer, resolve_model_path
    from hf_zero.data.multimodal import add_placeholders, encode_multimodal_rows, read_rows
    from hf_zero.data.vlm import VlmCollator, VlmProcessing

    name, out, _ = run
    merged_dir = tmp_path / "merged"
    assert main(["export", str(out / "final"), "--out", str(merged_dir), "--merge-lora"]) == 0
    merged = AutoModelForImageTextToText.from_pretrained(merged_dir).eval()
    adapted = PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(resolve_model_path(name)),
                                        out / "final").eval()
    digits = CONFIG.parent / "../data/tiny_multimodal/digits.jsonl"
    proc = VlmProcessing(str(merged_dir), get_tokenizer(str(merged_dir)))
    specs = proc.spec()
    samples, _ = encode_multimodal_rows(read_rows(str(digits), "d", "messages")[:2], proc.tokenizer, specs,
                                        add_placeholders(proc.tokenizer, specs), 512, "d", "d", digits.parent)
    batch = VlmCollator(proc)(samples)
    with torch.no_grad():
        assert torch.allclose(merged(**batch).logits, adapted(**batch).logits, atol=1e-5)

    image = digits.parent / "digits" / "00360.png"
    capsys.readouterr()
    assert main(["generate", "--adapter", str(out / "final"), "--image", str(image), "--prompt",
                 "What digit is this?", "--max-new-tokens", "4"]) == 0
    answer = capsys.readouterr().out.strip().splitlines()[-1]
    if name.endswith("smolvlm"):
        from PIL import Image
        from transformers import AutoProcessor

        hf = AutoProcessor.from_pretrained(merged_dir)
        text = hf.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text":
                                       "What digit is this?"}]}], add_generation_prompt=True)
        inputs = hf(text=[text], images=[[Image.open(image).convert("RGB")]], add_special_tokens=False,
                    return_tensors="pt")
        with torch.no_grad():
            ids = merged.generate(**inputs, max_new_tokens=4, do_sample=False)
        assert answer == hf.tokenizer.decode(ids[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True).strip()
    assert answer  # greedy tokens of a tiny random model: any text, but some
