"""One launch of `hf-zero bench`, start to summary: run it (stopped at --timeout, launched once more after a crash),
and turn the files its ranks wrote (hf_zero.train.bench_probe, hf_zero.estimate.measure) into step times,
throughput, memory and losses, or a failure with its cause."""

from __future__ import annotations

import os
import re
import signal
import statistics
import subprocess
import time
from pathlib import Path

from hf_zero.core.startup import T0_ENV, durations

__all__ = ["measure_launch", "summarize_run", "root_cause", "model_state_bytes"]


def _launch(cmd: list[str], env: dict, run_dir: Path, timeout: int) -> tuple[float, int]:
    """Run one launch to completion; (wall time it started, exit code). Output goes to run_dir/launch.log."""
    run_dir.mkdir(parents=True, exist_ok=True)
    for stale in [*run_dir.glob("bench_rank*.json"), *run_dir.glob("memory_rank*.json"), run_dir / "summary.json"]:
        stale.unlink(missing_ok=True)  # a failed run must not be read as its predecessor's results
    with open(run_dir / "launch.log", "w") as log:
        started = time.time()
        env = {**env, T0_ENV: repr(started)}  # the launch's t0: every phase its ranks record counts from here
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            return started, proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)  # the launcher forwards SIGTERM to its workers (killing it would not)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            log.write(f"\n[hf_zero bench] stopped after --timeout {timeout} s\n")
            return started, -1


def measure_launch(cmd: list[str], env: dict, run_dir: Path, args, tokens_per_step, global_batch) -> dict:
    """One launch, summarized; a run that crashed is launched once more, and the first crash is kept in the result.

    A benchmark launches a dozen multi-process jobs in a row; on CPU, gloo's TCP mesh set-up now and then loses a
    connection. One such crash must not void the other measurements, and must not be hidden either.
    """
    started, code = _launch(cmd, env, run_dir, args.timeout)
    result = summarize_run(run_dir, started, code, args.warmup, tokens_per_step, global_batch)
    if result["status"] == "ok" or code == -1:  # a timeout would only time out again
        return result
    first = result
    (run_dir / "launch.log").rename(run_dir / "launch.first-attempt.log")
    started, code = _launch(cmd, env, run_dir, args.timeout)
    result = summarize_run(run_dir, started, code, args.warmup, tokens_per_step, global_batch)
    result["retried_after"] = {"exit_code": first["exit_code"], "cause": first["cause"],
                               "log": str(run_dir / "launch.first-attempt.log")}
    return result


