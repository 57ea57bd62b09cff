"""recipes/multimodal.py on recipes/configs/tiny_multimodal.yaml in one process: the loss falls, a part a stage freezes
does not change by one bit while another trains, the final folder is the trained model, and bad input is one line."""

import json
import sys
from pathlib import Path

import pytest
import yaml
from testing_utils import REPO, read_summary, run_cmd

RECIPE = REPO / "recipes" / "multimodal.py"
CONFIG = REPO / "recipes" / "configs" / "tiny_multimodal.yaml"


def short_config(dst: Path, steps: int = 4, **overrides) -> Path:
    data = yaml.safe_load(CONFIG.read_text())
    for stage in data["stages"]:
        paths = stage["data"] if isinstance(stage["data"], list) else [stage["data"]]
        stage.update(steps=steps, data=[str((CONFIG.parent / p).resolve()) for p in paths])
    data.update(eval_samples=4, **overrides)
    dst.write_text(yaml.safe_dump(data, sort_keys=False))
    return dst


# Each test here runs the recipe (the module's run once, a resume, refusals): `make test`, not `make test-fast`.
pytestmark = pytest.mark.recipe_run


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("multimodal")
    out = root / "run"
    proc = run_cmd([sys.executable, RECIPE, "--config", short_config(root / "tiny.yaml"), "--output_dir", out,
                    "--disable_tqdm", "true", "--save_strategy", "steps", "--save_steps", "2", "--save_total_limit",
                    "4"])
    (root / "console.log").write_text(proc.stdout)
    return out


def weights(folder: Path, prefix: str) -> dict:
    from safetensors.torch import load_file

    return {k: v for k, v in load_file(folder / "model.safetensors").items() if k.startswith(prefix) or
            (prefix == "lora" and "lora_" in k)}


def same(a: dict, b: dict) -> bool:
    import torch

    assert a.keys() == b.keys() and a
    return all(torch.equal(a[k], b[k]) for k in a)


def test_the_loss_falls(run):
    s = read_summary(run)
    assert len(s["losses"]) == 8 and s["eval_loss_after"] < s["eval_loss_before"] - 0.05
    assert s["modalities"] == {"points": {"tokens": 4, "input_shape": [64, 3]},
                               "image": {"tokens": 5, "input_shape": [1, 8, 8]}}
    assert s["parts"]["points"]["lora"] == 0.0 and s["parts"]["images"]["projector.image"] == 1.5
    banner = (run.parent / "console.log").read_text()
    # PointNet(3 -> 32 -> 32 -> 32, head 32 -> 4 x 32) and its MLP projector (32 -> 32 -> 32): parameters per part
    assert "[hf_zero] modalities: points: 4 tokens/item, image: 5 tokens/item" in banner
    assert "[hf_zero] stage points: trains encoder.points (6,464), projector.points (2,112); frozen lora (" in banner


def test_a_frozen_part_does_not_change_by_one_bit_during_the_stage_that_freezes_it(run):
    # stage points (steps 1-4) trains encoder.points + projector.points; stage images (5-8) freezes encoder.points
    mid, boundary, end = (run / f"checkpoint-{n}" for n in (2, 4, 8))
    assert not same(weights(mid, "encoders.points"), weights(boundary, "encoders.points"))  # it trained in stage 1
    assert same(weights(boundary, "encoders.points"), weights(end, "encoders.points"))  # then not one bit moved
    for part in ("encoders.image", "projectors.image", "lora"):  # frozen in stage 1, trained in stage 2
        assert same(weights(mid, part), weights(boundary, part)), part
        assert not same(weights(boundary, part), weights(end, part)), part


