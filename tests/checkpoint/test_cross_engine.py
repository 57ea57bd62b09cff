"""Change the profile, keep the run: a checkpoint written under one ZeRO stage or engine resumes under another (and
on another rank count), converted once inside the checkpoint; `hf-zero convert` does the same ahead of time.

Runs go through the real `accelerate launch` on CPU ranks, fp32, with the 24-step tiny curriculum of
tests/test_checkpoints.py (3 stages x 8 steps, checkpoints every 3 steps, global batch 4 whatever the rank count).
The default suite chains three launches: an uninterrupted zero3 run (the reference, and the zero3 checkpoints),
zero3 -> fsdp2 on 1 rank from its checkpoint-9, then fsdp2 -> zero3 on 2 ranks from what that run wrote at step 12
(mid-stage). Every engine gives the same losses here within 5e-7 (measured: zero2, zero3 and fsdp2 uninterrupted),
so every resumed run is compared with the one reference."""

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from testing_utils import REPO, TINY, TINY24_FLAGS, launch_recipe, run_cmd

from hf_zero.checkpoint.convert import convert_checkpoint
from hf_zero.checkpoint.dcp import FSDP_OPTIM_DIR, read_dcp_groups
from hf_zero.checkpoint.fsdp import FSDP_MODEL_DIR
from hf_zero.checkpoint.store import crc32_of, file_sizes, read_metadata, write_json_atomic, write_manifest
from hf_zero.checkpoint.universal import universal_groups
from hf_zero.core.errors import UserError

COMMON = TINY24_FLAGS  # the session's reference runs (tiny24_references) are made with these: their runs serve here
TOL = 1e-5


@pytest.fixture(scope="module")
def config(tiny24_config):
    """The tiny curriculum with 8 steps per stage (the session's, shared with the checkpoint tests)."""
    return tiny24_config


def losses(out) -> dict[int, float]:
    return {h["step"]: h["loss"] for h in json.loads((Path(out) / "log_history.json").read_text()) if "loss" in h}


def max_loss_diff(out, ref, after: int) -> float:
    mine, theirs = losses(out), losses(ref)  # the resumed run's history starts with the checkpoint's
    steps = [s for s in theirs if s > after]
    assert steps and [s for s in sorted(mine) if s > after] == steps
    return max(abs(mine[s] - theirs[s]) for s in steps)


def max_weight_diff(a, b) -> float:
    """Over the final model's weights (LoRA: the adapter's)."""
    name = "adapter_model.safetensors" if (Path(a) / "final" / "adapter_model.safetensors").is_file() \
        else "model.safetensors"
    wa, wb = (load_file(str(Path(run) / "final" / name)) for run in (a, b))
    assert wa.keys() == wb.keys()
    return max((wa[k] - wb[k]).abs().max().item() for k in wa)


def resume(profile, source_run, step, dest, config, nproc=None, extra=()):
    """Copy checkpoint-`step` of `source_run` into a fresh output_dir and resume it there under `profile`."""
    dest.mkdir(parents=True)
    shutil.copytree(Path(source_run) / f"checkpoint-{step}", dest / f"checkpoint-{step}")
    return launch_recipe(profile, dest, *COMMON, *extra, config=config, nproc=nproc)


@pytest.fixture(scope="module")
def chain(tmp_path_factory, config, tiny24_references):
    """zero3 uninterrupted (2 ranks; the session's reference run, COMMON being its flags); zero3 -> fsdp2 on 1 rank
    from step 9; fsdp2 -> zero3 on 2 ranks from 12."""
    root = tmp_path_factory.mktemp("cross")
    ref = tiny24_references["zero3"]
    to_fsdp = root / "zero3-to-fsdp2"
    first = resume("fsdp2", ref, 9, to_fsdp, config, nproc=1)
    back = root / "fsdp2-to-zero3"
    second = resume("zero3", to_fsdp, 12, back, config)
    return SimpleNamespace(ref=ref, to_fsdp=to_fsdp, back=back, first=first, second=second)


