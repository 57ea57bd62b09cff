"""`hf-zero bench --preset gpu-matrix` on the CPU: its budget (variants left out are recorded as not run), its report
(MFU, the loss against the reference, the fastest variant per strategy, the targets) from known rows, its dry run,
the DeepSpeed settings a variant hands its run, and the plumbing end to end on a tiny model (two variants, 2 steps)."""

import csv
import importlib.util
import json

import pytest

from hf_zero.bench.matrix import VARIANTS, Variant, schedule
from hf_zero.bench.matrix_report import write_reports
from hf_zero.cli import main
from hf_zero.core.errors import UserError
from hf_zero.plan.deepspeed_config import BENCH_DEEPSPEED_ENV, build_deepspeed_config
from hf_zero.plan.profiles import load_profile


def test_schedule_records_the_variants_the_budget_leaves_out():
    """A variant starts only while the time left covers the median launch so far; the rest are not run."""
    now = [0.0]
    ran = []

    def run_one(v, left):
        ran.append((v.name, left))
        now[0] += 40.0  # every launch takes 40 s
        return {"variant": v.name, "status": "ok"}

    variants = [Variant(f"v{i}", "single_gpu", 8) for i in range(5)]
    rows = schedule(variants, run_one, 100.0, clock=lambda: now[0])
    assert [r["status"] for r in rows] == ["ok", "ok", "not run", "not run", "not run"]
    assert ran == [("v0", 100.0), ("v1", 60.0)]  # at 80 s, 20 s left < the 40 s median
    assert rows[2]["reason"] == "budget: 20 of 100 s left, a run takes ~40 s"
    assert rows[2]["strategy"] == "single_gpu" and rows[2]["micro_batch"] == 8


def test_variants_that_cost_nothing_do_not_count_as_launches():
    """A variant recorded as not run (its requirement missing) takes no time: it must not lower the median."""
    now = [0.0]

    def run_one(v, left):
        if v.needs:
            return {"variant": v.name, "status": "not run", "reason": "needs a CUDA GPU"}
        now[0] += 30.0
        return {"variant": v.name, "status": "ok"}

    variants = [Variant("a", "zero3", 8), Variant("b", "zero3", 8, needs=("cuda",)), Variant("c", "zero3", 8),
                Variant("d", "zero3", 8)]
    rows = schedule(variants, run_one, 70.0, clock=lambda: now[0])
    assert [r["status"] for r in rows] == ["ok", "not run", "ok", "not run"]
    assert rows[3]["reason"].startswith("budget: 10 of 70 s left")


def _row(name, strategy, micro, tps, losses, flags=(), deepspeed=None, peak=30 * 2**30):
    return {"variant": name, "strategy": strategy, "micro_batch": micro, "seq_len": 1024, "flags": list(flags),
            "deepspeed": deepspeed, "status": "ok", "step_time_s": 8 * 1024 / tps, "tokens_per_s": tps,
            "peak_memory_bytes": peak, "peak_memory_kind": "device", "estimate_bytes": 31 * 2**30,
            "losses": losses, "flops_per_token": 6.6e9}


