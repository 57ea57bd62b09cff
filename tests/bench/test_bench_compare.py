"""What `hf-zero bench` may conclude: the overhead verdict (never "yes" when the two trainings differ or the spread
is wider than the target), device vs offloaded bytes, the plain baseline's launcher, a one-rank packed LoRA bench
whose baseline trains the same thing, and the GPU preset's table (its CPU fallback)."""

import json
import math
import sys

import pytest
from testing_utils import REPO, run_cmd

QUICK = REPO / "recipes" / "configs" / "bench_quick.yaml"


def _run_result(losses, step, fingerprint=None):
    return {"status": "ok", "losses": losses, "step_time_median_s": step, "startup_s": 10.0, "launcher_s": 1.0,
            "fingerprint": fingerprint or {"param_dtype": "torch.float32"}}


def test_overhead_verdict_needs_the_same_training_and_a_spread_within_the_target():
    from hf_zero.bench.compare import overhead

    same = [5.0, 4.0, 3.0]

    def pairs(*ratios, plain_losses=same, fp=None):
        return [(_run_result(same, r), _run_result(plain_losses, 1.0, fp)) for r in ratios]

    assert overhead("zero2", pairs(1.00, 1.01, 1.02), "fp32")["verdict"] == "yes"
    assert overhead("zero2", pairs(1.05, 1.06, 1.05), "fp32")["verdict"] == "no"
    wide = overhead("zero2", pairs(0.98, 1.05, 1.00), "fp32")
    assert wide["verdict"] == "inconclusive" and "proves nothing" in wide["verdict_reason"]
    # the mean ratio, with two standard errors of it as the spread
    assert wide["step_time_ratio"] == pytest.approx(1.01) and wide["step_time_ratio_spread"] == pytest.approx(
        2 * 0.036056 / 3 ** 0.5, rel=1e-4)
    assert overhead("zero2", pairs(1.00), "fp32")["verdict"] == "inconclusive"  # one pair: no spread
    # Different training: never yes, whatever the timing.
    later = overhead("zero2", pairs(1.0, 1.0, 1.0, plain_losses=[5.0, 4.0, 3.1]), "fp32")
    assert later["verdict"] == "not comparable" and "losses differ by up to 1.00e-01" in later["verdict_reason"]
    first = overhead("zero2", pairs(1.0, 1.0, plain_losses=[5.03, 4.0, 3.0]), "bf16")
    assert first["verdict"] == "not comparable" and "first-step loss" in first["verdict_reason"]
    dtype = overhead("zero2", pairs(1.0, 1.0, fp={"param_dtype": "torch.bfloat16"}), "bf16")
    assert dtype["verdict"] == "not comparable" and "param_dtype torch.float32 vs torch.bfloat16" in \
        dtype["verdict_reason"]
    # bf16 on a GPU: later steps may drift by non-deterministic kernels, within the stated tolerance.
    drift = pairs(1.0, 1.01, plain_losses=[5.0, 4.004, 3.0])
    assert overhead("zero2", drift, "bf16")["verdict"] == "yes"
    assert overhead("zero2", drift, "fp32")["verdict"] == "not comparable"
    # fp32: a few steps of float rounding (the fused loss sums in chunks) is the same training; 1e-4 is not.
    rounding = pairs(1.0, 1.01, plain_losses=[5.0 + 4.8e-7, 4.0 - 1.43e-6, 3.0])
    assert overhead("zero2", rounding, "fp32")["verdict"] == "yes"
    assert overhead("zero2", pairs(1.0, 1.01, plain_losses=[5.0, 4.0001, 3.0]), "fp32")["verdict"] == "not comparable"


