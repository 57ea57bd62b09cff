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
    # integrations/ (the room for every reach into a library) sits with core: core's own reaches (a process
    # group's timeout, argparse's actions, the peft hiding) belong in it, and every layer above calls it; a patch
    # that needs a higher layer's module is handed it as an argument.
    {"__init__", "core", "integrations"},
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
# Start-up time: the imported module loads transformers (plan/arguments.py subclasses its TrainingArguments; the
# others import it or a TrainerCallback), seconds that `hf-zero check`, `estimate`, `preview`, `bench` and the
# launcher only pay once they read a recipe; each of those imports sits in the function that needs it.
_TRANSFORMERS = "loads transformers: imported where a recipe is read, not when the command or launcher starts"
LOCAL = {
    'hf_zero.checkpoint.export -> hf_zero.plan.arguments': _TRANSFORMERS,
    'hf_zero.bench.execute -> hf_zero.train.bench_probe': _TRANSFORMERS,
    'hf_zero.bench.plan -> hf_zero.plan.arguments': _TRANSFORMERS,
    'hf_zero.bench.plan -> hf_zero.train.model': _TRANSFORMERS,
    'hf_zero.bench.runs -> hf_zero.estimate.measure': _TRANSFORMERS,
    'hf_zero.commands.estimate -> hf_zero.plan.arguments': _TRANSFORMERS,
    'hf_zero.commands.estimate -> hf_zero.train.recipe_count': _TRANSFORMERS,
    'hf_zero.commands.train -> hf_zero.train.recipe_count': _TRANSFORMERS,
    'hf_zero.commands.preview -> hf_zero.train.composed_count': _TRANSFORMERS,
    'hf_zero.commands.preview -> hf_zero.train.vlm_check': _TRANSFORMERS,
    'hf_zero.commands.preview -> hf_zero.plan.arguments': _TRANSFORMERS,
    'hf_zero.plan.one_stage -> hf_zero.plan.arguments': _TRANSFORMERS,
    'hf_zero.plan.parse -> hf_zero.plan.arguments': _TRANSFORMERS,
    'hf_zero.plan.sequence_parallel -> hf_zero.plan.arguments': _TRANSFORMERS,
    'hf_zero.plan.shipped -> hf_zero.plan.arguments': _TRANSFORMERS,
    'hf_zero.preflight.checks -> hf_zero.plan.arguments': _TRANSFORMERS,
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


def _imports() -> tuple[list[tuple[str, str, bool]], dict[str, set[str]]]:
    """(importer, imported, inside a function) for every import of an hf_zero module; and per module the third-party
    packages it imports when it is loaded (not inside functions, not under TYPE_CHECKING)."""
    edges, third = [], {}
    for module, path in MODULES.items():
        loaded = third.setdefault(module, set())

        def walk(node, local):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.Import, ast.ImportFrom)):
                    edges.extend((module, target, local) for target in _targets(module, child))
                    if not local and not getattr(child, "level", 0):
                        names = [a.name for a in child.names] if isinstance(child, ast.Import) else [child.module]
                        loaded.update(n.split(".")[0] for n in names)
                if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                    continue
                walk(child, local or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

        walk(ast.parse(path.read_text(), str(path)), False)
    return edges, third


EDGES, THIRD_PARTY = _imports()


def loads_transformers(module: str, seen=None) -> bool:
    """Whether loading `module` imports transformers (itself or through the hf_zero modules it imports on load)."""
    seen = set() if seen is None else seen
    seen.add(module)
    if "transformers" in THIRD_PARTY[module]:
        return True
    return any(loads_transformers(dst, seen) for src, dst, inside in EDGES
               if src == module and not inside and dst not in seen)


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


def test_every_folder_is_in_a_layer_and_in_the_wheel():
    """setup.cfg lists the packages a wheel carries: a folder missing there installs without its modules."""
    import configparser

    config = configparser.ConfigParser()
    config.read(REPO / "setup.cfg")
    packaged = set(config["options"]["packages"].split())
    folders = {p.name for p in PKG.iterdir() if (p / "__init__.py").is_file()}
    assert {f"hf_zero.{f}" for f in folders} <= packaged
    assert folders <= set().union(*LAYERS)


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


def test_each_function_local_import_has_the_reason_it_gives():
    for entry, reason in LOCAL.items():
        importer, imported = entry.split(" -> ")
        if reason is _TRANSFORMERS:
            assert loads_transformers(imported), f"{entry}: {imported} does not load transformers: import at the top"
            assert not loads_transformers(importer), f"{entry}: {importer} loads it anyway: import at the top"


@pytest.mark.parametrize("src,dst,expected", [
    ("hf_zero.data.stages", "hf_zero.core.errors", False),
    ("hf_zero.core.errors", "hf_zero.data.stages", True),
    ("hf_zero.cli", "hf_zero.core.errors", False),
])
def test_the_layer_order_is_what_the_test_checks(src, dst, expected):
    assert (layer(dst) > layer(src)) is expected