def test_report_names_the_fastest_variant_per_strategy_and_the_settings_that_make_it(tmp_path):
    persist = {"zero_optimization": {"stage3_param_persistence_threshold": 10**9}}
    rows = [_row("single_gpu-mb8", "single_gpu", 8, 36000.0, [10.0, 9.0]),
            _row("zero2-mb8", "zero2", 8, 58000.0, [10.0, 9.01]),
            _row("zero3-mb8", "zero3", 8, 20000.0, [10.0, 9.02]),
            _row("single_gpu-mb16-liger", "single_gpu", 16, 60000.0, [10.5, 9.5], flags=("--use_liger_kernel",
                                                                                           "true")),
            _row("zero3-mb8-persist-all", "zero3", 8, 30000.0, [10.0, 9.03], deepspeed=persist),
            {"variant": "single_gpu-mb32", "strategy": "single_gpu", "micro_batch": 32, "flags": [],
             "deepspeed": None, "status": "skipped", "reason": "estimate 99.4 GiB > 79.6 GiB on the device"},
            {"variant": "zero3-mb8-deepcompile", "strategy": "zero3", "micro_batch": 8, "flags": [],
             "deepspeed": None, "status": "not run", "reason": "budget: 10 of 300 s left, a run takes ~40 s"}]
    machine = {"gpus": ["NVIDIA H100 80GB HBM3"], "memory_bytes": 128 * 2**30, "ranks": 1, "torch": "2.11.0",
               "transformers": "5.23.0", "accelerate": "1.15.0", "deepspeed": "0.19.8", "peft": "0.21.2",
               "date": "2026-11-27 16:00:00 UTC", "cpu": "x", "logical_cpus": 16}
    summary = {"preset": "gpu-matrix", "model": "benchmarks/models/llama-1b", "seq_len": 1024, "steps": 6,
               "warmup": 2, "budget_s": 300, "used_s": 290.0, "dry_run": False, "params": 1_100_048_384,
               "machine": machine, "rows": rows}
    write_reports(summary, tmp_path)
    report = json.loads((tmp_path / "matrix.json").read_text())
    fastest = report["fastest"]
    assert {s: f["variant"] for s, f in fastest.items()} == {"single_gpu": "single_gpu-mb16-liger",
                                                             "zero2": "zero2-mb8", "zero3": "zero3-mb8-persist-all"}
    assert fastest["single_gpu"]["recipe_flags"] == "--per_device_train_batch_size 16 --use_liger_kernel true"
    assert fastest["zero3"]["deepspeed"] == persist and fastest["zero3"]["vs_default"] == pytest.approx(1.5)
    assert fastest["zero3"]["vs_single_gpu"] == pytest.approx(0.5)
    by = {r["variant"]: r for r in report["rows"]}
    assert by["single_gpu-mb8"]["mfu"] == pytest.approx(6.6e9 * 36000 / 989e12)
    # the loss against single_gpu's at the same micro-batch (the same rows); mb16 is its own reference
    assert by["zero3-mb8"]["loss_reference"] == "single_gpu-mb8"
    assert by["zero3-mb8"]["max_abs_loss_diff_vs_reference"] == pytest.approx(0.02)
    assert by["single_gpu-mb16-liger"]["loss_reference"] is None
    assert [t["met"] for t in report["targets"]] == [False, True, False]
    md = (tmp_path / "matrix.md").read_text()
    assert "| single_gpu-mb32 | single_gpu | 32 x 1024 | defaults | skipped: estimate 99.4 GiB > 79.6 GiB" in md
    assert "| zero3-mb8-deepcompile |" in md and "not run: budget" in md
    assert "| zero3 | zero3-mb8-persist-all | 30,000 | 0.200 | 1.50x | 0.50x |" in md
    assert "- single_gpu MFU >= 0.45: 0.400 (missed)" in md and "1x NVIDIA H100 80GB HBM3" in md
    with open(tmp_path / "matrix.csv") as fh:
        table = list(csv.reader(line for line in fh if not line.startswith("#")))
    assert table[0][:5] == ["variant", "strategy", "micro_batch", "seq_len", "status"] and len(table) == 8


def test_a_variants_deepspeed_settings_reach_the_config_and_bad_ones_are_one_line(monkeypatch):
    zero3 = load_profile("zero3")
    monkeypatch.setenv(BENCH_DEEPSPEED_ENV, json.dumps({"zero_optimization": {
        "stage3_param_persistence_threshold": 10**7}, "compile": {"deepcompile": True}}))
    config = build_deepspeed_config(zero3, on_cpu=True)
    assert config["zero_optimization"]["stage3_param_persistence_threshold"] == 10**7
    assert config["zero_optimization"]["stage"] == 3 and config["compile"] == {"deepcompile": True}
    monkeypatch.setenv(BENCH_DEEPSPEED_ENV, "[1, 2")
    with pytest.raises(UserError, match=BENCH_DEEPSPEED_ENV):
        build_deepspeed_config(zero3, on_cpu=True)
    monkeypatch.delenv(BENCH_DEEPSPEED_ENV)
    assert build_deepspeed_config(zero3, on_cpu=True)["zero_optimization"]["stage3_param_persistence_threshold"] \
        == "auto"


