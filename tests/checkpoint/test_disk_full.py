"""A full or read-only disk outside the ZeRO-2 path is the one `disk:` line with the right cause (issue 39, item 6):
an FSDP2 checkpoint save (torch's zip writer says only "unexpected pos"; the distributed checkpoint wraps it in a
BaseException), `hf-zero export` (safetensors' own error), `hf-zero convert` and the conversion a resume does inside
a checkpoint. In-process: the write functions are patched to fail as the libraries do on a full disk."""

import errno
import json
import os
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from testing_utils import with_meta

from hf_zero.checkpoint import convert as convert_mod
from hf_zero.checkpoint.store import LATEST_NAME, crc32_of, file_sizes, write_json_atomic, write_manifest
from hf_zero.core import disk
from hf_zero.core.disk import disk_error
from hf_zero.core.errors import UserError

TORCH_FULL = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 1728 vs 1600")
SAFETENSORS_FULL = 'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left" })'


@pytest.fixture
def full_disk(monkeypatch, tmp_path):
    """shutil.disk_usage as if tmp_path were on a full disk (1 MiB free), every other path on a roomy one: what
    hf_zero asks when a library names no errno."""
    def usage(path):
        free = 1 << 20 if Path(path).absolute().is_relative_to(tmp_path) else 1 << 40
        return SimpleNamespace(total=1 << 41, used=(1 << 41) - free, free=free)

    monkeypatch.setattr(disk.shutil, "disk_usage", usage)


def _checkpoint_exception(cause: BaseException) -> BaseException:
    from torch.distributed.checkpoint.api import CheckpointException

    return CheckpointException("save failed", {0: (cause, None)})


def test_every_library_s_words_for_a_full_or_read_only_disk(tmp_path, full_disk):
    from safetensors import SafetensorError

    for exc in (_checkpoint_exception(TORCH_FULL), SafetensorError(SAFETENSORS_FULL),
                OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "x"))):
        line = disk_error(exc, tmp_path).line()
        assert line.startswith("disk: could not write ") and "free space" in line, line
    read_only = disk_error(OSError(errno.EROFS, "Read-only file system", str(tmp_path / "x"))).line()
    assert "Read-only file system" in read_only and "free space" not in read_only and "not writable" in read_only
    assert disk_error(ValueError("a bug"), tmp_path) is None and disk_error(TORCH_FULL) is not None


class _FailingSave:
    """What the Trainer's own _save_checkpoint does under FSDP2 on a full (or read-only) disk."""

    error: BaseException = None

    def _save_checkpoint(self, model, trial):
        Path(self.args.output_dir, f"checkpoint-{self.state.global_step}").mkdir(parents=True)
        raise self.error


def _trainer(out, error):
    from hf_zero.checkpoint.staging import StagedCheckpointMixin

    class Trainer(StagedCheckpointMixin, _FailingSave):
        pass

    t = Trainer()
    t.error = error
    t.args = SimpleNamespace(output_dir=str(out))
    t.state = SimpleNamespace(global_step=9)
    t.accelerator = SimpleNamespace(wait_for_everyone=lambda: None)
    t.is_world_process_zero = lambda: True
    return t


@pytest.mark.parametrize("cause,words", [(TORCH_FULL, "free space"),
                                          (OSError(errno.EROFS, "Read-only file system"), "not writable")],
                         ids=["full", "read_only"])
def test_fsdp2_checkpoint_save_on_a_full_disk_is_the_one_disk_line(tmp_path, monkeypatch, full_disk, cause, words):
    """Before: a 119-line traceback (CheckpointException is a BaseException the save's `except Exception` missed).
    After: the one `disk:` line naming the newest complete checkpoint, the staged folder removed, exit 2."""
    from hf_zero.checkpoint import write

    out = tmp_path / "run"
    (out / "checkpoint-6").mkdir(parents=True)
    (out / LATEST_NAME).write_text("checkpoint-6\n")
    lines = []
    monkeypatch.setattr(write, "report_user_error", lambda err: lines.append(err.line()))
    monkeypatch.setattr(write.os, "_exit", lambda code: (_ for _ in ()).throw(SystemExit(code)))
    with pytest.raises(SystemExit) as stop:
        _trainer(out, _checkpoint_exception(cause))._save_checkpoint(None, None)
    assert stop.value.code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("disk: could not write ") and words in lines[0] and "checkpoint-6" in lines[0], lines
    assert ("free space" in lines[0]) == (words == "free space")
    assert words != "free space" or "(1.0 MiB free)" in lines[0], lines  # the run's disk, not the current folder's
    assert not (out / ".hf_zero_staging" / "checkpoint-9").exists() and (out / "checkpoint-6").is_dir()


