"""`hf-zero estimate` on a stock VLM's recipe (hf_zero.train.vlm_count): the model as the run adapts it (LoRA, the
parts a stage trains in full), the visual tokens of the largest image the processor lets through, the vision tower's
saved bytes extended layer by layer exactly, and the model states within 10% of what a run holds."""

import json
import sys

import pytest
import torch
import yaml
from testing_utils import REPO, run_cmd

from hf_zero.cli import main

CONFIG = REPO / "recipes" / "configs" / "tiny_vlm.yaml"
MODELS = ("hf-zero/tiny-qwen2-vl", "hf-zero/tiny-smolvlm", "hf-zero/tiny-llava", "hf-zero/tiny-qwen3-vl")
QWENS = {"hf-zero/tiny-qwen2-vl": "qwen2_vl", "hf-zero/tiny-qwen3-vl": "qwen3_vl"}


def config_copy(dst, **overrides):
    data = yaml.safe_load(CONFIG.read_text())
    for stage in data["stages"]:
        stage["data"] = str((CONFIG.parent / stage["data"]).resolve())
    data.update(overrides)
    dst.write_text(yaml.safe_dump(data, sort_keys=False))
    return dst


def estimate_json(capsys, config, *flags):
    assert main(["estimate", "--config", str(config), "--json", *flags]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("name", QWENS)
@pytest.mark.parametrize("bound,side,tokens", [(256, 16, 4), (64, 8, 1)])
def test_the_estimate_counts_the_images_tokens_at_the_size_bound(tmp_path, capsys, bound, side, tokens, name):
    """Qwen2-VL, Qwen3-VL: image_max_pixels is an area; 16 x 16 pixels are 4 x 4 patches of 4, merged 2 x 2: 4
    tokens; the vision tower's saved bytes grow with the image."""
    est = estimate_json(capsys, config_copy(tmp_path / "c.yaml", image_max_pixels=bound, model_name_or_path=name),
                        "--profile", "ddp")
    vlm = est["multimodal"]
    assert (vlm["family"], vlm["image_side"], vlm["image_tokens_per_image"]) == (QWENS[name], side, tokens)
    assert vlm["activation_bytes"] == est["inputs"]["micro_batch"] * vlm["activation_bytes_per_row"] > 0
    assert [s["trains"] for s in vlm["stages"]] == [["projector"], ["vision_tower", "projector", "lora"]]
    if bound == 256:
        small = estimate_json(capsys, config_copy(tmp_path / "s.yaml", image_max_pixels=64, model_name_or_path=name),
                              "--profile", "ddp")
        assert small["multimodal"]["activation_bytes_per_row"] < vlm["activation_bytes_per_row"]


@pytest.mark.parametrize("name", MODELS)
def test_the_vision_towers_saved_bytes_extend_layer_by_layer_exactly(name, tmp_path):
    from PIL import Image

    from hf_zero.data.model_names import get_tokenizer, resolve_model_path
    from hf_zero.data.vlm import VlmProcessing
    from hf_zero.train.vlm_count import largest_image_side, saved_at_layers, vision_saved_bytes

    proc = VlmProcessing(resolve_model_path(name), get_tokenizer(name))
    side = largest_image_side(proc)
    Image.new("RGB", (side, side), (90, 20, 200)).save(tmp_path / "x.png")
    ids = proc.expand(tmp_path / "x.png")
    pixels = proc.pixels([[tmp_path / "x.png"]], torch.tensor([ids]))
    counted = saved_at_layers(proc.config, proc.family, pixels, 4)
    assert vision_saved_bytes(proc.config, proc.family, pixels, layers=4) == counted
    assert counted > saved_at_layers(proc.config, proc.family, pixels, 3) > 0
    if name.endswith("qwen3-vl"):  # its DeepStack merger (after layer 0) is in the direct count
        assert saved_at_layers(proc.config, proc.family, pixels, 4, ()) < counted


@pytest.mark.recipe_run
@pytest.mark.parametrize("name", MODELS)
def test_the_estimates_model_states_match_what_the_run_holds(tmp_path, capsys, name):
    """One process, one step a stage, `--measure_memory true`: parameters, gradients and Adam moments (fp32, one
    rank, no wrapper) within 10% of what the run held at its first step. The estimate used to count the LoRA
    adapters alone, not the projector a stage trains in full (2,816 trainable parameters of 23,520 for Qwen2-VL)."""
    from hf_zero.estimate.measure import read_measurements

    config = yaml.safe_load(config_copy(tmp_path / "c.yaml", model_name_or_path=name, eval_samples=0).read_text())
    config["stages"] = [{**s, "steps": 1} for s in config["stages"]]
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    out = tmp_path / "run"
    run_cmd([sys.executable, REPO / "recipes" / "vlm.py", "--config", tmp_path / "c.yaml", "--output_dir", out,
             "--measure_memory", "true", "--save_final_model", "false", "--disable_tqdm", "true"])
    (measured,) = read_measurements(out)
    est = estimate_json(capsys, tmp_path / "c.yaml", "--profile", "ddp", "--precision", "fp32", "--gpus-per-node", "1")
    row = est["strategies"][0]["gpu_bytes_per_rank"]
    for part in ("params", "grads", "optimizer"):
        assert measured["measured"][part] == pytest.approx(row[part], rel=0.10), (part, measured, row)