@pytest.mark.parametrize("argv,field", [
    (["--variants", "single_gpu-mb8,nope"], "--variants"),
    (["--budget", "0"], "--budget"),
    (["--seq-lens", "4"], "--seq-lens"),
])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(argv, field, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["bench", "--preset", "gpu-matrix", *argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("hf-zero: error: ") and field in err[0], err
    assert not out.exists()


@pytest.fixture
def tiny_config(tmp_path):
    from hf_zero.data.model_names import get_model_config

    folder = tmp_path / "tiny"
    get_model_config("tiny-llama").save_pretrained(folder)
    return folder


@pytest.mark.recipe_run  # plans every variant on the 1.1B config (10 s)
def test_dry_run_plans_each_variant_as_on_a_gpu_without_launching(tiny_config, tmp_path, capsys):
    """Recipe, data, flags and DeepSpeed settings of each run reconciled as on a GPU, nothing launched: a Liger
    variant fails where liger-kernel is not installed (the GPU kit must carry it), a CUDA-only one is planned."""
    out = tmp_path / "out"
    names = ["single_gpu-mb8", "zero3-mb8-prefetch", "single_gpu-mb8-liger", "single_gpu-mb8-compile"]
    rc = main(["bench", "--preset", "gpu-matrix", "--dry-run", "--model-config", str(tiny_config), "--seq-lens",
               "48", "--variants", ",".join(names), "--out", str(out)])
    rows = {r["variant"]: r for r in json.loads((out / "matrix.json").read_text())["rows"]}
    assert list(rows) == names and not list(out.glob("variants/*/run"))
    assert rows["zero3-mb8-prefetch"]["status"] == "planned" and "--config_file" in rows["zero3-mb8-prefetch"][
        "command"] and rows["zero3-mb8-prefetch"]["estimate_bytes"] > 0
    assert rows["single_gpu-mb8-compile"]["status"] == "planned"
    if importlib.util.find_spec("liger_kernel"):
        assert rc == 0 and rows["single_gpu-mb8-liger"]["status"] == "planned"
    else:
        assert rc == 1 and rows["single_gpu-mb8-liger"]["status"] == "failed"
        assert "liger-kernel is not installed" in rows["single_gpu-mb8-liger"]["reason"]
    assert "Dry run: every variant planned" in (out / "matrix.md").read_text()


def test_every_variant_names_a_known_profile_and_distinct_settings():
    from hf_zero.plan.profiles import list_profiles

    assert len({v.name for v in VARIANTS}) == len(VARIANTS)
    assert {v.strategy for v in VARIANTS} <= set(list_profiles())
    assert len({(v.strategy, v.micro, v.flags, json.dumps(v.deepspeed)) for v in VARIANTS}) == len(VARIANTS)
    assert {v.micro for v in VARIANTS} == {8, 16, 32}


@pytest.mark.multiproc
def test_matrix_runs_its_variants_on_a_tiny_model(tiny_config, tmp_path, capsys):
    """Two variants through the real launcher, 2 steps each, and one that needs a GPU: the table, the DeepSpeed
    settings the ZeRO-3 run was given, the loss against single_gpu's."""
    out = tmp_path / "out"
    assert main(["bench", "--preset", "gpu-matrix", "--model-config", str(tiny_config), "--seq-lens", "48",
                 "--variants", "single_gpu-mb8,zero3-mb8-persist-all,single_gpu-mb8-liger", "--steps", "2",
                 "--warmup", "0", "--budget", "1200", "--out", str(out)]) == 0
    report = json.loads((out / "matrix.json").read_text())
    rows = {r["variant"]: r for r in report["rows"]}
    assert [rows[n]["status"] for n in rows] == ["ok", "ok", "not run"]
    assert rows["single_gpu-mb8-liger"]["reason"] == "needs a CUDA GPU"
    for name in ("single_gpu-mb8", "zero3-mb8-persist-all"):
        assert rows[name]["tokens_per_s"] > 0 and len(rows[name]["losses"]) == 2 and rows[name]["mfu"] is None
    assert rows["zero3-mb8-persist-all"]["loss_reference"] == "single_gpu-mb8"
    assert rows["zero3-mb8-persist-all"]["max_abs_loss_diff_vs_reference"] < 0.05  # bf16, the same rows
    plan = json.loads((out / "variants" / "zero3-mb8-persist-all" / "run" / "run_plan.json").read_text())
    assert json.dumps(plan).count('"stage3_param_persistence_threshold": 1000000000') == 1
    assert set(report["fastest"]) == {"single_gpu", "zero3"}
    assert "| zero3-mb8-persist-all | zero3 | 8 x 48 |" in (out / "matrix.md").read_text()