def _plain_checkpoint(root: Path) -> Path:
    """A Trainer checkpoint of plain safetensors weights: what `hf-zero export` copies shard by shard."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    ck = root / "checkpoint-3"
    ck.mkdir(parents=True)
    LlamaConfig(hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=2, vocab_size=32).save_pretrained(str(ck))
    save_file({"model.embed_tokens.weight": torch.ones(32, 8)}, str(ck / "model.safetensors"))
    (ck / "trainer_state.json").write_text(json.dumps({"global_step": 3}))
    return ck


@pytest.mark.parametrize("error,words", [(SAFETENSORS_FULL, "free space"),
                                          (OSError(errno.EROFS, "Read-only file system"), "not writable")],
                         ids=["full", "read_only"])
def test_export_on_a_full_disk_is_one_line_and_leaves_nothing(tmp_path, monkeypatch, capsys, error, words):
    """Before: a SafetensorError traceback, and OUT.partial/ left behind. After: one line, nothing left."""
    import safetensors.torch
    from safetensors import SafetensorError

    from hf_zero.cli import main

    ck = _plain_checkpoint(tmp_path)
    exc = SafetensorError(error) if isinstance(error, str) else error

    def failing(*args, **kwargs):
        raise exc

    monkeypatch.setattr(safetensors.torch, "save_file", failing)
    out = tmp_path / "exported"
    assert main(["export", str(ck), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("hf-zero: error: disk: could not write ") and words in err, err
    assert ("free space" in err) == (words == "free space"), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-3"]


def _fsdp_checkpoint(root: Path) -> Path:
    """An FSDP2 checkpoint as `hf-zero convert` sees it (its distributed-checkpoint folders copied as they are)."""
    ck = with_meta(root, engine="fsdp2", profile="fsdp2", zero_stage=0)
    shutil.rmtree(ck / "global_step")
    for name in ("pytorch_model_fsdp_0", "optimizer_0"):
        (ck / name).mkdir()
        (ck / name / "__0_0.distcp").write_bytes(os.urandom(256))
    write_manifest(ck, {rel: crc32_of(ck / rel) for rel in file_sizes(ck)})
    return ck


def test_convert_on_a_full_disk_says_disk_and_the_same_command_then_works(tmp_path, monkeypatch):
    """Before: the OSError escaped and `.checkpoint-6.partial/` stayed, so the same command failed with `--out ...
    is not empty`. After: the `disk:` line, nothing left, and the same command converts once there is room."""
    ck = _fsdp_checkpoint(tmp_path / "run")
    monkeypatch.setattr(convert_mod, "check_checkpoint", lambda folder: None)  # (its own tests: test_safe_load.py)
    real = shutil.copytree

    def full(src, dst, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(dst))

    monkeypatch.setattr(convert_mod.shutil, "copytree", full)
    out = tmp_path / "converted"
    with pytest.raises(UserError) as err:
        convert_mod.convert_checkpoint(str(ck), "fsdp2", str(out))
    assert err.value.field == "disk" and "No space left on device" in err.value.problem
    assert "free space" in err.value.fix
    assert not out.exists() or not any(out.iterdir())
    monkeypatch.setattr(convert_mod.shutil, "copytree", real)
    assert convert_mod.convert_checkpoint(str(ck), "fsdp2", str(out)) == out / "checkpoint-6"


def test_a_killed_convert_s_partial_is_removed_by_the_next_one_and_nothing_else(tmp_path, monkeypatch):
    ck = _fsdp_checkpoint(tmp_path / "run")
    monkeypatch.setattr(convert_mod, "check_checkpoint", lambda folder: None)
    out = tmp_path / "converted"
    (out / ".checkpoint-6.partial" / "optimizer_0").mkdir(parents=True)  # what a SIGKILLed convert leaves
    write_json_atomic(out / ".hf_zero_convert.json", {"partial": ".checkpoint-6.partial"})
    assert convert_mod.convert_checkpoint(str(ck), "fsdp2", str(out)) == out / "checkpoint-6"
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-6"]
    other = tmp_path / "other"
    (other / ".checkpoint-6.partial").mkdir(parents=True)  # no mark: not hf_zero's, never deleted
    with pytest.raises(UserError) as err:
        convert_mod.convert_checkpoint(str(ck), "fsdp2", str(other))
    assert err.value.field == "--out" and (other / ".checkpoint-6.partial").is_dir()


def _deepspeed_checkpoint(root: Path) -> Path:
    ck = with_meta(root)
    (ck / "latest").write_text("global_step6")
    (ck / "global_step6").mkdir()
    return ck


@pytest.mark.parametrize("stderr", ["OSError: [Errno 28] No space left on device: '/x/zero/fp32.pt'",
                                    "RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos 8 vs 0"],
                         ids=["errno", "torch_zip_writer"])
def test_ds_to_universal_on_a_full_disk_blames_the_disk_not_the_rank_count(tmp_path, monkeypatch, full_disk, stderr):
    ck = _deepspeed_checkpoint(tmp_path)
    monkeypatch.setattr(convert_mod.subprocess, "run",
                        lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1, "", f"Traceback ...\n{stderr}\n"))
    with pytest.raises(UserError) as err:
        convert_mod.convert_to_universal(ck)
    assert err.value.field == "disk" and "another number of ranks" not in err.value.line(), err.value.line()
    assert not (ck / "global_step6_universal.partial").exists()


def test_ds_to_universal_failing_otherwise_still_names_the_rank_count(tmp_path, monkeypatch):
    ck = _deepspeed_checkpoint(tmp_path)
    monkeypatch.setattr(convert_mod.subprocess, "run",
                        lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1, "", "KeyError: 'param_shapes'\n"))
    with pytest.raises(UserError) as err:
        convert_mod.convert_to_universal(ck)
    assert err.value.field == "resume" and "another number of ranks" in err.value.problem


def test_in_place_conversion_on_a_full_disk_is_the_disk_line(tmp_path, monkeypatch, full_disk):
    """The conversion a resume does inside an FSDP2 checkpoint for ZeRO: torch's zip writer fails mid-write."""
    ck = _fsdp_checkpoint(tmp_path)

    def full(*args, **kwargs):
        raise TORCH_FULL

    monkeypatch.setattr(convert_mod, "dcp_to_universal", full)
    with pytest.raises(UserError) as err:
        convert_mod.convert_in_place(ck, "deepspeed", convert_mod.convert_to_universal)
    assert err.value.field == "disk" and "free space" in err.value.fix and "then run the same command" in err.value.fix
