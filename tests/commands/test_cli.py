"""The `hf-zero` command: fast help, one-line errors, and the launch lines it builds."""

import os
import re
import subprocess
import sys

import pytest
from testing_utils import REPO

from hf_zero.cli import main
from hf_zero.launch.launch_command import build_launch_command


def test_help_does_not_import_torch():
    code = "import sys; from hf_zero.cli import main; main(['--help']); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO).stdout
    assert out.strip().splitlines()[-1] == "False"
    for name in ("train", "estimate", "check", "export", "bench", "slurm"):
        assert name in out


@pytest.mark.parametrize("argv,field", [
    (["frobnicate"], "unknown command"),
    (["train", "--profile", "zero9", "--dry-run"], "profile"),
    (["train", "--profile", "zero2", "--precision", "fp8", "--dry-run"], "--precision"),
    (["profiles", "--bogus"], "unrecognized"),
])
def test_bad_input_one_line_exit_2(capsys, argv, field):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("hf-zero: error:") and field in err[0]


def test_profiles_pick_on_cpu(capsys):
    assert main(["profiles", "--pick"]) == 0
    assert capsys.readouterr().out.strip() == "cpu"


def test_launch_line_nproc_precision_and_nodes():
    cmd, env = build_launch_command("zero3", "r.py", ["--config", "c.yaml"], nproc=4, precision="bf16")
    assert cmd[cmd.index("--num_processes") + 1] == "4" and cmd[cmd.index("--mixed_precision") + 1] == "bf16"
    assert cmd[-3:] == ["r.py", "--config", "c.yaml"] and env["HF_ZERO_PROFILE"].endswith("zero3.yaml")
    multi, _ = build_launch_command("multinode", "r.py", [], nproc=2, nodes=2, machine_rank=1, main_ip="10.0.0.1")
    assert multi[multi.index("--num_processes") + 1] == "4"  # accelerate counts processes over all machines
    assert multi[multi.index("--machine_rank") + 1] == "1" and "10.0.0.1" in multi


def test_train_passes_recipe_flags_through(capsys):
    assert main(["train", "--profile", "zero2", "--config", "x.yaml", "--dry-run", "--learning_rate", "1e-4"]) == 0
    line = capsys.readouterr().out
    assert line.rstrip().endswith("--config x.yaml --learning_rate 1e-4")


def test_version(capsys):
    from importlib.metadata import version

    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"hf-zero {version('hf_zero')}"


