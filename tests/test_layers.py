"""hf_zero's floors: every module imports only from its own layer or the layers below it, no two modules import
each other (directly or around a circle), and hf_zero's own modules are imported at the top of a file, where a
reader sees what a module depends on (a function-local import of an hf_zero module only with a reason below).

Heavy third-party libraries (torch, transformers, deepspeed, peft, datasets, accelerate) may be imported inside
functions: that keeps `hf-zero --help` fast. This test only looks at imports of hf_zero's own modules."""

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PKG = REPO / "hf_zero"

# The layer order, lowest first; a module may import from its own layer and any layer before it. Keys are the
# folders of hf_zero/ (and the top-level modules: "__init__" is the package itself, "cli" the `hf-zero` command).
LAYERS = [
    {"__init__", "core"},
    {"data", "metrics"},
    {"plan"},
    {"estimate"},
    {"checkpoint"},
    {"preflight"},
    {"launch"},
    {"train"},
    {"bench"},
    {"commands", "cli"},
]

# Imports that go up a layer, until they are moved: "importer -> imported".
UPWARD = set()

# Circles of modules that import each other, until they are broken: each as the sorted tuple of its modules.
CYCLES = set()

# hf_zero modules imported inside a function: "importer -> imported": why it cannot be at the top of the file.
LOCAL = {
    'hf_zero.bench.execute -> hf_zero.bench.plan': 'not moved to the top yet',
    'hf_zero.bench.execute -> hf_zero.bench.report': 'not moved to the top yet',
    'hf_zero.bench.execute -> hf_zero.launch.launch_command': 'not moved to the top yet',
    'hf_zero.bench.execute -> hf_zero.plan.profiles': 'not moved to the top yet',
    'hf_zero.bench.execute -> hf_zero.plan.shipped': 'not moved to the top yet',
    'hf_zero.bench.execute -> hf_zero.train.bench_probe': 'not moved to the top yet',
    'hf_zero.bench.gpu -> hf_zero.bench.execute': 'not moved to the top yet',
    'hf_zero.bench.gpu -> hf_zero.bench.report': 'not moved to the top yet',
    'hf_zero.bench.gpu -> hf_zero.bench.views': 'not moved to the top yet',
    'hf_zero.bench.gpu -> hf_zero.data.cache': 'not moved to the top yet',
    'hf_zero.bench.gpu -> hf_zero.data.model_names': 'not moved to the top yet',
    'hf_zero.bench.plan -> hf_zero.core.config': 'not moved to the top yet',
    'hf_zero.bench.plan -> hf_zero.data.curriculum': 'not moved to the top yet',
    'hf_zero.bench.plan -> hf_zero.data.model_names': 'not moved to the top yet',
    'hf_zero.bench.plan -> hf_zero.data.packing': 'not moved to the top yet',
    'hf_zero.bench.plan -> hf_zero.data.stages': 'not moved to the top yet',
    'hf_zero.bench.plan -> hf_zero.estimate.memory': 'not moved to the top yet',
    'hf_zero.bench.plan -> hf_zero.plan.parse': 'not moved to the top yet',
    'hf_zero.bench.plan -> hf_zero.plan.profiles': 'not moved to the top yet',
    'hf_zero.bench.plan -> hf_zero.plan.reconcile': 'not moved to the top yet',
    'hf_zero.bench.plan -> hf_zero.train.model': 'not moved to the top yet',
    'hf_zero.bench.report -> hf_zero': 'not moved to the top yet',
    'hf_zero.bench.report -> hf_zero.bench.plan': 'not moved to the top yet',
    'hf_zero.bench.report -> hf_zero.bench.plot': 'not moved to the top yet',
    'hf_zero.bench.report -> hf_zero.bench.views': 'not moved to the top yet',
    'hf_zero.bench.report -> hf_zero.estimate.flops': 'not moved to the top yet',
    'hf_zero.bench.report -> hf_zero.plan.profiles': 'not moved to the top yet',
    'hf_zero.bench.runs -> hf_zero.estimate.measure': 'not moved to the top yet',
    'hf_zero.checkpoint.export -> hf_zero.checkpoint.final': 'not moved to the top yet',
    'hf_zero.checkpoint.export -> hf_zero.checkpoint.fsdp': 'not moved to the top yet',
    'hf_zero.checkpoint.export -> hf_zero.data.model_names': 'not moved to the top yet',
    'hf_zero.checkpoint.final -> hf_zero.checkpoint.fsdp': 'not moved to the top yet',
    'hf_zero.checkpoint.final -> hf_zero.core.distributed': 'not moved to the top yet',
    'hf_zero.checkpoint.resume -> hf_zero.checkpoint.fsdp': 'not moved to the top yet',
    'hf_zero.checkpoint.write -> hf_zero.checkpoint.final': 'not moved to the top yet',
    'hf_zero.checkpoint.write -> hf_zero.checkpoint.fsdp': 'not moved to the top yet',
    'hf_zero.checkpoint.write -> hf_zero.estimate.measure': 'not moved to the top yet',
    'hf_zero.checkpoint.write -> hf_zero.plan.run_plan': 'not moved to the top yet',
    'hf_zero.cli -> hf_zero.launch.worker': 'not moved to the top yet',
    'hf_zero.commands.estimate -> hf_zero.core.config': 'not moved to the top yet',
    'hf_zero.commands.estimate -> hf_zero.data.model_names': 'not moved to the top yet',
    'hf_zero.commands.estimate -> hf_zero.estimate.activations': 'not moved to the top yet',
    'hf_zero.commands.estimate -> hf_zero.estimate.memory': 'not moved to the top yet',
    'hf_zero.commands.estimate -> hf_zero.estimate.recipe': 'not moved to the top yet',
    'hf_zero.commands.estimate -> hf_zero.plan.reconcile': 'not moved to the top yet',
    'hf_zero.commands.preview -> hf_zero.core.config': 'not moved to the top yet',
    'hf_zero.commands.preview -> hf_zero.data.chat': 'not moved to the top yet',
    'hf_zero.commands.preview -> hf_zero.data.model_names': 'not moved to the top yet',
    'hf_zero.commands.preview -> hf_zero.data.packing': 'not moved to the top yet',
    'hf_zero.commands.preview -> hf_zero.data.stages': 'not moved to the top yet',
    'hf_zero.commands.preview -> hf_zero.plan.parse': 'not moved to the top yet',
    'hf_zero.commands.preview -> hf_zero.plan.shipped': 'not moved to the top yet',
    'hf_zero.commands.train -> hf_zero.checkpoint.resume': 'not moved to the top yet',
    'hf_zero.commands.train -> hf_zero.core.errors': 'not moved to the top yet',
    'hf_zero.commands.train -> hf_zero.estimate.recipe': 'not moved to the top yet',
    'hf_zero.commands.train -> hf_zero.launch.interrupt': 'not moved to the top yet',
    'hf_zero.commands.train -> hf_zero.launch.launcher': 'not moved to the top yet',
    'hf_zero.commands.train -> hf_zero.plan.hostfile': 'not moved to the top yet',
    'hf_zero.commands.train -> hf_zero.plan.profiles': 'not moved to the top yet',
    'hf_zero.commands.train -> hf_zero.plan.shipped': 'not moved to the top yet',
    'hf_zero.commands.train -> hf_zero.preflight.checks': 'not moved to the top yet',
    'hf_zero.core.config -> hf_zero.core.validate': 'not moved to the top yet',
    'hf_zero.data.assets -> hf_zero.core.distributed': 'not moved to the top yet',
    'hf_zero.data.assets -> hf_zero.core.files': 'not moved to the top yet',
    'hf_zero.data.cache -> hf_zero.core.distributed': 'not moved to the top yet',
    'hf_zero.data.chat -> hf_zero.data.chat_template': 'not moved to the top yet',
    'hf_zero.data.chat_template -> hf_zero.data.model_names': 'not moved to the top yet',
    'hf_zero.data.classification -> hf_zero.data.stages': 'not moved to the top yet',
    'hf_zero.data.stages -> hf_zero.core.console': 'not moved to the top yet',
    'hf_zero.data.stages -> hf_zero.data.assets': 'not moved to the top yet',
    'hf_zero.data.stages -> hf_zero.data.chat': 'not moved to the top yet',
    'hf_zero.data.stages -> hf_zero.data.chat_template': 'not moved to the top yet',
    'hf_zero.data.stages -> hf_zero.data.packing': 'not moved to the top yet',
    'hf_zero.estimate.fsdp -> hf_zero.plan.fsdp': 'not moved to the top yet',
    'hf_zero.estimate.memory -> hf_zero.data.model_names': 'not moved to the top yet',
    'hf_zero.estimate.memory -> hf_zero.estimate.activations': 'not moved to the top yet',
    'hf_zero.estimate.memory -> hf_zero.estimate.fsdp': 'not moved to the top yet',
    'hf_zero.estimate.recipe -> hf_zero.data.model_names': 'not moved to the top yet',
    'hf_zero.estimate.recipe -> hf_zero.estimate.memory': 'not moved to the top yet',
    'hf_zero.estimate.recipe -> hf_zero.plan.parse': 'not moved to the top yet',
    'hf_zero.estimate.recipe -> hf_zero.plan.profiles': 'not moved to the top yet',
    'hf_zero.estimate.recipe -> hf_zero.plan.reconcile': 'not moved to the top yet',
    'hf_zero.estimate.recipe -> hf_zero.plan.shipped': 'not moved to the top yet',
    'hf_zero.launch.launcher -> hf_zero.launch.interrupt': 'not moved to the top yet',
    'hf_zero.launch.launcher -> hf_zero.plan.profiles': 'not moved to the top yet',
    'hf_zero.launch.launcher -> hf_zero.plan.run_plan': 'not moved to the top yet',
    'hf_zero.launch.slurm -> hf_zero.launch.launch_command': 'not moved to the top yet',
    'hf_zero.launch.slurm -> hf_zero.plan.parse': 'not moved to the top yet',
    'hf_zero.launch.slurm -> hf_zero.plan.profiles': 'not moved to the top yet',
    'hf_zero.launch.slurm -> hf_zero.plan.shipped': 'not moved to the top yet',
    'hf_zero.metrics -> hf_zero.core.errors': 'not moved to the top yet',
    'hf_zero.plan.parse -> hf_zero.core.config': 'not moved to the top yet',
    'hf_zero.plan.parse -> hf_zero.core.distributed': 'not moved to the top yet',
    'hf_zero.plan.parse -> hf_zero.core.validate': 'not moved to the top yet',
    'hf_zero.plan.profiles -> hf_zero.core.validate': 'not moved to the top yet',
    'hf_zero.plan.reconcile -> hf_zero.data.model_names': 'not moved to the top yet',
    'hf_zero.plan.run_plan -> hf_zero.core.files': 'not moved to the top yet',
    'hf_zero.plan.run_plan -> hf_zero.plan.parse': 'not moved to the top yet',
    'hf_zero.plan.run_plan -> hf_zero.plan.profiles': 'not moved to the top yet',
    'hf_zero.plan.run_plan -> hf_zero.plan.shipped': 'not moved to the top yet',
    'hf_zero.plan.shipped -> hf_zero.core.config': 'not moved to the top yet',
    'hf_zero.plan.shipped -> hf_zero.core.errors': 'not moved to the top yet',
    'hf_zero.plan.shipped -> hf_zero.plan.parse': 'not moved to the top yet',
    'hf_zero.preflight.check_io -> hf_zero.checkpoint.store': 'not moved to the top yet',
    'hf_zero.preflight.check_io -> hf_zero.core.config': 'not moved to the top yet',
    'hf_zero.preflight.check_io -> hf_zero.core.validate': 'not moved to the top yet',
    'hf_zero.preflight.check_io -> hf_zero.data.chat': 'not moved to the top yet',
    'hf_zero.preflight.check_io -> hf_zero.data.curriculum': 'not moved to the top yet',
    'hf_zero.preflight.check_io -> hf_zero.data.model_names': 'not moved to the top yet',
    'hf_zero.preflight.check_io -> hf_zero.data.stages': 'not moved to the top yet',
    'hf_zero.preflight.check_io -> hf_zero.estimate.memory': 'not moved to the top yet',
    'hf_zero.preflight.check_io -> hf_zero.plan.parse': 'not moved to the top yet',
    'hf_zero.preflight.check_io -> hf_zero.preflight.check_rules': 'not moved to the top yet',
    'hf_zero.preflight.check_rules -> hf_zero.core.ops': 'not moved to the top yet',
    'hf_zero.preflight.check_rules -> hf_zero.data.model_names': 'not moved to the top yet',
    'hf_zero.preflight.check_rules -> hf_zero.estimate.memory': 'not moved to the top yet',
    'hf_zero.preflight.check_rules -> hf_zero.plan.fsdp': 'not moved to the top yet',
    'hf_zero.preflight.check_rules -> hf_zero.plan.hostfile': 'not moved to the top yet',
    'hf_zero.preflight.check_rules -> hf_zero.plan.profiles': 'not moved to the top yet',
    'hf_zero.preflight.check_rules -> hf_zero.plan.reconcile': 'not moved to the top yet',
    'hf_zero.preflight.checks -> hf_zero.core.config': 'not moved to the top yet',
    'hf_zero.preflight.checks -> hf_zero.core.validate': 'not moved to the top yet',
    'hf_zero.preflight.checks -> hf_zero.data.model_names': 'not moved to the top yet',
    'hf_zero.preflight.checks -> hf_zero.estimate.recipe': 'not moved to the top yet',
    'hf_zero.preflight.checks -> hf_zero.plan.fsdp': 'not moved to the top yet',
    'hf_zero.preflight.checks -> hf_zero.plan.hostfile': 'not moved to the top yet',
    'hf_zero.preflight.checks -> hf_zero.plan.parse': 'not moved to the top yet',
    'hf_zero.preflight.checks -> hf_zero.plan.profiles': 'not moved to the top yet',
    'hf_zero.preflight.checks -> hf_zero.plan.reconcile': 'not moved to the top yet',
    'hf_zero.preflight.checks -> hf_zero.plan.shipped': 'not moved to the top yet',
    'hf_zero.preflight.checks -> hf_zero.preflight.check_rules': 'not moved to the top yet',
    'hf_zero.train.classifier -> hf_zero.core.distributed': 'not moved to the top yet',
    'hf_zero.train.classifier -> hf_zero.data.model_names': 'not moved to the top yet',
    'hf_zero.train.classifier -> hf_zero.train.model': 'not moved to the top yet',
    'hf_zero.train.classifier -> hf_zero.train.trainer': 'not moved to the top yet',
    'hf_zero.train.generate -> hf_zero.data.chat_template': 'not moved to the top yet',
    'hf_zero.train.generate -> hf_zero.data.model_names': 'not moved to the top yet',
    'hf_zero.train.model -> hf_zero.core.distributed': 'not moved to the top yet',
    'hf_zero.train.model -> hf_zero.core.errors': 'not moved to the top yet',
    'hf_zero.train.model -> hf_zero.data.chat_template': 'not moved to the top yet',
    'hf_zero.train.recipe_steps -> hf_zero.checkpoint.resume': 'not moved to the top yet',
    'hf_zero.train.recipe_steps -> hf_zero.core.config': 'not moved to the top yet',
    'hf_zero.train.recipe_steps -> hf_zero.core.errors': 'not moved to the top yet',
    'hf_zero.train.recipe_steps -> hf_zero.data.curriculum': 'not moved to the top yet',
    'hf_zero.train.recipe_steps -> hf_zero.data.stages': 'not moved to the top yet',
    'hf_zero.train.recipe_steps -> hf_zero.estimate.measure': 'not moved to the top yet',
    'hf_zero.train.recipe_steps -> hf_zero.launch.interrupt': 'not moved to the top yet',
    'hf_zero.train.recipe_steps -> hf_zero.train.bench_probe': 'not moved to the top yet',
    'hf_zero.train.recipe_steps -> hf_zero.train.trainer': 'not moved to the top yet',
    'hf_zero.train.run -> hf_zero.core.console': 'not moved to the top yet',
    'hf_zero.train.run -> hf_zero.core.distributed': 'not moved to the top yet',
    'hf_zero.train.run -> hf_zero.core.errors': 'not moved to the top yet',
    'hf_zero.train.run -> hf_zero.core.files': 'not moved to the top yet',
    'hf_zero.train.run -> hf_zero.data.assets': 'not moved to the top yet',
    'hf_zero.train.run -> hf_zero.launch.interrupt': 'not moved to the top yet',
    'hf_zero.train.run -> hf_zero.launch.launch_command': 'not moved to the top yet',
    'hf_zero.train.run -> hf_zero.plan.parse': 'not moved to the top yet',
    'hf_zero.train.run -> hf_zero.plan.profiles': 'not moved to the top yet',
    'hf_zero.train.run -> hf_zero.plan.run_plan': 'not moved to the top yet',
    'hf_zero.train.run -> hf_zero.plan.shipped': 'not moved to the top yet',
    'hf_zero.train.run -> hf_zero.preflight.check_rules': 'not moved to the top yet',
    'hf_zero.train.samples -> hf_zero.train.generate': 'not moved to the top yet',
    'hf_zero.train.throughput -> hf_zero.estimate.flops': 'not moved to the top yet',
    'hf_zero.train.throughput -> hf_zero.estimate.measure': 'not moved to the top yet',
    'hf_zero.train.throughput -> hf_zero.plan.run_plan': 'not moved to the top yet',
    'hf_zero.train.trainer -> hf_zero.checkpoint.resume': 'not moved to the top yet',
    'hf_zero.train.trainer -> hf_zero.checkpoint.write': 'not moved to the top yet',
    'hf_zero.train.trainer -> hf_zero.core.console': 'not moved to the top yet',
    'hf_zero.train.trainer -> hf_zero.core.distributed': 'not moved to the top yet',
    'hf_zero.train.trainer -> hf_zero.launch.interrupt': 'not moved to the top yet',
    'hf_zero.train.trainer -> hf_zero.train.fsdp': 'not moved to the top yet',
    'hf_zero.train.trainer -> hf_zero.train.throughput': 'not moved to the top yet',
}


