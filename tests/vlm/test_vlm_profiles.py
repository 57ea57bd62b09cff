"""Stock VLMs on 2 CPU ranks under every engine: the same losses as DDP (tiny_vlm.yaml: the projector trained in
full in stage align, then LoRA in the language model and the vision tower's qkv with the projector), and the step
where one rank has only text rows and the other only image rows completes under ZeRO-3 and FSDP2 (the hang of
Qwen3-VL#126 and ms-swift#8171: hf_zero.train.vlm runs the vision tower on a blank image for a text-only batch)."""

import json
import textwrap
from pathlib import Path

import pytest
import yaml
from testing_utils import REPO, Lazy, launch_recipe, read_summary

pytestmark = [pytest.mark.multiproc, pytest.mark.extended]

RECIPE = REPO / "recipes" / "vlm.py"
CONFIG = REPO / "recipes" / "configs" / "tiny_vlm.yaml"
DIGITS = REPO / "recipes" / "data" / "tiny_multimodal" / "digits.jsonl"
FLAGS = ["--global_batch_size", "4"]
STEPS = 2
MODELS = ("hf-zero/tiny-qwen2-vl", "hf-zero/tiny-smolvlm", "hf-zero/tiny-llava", "hf-zero/tiny-qwen3-vl")


def short_config(dst: Path, model: str) -> Path:
    data = yaml.safe_load(CONFIG.read_text())
    for stage in data["stages"]:
        stage.update(steps=STEPS, data=str(DIGITS))
    data.update(eval_samples=0, per_device_train_batch_size=2, model_name_or_path=model)
    dst.write_text(yaml.safe_dump(data, sort_keys=False))
    return dst


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(model, profile) -> output folder of its 2-rank run, launched when a test first reads it."""
    root = tmp_path_factory.mktemp("vlm_profiles")

    def make(key):
        model, profile = key
        name = model.rsplit("/", 1)[-1]  # tiny-qwen2-vl and tiny-qwen3-vl: their last words are the same
        out = root / f"{name}-{profile}"
        launch_recipe(profile, out, *FLAGS, config=short_config(root / f"{name}.yaml", model), recipe=RECIPE)
        return out
    return Lazy(make)


# LLaVA under ZeRO-3 parted from DDP at the first step that trained LoRA (6.2e-4 on the last of 4 losses) until the
# base model was loaded without drawing from the run's random state (hf_zero.train.model.drawing_nothing): zero.Init
# builds CLIP's class_embedding with torch.randn, a plain load on meta draws nothing, and LoRA's lora_A, drawn next,
# started 0.33 apart.
CASES = [(m, p) for p in ("zero2", "zero3", "fsdp2") for m in MODELS]


@pytest.mark.parametrize("model,profile", CASES)
def test_losses_match_ddp(runs, model, profile):
    base, s = read_summary(runs[model, "ddp"]), read_summary(runs[model, profile])
    assert (s["profile"], s["world_size"], s["global_batch"]) == (profile, 2, 4)
    assert len(s["losses"]) == len(base["losses"]) == 2 * STEPS
    diffs = [abs(a - b) for a, b in zip(s["losses"], base["losses"])]
    assert max(diffs) <= 1e-4, diffs


# The recipe with the sample order forced: in each step's global batch of 4, rank 0's micro-batch comes from source 0
# (text rows), rank 1's from source 1 (image rows). Each rank records whether its batches held images.
WRAPPER = textwrap.dedent('''\
    import json, os, runpy, sys
    import hf_zero.train.recipe_steps as steps
    from hf_zero.data.vlm import VlmCollator

    original = steps.build_sample_order

    def forced(schedule, source_sizes, weights, seed):
        order = original(schedule, source_sizes, weights, seed)
        half = schedule.global_batch // 2
        for k in range(len(order)):
            src = 0 if k % schedule.global_batch < half else 1
            order[k, 1], order[k, 2] = src, k % source_sizes[order[k, 0]][src]
        return order

    steps.build_sample_order = forced
    collate = VlmCollator.__call__

    def recording(self, samples):
        batch = collate(self, samples)
        with open(os.path.join(os.environ["FORCED_SPLIT_LOG"], f"rank{os.environ.get('RANK', '0')}.jsonl"), "a") as f:
            f.write(json.dumps("pixel_values" in batch) + "\\n")
        return batch

    VlmCollator.__call__ = recording
    sys.argv[0] = RECIPE
    runpy.run_path(RECIPE, run_name="__main__")
''')


# Qwen3-VL too: its DeepStack mergers are more of the vision side a text-only rank must run
@pytest.mark.parametrize("model", ["hf-zero/tiny-qwen2-vl", "hf-zero/tiny-qwen3-vl"])
@pytest.mark.parametrize("profile", ["zero3", "fsdp2"])
def test_text_only_rank_beside_image_only_rank_completes(tmp_path, profile, model):
    text = tmp_path / "text.jsonl"
    text.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Say {w}."},
                                                     {"role": "assistant", "content": w}]}) + "\n"
                            for w in ("one", "two", "three", "four", "five", "six", "seven", "eight")))
    config = yaml.safe_load(short_config(tmp_path / "base.yaml", model).read_text())
    config["stages"] = [{"name": "mixed", "data": [str(text), str(DIGITS)], "steps": 3,
                         "train": ["vision_tower", "projector", "lora"]}]
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    wrapper = tmp_path / "vlm.py"  # the YAML names the vlm recipe: the script's name must match
    wrapper.write_text(f"RECIPE = {str(RECIPE)!r}\n" + WRAPPER)
    logs = tmp_path / "batches"
    logs.mkdir()
    out = tmp_path / "run"
    launch_recipe(profile, out, *FLAGS, config=tmp_path / "cfg.yaml", recipe=wrapper, timeout=900,
                  env={"FORCED_SPLIT_LOG": str(logs), "PYTHONPATH": str(REPO)})
    seen = {r: [json.loads(line) for line in (logs / f"rank{r}.jsonl").read_text().splitlines()] for r in (0, 1)}
    assert seen == {0: [False] * 3, 1: [True] * 3}  # rank 0: text only (the blank image), rank 1: images only
    s = read_summary(out)
    assert s["profile"] == profile and len(s["losses"]) == 3
