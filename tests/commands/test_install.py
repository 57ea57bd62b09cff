"""`pip install .` outside the repository: a wheel of the project, installed (no dependencies) into a fresh virtualenv
beside this one's packages, finds its profiles and recipes through the package and trains by profile name from a
directory that is not the repository."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from testing_utils import REPO


def _run(cmd, cwd, env, timeout=900):
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd} failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}"
    return proc


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(venv bin folder, environment) with hf_zero installed from a wheel and nothing of the checkout importable."""
    tmp = tmp_path_factory.mktemp("install")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    # Build from a copy of the tracked files: building writes build/ and *.egg-info/ beside setup.cfg.
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           capture_output=True, text=True, check=True).stdout
    src = tmp / "src"
    for name in filter(None, files.split("\0")):
        if (REPO / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, src / name)
    built = _run([sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "--no-build-isolation", "-w", tmp / "dist",
                  src], cwd=tmp, env=env)
    # setup.cfg names every folder Python sees as a package: `make install` prints no wall of setuptools warnings
    assert "would be ignored" not in built.stdout + built.stderr, (built.stdout + built.stderr)[-4000:]
    wheel = next((tmp / "dist").glob("hf_zero-*.whl"))
    venv = tmp / "venv"
    _run([Path(sys.base_prefix) / "bin" / "python3", "-m", "venv", venv], cwd=tmp, env=env)
    site = next((venv / "lib").glob("python3*/site-packages"))
    # The dependencies are this virtualenv's: its site-packages as a plain path entry, so its own .pth files (the
    # editable install of the checkout among them) are not run.
    (site / "zz_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run([venv / "bin" / "python", "-m", "pip", "install", "-q", "--no-deps", "--ignore-installed", wheel],
         cwd=tmp, env=env)
    return venv / "bin", {**env, "PATH": f"{venv / 'bin'}:{env['PATH']}"}


def test_wheel_imports_hf_zero_from_the_virtualenv_not_the_checkout(installed, tmp_path):
    bin_dir, env = installed
    where = _run([bin_dir / "python", "-c", "import hf_zero, hf_zero.plan.shipped as s; "
                  "print(hf_zero.__file__); print(s.shipped_dir('accelerate_configs'))"], cwd=tmp_path, env=env)
    module, profiles = where.stdout.split()
    venv = bin_dir.parent
    assert Path(module).is_relative_to(venv) and Path(profiles).is_relative_to(venv)
    assert (Path(profiles) / "zero3.yaml").is_file() and not Path(module).is_relative_to(REPO)


@pytest.mark.multiproc
def test_profiles_check_and_a_2_rank_run_by_profile_name_outside_the_repository(installed, tmp_path):
    bin_dir, env = installed
    table = _run([bin_dir / "hf-zero", "profiles"], cwd=tmp_path, env=env).stdout
    assert all(name in table for name in ("zero2", "zero3_offload", "fsdp2", "h100x8"))
    # A copied tiny recipe YAML (its data paths are relative to the YAML's folder).
    shutil.copytree(REPO / "recipes" / "data" / "tiny", tmp_path / "data" / "tiny")
    (tmp_path / "configs").mkdir()
    config = tmp_path / "configs" / "tiny.yaml"
    shutil.copy(REPO / "recipes" / "configs" / "tiny_curriculum.yaml", config)
    _run([bin_dir / "hf-zero", "check", "--profile", "zero2", "--config", config], cwd=tmp_path, env=env)
    out = tmp_path / "run"
    proc = _run([bin_dir / "hf-zero", "train", "--profile", "zero2", "--nproc", "2", "--config", config,
                 "--output_dir", out], cwd=tmp_path, env=env)
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["profile"], summary["world_size"]) == ("zero2", 2), proc.stdout[-2000:]
    assert (out / "final" / "model.safetensors").is_file()
