"""`hf-zero bench`: DDP vs ZeRO-1/2/3/offload and FSDP2 side by side (hf_zero/bench/): time, memory, loss parity."""

from __future__ import annotations

from hf_zero.bench.execute import DEFAULT_STRATEGIES, execute
from hf_zero.bench.gpu import add_preset_arguments, run_preset
from hf_zero.bench.matrix import run_matrix

__all__ = ["add_arguments", "run", "ACCEPTS_EXTRA"]


ACCEPTS_EXTRA = True  # unknown flags go to the recipe (e.g. --per_device_train_batch_size 4)


def add_arguments(parser) -> None:
    parser.add_argument("--config", help="recipe YAML (default: the shipped recipes/configs/bench.yaml)")
    parser.add_argument("--model", help="model instead of the recipe's (offline name, folder or hub id)")
    parser.add_argument("--strategies", default=DEFAULT_STRATEGIES,
                        help="comma-separated profiles to compare (default: DDP, ZeRO-1/2/3, zero3_offload, fsdp2, "
                        "fsdp2_offload; zero3_nvme too, with libaio and an NVMe path)")
    parser.add_argument("--nproc", type=int, default=2, help="ranks per strategy (default 2)")
    parser.add_argument("--steps", type=int, help="optimizer steps per run (default: the recipe's)")
    parser.add_argument("--out", default="bench_out", help="output folder (default bench_out)")
    parser.add_argument("--precision", choices=("fp32", "bf16", "fp16"), help="same for every strategy "
                        "(default: the profiles', fp32); loss parity is a target in fp32, recorded in bf16/fp16")
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of step-time statistics")
    parser.add_argument("--overhead-repeats", type=int, default=None,
                        help="hf_zero / plain Trainer pairs, interleaved A/B, B/A, ..., for the overhead ratio and "
                        "its spread (default 4: one warm-up pair and 3 measured; 0: skip; --preset gpu: 0)")
    parser.add_argument("--overhead-warmup-pairs", type=int, default=1,
                        help="first pairs left out of the overhead ratio while one pair remains: they find cold "
                        "caches (default 1)")
    parser.add_argument("--overhead-strategy", help="profile for the overhead and packing runs (default: zero2 "
                        "if benchmarked, else the first strategy)")
    parser.add_argument("--plain-launcher", choices=("accelerate", "torchrun"), default="accelerate",
                        help="how the plain Trainer script is started: `accelerate launch` with the same profile, "
                        "as hf_zero's recipe is (default: the layer's own cost), or the torchrun underneath it "
                        "(also counts accelerate's launcher, ~0.5 s on 2 CPU cores, against hf_zero)")
    parser.add_argument("--no-packing", action="store_true", help="skip the run with packing switched the other "
                        "way from the recipe (packed if it does not pack, unpacked if it does)")
    parser.add_argument("--keep-models", action="store_true", help="let every run write its final model to "
                        "OUT/runs/*/final (default: none is written)")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds before a run is stopped (default 1800)")
    parser.add_argument("--note", default="", help="what else ran on the machine meanwhile (recorded in the reports)")
    add_preset_arguments(parser)


def run(args) -> int:
    if args.preset == "gpu-matrix":
        return run_matrix(args)
    if args.preset:
        return run_preset(args)
    return execute(args)[1]