@pytest.mark.multiproc
def test_zero3_on_2_ranks_resumes_under_fsdp2_on_1(chain):
    out = chain.first.stdout
    assert ("checkpoint-9: zero3 on 2 ranks -> fsdp2 on 1 rank; converting once (kept inside the checkpoint)"
            in out)
    assert "resuming from" in out and "at step 9 (stage 'medium', 1/8 steps done)" in out
    assert max_loss_diff(chain.to_fsdp, chain.ref, 9) <= TOL
    assert max_weight_diff(chain.to_fsdp, chain.ref) <= TOL
    # The conversion stays inside the checkpoint, where FSDP2 reads it; the run's own checkpoints are FSDP2's.
    kept = chain.to_fsdp / "checkpoint-9"
    assert (kept / FSDP_MODEL_DIR / ".complete").is_file() and (kept / FSDP_OPTIM_DIR).is_dir()
    # A second resume from it finds the conversion and does not convert again.
    from hf_zero.checkpoint.convert import convert_in_place, convert_to_universal
    from hf_zero.checkpoint.resume import profile_switch
    from hf_zero.plan.profiles import load_profile

    line = profile_switch(kept, read_metadata(kept), load_profile("fsdp2"), 1, "fsdp2")
    assert line.endswith("fsdp2 on 1 rank; converted before (kept inside the checkpoint)")
    written = {p: p.stat().st_mtime_ns for p in kept.rglob("*")}
    convert_in_place(kept, "fsdp2", convert_to_universal)
    assert {p: p.stat().st_mtime_ns for p in kept.rglob("*")} == written
    meta = read_metadata(chain.to_fsdp / "checkpoint-12")
    assert (meta["profile"], meta["engine"], meta["world_size"]) == ("fsdp2", "fsdp2", 1)


@pytest.mark.multiproc
def test_fsdp2_on_1_rank_resumes_under_zero3_on_2(chain):
    assert ("checkpoint-12: fsdp2 on 1 rank -> zero3 on 2 ranks; converting once (kept inside the checkpoint)"
            in chain.second.stdout)
    assert "restored per-group Adam steps" in chain.second.stdout  # ZeRO-3 universal loading, repaired
    assert max_loss_diff(chain.back, chain.ref, 12) <= TOL
    assert max_weight_diff(chain.back, chain.ref) <= TOL
    assert (chain.back / "checkpoint-12" / "latest_universal").is_file()


@pytest.mark.multiproc
def test_convert_round_trips_and_resumes_without_converting_again(chain, tmp_path, config):
    """zero3 -> fsdp2 -> zero3 and fsdp2 -> zero2 -> fsdp2 with `hf-zero convert` equal the source's state (every
    weight, both Adam moments, steps and group hyper-parameters); the output resumes with nothing left to convert."""
    z3 = chain.ref / "checkpoint-15"
    before = sorted(p.name for p in z3.iterdir())
    universal = convert_checkpoint(z3, "zero3", tmp_path / "u")  # DeepSpeed's own conversion: A's state
    as_fsdp = convert_checkpoint(z3, "fsdp2", tmp_path / "a", nproc=1)
    back = convert_checkpoint(as_fsdp, "zero3", tmp_path / "b")
    assert_same(_universal_state(back), _universal_state(universal))
    assert sorted(p.name for p in z3.iterdir()) == before  # the source is only read
    f2 = chain.to_fsdp / "checkpoint-15"
    as_zero = convert_checkpoint(f2, "zero2", tmp_path / "c", nproc=2)
    again = convert_checkpoint(as_zero, "fsdp2", tmp_path / "d")
    assert_same(_dcp_state(again), _dcp_state(f2))
    meta = read_metadata(as_zero)
    assert (meta["profile"], meta["zero_stage"], meta["world_size"], meta["converted"]["layout"]) == \
        ("zero2", 2, 2, "universal")
    # The converted checkpoint resumes under its profile with nothing to convert (the 2-rank run of the CLI's
    # output; its losses match the reference).
    proc = run_cmd([REPO / ".venv" / "bin" / "hf-zero", "convert", f2, "--to", "zero2", "--nproc", "2", "--out",
                    tmp_path / "e"])
    assert "resume with --output_dir" in proc.stdout
    out = tmp_path / "e"
    proc = launch_recipe("zero2", out, *COMMON, config=config)
    assert "converting" not in proc.stdout
    assert "converted by `hf-zero convert`, loaded as a universal checkpoint on 2 ranks" in proc.stdout
    assert max_loss_diff(out, chain.ref, 15) <= TOL


