"""The `hf-zero` command: fast help, one-line errors, and the launch lines it builds."""

import subprocess
import sys

import pytest
from conftest import REPO

from hf_zero.cli import main
from hf_zero.launch.command import build_launch_command


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
    """`hf-zero profiles` reads each profile; its "for" column is the YAML's `# For:` line, which the README's
    profile table repeats."""
    import re

    from hf_zero.core.profiles import list_profiles, load_profile

    assert main(["profiles"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["profile", "processes", "strategy", "offload", "(optimizer", "/", "params)",
                                "precision", "for"]
    readme = (REPO / "README.md").read_text()
    rows = {m[0]: m[1] for m in re.findall(r"^\| `(\w+)` \|.*\| (.*?) \|$", readme, re.M)}
    for name in list_profiles():
        p = load_profile(name)
        uses = next(ln[len("# For:"):].strip() for ln in open(p.path) if ln.startswith("# For:"))
        row = next(ln for ln in lines[1:] if ln[2:].split()[0] == name)
        assert row.rstrip().endswith(uses) and f" {p.precision} " in row and f" {p.num_processes} " in row
        assert rows[name] == uses, name
    assert lines[-1].startswith("this machine: cpu") and any(ln.startswith("* cpu ") for ln in lines)
