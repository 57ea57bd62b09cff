"""No code runs from a checkpoint: every pickle of a checkpoint loads under torch's weights-only unpickler
with hf_zero's allowlist; a crafted one is refused in one line naming the file and the type, by resume (on every
rank, printed once) and export, before anything runs it. One real 2-rank zero2 run provides the checkpoint."""

import io
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from testing_utils import REPO, TINY

from hf_zero.checkpoint.allowlist import ALLOWED, allowed_globals
from hf_zero.checkpoint.convert import convert_to_universal
from hf_zero.checkpoint.resume import _choose
from hf_zero.checkpoint.safe_load import FORCE_ENV, _is_pickle, check_checkpoint, safe_checkpoint_loading
from hf_zero.checkpoint.store import MANIFEST_NAME, crc32_of, file_sizes, write_manifest
from hf_zero.cli import main
from hf_zero.core.errors import UserError


class Payload:
    """What an attacker puts in a pickle: unpickling it with plain pickle creates `marker`."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _pickles(folder: Path) -> list[Path]:
    return [p for p in sorted(folder.rglob("*")) if p.is_file() and p.suffix != ".distcp" and _is_pickle(p)]


def _plant(checkpoint: Path, rel: str, marker: Path) -> Path:
    """A copy of a real file with the payload inside, and a manifest that matches it (a manifest proves the files
    are the ones written, not who wrote them)."""
    path = checkpoint / rel
    value = torch.load(path, weights_only=False)  # our own clean file
    if isinstance(value, dict):
        value["extra"] = Payload(marker)
    else:
        value.extra = Payload(marker)
    torch.save(value, path)
    if (checkpoint / MANIFEST_NAME).is_file():
        write_manifest(checkpoint, {r: crc32_of(checkpoint / r) for r in file_sizes(checkpoint)})
    return path


@pytest.fixture(scope="module")
def trained(strategy_runs):
    """A finished 2-rank zero2 run (the session's shared one) and its last checkpoint, checkpoint-15."""
    return strategy_runs["zero2"].out


@pytest.mark.multiproc
def test_every_pickle_of_a_real_checkpoint_loads_under_the_allowlist(trained):
    from torch import _weights_only_unpickler as wo

    checkpoint = trained / "checkpoint-15"
    files = _pickles(checkpoint)
    names = {p.name for p in files}
    assert {"mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt", "rng_state_1.pth",
            "scheduler.pt", "training_args.bin"} <= names and len(files) == 7, names
    assert check_checkpoint(checkpoint) == 7
    # The allowlist holds what these files need beyond torch's defaults: nothing is missing from it.
    needed = set()
    for path in files:
        with open(path, "rb") as f, torch.serialization._open_zipfile_reader(f) as z:
            needed |= wo.get_globals_in_pkl(io.BytesIO(z.get_record("data.pkl")))
    needed -= set(wo._get_allowed_globals())
    assert needed and needed <= set(ALLOWED), needed - set(ALLOWED)
    assert len(allowed_globals()) == len(ALLOWED)  # each entry names an object that exists


@pytest.mark.multiproc
def test_final_holds_no_pickle_and_its_training_arguments_as_json(trained):
    final = trained / "final"
    assert not (final / "training_args.bin").exists() and _pickles(final) == []
    args = json.loads((final / "training_args.json").read_text())
    assert args["output_dir"] == str(trained) and args["deepspeed"]["zero_optimization"]["stage"] == 2


@pytest.mark.multiproc
def test_resume_refuses_a_payload_in_the_model_states_on_every_rank_in_one_line(trained, tmp_path):
    checkpoint = tmp_path / "checkpoint-15"
    shutil.copytree(trained / "checkpoint-15", checkpoint)
    marker = tmp_path / "pwned"
    bad = _plant(checkpoint, "global_step15/mp_rank_00_model_states.pt", marker)
    # The last stage longer (and the change allowed): a resume with steps left to train, so that what stops it is
    # the payload, not "nothing would train" (checkpoint-15 is the end of the tiny curriculum).
    recipe = yaml.safe_load(Path(TINY).read_text())
    recipe["stages"][-1]["steps"] += 5
    here = Path(TINY).parent  # the data paths are relative to the recipe: absolute in the copy
    for stage in recipe["stages"]:
        data = stage["data"]
        stage["data"] = [str(here / d) for d in data] if isinstance(data, list) else str(here / data)
    config = tmp_path / "longer.yaml"
    config.write_text(yaml.safe_dump(recipe))
    proc = subprocess.run([sys.executable, "-m", "hf_zero.cli", "train", "--profile", "zero2", "--config", config,
                           "--output_dir", tmp_path / "run", "--disable_tqdm", "true", "--allow_changes", "stages",
                           "--resume_from_checkpoint", checkpoint], cwd=REPO, capture_output=True, text=True,
                          timeout=900)
    out = proc.stdout + proc.stderr
    line = f"hf-zero: error: checkpoint: {bad} holds posix.system, which hf_zero does not load"
    assert proc.returncode == 2 and out.count(line) == 1 and "Traceback" not in out, out[-3000:]
    assert not marker.exists()
    # The same file refused by export.
    assert main(["export", str(checkpoint), "--out", str(tmp_path / "exported")]) == 2
    assert not marker.exists() and not (tmp_path / "exported").exists()


@pytest.mark.multiproc
@pytest.mark.parametrize("rel", ["rng_state_1.pth", "training_args.bin"])
def test_a_foreign_checkpoint_given_by_flag_is_checked_file_by_file(trained, tmp_path, rel, capsys):
    checkpoint = tmp_path / "checkpoint-15"
    shutil.copytree(trained / "checkpoint-15", checkpoint)
    (checkpoint / MANIFEST_NAME).unlink()  # not written by hf_zero: no manifest to check first
    marker = tmp_path / "pwned"
    bad = _plant(checkpoint, rel, marker)
    ctx = SimpleNamespace(training_args=SimpleNamespace(output_dir=str(tmp_path / "run"),
                                                        resume_from_checkpoint=str(checkpoint)))
    with pytest.raises(UserError) as err:
        _choose(ctx, fresh_start=False)
    assert err.value.field == "checkpoint" and f"{bad} holds posix.system" in err.value.problem
    assert main(["export", str(checkpoint), "--out", str(tmp_path / "exported")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [f"hf-zero: error: {err.value.line()}"]
    assert not marker.exists()


def test_the_guard_makes_every_torch_load_weights_only_even_deepspeeds(tmp_path):
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    marker = tmp_path / "pwned"
    bad = tmp_path / "mp_rank_00_model_states.pt"
    torch.save({"module": {"w": torch.ones(2)}, "x": Payload(marker)}, bad)
    good = tmp_path / "good.pt"
    torch.save({"w": torch.ones(2)}, good)
    before = os.environ.get(FORCE_ENV)
    with safe_checkpoint_loading():
        assert os.environ[FORCE_ENV] == "1"  # what subprocesses inherit; torch honours it over weights_only=False
        assert torch.equal(torch.load(good, weights_only=False)["w"], torch.ones(2))
        with pytest.raises(UserError) as err:
            TorchCheckpointEngine().load(str(bad))  # torch.load(..., weights_only=False) inside DeepSpeed
        with safe_checkpoint_loading():  # re-entrant: the inner exit keeps the outer guard
            pass
        with pytest.raises(UserError):
            torch.load(bad, weights_only=False)
    assert os.environ.get(FORCE_ENV) == before and torch.load is torch.serialization.load
    assert err.value.line().startswith(f"checkpoint: {bad} holds posix.system, which hf_zero does not load;")
    assert not marker.exists()


def test_distributed_checkpoint_metadata_and_byte_items_are_checked(tmp_path):
    """FSDP2's checkpoints: torch reads .metadata with plain pickle and non-tensor items with weights_only=False."""
    import torch.distributed.checkpoint as dcp

    model = torch.nn.Linear(2, 2)
    optim = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    optim.step()
    folder = tmp_path / "optimizer_0"
    dcp.save({"optimizer": optim.state_dict()}, checkpoint_id=str(folder), no_dist=True)
    assert check_checkpoint(tmp_path) == 1  # the .metadata; its byte items (param_groups) load too
    marker = tmp_path / "pwned"
    bad = tmp_path / "evil" / ".metadata"
    bad.parent.mkdir()
    bad.write_bytes(pickle.dumps(Payload(marker), protocol=4))
    with pytest.raises(UserError, match=r"evil/\.metadata holds posix\.system"):
        check_checkpoint(tmp_path / "evil")
    # A byte item of the .distcp replaced by a payload of the same length (DCP records offsets and lengths).
    meta = pickle.load(open(folder / ".metadata", "rb"))
    index, info = next((i, s) for i, s in meta.storage_data.items() if "param_groups" in i.fqn)
    blob = io.BytesIO()
    torch.save(Payload(marker), blob)
    meta.storage_data[index] = type(info)(info.relative_path, os.path.getsize(folder / info.relative_path),
                                          len(blob.getvalue()))
    with open(folder / info.relative_path, "ab") as f:
        f.write(blob.getvalue())
    pickle.dump(meta, open(folder / ".metadata", "wb"))
    with pytest.raises(UserError, match=r"\.distcp holds posix\.system"):
        check_checkpoint(folder)
    assert not marker.exists()


@pytest.mark.multiproc
def test_ds_to_universal_runs_under_the_guard(trained, tmp_path):
    """The rank-count conversion is a subprocess of DeepSpeed's: a payload it would load is refused there too."""
    checkpoint = tmp_path / "checkpoint-15"
    shutil.copytree(trained / "checkpoint-15", checkpoint)
    marker = tmp_path / "pwned"
    bad = _plant(checkpoint, "global_step15/zero_pp_rank_1_mp_rank_00_optim_states.pt", marker)
    with pytest.raises(UserError) as err:
        convert_to_universal(checkpoint)
    assert err.value.line().startswith(f"checkpoint: {bad} holds posix.system"), err.value.line()
    assert not marker.exists() and not (checkpoint / "global_step15_universal").exists()
