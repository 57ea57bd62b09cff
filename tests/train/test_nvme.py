"""NVMe offload (ZeRO-Infinity), run for real on CPU with libaio: DeepSpeed's async_io op, swap files in the
configured folder (not ./none/, where accelerate 1.15's dropped path would put them), on a model big enough to
swap (small-llama: DeepSpeed skips partitions under 1 MiB).

Losses against plain ZeRO-3: optimizer on NVMe to 1e-4; parameters on NVMe too to 1e-3 (platform-notes.md: on CPU
fp32 parameters can pass through bf16 swap buffers). Needs `apt-get install libaio-dev` (scripts/system_deps.sh,
which also prebuilds the op; without it the first run here builds it, ~280 s).
"""

import os
import sys
from pathlib import Path

import pytest
import yaml
from testing_utils import PROFILES, RECIPE, REPO, libaio_missing_reason, read_summary, run_cmd, write_short_config

NVME_YAML = REPO / "recipes" / "configs" / "nvme_swap.yaml"


@pytest.fixture(scope="module")
def async_io():
    """DeepSpeed's async_io op, built once (a no-op when scripts/system_deps.sh prebuilt it). In a child process,
    as system_deps.sh and every run build it: built inside pytest its compile line came out different, and the
    next run rebuilt it (~5 min on 2 cores each time)."""
    if reason := libaio_missing_reason():  # the preflight's own probe
        pytest.skip(reason)

    proc = run_cmd([sys.executable, "-m", "hf_zero.core.ops", "AsyncIOBuilder"], timeout=900, check=False)
    assert "AsyncIOBuilder: ok" in proc.stdout, f"async_io did not build: {proc.stdout}{proc.stderr[-2000:]}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory, async_io):
    """One tmp tree for the module: the config, and a launcher for 2-rank runs from a scratch working folder."""
    root = tmp_path_factory.mktemp("nvme")
    config = write_short_config(NVME_YAML, root / "nvme_swap.yaml", [4])
    cwd = root / "cwd"  # where ./none/ would appear if the NVMe path were dropped
    cwd.mkdir()

    def launch(name, profile_path, nvme_path=None):
        out = root / name
        env = {"HF_ZERO_NVME_PATH": str(nvme_path)} if nvme_path else {}
        run_cmd([sys.executable, "-m", "accelerate.commands.launch", "--config_file", profile_path, RECIPE,
                 "--config", config, "--output_dir", out, "--disable_tqdm", "true"], cwd=cwd, env=env, timeout=900)
        return read_summary(out)

    launch.root, launch.cwd = root, cwd
    yield launch
    import shutil

    for swap in root.glob("swap_*"):  # ~300 MB of swap files; pytest keeps its last three tmp trees
        shutil.rmtree(swap, ignore_errors=True)


def _optimizer_only_profile(folder: Path) -> Path:
    """zero3_nvme with parameters kept in memory: only the optimizer state swaps."""
    raw = yaml.safe_load((PROFILES / "zero3_nvme.yaml").read_text())
    raw["deepspeed_config"]["offload_param_device"] = "none"
    raw["deepspeed_config"].pop("offload_param_nvme_path")
    path = folder / "zero3_nvme_optimizer.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _swap_files(folder: Path) -> dict:
    """{"optimizer/rank0": bytes, "float32params/rank1": bytes, ...} of non-empty DeepSpeed swap files."""
    found = {}
    for f in folder.rglob("*.tensor.swp"):
        if f.stat().st_size:
            key = f"{f.parent.parent.name}/{f.parent.name}"
            found[key] = found.get(key, 0) + f.stat().st_size
    return found


def _max_diff(a, b):
    assert len(a) == len(b) == 4, (a, b)
    return max(abs(x - y) for x, y in zip(a, b))


@pytest.mark.multiproc
def test_nvme_offload_swaps_to_the_configured_path_and_matches_zero3(runs):
    from hf_zero.estimate.memory import estimate
    from hf_zero.estimate.model_count import count_model

    baseline = runs("zero3", PROFILES / "zero3.yaml")

    swap_opt = runs.root / "swap_opt"
    opt = runs("nvme_optimizer", _optimizer_only_profile(runs.root), swap_opt)
    assert (opt["offload_optimizer"], opt["offload_param"]) == ("nvme", "none")
    files = _swap_files(swap_opt / "zero_stage_3")
    assert {"optimizer/rank0", "optimizer/rank1"} <= set(files), files
    assert not any("params" in k for k in files), files
    assert _max_diff(opt["losses"], baseline["losses"]) < 1e-4, (opt["losses"], baseline["losses"])

    swap_all = runs.root / "swap_all"
    both = runs("nvme_all", PROFILES / "zero3_nvme.yaml", swap_all)
    assert (both["profile"], both["offload_optimizer"], both["offload_param"]) == ("zero3_nvme", "nvme", "nvme")
    files = _swap_files(swap_all / "zero_stage_3")
    assert {"optimizer/rank0", "optimizer/rank1"} <= set(files), files
    assert any(k.endswith("params/rank0") for k in files) and any(k.endswith("params/rank1") for k in files), files
    assert _max_diff(both["losses"], baseline["losses"]) < 1e-3, (both["losses"], baseline["losses"])
    assert Path(both["final_dir"], "model.safetensors").is_file()

    assert not (runs.cwd / "none").exists(), "swap files went to ./none/ (accelerate's dropped nvme path)"
    # The preflight's free-space figure must bound what DeepSpeed really wrote.
    need = estimate(count_model("small-llama"), "zero3_nvme", world_size=2, gpus_per_node=2, precision="fp32")
    assert sum(files.values()) <= need["nvme_bytes"], (files, need["nvme_bytes"])


