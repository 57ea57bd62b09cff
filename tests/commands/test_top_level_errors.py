"""One top-level handler for every command (issue 40): whatever escapes a command ends in one line naming the command
and the cause, exit 2 when the input is to blame and 1 for a bug, and `--verbose` shows the traceback. Before,
only UserError and a full disk were caught: `hf-zero estimate` (and any command meeting an unexpected exception)
printed a traceback."""

import importlib

import pytest

from hf_zero.cli import COMMANDS, main

# the least each command parses before it runs
ARGS = {"train": [], "init": [], "profiles": [], "estimate": [], "check": [], "export": ["ckpt", "--out", "o"],
        "convert": ["ckpt", "--to", "zero2", "--out", "o"], "bench": [], "slurm": ["--profile", "zero2"],
        "preview": [], "generate": ["--prompt", "hi"]}


def _failing_run(monkeypatch, name, exc):
    module = importlib.import_module(COMMANDS[name][0])

    def run(args):
        raise exc

    monkeypatch.setattr(module, "run", run)


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_a_bug_in_any_command_is_one_line_naming_it_exit_1(name, monkeypatch, capsys):
    assert set(ARGS) == set(COMMANDS)  # a new command gets a row here
    _failing_run(monkeypatch, name, RuntimeError("boom\nsecond line"))
    assert main([name, *ARGS[name]]) == 1
    out = capsys.readouterr()
    assert out.err.strip().splitlines() == [
        f"hf-zero: error: hf-zero {name}: RuntimeError: boom; an unexpected error (a bug in hf-zero): --verbose "
        "shows its traceback"]


def test_verbose_shows_the_traceback(monkeypatch, capsys):
    monkeypatch.delenv("HF_ZERO_VERBOSE", raising=False)
    _failing_run(monkeypatch, "estimate", KeyError("x"))
    assert main(["estimate", "--verbose"]) == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and err.strip().splitlines()[-1].startswith(
        "hf-zero: error: hf-zero estimate: KeyError: 'x'")


def test_a_file_the_system_refuses_is_the_users_to_fix_exit_2(monkeypatch, capsys):
    _failing_run(monkeypatch, "export", IsADirectoryError(21, "Is a directory", "/some/where"))
    assert main(["export", *ARGS["export"]]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["hf-zero: error: hf-zero export: cannot use /some/where: Is a directory; check that path (its "
                   "kind, permissions and free space)"]


def test_ctrl_c_is_one_line(monkeypatch, capsys):
    _failing_run(monkeypatch, "estimate", KeyboardInterrupt())
    assert main(["estimate"]) == 130
    assert capsys.readouterr().err.strip().splitlines() == ["hf-zero: hf-zero estimate interrupted (Ctrl-C)"]


def test_estimate_with_an_unexpected_model_config_is_one_line(monkeypatch, capsys):
    """The real path, not a stand-in run(): an exception from inside estimate's own code."""
    import hf_zero.commands.estimate as estimate

    def broken(*args, **kwargs):
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr(estimate, "count_model", broken)
    assert main(["estimate", "--model", "tiny-llama"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("hf-zero: error: hf-zero estimate: ZeroDivisionError"), err


def test_convert_out_naming_a_file(tmp_path, capsys):
    """`hf-zero convert --out FILE` was a NotADirectoryError traceback; now one line, before the checkpoint is read."""
    out = tmp_path / "taken.txt"
    out.write_text("mine\n")
    assert main(["convert", str(tmp_path / "checkpoint-3"), "--to", "zero3", "--out", str(out)]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"hf-zero: error: --out: {out} is a file, not a folder; give a new folder"]
    assert out.read_text() == "mine\n"


def test_estimate_a_model_config_transformers_rejects_is_the_users_exit_2(tmp_path, capsys):
    """A config.json transformers' own validation refuses was a traceback from `hf-zero estimate` (exit 1)."""
    import json

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 8, "hidden_size": 4}))
    assert main(["estimate", "--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"hf-zero: error: model_name_or_path: {tmp_path}: transformers "
                                               "cannot read its config.json"), err