def test_overhead_pairs_needed_warmup_pairs_and_start_up_phases():
    """Pure functions, no timing: the verdict resolves 3% only when 2 standard errors of the mean pair ratio are
    within 2% and on one side of the limit; otherwise it says how many pairs would (n x (spread / wanted)^2)."""
    from hf_zero.bench.compare import overhead, overhead_verdict, startup_breakdown
    from hf_zero.core.startup import durations

    noisy = overhead_verdict([0.93, 1.14, 1.04, 1.06])  # the spread: far from telling 3%
    assert noisy["verdict"] == "inconclusive" and noisy["spread"] > 0.02
    wanted = min(0.02, abs(noisy["ratio"] - 1.03))  # the resolution, or the distance to the limit if smaller
    assert noisy["pairs_needed"] == math.ceil(4 * (noisy["spread"] / wanted) ** 2) and noisy["pairs_needed"] > 4
    tight = overhead_verdict([1.026, 1.031, 1.036, 1.031])  # precise, but right at the limit: more pairs to tell
    assert tight["verdict"] == "inconclusive" and "straddles" in tight["reason"] and tight["pairs_needed"] > 4
    assert overhead_verdict([1.010, 1.012, 1.008])["verdict"] == "yes"
    assert overhead_verdict([1.060, 1.062, 1.058])["verdict"] == "no"
    assert overhead_verdict([])["verdict"] == "not measured"
    assert overhead_verdict([1.0])["pairs_needed"] is None

    same = [5.0, 4.0, 3.0]
    hf = [{**_run_result(same, r), "startup_phases_s": [("imports", 2.0 + i), ("model", 1.0)]}
          for i, r in enumerate((1.50, 1.00, 1.01, 1.02))]
    plain = [{**_run_result(same, 1.0), "startup_phases_s": [("imports", 2.0)]} for _ in hf]
    # the first (cold) pair is left out: without it the ratios agree
    kept = overhead("zero2", list(zip(hf, plain)), "fp32", warmup_pairs=1)
    assert kept["verdict"] == "yes" and kept["step_time_ratios"] == [1.00, 1.01, 1.02] and kept["warmup_pairs"] == 1
    assert overhead("zero2", list(zip(hf, plain)), "fp32")["verdict"] == "inconclusive"
    assert overhead("zero2", list(zip(hf, plain))[:1], "fp32", warmup_pairs=1)["repeats"] == 1  # one pair: kept
    assert kept["startup_breakdown_hf_zero"] == [("imports", 4.0), ("model", 1.0)]  # medians over the kept pairs
    assert startup_breakdown([{"startup_phases_s": [("a", 1.0)]}, {"startup_phases_s": [("b", 3.0)]}]) == [
        ("a", 0.5), ("b", 1.5)]
    # a phase lasts until the next one starts; the time before the first is Python's start and imports
    assert durations([("model", 13.0), ("plan", 10.0), ("model", 16.0)], 8.0, 20.0) == [
        ("Python start-up and imports", 2.0), ("plan", 3.0), ("model", 7.0)]


def test_plain_baseline_goes_through_accelerate_launch_with_the_same_profile_or_through_torchrun(tmp_path):
    """By default the plain script is started as hf_zero's recipe is (the same `accelerate launch` line: profile,
    processes, precision, port), so the pair differs only in the script. With torchrun, the launcher accelerate runs
    DeepSpeed and DDP profiles through even at one process (a plain interpreter there has no process group:
    DeepSpeed then looks for MPI and the baseline crashed at --nproc 1)."""
    from hf_zero.bench.execute import PLAIN_SCRIPT, plain_launch_command
    from hf_zero.launch.launch_command import build_launch_command

    spec, run = tmp_path / "spec.json", tmp_path / "run"
    script = [str(PLAIN_SCRIPT), "--spec", str(spec), "--output_dir", str(run)]
    for profile, nproc, precision in (("zero3", 2, None), ("zero2", 1, "bf16"), ("single_gpu", 1, None)):
        cmd = plain_launch_command(profile, nproc, 1234, spec, run, "accelerate", precision)
        recipe, _ = build_launch_command(profile, "recipe.py", ["--config", "x.yaml"], nproc=nproc,
                                         precision=precision, main_port=1234)
        assert cmd[:-5] == recipe[:-3] and cmd[-5:] == script, (cmd, recipe)
    single = plain_launch_command("single_gpu", 1, 1234, spec, run, "torchrun")
    assert single == [sys.executable, *script]
    for profile, nproc in (("zero2", 1), ("zero3_offload", 1), ("ddp", 2), ("zero2", 2)):
        cmd = plain_launch_command(profile, nproc, 1234, spec, run, "torchrun")
        assert cmd[1:3] == ["-m", "torch.distributed.run"] and cmd[cmd.index("--nproc_per_node") + 1] == str(nproc)
        assert cmd[cmd.index("--master_port") + 1] == "1234" and cmd[-5:] == single[1:]


def test_offloaded_bytes_are_counted_apart_from_the_device():
    from hf_zero.bench.compare import offload_split

    parts = {"params": 10, "grads": 20, "grad_buckets": 1, "optimizer": 60, "total": 91}
    assert offload_split(parts, "none", "none") == {"device": 91, "host": 0}
    assert offload_split(parts, "cpu", "none") == {"device": 11, "host": 80}
    assert offload_split(parts, "cpu", "cpu") == {"device": 1, "host": 90}