def test_every_hf_zero_process_builds_ops_with_the_venvs_ninja():
    """With Debian's ninja first on PATH, a prebuilt op would be rebuilt from scratch (incompatible build logs)."""
    import subprocess

    venv_ninja = Path(sys.executable).parent / "ninja"
    if not venv_ninja.is_file():
        pytest.skip("no ninja next to this Python")
    code = "import shutil, hf_zero; print(shutil.which('ninja'))"
    out = subprocess.run([sys.executable, "-c", code], env={"PATH": "/usr/bin:/bin"}, capture_output=True,
                         text=True, check=True).stdout.strip()
    assert out == str(venv_ninja)


def test_ops_are_built_in_the_venv_unless_a_folder_is_given(tmp_path, monkeypatch):
    """torch's default build folder is shared by all of a user's environments; two checkouts would rebuild each
    other's ops at every switch. An hf_zero process builds them in its venv, or where TORCH_EXTENSIONS_DIR says."""
    import subprocess

    from torch.utils.cpp_extension import _get_build_directory

    if sys.prefix == sys.base_prefix:
        pytest.skip("not in a virtual environment: torch's own default stays")
    code = "import os, hf_zero; print(os.environ['TORCH_EXTENSIONS_DIR'])"
    env = {k: v for k, v in os.environ.items() if k != "TORCH_EXTENSIONS_DIR"}
    for given, folder in ((None, Path(sys.prefix) / "torch_extensions"), (tmp_path / "ext", tmp_path / "ext")):
        run_env = {**env, "TORCH_EXTENSIONS_DIR": str(given)} if given else env
        out = subprocess.run([sys.executable, "-c", code], env=run_env, capture_output=True, text=True,
                             check=True).stdout.strip()
        assert out == str(folder)
        # where torch (and so DeepSpeed's op builder) then builds an op
        monkeypatch.setenv("TORCH_EXTENSIONS_DIR", out)
        assert _get_build_directory("cpu_adam", False) == str(folder / "cpu_adam")


@pytest.mark.slow
def test_system_deps_script_is_idempotent():
    """scripts/system_deps.sh (CI runs it before `make test`) on a machine that has everything: no apt-get, the
    async_io op loads, exit 0. Slow: loading the op recompiles it (~5 min on 2 cores) whenever another build of it
    since (a test's own compiler flags) left a different ninja command line behind."""
    import shutil
    import subprocess

    wanted = ("libaio-dev", "slurm-wlm", "munge")
    if not shutil.which("dpkg-query"):
        pytest.skip("no dpkg here: scripts/system_deps.sh only says it skips")
    status = subprocess.run(["dpkg-query", "-W", "-f=${Status}\n", *wanted], capture_output=True, text=True).stdout
    if status.count("install ok installed") != len(wanted):
        pytest.skip("the packages are not installed yet; this test does not apt-get for you: "
                    "run scripts/system_deps.sh")
    proc = run_cmd(["bash", REPO / "scripts" / "system_deps.sh"], timeout=900)
    assert "already installed" in proc.stdout and "installing" not in proc.stdout, proc.stdout
    assert "AsyncIOBuilder: ok" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.parametrize("where, nvme_bytes, says", [
    ("under_a_file", None, "is a file"),
    ("ok", 10**18, "free"),
])
def test_nvme_preflight_names_the_path_and_the_fix(tmp_path, monkeypatch, async_io, where, nvme_bytes, says):
    from hf_zero.core.errors import UserError
    from hf_zero.plan.profiles import load_profile
    from hf_zero.preflight.check_rules import verify_offload

    (tmp_path / "file").write_text("")
    path = tmp_path / "file" / "nvme" if where == "under_a_file" else tmp_path / "nvme"
    monkeypatch.setenv("HF_ZERO_NVME_PATH", str(path))
    with pytest.raises(UserError) as err:
        verify_offload(load_profile("zero3_nvme"), nvme_bytes, build_cpu_adam=False)
    assert err.value.field == "HF_ZERO_NVME_PATH" and says in err.value.problem, err.value.line()
    assert "HF_ZERO_NVME_PATH" in err.value.fix
    monkeypatch.setenv("HF_ZERO_NVME_PATH", str(tmp_path / "nvme"))
    assert "writable" in verify_offload(load_profile("zero3_nvme"), 10**6, build_cpu_adam=False)