def assert_same(a: dict, b: dict, tol=1e-6) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if torch.is_tensor(a[key]):
            assert a[key].shape == b[key].shape and (a[key] - b[key]).abs().max().item() <= tol, key
        elif isinstance(a[key], float):
            assert a[key] == pytest.approx(b[key], abs=tol), key
        else:
            assert a[key] == b[key], key


def _universal_state(checkpoint_or_universal) -> dict:
    """Every number a universal checkpoint carries, flattened: name/state -> list, group i/key -> value."""
    folder = Path(checkpoint_or_universal)
    if (folder / "latest_universal").is_file():
        folder = folder / (folder / "latest_universal").read_text().strip()
    out = {}
    for path in sorted((folder / "zero").glob("*/*.pt")):
        loaded = torch.load(path, weights_only=True)
        tensor = loaded["param"] if isinstance(loaded, dict) else loaded
        out[f"{path.parent.name}/{path.stem}"] = torch.as_tensor(tensor).float().flatten()
    for i, group in enumerate(universal_groups(folder)):
        for key in ("lr", "initial_lr", "weight_decay", "eps"):
            out[f"group{i}/{key}"] = group[key]
        out[f"group{i}/names"] = len(group["names"])
    return out


def _dcp_state(checkpoint) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    out = {}
    for sub in (FSDP_MODEL_DIR, FSDP_OPTIM_DIR):
        folder = str(Path(checkpoint) / sub)
        entries = dcp.FileSystemReader(folder).read_metadata().state_dict_metadata
        for key, meta in entries.items():
            if isinstance(meta, TensorStorageMetadata):
                box = {key: torch.empty(meta.size, dtype=meta.properties.dtype)}
                dcp.load(box, storage_reader=dcp.FileSystemReader(folder), no_dist=True)
                out[key] = box[key].float().flatten()
    for i, group in enumerate(read_dcp_groups(Path(checkpoint) / FSDP_OPTIM_DIR)):
        out.update({f"group{i}/{k}": group[k] for k in ("lr", "initial_lr", "weight_decay", "eps")})
        out[f"group{i}/params"] = list(group["params"])
    return out


# ---------------------------------------------------------------- refusals (in-process, no engine)

def _checkpoint(root: Path, **meta) -> Path:
    ck = root / "checkpoint-6"
    ck.mkdir(parents=True)
    (ck / "trainer_state.json").write_text(json.dumps({"global_step": 6}))
    base = {"global_step": 6, "world_size": 2, "zero_stage": 3, "engine": "deepspeed", "profile": "zero3",
            "global_batch": 4, "micro_batch": 2, "grad_accum": 1, "precision": "fp32"}
    write_json_atomic(ck / "hf_zero_checkpoint.json", {**base, **meta})
    write_manifest(ck, {rel: crc32_of(ck / rel) for rel in file_sizes(ck)})
    return ck