def _modules() -> dict[str, Path]:
    mods = {}
    for path in PKG.rglob("*.py"):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


MODULES = _modules()


def _targets(module: str, node) -> list[str]:
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        if node.level:
            base = module.split(".")
            if MODULES[module].name != "__init__.py":
                base = base[:-1]
            base = base[: len(base) - (node.level - 1)]
            prefix = ".".join(base + ([node.module] if node.module else []))
        else:
            prefix = node.module or ""
        names = [f"{prefix}.{a.name}" if f"{prefix}.{a.name}" in MODULES else prefix for a in node.names]
    out = []
    for name in names:
        if name.split(".")[0] != "hf_zero":
            continue
        while name not in MODULES and "." in name:
            name = name.rsplit(".", 1)[0]
        if name != module:
            out.append(name)
    return out


def _imports() -> list[tuple[str, str, bool]]:
    """(importer, imported, inside a function) for every import of an hf_zero module."""
    edges = []
    for module, path in MODULES.items():
        def walk(node, local):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.Import, ast.ImportFrom)):
                    edges.extend((module, target, local) for target in _targets(module, child))
                walk(child, local or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

        walk(ast.parse(path.read_text(), str(path)), False)
    return edges


EDGES = _imports()


def layer(module: str) -> int:
    parts = module.split(".")
    room = parts[1] if len(parts) > 1 else "__init__"
    for index, rooms in enumerate(LAYERS):
        if room in rooms:
            return index
    raise AssertionError(f"{module}: its folder {room!r} is in no layer of LAYERS")


def _cycles() -> set[tuple[str, ...]]:
    """Strongly connected components of more than one module (Tarjan)."""
    graph = {m: set() for m in MODULES}
    for src, dst, _ in EDGES:
        graph[src].add(dst)
    index, low, stack, on_stack, found = {}, {}, [], set(), set()

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.add(tuple(sorted(comp)))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_every_module_is_in_a_layer():
    for module in MODULES:
        layer(module)


def test_no_module_imports_from_a_higher_layer():
    upward = {f"{src} -> {dst}" for src, dst, _ in EDGES if layer(dst) > layer(src)}
    assert upward - UPWARD == set(), "imports from a higher layer (move the code to where it belongs)"
    assert UPWARD - upward == set(), "listed in UPWARD but gone: remove them from the list"


def test_no_modules_import_each_other():
    cycles = _cycles()
    assert cycles - CYCLES == set(), "modules that import each other, directly or around a circle"
    assert CYCLES - cycles == set(), "listed in CYCLES but gone: remove them from the list"


def test_hf_zero_modules_are_imported_at_the_top_of_a_file():
    local = {f"{src} -> {dst}" for src, dst, inside in EDGES if inside}
    assert local - set(LOCAL) == set(), "hf_zero modules imported inside a function: import them at the top"
    assert set(LOCAL) - local == set(), "listed in LOCAL but gone: remove them from the list"
    assert all(reason.strip() for reason in LOCAL.values()), "every entry of LOCAL says why"


@pytest.mark.parametrize("src,dst,expected", [
    ("hf_zero.data.stages", "hf_zero.core.errors", False),
    ("hf_zero.core.errors", "hf_zero.data.stages", True),
    ("hf_zero.cli", "hf_zero.core.errors", False),
])
def test_the_layer_order_is_what_the_test_checks(src, dst, expected):
    assert (layer(dst) > layer(src)) is expected
