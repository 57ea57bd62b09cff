"""A finished run asked to train again (`--fresh_start true`, or `--resume_from_checkpoint` on it) moves what it
wrote to a new archive: every generation is kept (previous-run/, previous-run-2/, ...), the checkpoint being resumed
is followed where it moved and never deleted, and the move survives a kill at any of its steps (issue 39, item 2).
In-process: rank 0's decision (checkpoint/resume.py `_choose`) on checkpoints made by testing_utils."""

import json
import os
from types import SimpleNamespace

import pytest
from testing_utils import make_checkpoint, with_meta

from hf_zero.checkpoint import archive as store
from hf_zero.checkpoint.archive import ARCHIVE_JOURNAL
from hf_zero.checkpoint.resume import _choose
from hf_zero.checkpoint.store import (
    crc32_of,
    file_sizes,
    validate_checkpoint,
    write_json_atomic,
    write_manifest,
)
from hf_zero.core.errors import UserError

RUN_FILES = {"summary.json": '{"eval_loss_after": 1.0}', "log_history.json": "[]", "loss.png": "curves",
             "run_plan.json": '{"profile": "zero2"}', "latest_checkpoint": "checkpoint-6\n"}


def _ctx(out, resume=None, world=2):
    from hf_zero.plan.reconcile import BatchPlan

    profile = SimpleNamespace(name="zero2", zero_stage=2, uses_deepspeed=True, uses_fsdp=False, engine="deepspeed")
    args = SimpleNamespace(output_dir=str(out), resume_from_checkpoint=str(resume) if resume else None)
    plan = SimpleNamespace(batch=BatchPlan(micro=4 // world, accumulation=1, world=world), world=world)
    return SimpleNamespace(profile=profile, plan=plan, training_args=args)


def _finished_run(out, tag: str):
    """A run that finished: checkpoint-6 (its metadata names `tag`), final/, summary, plot, plan, logs."""
    import torch

    out.mkdir(parents=True, exist_ok=True)
    ck = with_meta(out, tag=tag)
    torch.save({"exp_avg": torch.full((4,), float(len(tag)))}, ck / "global_step" / "optim_states.pt")  # loadable
    write_manifest(ck, {rel: crc32_of(ck / rel) for rel in file_sizes(ck)})
    (out / "final").mkdir()
    (out / "final" / "model.safetensors").write_text(f"weights of {tag}")
    for name, text in RUN_FILES.items():
        (out / name).write_text(text.replace("1.0", tag) if name == "summary.json" else f"{text} {tag}")
    return ck


def _tag(folder) -> str:
    return json.loads((folder / "hf_zero_checkpoint.json").read_text())["tag"]


def test_every_archive_generation_is_kept(tmp_path):
    """Before: a second fresh start deleted previous-run/ ("one generation is kept"), the first run's only
    checkpoint with it. After: previous-run/ stays as it was, the second run goes to previous-run-2/."""
    out = tmp_path / "run"
    _finished_run(out, "first")
    assert _choose(_ctx(out), fresh_start=True)["resume"] is None
    _finished_run(out, "second")
    assert _choose(_ctx(out), fresh_start=True)["resume"] is None
    for archive, tag in (("previous-run", "first"), ("previous-run-2", "second")):
        kept = out / archive
        assert validate_checkpoint(kept / "checkpoint-6") is None and _tag(kept / "checkpoint-6") == tag
        assert (kept / "final" / "model.safetensors").read_text() == f"weights of {tag}"
        assert (kept / "loss.png").read_text().endswith(tag) and (kept / "run_plan.json").read_text().endswith(tag)
    assert sorted(p.name for p in out.iterdir()) == ["previous-run", "previous-run-2"]


def test_resume_from_an_archived_checkpoint_resumes_that_very_one(tmp_path):
    """Before: `--resume_from_checkpoint RUN/previous-run/checkpoint-6` on a finished run deleted that checkpoint
    (the archive step replaced previous-run/) and resumed from the top-level checkpoint-6 moved there in its place.
    After: the finished run goes to previous-run-2/ (its loss.png and run_plan.json too), the archived checkpoint is
    resumed as it is."""
    out = tmp_path / "run"
    _finished_run(out, "old")
    assert _choose(_ctx(out), fresh_start=True)["resume"] is None  # -> previous-run/
    _finished_run(out, "new")
    asked = out / "previous-run" / "checkpoint-6"
    before = {rel: crc32_of(asked / rel) for rel in file_sizes(asked)}
    decision = _choose(_ctx(out, resume=asked), fresh_start=False)
    assert decision["resume"] == str(asked) and _tag(asked) == "old"
    assert {rel: crc32_of(asked / rel) for rel in file_sizes(asked)} == before
    moved = out / "previous-run-2"
    assert _tag(moved / "checkpoint-6") == "new" and (moved / "loss.png").read_text().endswith("new")
    assert (moved / "run_plan.json").read_text().endswith("new") and (moved / "summary.json").is_file()
    assert not (out / "loss.png").exists() and not (out / "run_plan.json").exists()


def test_resume_of_a_finished_run_follows_its_checkpoint_into_the_archive(tmp_path):
    out = tmp_path / "run"
    _finished_run(out, "only")
    decision = _choose(_ctx(out, resume=out / "checkpoint-6"), fresh_start=False)
    assert decision["resume"] == str(out / "previous-run" / "checkpoint-6")
    assert validate_checkpoint(out / "previous-run" / "checkpoint-6") is None


def test_a_refused_resume_of_a_finished_run_moves_nothing(tmp_path):
    """--max_steps at or below the checkpoint's step, or stages that now end there: refused in one line before the
    finished run moves aside (before: it was archived, then the run trained nothing)."""
    out = tmp_path / "run"
    _finished_run(out, "kept")
    before = sorted(p.name for p in out.iterdir())
    for max_steps, steps, field in ((5, 10, "max_steps"), (6, 10, "max_steps"), (-1, 6, "stages")):
        ctx = _ctx(out, resume=out / "checkpoint-6")
        ctx.training_args.max_steps = max_steps
        ctx.settings = {"stages": [{"name": "a", "steps": steps}]}
        with pytest.raises(UserError) as err:
            _choose(ctx, fresh_start=False)
        assert err.value.field == field and "nothing would train" in err.value.problem
        assert sorted(p.name for p in out.iterdir()) == before
    ctx.training_args.max_steps, ctx.settings = 7, {"stages": [{"name": "a", "steps": 10}]}
    assert _choose(ctx, fresh_start=False)["resume"] == str(out / "previous-run" / "checkpoint-6")


def _entries(out) -> int:
    return len(store._run_outputs(out))


@pytest.mark.parametrize("how", ["fresh_start", "resume"])
def test_archive_move_finishes_after_a_kill_at_every_step(tmp_path, monkeypatch, how):
    """A kill after k of the move's renames (k = 0 .. all, and after the last one before the journal is removed):
    the next start finishes the move before anything else; nothing is lost, and the same command works.
    Before: the same resume command said `checkpoint-6 is not a folder`, and the next fresh start or resume from
    previous-run/ deleted every checkpoint."""
    probe = tmp_path / "probe"
    _finished_run(probe, "x")
    steps = _entries(probe)
    for k in range(steps + 1):
        out = tmp_path / f"kill{k}"
        _finished_run(out, f"k{k}")
        want = {p.name for p in out.iterdir()}
        calls = {"n": 0}
        real_rename, real_sync = os.rename, store.fsync_dir

        def killed_rename(src, dst, k=k):
            if calls["n"] == k:
                raise SystemExit("killed")  # nothing of hf_zero's runs after this: like SIGKILL
            calls["n"] += 1
            real_rename(src, dst)

        def killed_sync(path):
            raise SystemExit("killed")

        monkeypatch.setattr(store.os, "rename", killed_rename)
        if k == steps:  # every entry moved; killed before the journal is removed
            monkeypatch.setattr(store, "fsync_dir", killed_sync)
        resume = out / "checkpoint-6" if how == "resume" else None
        with pytest.raises(SystemExit):
            _choose(_ctx(out, resume=resume), fresh_start=how == "fresh_start")
        monkeypatch.setattr(store.os, "rename", real_rename)
        monkeypatch.setattr(store, "fsync_dir", real_sync)
        assert (out / ARCHIVE_JOURNAL).is_file()
        seen = {p.name for p in out.iterdir()} | {p.name for p in (out / "previous-run").glob("*")}
        assert want <= seen, f"kill after {k}: lost {want - seen}"
        # The same command again.
        decision = _choose(_ctx(out, resume=resume), fresh_start=how == "fresh_start")
        archive = out / "previous-run"
        assert not (out / ARCHIVE_JOURNAL).exists() and {p.name for p in archive.iterdir()} == want
        assert sorted(p.name for p in out.iterdir()) == ["previous-run"], f"kill after {k}"
        assert validate_checkpoint(archive / "checkpoint-6") is None and _tag(archive / "checkpoint-6") == f"k{k}"
        if how == "resume":
            assert decision["resume"] == str(archive / "checkpoint-6")
            # and the natural next command, from the archive, resumes it and deletes nothing
            again = _choose(_ctx(out, resume=archive / "checkpoint-6"), fresh_start=False)
            assert again["resume"] == str(archive / "checkpoint-6")
            assert validate_checkpoint(archive / "checkpoint-6") is None
        else:
            assert decision["resume"] is None
    assert steps == 7  # checkpoint, final, summary, logs, plot, plan, latest: a kill point after each


def test_a_planted_journal_moves_nothing_outside(tmp_path):
    out = tmp_path / "run"
    make_checkpoint(out, 6)
    (tmp_path / "victim").mkdir()
    write_json_atomic(out / ARCHIVE_JOURNAL, {"archive": "previous-run", "entries": ["../victim"]})
    with pytest.raises(UserError) as err:
        _choose(_ctx(out), fresh_start=True)
    assert err.value.field == "output_dir" and "nothing was moved" in err.value.problem
    assert (tmp_path / "victim").is_dir() and (out / "checkpoint-6").is_dir()
