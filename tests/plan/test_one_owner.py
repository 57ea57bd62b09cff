"""World size, global batch and precision are each derived in one place, which everything else reads:

- the world size in hf_zero/plan/world.py (from the environment a launcher gives every rank, or processes per
  machine x machines before the launch); inside a rank, the run plan's `world` / `nodes`;
- the global batch in BatchPlan.global_batch (hf_zero/plan/reconcile.py);
- a profile's precision in hf_zero/plan/profiles.py: `with_precision` for a `--precision`, and the loaders that
  read what a profile YAML or accelerate's environment declares.

An ast scan of hf_zero/, so that a new site fails here rather than drifting from the others. Reading the live
process group's size right before a collective (torch.distributed.get_world_size()) is reading, not deriving,
and is not looked for."""

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "hf_zero"

WORLD_OWNER = "plan/world.py"
BATCH_OWNER = ("plan/reconcile.py", "BatchPlan.global_batch")
PRECISION_OWNER = "plan/profiles.py"
# Functions of profiles.py that set mixed_precision: why each may.
PRECISION_ALLOWED = {
    "with_precision": "the owner: a command's --precision applied to a profile",
    "_read_profile": "reads the profile YAML's own mixed_precision",
    "_fsdp_fields": "reads an FSDP profile's (or accelerate's FSDP environment's) declared precision",
    "profile_from_env": "reads the precision accelerate put in a rank's environment (also fp8, which --precision "
                        "does not take)",
}
# Modules allowed to name the world-size variables: why (none of them reads the world from them).
WORLD_NAMES_ALLOWED = {
    "data/assets.py": "removes the launcher's variables from a child process's environment",
    "checkpoint/convert.py": "removes the launcher's variables from a child process's environment",
}

ENV_WORLD = {"WORLD_SIZE", "LOCAL_WORLD_SIZE"}
PER_MACHINE = {"nproc", "gpn", "gpus_per_node", "nproc_per_node", "per_machine"}
MACHINES = {"nodes", "machines", "num_machines"}
MICRO = {"micro", "micro_batch", "per_device_train_batch_size"}
ACCUM = {"accum", "accumulation", "gradient_accumulation_steps", "grad_accumulation"}


def _names(node) -> set[str]:
    """Variable and attribute names in an expression: `st.nproc * st.machines` -> {st, nproc, machines}."""
    return {n.id if isinstance(n, ast.Name) else n.attr for n in ast.walk(node)
            if isinstance(n, (ast.Name, ast.Attribute))}


def _product_names(node: ast.BinOp) -> set[str]:
    """The names in every factor of a chain of multiplications (a * b * c)."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
        return _product_names(node.left) | _product_names(node.right)
    return _names(node)


def _scopes(tree):
    """(qualified function or class name, node) for every node, the innermost enclosing def/class named."""
    def visit(node, scope):
        for child in ast.iter_child_nodes(node):
            inner = f"{scope}.{child.name}".lstrip(".") if isinstance(
                child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) else scope
            yield inner, child
            yield from visit(child, inner)
    yield from visit(tree, "")


def _findings(rel: str, tree) -> list[str]:
    out = []
    # a * b * c is one product: looked at once, from its outermost multiplication
    inner = {id(side) for n in ast.walk(tree) if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Mult)
             for side in (n.left, n.right) if isinstance(side, ast.BinOp) and isinstance(side.op, ast.Mult)}
    for scope, node in _scopes(tree):
        where = f"{rel}:{getattr(node, 'lineno', '?')} ({scope or 'module'})"
        if rel != WORLD_OWNER and rel not in WORLD_NAMES_ALLOWED and isinstance(node, ast.Constant) \
                and node.value in ENV_WORLD:
            out.append(f"{where}: reads {node.value} (use hf_zero.plan.world, or the run plan's world)")
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult) and id(node) not in inner:
            names = _product_names(node)
            if rel != WORLD_OWNER and names & PER_MACHINE and names & MACHINES:
                out.append(f"{where}: processes per machine x machines (use hf_zero.plan.world.world_of)")
            if (rel, scope) != BATCH_OWNER and names & MICRO and names & ACCUM:
                out.append(f"{where}: micro x accumulation (read BatchPlan.global_batch)")
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.FloorDiv) and rel != WORLD_OWNER \
                and "num_processes" in _names(node.left) and _names(node.right) & MACHINES:
            out.append(f"{where}: num_processes over machines (use hf_zero.plan.world.per_machine_of)")
        sets_precision = (isinstance(node, ast.keyword) and node.arg == "mixed_precision") or (
            isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)) and any(
                isinstance(t, ast.Attribute) and t.attr == "mixed_precision"
                for t in (node.targets if isinstance(node, ast.Assign) else [node.target])))
        if sets_precision and not (rel == PRECISION_OWNER and scope in PRECISION_ALLOWED):
            out.append(f"{where}: sets a profile's mixed_precision (use hf_zero.plan.profiles.with_precision)")
    return out


def scan(root: Path = PKG) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        found += _findings(rel, ast.parse(path.read_text(), str(path)))
    return found


def test_world_global_batch_and_precision_are_derived_in_one_place_each():
    assert scan() == []


def test_the_scan_finds_each_kind_of_second_derivation():
    """The scan is not vacuous: each pattern it forbids, written outside its owner, is found."""
    source = '''
import os
from dataclasses import replace

def f(env, st, prof, recipe, world, profile):
    a = int(os.environ.get("WORLD_SIZE", "1"))
    b = env.get("LOCAL_WORLD_SIZE")
    c = st.nproc * st.machines
    d = prof.num_processes // max(prof.num_machines, 1)
    e = recipe.micro * recipe.accumulation * world
    g = replace(profile, mixed_precision="bf16")
    profile.mixed_precision = "no"
'''
    found = _findings("train/somewhere.py", ast.parse(source))
    kinds = ["reads WORLD_SIZE", "reads LOCAL_WORLD_SIZE", "per machine x machines", "num_processes over machines",
             "micro x accumulation", "sets a profile's mixed_precision"]
    for kind in kinds:
        assert any(kind in f for f in found), (kind, found)
    assert len(found) == 7, found  # mixed_precision twice: the keyword and the assignment
    # The owners themselves are where these belong.
    assert _findings(WORLD_OWNER, ast.parse("def world_of(nproc, machines):\n    return nproc * machines\n")) == []
    assert _findings(PRECISION_OWNER, ast.parse(
        "def with_precision(profile, p):\n    return replace(profile, mixed_precision=p)\n")) == []
