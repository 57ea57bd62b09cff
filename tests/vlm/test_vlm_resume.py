"""A stock VLM's run resumes as a text model's does: stopped at its stage boundary on 2 CPU ranks (the last step of
stage align, which trains the projector alone), it goes on on 1 rank under another engine (ZeRO-3 -> ZeRO-2,
ZeRO-3 -> FSDP2, FSDP2 -> ZeRO-3) from the converted checkpoint, and stage tune (LoRA in the language model and
the vision tower's qkv, with the projector) gives the uninterrupted run's losses and final adapter."""

import json
import shutil
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file
from testing_utils import REPO, Lazy, launch_recipe

pytestmark = [pytest.mark.multiproc, pytest.mark.extended]

RECIPE = REPO / "recipes" / "vlm.py"
CONFIG = REPO / "recipes" / "configs" / "tiny_vlm.yaml"
DIGITS = REPO / "recipes" / "data" / "tiny_multimodal" / "digits.jsonl"
BOUNDARY = 2
FLAGS = ["--global_batch_size", "4", "--save_strategy", "steps", "--save_steps", str(BOUNDARY)]


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """(config, profile -> the uninterrupted 2-rank run of tiny Qwen2-VL under it): 2 stages x 2 steps, a checkpoint
    at the boundary; each run launched when a test first reads it."""
    root = tmp_path_factory.mktemp("vlm_resume")
    data = yaml.safe_load(CONFIG.read_text())
    for stage in data["stages"]:
        stage.update(steps=BOUNDARY, data=str(DIGITS))
    data.update(eval_samples=0, per_device_train_batch_size=2, model_name_or_path="hf-zero/tiny-qwen2-vl")
    config = root / "tiny.yaml"
    config.write_text(yaml.safe_dump(data, sort_keys=False))

    def make(profile):
        launch_recipe(profile, root / profile, *FLAGS, config=config, recipe=RECIPE)
        return root / profile
    return config, Lazy(make)


def losses(out) -> dict[int, float]:
    return {h["step"]: h["loss"] for h in json.loads((Path(out) / "log_history.json").read_text()) if "loss" in h}


# zero3 -> fsdp2 once failed on the projector, which peft trains as modules_to_save: the converted checkpoint named
# it `merger.modules_to_save.ln_q.weight` where FSDP2's adapter loader wants `merger.ln_q.weight`
# (hf_zero.checkpoint.fsdp.adapter_state_key, shared with the final folder's names).
@pytest.mark.parametrize(("source", "target"), [("zero3", "zero2"), ("zero3", "fsdp2"), ("fsdp2", "zero3")])
def test_a_boundary_resume_on_another_engine_and_rank_count_continues_the_run(sources, tmp_path, source, target):
    config, runs = sources
    ref = runs[source]
    dest = tmp_path / target
    dest.mkdir()
    shutil.copytree(ref / f"checkpoint-{BOUNDARY}", dest / f"checkpoint-{BOUNDARY}")
    proc = launch_recipe(target, dest, *FLAGS, config=config, recipe=RECIPE, nproc=1)
    assert f"checkpoint-{BOUNDARY}: {source} on 2 ranks -> {target} on 1 rank; converting once" in proc.stdout, \
        proc.stdout[-2000:]
    assert f"at step {BOUNDARY} (stage 'align', {BOUNDARY}/{BOUNDARY} steps done)" in proc.stdout, proc.stdout[-2000:]
    mine, theirs = losses(dest), losses(ref)
    after = [step for step in sorted(theirs) if step > BOUNDARY]
    assert [step for step in sorted(mine) if step > BOUNDARY] == after == [3, 4]
    assert max(abs(mine[s] - theirs[s]) for s in after) <= 1e-5, (mine, theirs)
    a, b = (load_file(str(run / "final" / "adapter_model.safetensors")) for run in (dest, ref))
    assert a.keys() == b.keys() and any("lora_A" in k for k in a) and any(".merger." in k for k in a)
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-5
