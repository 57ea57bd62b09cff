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


QWEN25_3B = "Qwen/Qwen2.5-VL-3B-Instruct"  # hf_zero ships its shape (hf_zero/data/model_shapes/qwen25_vl_3b)


def _shape(name):
    from hf_zero.data.model_names import SHAPES, SHAPES_DIR

    return SHAPES_DIR / SHAPES[name]


def test_the_shipped_qwen25_vl_3b_shape_counts_its_published_parameters():
    """Qwen2.5-VL-3B-Instruct as the run builds it, on the meta device from the config.json hf_zero ships (offline,
    no weights; online the hub's own): 3,754,622,976 parameters, the 3.75B its hub page gives, within 1%; by part,
    the vision tower 631,975,680, its merger (the projector) 36,708,608 and the language model with its tied token
    table 3,085,938,688."""
    from hf_zero.plan.arguments import ModelArguments
    from hf_zero.train.vlm import part_of
    from hf_zero.train.vlm_check import vlm_on_meta

    model, family = vlm_on_meta(ModelArguments(model_name_or_path=QWEN25_3B))
    parts: dict = {}
    for name, param in model.named_parameters():  # each once: the LM head is the token table (tied)
        parts[part_of(name, family)] = parts.get(part_of(name, family), 0) + param.numel()
    assert family.name == "qwen2_5_vl" and model.config.tie_word_embeddings
    assert sum(parts.values()) == pytest.approx(3.75e9, rel=0.01)
    assert parts == {"vision_tower": 631_975_680, "projector": 36_708_608, "language_model": 3_085_938_688}


@pytest.mark.parametrize("bound,side,tokens", [(451584, 672, 576), (401408, 633, 484), (None, 3584, 16384)])
def test_qwen25_vl_3b_visual_tokens_at_the_size_bound(tmp_path, bound, side, tokens):
    """The shipped image processor settings (patch 14, merge 2, max_pixels 12,845,056) and the tokenizer standing in
    for Qwen's: an image at the bound is (side rounded to 28 pixels / 28)^2 tokens. 672 x 672 (= 451,584, the YAML's
    image_max_pixels) is 24 x 24 = 576; 401,408 lets 633 x 633 through, resized to 616 x 616: 484; the processor's
    own bound is 3584 x 3584: 16,384. The run's ids around them are the config's vision start and end."""
    from PIL import Image

    from hf_zero.data.tiny_vlm import qwen_tokenizer
    from hf_zero.data.vlm import VlmProcessing
    from hf_zero.train.vlm_count import largest_image_side

    proc = VlmProcessing(str(_shape(QWEN25_3B)), qwen_tokenizer(), bound)
    assert largest_image_side(proc) == side
    Image.new("RGB", (side, side), (90, 20, 200)).save(tmp_path / "x.png")
    ids = proc.expand(tmp_path / "x.png")
    assert (ids[0], ids[-1]) == (151652, 151653) and ids.count(proc.image_token_id) == tokens == len(ids) - 2


def test_a_shape_only_model_is_counted_from_its_shape_and_refused_for_training(capsys):
    """Offline, the hub id's shape is what the estimate reads (shape_folder); training it needs the weights and
    tokenizer, which are not here: `hf-zero train` stops in one line before any launch."""
    from hf_zero.data.model_names import offline_unless_reachable, shape_folder

    if not offline_unless_reachable():
        pytest.skip("the hub is reachable: the model's own files are read, not the shape")
    assert shape_folder(QWEN25_3B) == _shape(QWEN25_3B) and shape_folder("hf-zero/tiny-qwen2-vl") is None
    config = REPO / "recipes" / "configs" / "qwen25_vl_3b.yaml"
    assert main(["train", "--config", str(config)]) != 0  # stopped by the checks, before the launch
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("hf-zero: error: ") and QWEN25_3B in err[0], err


def test_a_shape_only_model_is_refused_for_training_whatever_tokenizer_is_given(capsys, tmp_path):
    """With a tokenizer that loads (the tiny models'), the checks once passed and the ranks launched and failed on
    the missing weights with a traceback; now one line naming model_name_or_path before any launch, under `hf-zero
    train` and in `hf-zero check` (Llama 3.1 8B's shape too)."""
    from testing_utils import check

    from hf_zero.data.model_names import get_tiny_llama_path, offline_unless_reachable
    from hf_zero.data.tiny_vlm import get_tiny_vlm_path

    if not offline_unless_reachable():
        pytest.skip("the hub is reachable: the model's own files are read, not the shape")
    config = REPO / "recipes" / "configs" / "qwen25_vl_3b.yaml"
    tokenizer, llama_tokenizer = str(get_tiny_vlm_path("hf-zero/tiny-qwen2-vl")), str(get_tiny_llama_path())
    capsys.readouterr()  # building them (on a first use) prints its progress
    assert main(["train", "--config", str(config), "--tokenizer_name_or_path", tokenizer]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"hf-zero: error: model_name_or_path: {QWEN25_3B}: hf_zero ships only "
                                               "its shape"), err
    llama = REPO / "recipes" / "configs" / "long_context_gpu.yaml"
    rc, results = check(capsys, "--config", str(llama), "--tokenizer_name_or_path", llama_tokenizer,
                        output_dir=tmp_path / "o")
    ok, line = results["model"]
    assert rc == 2 and ok is False and "meta-llama/Llama-3.1-8B-Instruct: hf_zero ships only its shape" in line


def test_the_ranks_start_up_count_is_the_parameters_without_running_the_vision_tower():
    """Each rank's start-up room check counts the VLM without sizing an image (no CPU forward of the vision tower in
    every rank): the same parameters, trainable parts and optimizer groups as the estimate's count, no activations."""
    from hf_zero.train.recipe_count import count_parts

    config = str(REPO / "recipes" / "configs" / "tiny_vlm.yaml")
    full, light = count_parts(config), count_parts(config, activations=False)
    assert light.count == full.count and light.trains == full.trains
    assert light.activation_bytes("fp32") == 0 < full.activation_bytes("fp32")


def test_the_vision_term_counts_items_per_row_images_a_row(tmp_path, capsys):
    """`items_per_row: 3`: three images at the bound per row, three times the vision term in every strategy's
    activations, and the table's line says how many it counted."""
    one = estimate_json(capsys, config_copy(tmp_path / "one.yaml"), "--profile", "ddp", "--precision", "fp32")
    three = estimate_json(capsys, config_copy(tmp_path / "three.yaml", items_per_row=3), "--profile", "ddp",
                          "--precision", "fp32")
    per_image = one["multimodal"]["activation_bytes_per_row"]
    assert (one["multimodal"]["images_per_row"], three["multimodal"]["images_per_row"]) == (1, 3)
    assert three["multimodal"]["activation_bytes_per_row"] == 3 * per_image > 0
    micro = one["inputs"]["micro_batch"]
    grown = three["strategies"][0]["gpu_bytes_per_rank"]["activations"] - \
        one["strategies"][0]["gpu_bytes_per_rank"]["activations"]
    assert grown == 2 * micro * per_image
    assert main(["estimate", "--config", str(tmp_path / "three.yaml"), "--profile", "ddp"]) == 0
    assert ", 3 images per row (items_per_row) (" in capsys.readouterr().out