def test_profiles_table_matches_the_profiles_and_the_readme(capsys):
    """`hf-zero profiles` reads each profile; its "for" column is the YAML's `# For:` line, which the profile
    table of docs/profiles.md repeats."""
    import re

    from hf_zero.plan.profiles import list_profiles, load_profile

    assert main(["profiles"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["profile", "processes", "strategy", "offload", "(optimizer", "/", "params)",
                                "precision", "for"]
    page = (REPO / "docs" / "profiles.md").read_text()
    rows = {m[0]: m[1] for m in re.findall(r"^\| `(\w+)` \|.*\| (.*?) \|$", page, re.M)}
    for name in list_profiles():
        p = load_profile(name)
        uses = next(ln[len("# For:"):].strip() for ln in open(p.path) if ln.startswith("# For:"))
        row = next(ln for ln in lines[1:] if ln[2:].split()[0] == name)
        assert row.rstrip().endswith(uses) and f" {p.precision} " in row and f" {p.num_processes} " in row
        assert rows[name] == uses, name
    assert lines[-1].startswith("this machine: cpu") and any(ln.startswith("* cpu ") for ln in lines)


def _value_for(action) -> list[str]:
    if action.nargs == 0:
        return []
    if action.choices:
        return [str(list(action.choices)[-1])]
    return ["3"] if action.type is int else ["x"]


@pytest.mark.parametrize("name", [n for n in __import__("hf_zero.cli").cli.COMMANDS])
def test_underscore_flags_parse_as_dashed_ones(name):
    """`--gpu_memory 48GiB` is `--gpu-memory 48GiB`, as accelerate launch takes both; every multi-word flag of every
    command, one at a time; the recipe's own --output_dir / --save_steps stay the recipe's where a command says so."""
    from hf_zero.cli import command_parser

    parser, module = command_parser(name)
    required = []
    for action in parser._actions:
        if action.required:
            required += ([action.option_strings[0]] if action.option_strings else []) + _value_for(action)
    dash_only = getattr(module, "DASH_ONLY", ())
    flags = [(a, o) for a in parser._actions for o in a.option_strings if o.startswith("--") and "-" in o[2:]]
    for action, dashed in flags:
        underscored = "--" + dashed[2:].replace("-", "_")
        value = _value_for(action)
        want, _ = parser.parse_known_args(required + [dashed, *value])
        got, extra = parser.parse_known_args(required + [underscored, *value])
        if dashed in dash_only:
            assert extra[0] == underscored, dashed  # passed on to the recipe
        else:
            assert vars(got) == vars(want) and extra == [], dashed
            assert getattr(got, action.dest) != action.default, dashed  # the flag was read, not ignored
    if flags and len(flags) > len(dash_only):
        assert "Flags take dashes or underscores" in parser.format_help()
        listed = set(re.findall(r"--[\w-]+", parser.format_help().split("Flags take")[0]))
        assert not listed & set(parser.underscored)  # help lists each flag once, dashed


def test_underscore_flags_reach_the_launch_line(capsys):
    assert main(["train", "--profile", "multinode", "--dry_run", "--machine_rank", "1", "--main_ip", "10.0.0.1",
                 "--nodes", "2", "--learning_rate", "1e-4"]) == 0
    line = capsys.readouterr().out
    assert "--machine_rank 1 --main_process_ip 10.0.0.1" in line and line.rstrip().endswith("--learning_rate 1e-4")


def test_train_help_names_the_default_config_and_the_recipe_flags(capsys):
    from hf_zero.plan.shipped import DEFAULT_CONFIG

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    assert f"Default config: {DEFAULT_CONFIG}" in out and "TrainingArguments field" in out
    assert "--help-recipe" in out and "Every field of the recipe is a flag too" in out


def test_help_recipe_lists_the_recipes_fields(capsys):
    import dataclasses

    from transformers import TrainingArguments

    from hf_zero.plan.arguments import CurriculumArguments, ModelArguments

    assert main(["train", "--help-recipe"]) == 0
    out = capsys.readouterr().out
    inherited = {f.name for f in dataclasses.fields(TrainingArguments)}
    own = [f for cls in (ModelArguments, CurriculumArguments) for f in dataclasses.fields(cls)
           if f.name not in inherited]
    assert len(own) > 10
    for f in own:
        assert f"  --{f.name} (default: " in out, f.name
        assert " ".join(f.metadata["help"].split()[:4]) in " ".join(out.split()), f.name
    count = len([f for f in dataclasses.fields(TrainingArguments) if f.init and not f.name.startswith("_")])
    assert f"and every TrainingArguments field (transformers): {count} more" in out
    assert "  --learning_rate " not in out and "  --logging_steps " not in out  # not all 100+ of them
    assert main(["train", "--help_recipe", "all"]) == 0
    everything = capsys.readouterr().out
    from hf_zero.plan.parse import HF_ZERO_TRAINING_DEFAULTS

    assert "  --learning_rate (default: " in everything and "The initial learning rate" in everything
    assert f"  --logging_steps (default: {HF_ZERO_TRAINING_DEFAULTS['logging_steps']})" in everything  # hf_zero's


def test_make_train_hints_use_args(monkeypatch):
    """Under `make train` a suggested recipe flag reads as make takes it: ARGS="--fresh_start true"."""
    from hf_zero.checkpoint.compare import check_finished_settings
    from hf_zero.core.errors import UserError

    make = subprocess.run(["make", "-n", "train", "BIN=.venv/bin"], capture_output=True, text=True, cwd=REPO).stdout
    assert "HF_ZERO_VIA_MAKE=1 .venv/bin/hf-zero train" in make
    monkeypatch.delenv("HF_ZERO_VIA_MAKE", raising=False)
    with pytest.raises(UserError, match=r"; --fresh_start true trains again"):
        check_finished_settings("runs/x", {"seed": 1}, {"seed": 2})
    monkeypatch.setenv("HF_ZERO_VIA_MAKE", "1")
    with pytest.raises(UserError, match=r'; ARGS="--fresh_start true" trains again'):
        check_finished_settings("runs/x", {"seed": 1}, {"seed": 2})


def test_every_command_takes_verbose_and_sets_the_one_switch(monkeypatch, capsys):
    """One console rule: the libraries' warnings and bars are off for every command unless --verbose, which sets the
    switch every process of the command reads (hf_zero.core.console)."""
    from hf_zero.cli import COMMANDS, command_parser
    from hf_zero.core.console import VERBOSE_ENV

    for name in COMMANDS:
        assert "--verbose" in command_parser(name)[0].format_help(), name
    monkeypatch.setenv(VERBOSE_ENV, "0")  # restored (unset) after the test: --verbose sets it in this process
    assert main(["profiles", "--verbose"]) == 0
    assert os.environ[VERBOSE_ENV] == "1"
    assert "this machine:" in capsys.readouterr().out


def test_make_test_gpu_collects_every_file_with_a_gpu_test(request):
    """`make test-gpu` collects only GPU_TESTS (Makefile): each file holding a test marked gpu is among them (as
    this session collected them, and by the marker's text, for a session that collected fewer files)."""
    from conftest import GPU_TEST_FILES

    make = subprocess.run(["make", "-n", "test-gpu", "BIN=.venv/bin"], capture_output=True, text=True, cwd=REPO).stdout
    line = next(ln for ln in make.splitlines() if "pytest -m gpu" in ln)
    marked = re.compile(r"pytest\.mark\.gpu\b")
    written = {str(p.relative_to(REPO)) for p in (REPO / "tests").rglob("test_*.py") if marked.search(p.read_text())}
    collected = request.config.stash.get(GPU_TEST_FILES, set())
    assert {"tests/train/test_gpu.py", "tests/train/test_qlora.py"} <= written
    assert written | collected <= set(line.split()), (written | collected, line)