@pytest.mark.slow  # five 1-rank launches (~5 min here); make test-extended runs the 2-rank quick bench (test_bench.py)
@pytest.mark.multiproc
def test_one_rank_packed_lora_bench_compares_like_with_like(tmp_path):
    """At N=1: no ZeRO-3/DDP ratio (nothing is sharded), offloaded bytes apart; a recipe that packs and trains LoRA
    gives the plain baseline the same packed rows and adapters (losses equal), through the launcher accelerate
    would pick (torchrun, one process) with `--plain-launcher torchrun`, by the same `accelerate launch` line
    without it."""
    out = tmp_path / "out"
    proc = run_cmd([sys.executable, "-m", "hf_zero.cli", "bench", "--config", QUICK, "--nproc", "1", "--strategies",
                    "zero2,zero3_offload", "--warmup", "1", "--overhead-repeats", "1", "--out", out,
                    "--packing", "true", "--use_peft", "true"], timeout=1800)
    report = json.loads((out / "bench.json").read_text())
    assert report["nproc"] == 1 and report["packing"] is True
    assert all(s["status"] == "ok" for s in report["strategies"])
    checks = report["checks"]
    assert checks["zero3_over_ddp_model_state"] is None and checks["model_state_in_paper_order"] is None
    md = (out / "bench.md").read_text()
    assert "ZeRO-3 / DDP" not in md and "At 1 rank ZeRO shards nothing" in md
    rows = {s["name"]: s for s in report["strategies"]}
    off = rows["zero3_offload"]
    assert off["model_state_host_bytes_per_rank"] > 0 and off["estimate_host_bytes_per_rank"] > 0
    assert off["model_state_device_bytes_per_rank"] + off["model_state_host_bytes_per_rank"] == \
        off["model_state_bytes_per_rank"]
    assert rows["zero2"]["model_state_host_bytes_per_rank"] == 0
    assert report["trainable_params"] < report["params"]  # LoRA
    plain = report["plain_trainer"]
    assert plain["comparable"] is True and plain["max_abs_loss_diff_vs_hf_zero"] <= 1e-6, plain.get("verdict_reason")
    spec = json.loads((out / "plain" / "spec.json").read_text())
    assert spec["packing"] is True and spec["lora"]["r"] == 16
    first = json.loads((out / "plain" / "samples.jsonl").read_text().splitlines()[0])
    assert "position_ids" in first
    pack = report["packing_comparison"]
    assert pack["recipe_packs"] is True and pack["status"] == "ok" and pack["tokens_per_s_unpacked"] > 0
    assert "wrote" in proc.stdout and not list(out.glob("runs/*/final"))


# The default tier runs the preset's code on its reference pair and the one offloading strategy (zero2 and zero3 run
# through the real launcher in the session's strategy runs); every preset strategy is the slow tier's (and the GPU's).
PRESET_SUBSETS = [pytest.param(("single_gpu", "zero3_offload"), id="single_gpu-zero3_offload"),
                  pytest.param(None, marks=pytest.mark.slow, id="every-preset-strategy")]


@pytest.mark.multiproc
@pytest.mark.parametrize("strategies", PRESET_SUBSETS)
def test_gpu_preset_writes_its_table_and_falls_back_to_the_cpu(tmp_path, monkeypatch, capsys, strategies):
    """`hf-zero bench --preset gpu` on a tiny config and one short row length: the bare PyTorch loop and the
    preset's strategies at one rank in bf16, the combined table and each shape's full reports; without a GPU, MFU
    null."""
    from hf_zero.bench import gpu
    from hf_zero.bench.compare import FIRST_LOSS_ATOL
    from hf_zero.cli import main
    from hf_zero.data.model_names import get_model_config

    if strategies:
        monkeypatch.setattr(gpu, "PRESET_STRATEGIES", strategies)
    config = tmp_path / "tiny"
    get_model_config("tiny-llama").save_pretrained(config)
    out = tmp_path / "out"
    assert main(["bench", "--preset", "gpu", "--model-config", str(config), "--seq-lens", "48", "--micro-batch", "2",
                 "--steps", "4", "--warmup", "1", "--out", str(out)]) == 0
    stdout = capsys.readouterr().out
    summary = json.loads((out / "bench.json").read_text())
    names = ["torch_loop", *gpu.PRESET_STRATEGIES]
    assert [r["strategy"] for r in summary["table"]] == names and summary["preset"] == "gpu"
    for r in summary["table"]:
        assert r["status"] == "ok" and r["seq_len"] == 48 and r["rows"] == 2 and r["tokens_per_s"] > 0
        assert r["mfu"] is None and r["peak_memory_kind"] == "rss"  # no GPU here: no device peak to divide by
    by = {r["strategy"]: r for r in summary["table"]}
    assert by["single_gpu"]["vs_single_gpu"] == 1.0
    assert by["zero3_offload"]["vs_single_gpu"] == pytest.approx(
        by["zero3_offload"]["tokens_per_s"] / by["single_gpu"]["tokens_per_s"])
    md = (out / "bench.md").read_text()
    assert "| rows x tokens | strategy | s/step | tokens/s | MFU |" in md and "CPU fallback" in md
    assert md.count("| 2 x 48 |") == len(names)
    report = json.loads((out / "seq48" / "bench.json").read_text())
    assert report["precision"] == "bf16" and report["nproc"] == 1 and report["packing"] is True
    assert report["flops_per_token"] > 0 and (out / "seq48" / "bench.png").is_file()
    rows = {r["name"]: r for r in report["strategies"]}
    # The reference loop trains the same rows from the same weights: the first step (no update yet) agrees.
    assert abs(rows["torch_loop"]["losses"][0] - rows["single_gpu"]["losses"][0]) <= FIRST_LOSS_ATOL["bf16"]
    assert "wrote" in stdout and not list(out.glob("seq48/runs/*/final"))