def summarize_run(run_dir: Path, started: float, code: int, warmup: int, tokens_per_step, global_batch) -> dict:
    """One run's timings, memory and losses from the files its ranks wrote; status "failed" with the log's tail."""
    import json

    from hf_zero.estimate.measure import read_measurements

    probes = sorted((json.loads(p.read_text()) for p in run_dir.glob("bench_rank*.json")), key=lambda r: r["rank"])
    summary = run_dir / "summary.json"
    if code != 0 or not probes or not summary.is_file():
        lines = (run_dir / "launch.log").read_text(errors="replace").strip().splitlines()
        return {"status": "failed", "exit_code": code, "log": str(run_dir / "launch.log"),
                "cause": root_cause(lines), "error": "\n".join(lines[-15:])}
    begin, end = probes[0]["step_begin"], probes[0]["step_end"]
    # A step is begin-to-next-begin (forward, backward, optimizer, logging, next batch); the last one ends at its end.
    times = [b - a for a, b in zip(begin, begin[1:])] + [end[-1] - begin[-1]]
    kept = list(range(min(warmup, len(times) - 1), len(times)))
    steady = [times[k] for k in kept]
    q = statistics.quantiles(steady, n=4) if len(steady) > 1 else [steady[0]] * 3
    median = statistics.median(steady)
    out = {
        "status": "ok", "run_dir": str(run_dir), "steps": len(times), "warmup_steps": kept[0],
        "step_times_s": [round(t, 5) for t in times], "step_time_median_s": median,
        "step_time_p25_s": q[0], "step_time_p75_s": q[2], "step_time_min_s": min(steady),
        "step_time_max_s": max(steady), "startup_s": begin[0] - started, "wall_s": probes[0]["train_end"] - started,
        # start-up = the launcher starting the workers + a worker's imports and set-up up to its first step
        "launcher_s": min(p["process_start"] for p in probes) - started,
        # where start-up went: rank 0's phases (the launcher's handed on to it), up to its first step
        "startup_phases_s": [(name, round(s, 3)) for name, s in durations(probes[0].get("startup_phases") or [],
                                                                           started, begin[0])],
        "samples_per_s": global_batch / median,
        "tokens_per_s": statistics.median(tokens_per_step[k] / times[k] for k in kept if k < len(tokens_per_step)),
        "fingerprint": probes[0].get("fingerprint") or {},
        "peak_rss_bytes_by_rank": [p["peak_rss_bytes"] for p in probes],
        "device_peak_bytes_by_rank": [p["device_peak_bytes"] for p in probes],
        "losses": json.loads(summary.read_text())["losses"],
    }
    out["peak_rss_bytes_per_rank"] = max(out["peak_rss_bytes_by_rank"])
    device = [b for b in out["device_peak_bytes_by_rank"] if b is not None]
    # What limits a run: device memory on GPUs, the process's RSS on a CPU machine.
    out["peak_memory_kind"] = "device" if device else "rss"
    out["peak_memory_bytes_per_rank"] = max(device) if device else out["peak_rss_bytes_per_rank"]
    measured = read_measurements(run_dir)
    if measured:
        by_rank = [model_state_bytes(m, p.get("ddp_bucket_bytes", 0)) for m, p in zip(measured, probes)]
        out["model_state_by_rank"] = by_rank
        out["model_state_bytes_per_rank"] = max(r["total"] for r in by_rank)
        out["model_state_peak_bytes_per_rank"] = max(r["total_with_step_temporaries"] for r in by_rank)
    return out


def root_cause(lines: list[str]) -> str:
    """The line that says why a launch failed: a worker's exception, not the launcher's ChildFailedError banner."""
    for line in reversed(lines):
        text = line.strip()
        if (re.match(r"^(\[rank\d+\]:\s*)?[\w.]*(Error|Exception|Interrupt)\b.*:", text)
                and "ChildFailedError" not in text):
            return text[:300]
    return next((x.strip()[:300] for x in reversed(lines) if x.strip() and not set(x.strip()) <= set("=-")), "")


def model_state_bytes(record: dict, ddp_buckets: int) -> dict:
    """One rank's model states from hf_zero.estimate.measure's snapshots of step 1, counted as the ZeRO paper counts
    them: parameters and optimizer state after the step, gradients as held through backward (per-parameter gradients,
    partitions) plus the gradient communication buckets (DDP's are a full second copy). Temporaries of the optimizer
    step itself (DeepSpeed's flattened fp32 gradient copy, torch Adam's intermediates) are left out for every
    strategy, as they must be: only DeepSpeed's can be seen. `total_with_step_temporaries` adds DeepSpeed's."""
    snaps = {k: record.get(k) or {} for k in ("in_backward", "before_step", "after_step")}
    buckets = max(s.get("buffers", 0) for s in snaps.values()) + ddp_buckets
    # FSDP2 writes its sharded gradients straight into `.grad` (its sharded parameters are no autograd leaves, so the
    # in-backward hook never fires): they are held from backward to the step, as seen just before it.
    backward = snaps["in_backward"] if snaps["in_backward"].get("params") else snaps["before_step"]
    held = max(backward.get("grads", 0), snaps["after_step"].get("grads", 0))
    parts = {"params": record["measured"]["params"], "grads": held, "grad_buckets": buckets,
             "optimizer": record["measured"]["optimizer"]}
    total = sum(parts.values())
    return {**parts, "total": total, "total_with_step_temporaries": total - held + record["measured"]["grads"]}
