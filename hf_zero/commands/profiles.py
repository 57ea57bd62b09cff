"""`hf-zero profiles`: one row per profile, and the one this machine would use."""

from __future__ import annotations

from pathlib import Path

from hf_zero.estimate.pick import pick_profile
from hf_zero.plan.profiles import list_profiles, load_profile

__all__ = ["add_arguments", "run", "profiles_table"]


def add_arguments(parser) -> None:
    parser.add_argument("--pick", action="store_true", help="print only the profile this machine would use")


def profiles_table(pick: str | None = None) -> list[str]:
    """One row per profile: processes, strategy, offload, precision and what it is for (its YAML's `# For:`)."""
    rows = [("profile", "processes", "strategy", "offload (optimizer / params)", "precision", "for")]
    for name in list_profiles():
        p = load_profile(name)
        strategy = f"ZeRO-{p.zero_stage}" if p.uses_deepspeed else {"NO": "none", "MULTI_GPU": "DDP"}.get(
            p.distributed_type, p.distributed_type)
        procs = f"{p.num_processes}" + (f" on {p.num_machines} machines" if p.num_machines > 1 else "")
        offload = " / ".join("-" if d == "none" else d.upper() if d == "cpu" else "NVMe"
                             for d in (p.offload_optimizer, p.offload_param))
        uses = next((ln[len("# For:"):].strip() for ln in Path(p.path).read_text().splitlines()
                     if ln.startswith("# For:")), "")
        rows.append((("* " if name == pick else "  ") + name, procs, strategy, offload, p.precision, uses))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1] for r in rows]


def run(args) -> int:
    name, why = pick_profile()
    if args.pick:
        print(name)
        return 0
    print("\n".join(profiles_table(name)))
    print(f"this machine: {name} ({why})")
    return 0
