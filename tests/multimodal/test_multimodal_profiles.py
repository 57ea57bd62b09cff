"""The composed model (tiny Llama + LoRA, a PointNet and a ViT through MLP projectors) on 2 CPU ranks under every
engine (and single_gpu's one process): the same losses as DDP, and a run resumed at its stage boundary (where what
trains changes) on 1 rank, under the same engine or another, continues with the losses and weights of the
uninterrupted run.

Each run: tiny_multimodal.yaml cut to 2 stages x 3 steps (points, then images + shapes), a global batch of 4 whatever
the rank count, a checkpoint at the boundary (step 3)."""

import json
import shutil
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file
from testing_utils import REPO, Lazy, launch_recipe, profile, read_summary

pytestmark = [pytest.mark.multiproc, pytest.mark.extended]

RECIPE = REPO / "recipes" / "multimodal.py"
CONFIG = REPO / "recipes" / "configs" / "tiny_multimodal.yaml"
FLAGS = ["--global_batch_size", "4", "--save_strategy", "steps", "--save_steps", "3"]
BOUNDARY = 3


def short_config(dst: Path) -> Path:
    data = yaml.safe_load(CONFIG.read_text())
    for stage in data["stages"]:
        paths = stage["data"] if isinstance(stage["data"], list) else [stage["data"]]
        stage.update(steps=BOUNDARY, data=[str((CONFIG.parent / p).resolve()) for p in paths])
    data.update(eval_samples=0, per_device_train_batch_size=2)
    dst.write_text(yaml.safe_dump(data, sort_keys=False))
    return dst


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    return short_config(tmp_path_factory.mktemp("mm_profiles") / "tiny.yaml")


@pytest.fixture(scope="module")
def runs(config):
    """profile -> output folder of its uninterrupted 2-rank run, launched when a test first reads it."""
    def make(name):
        out = config.parent / name
        # single_gpu's own precision is bf16: compared with DDP in the fp32 the cpu profiles run
        launch = profile(config.parent, "single_gpu", {"mixed_precision: bf16": "mixed_precision: 'no'"})[:-5] \
            if name == "single_gpu" else name
        launch_recipe(launch, out, *FLAGS, config=config, recipe=RECIPE)
        return out
    return Lazy(make)


def losses(out) -> dict[int, float]:
    return {h["step"]: h["loss"] for h in json.loads((Path(out) / "log_history.json").read_text()) if "loss" in h}


def max_weight_diff(a: Path, b: Path) -> float:
    wa, wb = (load_file(str(Path(run) / "final" / "model.safetensors")) for run in (a, b))
    assert wa.keys() == wb.keys()
    return max((wa[k] - wb[k]).abs().max().item() for k in wa)


@pytest.mark.parametrize("profile", ["zero2", "zero3", "zero3_offload", "fsdp2", "single_gpu"])
def test_losses_match_ddp(runs, profile):
    """single_gpu: one process (its summary's engine: "single"), the same global batch of 4 as 2 micro-batches."""
    base, s = read_summary(runs["ddp"]), read_summary(runs[profile])
    one = profile == "single_gpu"
    assert (s["profile"], s["world_size"], s["global_batch"]) == ("single" if one else profile, 1 if one else 2, 4)
    assert len(s["losses"]) == len(base["losses"]) == 2 * BOUNDARY
    diffs = [abs(a - b) for a, b in zip(s["losses"], base["losses"])]
    assert max(diffs) <= 1e-4, diffs
    assert max_weight_diff(runs[profile], runs["ddp"]) <= 1e-4


@pytest.mark.parametrize(("source", "target"), [("ddp", "ddp"), ("zero3", "zero2"), ("zero3", "fsdp2")])
def test_a_boundary_resume_on_1_rank_continues_the_2_rank_run(runs, config, tmp_path, source, target):
    """checkpoint-3 of a 2-rank run (the last step of stage points, which trains the point encoder and projector only)
    resumed on 1 rank under `target`: stage images then trains LoRA, the image encoder and both projectors, from the
    part plan's parameter groups restored with the optimizer; its losses and final weights are the source's."""
    ref = runs[source]
    dest = tmp_path / f"{source}-to-{target}"
    dest.mkdir()
    shutil.copytree(ref / f"checkpoint-{BOUNDARY}", dest / f"checkpoint-{BOUNDARY}")
    proc = launch_recipe(target, dest, *FLAGS, config=config, recipe=RECIPE, nproc=1)
    assert f"at step {BOUNDARY} (stage 'points', {BOUNDARY}/{BOUNDARY} steps done)" in proc.stdout, proc.stdout[-2000:]
    if source != target:
        assert f"checkpoint-{BOUNDARY}: {source} on 2 ranks -> {target} on 1 rank; converting once" in proc.stdout
    s = read_summary(dest)
    assert (s["profile"], s["world_size"]) == ("single" if target == "ddp" else target, 1)  # DDP of 1: plain
    mine, theirs = losses(dest), losses(ref)
    after = [step for step in theirs if step > BOUNDARY]
    assert [step for step in sorted(mine) if step > BOUNDARY] == after == [4, 5, 6]
    assert max(abs(mine[step] - theirs[step]) for step in after) <= 1e-5, (mine, theirs)
    assert max_weight_diff(dest, ref) <= 1e-5
    # the point encoder, frozen in stage images, leaves the resumed run as it entered it: not one bit moved
    entered = load_file(str(ref / f"checkpoint-{BOUNDARY}" / "model.safetensors"))
    final = load_file(str(dest / "final" / "model.safetensors"))
    frozen = [k for k in final if k.startswith("encoders.points.")]
    assert frozen and all((final[k] == entered[k]).all() for k in frozen)