def test_the_final_folder_holds_the_trained_model(run):
    import torch

    from hf_zero.train.composed import ComposedModel

    model = ComposedModel.from_pretrained(run / "final")
    last = weights(run / "checkpoint-8", "")
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in last.items())
    adapter = json.loads((run / "final" / "llm_adapter" / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == "hf-zero/tiny-llama"  # the hub id: loads offline from the cache


def test_the_output_room_is_sized_for_the_final_folder(run):
    """`hf-zero check` and the ranks' start-up check size the final folder as it is written: the whole composed model
    and its LLM's adapter beside it (fp32 here), within 10%; the LLM's LoRA alone, which they once sized, is a
    third of it."""
    from hf_zero.train.recipe_count import count_parts

    parts = count_parts(str(CONFIG))
    written = sum(f.stat().st_size for f in (run / "final").rglob("*.safetensors"))
    assert abs(4 * parts.final_params - written) <= 0.1 * written, (4 * parts.final_params, written)
    assert 4 * parts.count.trainable_params < 0.6 * written


def test_packed_rows_train_with_their_items(tmp_path):
    """`packing: true`: conversations go whole into rows of max_seq_length with their point clouds and images (the
    losses per conversation are those it has alone: tests/multimodal/test_composed.py); fewer rows, same steps."""
    import math

    out = tmp_path / "o"
    proc = run_cmd([sys.executable, RECIPE, "--config", short_config(tmp_path / "c.yaml", steps=2, max_seq_length=128),
                    "--output_dir", out, "--packing", "true", "--disable_tqdm", "true", "--save_final_model", "false"])
    s = read_summary(out)
    assert s["settings"]["packing"] is True and len(s["losses"]) == 4 and all(map(math.isfinite, s["losses"]))
    assert math.isfinite(s["eval_loss_after"]) and "Traceback" not in proc.stderr


@pytest.mark.parametrize("case", ["missing_image", "unknown_part"])
def test_bad_input_is_one_line_exit_2(tmp_path, case):
    extra = {}
    if case == "missing_image":
        rows = (REPO / "recipes/data/tiny_multimodal/digits.jsonl").read_text().splitlines()
        rows[2] = rows[2].replace('"image": "digits/', '"image": "digits/gone_')
        data = tmp_path / "digits.jsonl"
        data.write_text("\n".join(rows) + "\n")
        for f in (REPO / "recipes/data/tiny_multimodal/digits").iterdir():
            (tmp_path / "digits").mkdir(exist_ok=True)
            (tmp_path / "digits" / f.name).write_bytes(f.read_bytes())
    config = short_config(tmp_path / "bad.yaml", **extra)
    text = config.read_text()
    if case == "missing_image":
        text = text.replace(str(REPO / "recipes/data/tiny_multimodal/digits.jsonl"), str(data))
    else:
        text = text.replace("- encoder.image", "- vision_tower")
    config.write_text(text)
    proc = run_cmd([sys.executable, RECIPE, "--config", config, "--output_dir", tmp_path / "o"], check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    err = [ln for ln in proc.stderr.splitlines() if ln.startswith("hf-zero: error:")]
    assert len(err) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    if case == "missing_image":
        assert err[0].startswith("hf-zero: error: stages[images].data[0]: ") and " row 3: image file digits/gone_" \
            in err[0], err[0]
    else:
        assert err[0].startswith("hf-zero: error: stages[images].train: unknown part 'vision_tower'; use one of "), \
            err[0]


def test_check_opens_every_image_and_array_and_names_a_bad_one(tmp_path, capsys):
    from testing_utils import check

    rc, results = check(capsys, "--config", str(short_config(tmp_path / "good.yaml")), output_dir=tmp_path / "o")
    assert rc == 0 and results["data"][0] is True
    assert results["data"][1].startswith("2 stage(s), every image and array opened: points 60 rows, 60 files; "
                                         "images 120 rows, 120 files; "), results["data"]
    shapes = tmp_path / "shapes"
    shapes.mkdir()
    for f in (REPO / "recipes/data/tiny_multimodal/shapes").iterdir():
        (shapes / f.name).write_bytes(f.read_bytes())
    (shapes / "00007_cylinder.npy").write_bytes(b"not an array")
    rows = tmp_path / "shapes.jsonl"
    rows.write_text((REPO / "recipes/data/tiny_multimodal/shapes.jsonl").read_text())
    config = short_config(tmp_path / "bad.yaml")
    config.write_text(config.read_text().replace(str(REPO / "recipes/data/tiny_multimodal/shapes.jsonl"), str(rows)))
    rc, results = check(capsys, "--config", str(config), output_dir=tmp_path / "o")
    ok, line = results["data"]
    assert rc == 2 and ok is False and " row 8: points file shapes/00007_cylinder.npy: " in line, line


def test_a_mid_stage_resume_gives_the_uninterrupted_weights(run, tmp_path):
    """The run cut after checkpoint-6 (mid stage 2, with every part in its own parameter group and LR factor), then
    resumed: its final model equals the uninterrupted run's to the bit."""
    import shutil

    import torch

    cut = tmp_path / "run"
    shutil.copytree(run, cut, ignore=shutil.ignore_patterns("checkpoint-8", "final", "summary.json",
                                                            "log_history.json", "loss.png", "runs"))
    (cut / "latest_checkpoint").write_text("checkpoint-6\n")
    run_cmd([sys.executable, RECIPE, "--config", run.parent / "tiny.yaml", "--output_dir", cut, "--disable_tqdm",
             "true", "--save_strategy", "steps", "--save_steps", "2", "--save_total_limit", "4"])
    assert read_summary(cut)["resumed_from"].endswith("checkpoint-6")
    resumed, straight = weights(cut / "final", ""), weights(run / "final", "")
    assert resumed.keys() == straight.keys() and all(torch.equal(resumed[k], straight[k]) for k in straight)