def _ctx(root, profile_name, world=2, global_batch=4, precision="fp32"):
    from hf_zero.plan.profiles import load_profile
    from hf_zero.plan.reconcile import BatchPlan

    batch = BatchPlan(micro=global_batch // world, accumulation=1, world=world)
    args = SimpleNamespace(output_dir=str(root), resume_from_checkpoint=None)
    return SimpleNamespace(profile=load_profile(profile_name), training_args=args,
                           plan=SimpleNamespace(batch=batch, world=world, precision=precision))


def test_engine_change_is_planned_and_what_cannot_carry_over_is_refused(tmp_path, capsys):
    from hf_zero.checkpoint.resume import _choose

    _checkpoint(tmp_path)
    plan = _choose(_ctx(tmp_path, "fsdp2", world=1), fresh_start=False)
    assert plan == {"resume": str(tmp_path / "checkpoint-6"), "universal": False, "convert": "fsdp2"}
    assert "checkpoint-6: zero3 on 2 ranks -> fsdp2 on 1 rank; converting once (kept inside the checkpoint)" \
        in capsys.readouterr().out
    assert _choose(_ctx(tmp_path, "zero2"), fresh_start=False) == {"resume": str(tmp_path / "checkpoint-6"),
                                                                    "universal": True}
    with pytest.raises(UserError) as err:  # another global batch: another data order and schedule
        _choose(_ctx(tmp_path, "fsdp2", world=2, global_batch=8), fresh_start=False)
    assert err.value.field == "global_batch_size" and "--global_batch_size 4" in err.value.fix
    with pytest.raises(UserError) as err:  # fp16 holds a loss scale the others do not
        _choose(_ctx(tmp_path, "fsdp2", precision="fp16"), fresh_start=False)
    assert err.value.field == "precision" and "--fp32 true" in err.value.fix
    with pytest.raises(UserError) as err:  # DDP keeps no sharded optimizer state to convert to
        _choose(_ctx(tmp_path, "ddp"), fresh_start=False)
    assert err.value.field == "profile" and "hf-zero export" in err.value.fix


def test_convert_bad_input_is_one_line(tmp_path):
    hf_zero = REPO / ".venv" / "bin" / "hf-zero"
    ck = _checkpoint(tmp_path / "run", engine="ddp", zero_stage=0, profile="ddp")
    proc = run_cmd([hf_zero, "convert", ck, "--to", "fsdp2", "--out", tmp_path / "o"], check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == ("hf-zero: error: CHECKPOINT: checkpoint-6 was written by ddp profile; only zero "
                                   "and fsdp2 checkpoints convert; resume it with the profile that wrote it")
    proc = run_cmd([hf_zero, "convert", tmp_path / "nowhere", "--to", "fsdp2", "--out", tmp_path / "o"],
                   check=False)
    assert proc.returncode == 2 and proc.stderr.startswith("hf-zero: error: CHECKPOINT: ")


# ---------------------------------------------------------------- the long matrix (slow)

LORA = ["--use_peft", "true", "--lora_r", "8", "--lora_dropout", "0", "--lora_target_modules", "q_proj", "v_proj"]


@pytest.fixture(scope="module")
def sources(tmp_path_factory, config, chain, tiny24_references):
    """An uninterrupted run per (source profile, LoRA), started the first time a pair asks for it; without LoRA the
    session's reference runs (COMMON being their flags)."""
    runs = {("zero3", False): chain.ref}

    def get(profile, lora=False):
        if not lora:
            return tiny24_references[profile]
        if (profile, lora) not in runs:
            out = tmp_path_factory.mktemp("src") / f"{profile}{'-lora' if lora else ''}"
            launch_recipe(profile, out, *COMMON, *(LORA if lora else []), config=config)
            runs[profile, lora] = out
        return runs[profile, lora]
    return get


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("source, target, step, nproc, lora", [
    ("zero2", "zero3", 9, None, False),
    ("zero3", "zero2", 12, None, False),
    ("fsdp2", "zero2", 9, 1, False),
    ("zero2", "fsdp2_offload", 12, None, False),
    ("zero3_offload", "zero1", 9, None, False),
    ("zero3", "fsdp2", 9, 1, True),
    ("fsdp2", "zero2", 12, None, True),
])
def test_matrix(sources, tmp_path, config, source, target, step, nproc, lora):
    out = tmp_path / f"{source}-to-{target}"
    proc = resume(target, sources(source, lora), step, out, config, nproc=nproc, extra=LORA if lora else ())
    ranks = "1 rank" if nproc == 1 else "2 ranks"
    assert f"checkpoint-{step}: {source} on 2 ranks -> {target} on {ranks}; converting once" in proc.stdout
    ref = sources("zero3", lora)  # every engine trains the same losses here (module docstring)
    assert max_loss_diff(out, ref, step) <= TOL
    assert max_weight_diff(out, ref) <= TOL


def test_check_says_what_a_resume_under_another_profile_changes(tmp_path, capsys):
    from hf_zero.cli import main

    out = tmp_path / "run"
    _checkpoint(out)
    rc = main(["check", "--profile", "fsdp2", "--nproc", "1", "--config", str(TINY), "--output-dir", str(out),
               "--global_batch_size", "4"])
    lines = capsys.readouterr().out.splitlines()
    output = next(line for line in lines if line.split(" ", 2)[1].rstrip(":") == "output")
    assert rc == 0 and output.startswith("ok ")
    assert output.endswith("resume: checkpoint-6: zero3 on 2 ranks -> fsdp2 on 1 rank; converting once (kept inside "
                           "the checkpoint)")
