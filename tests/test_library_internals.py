"""Each private name hf_zero uses from torch, transformers, accelerate or argparse (listed, with its reason, in
hf_zero/core/internals.py) still exists and still means what hf_zero relies on; and no other private name is used."""

import argparse
import ast
import inspect
import os
from pathlib import Path

import pytest

from hf_zero.core.internals import ACCELERATE_STATE_REWRITE, INTERNALS

PKG = Path(__file__).resolve().parents[1] / "hf_zero"


def _private_names_used() -> dict[str, set[str]]:
    """Private names hf_zero reads from objects that are not its own: attributes (not on self/cls), getattr strings,
    and names imported from other packages; hf_zero's own private names are left out."""
    own, used = set(), {}
    for path in PKG.rglob("*.py"):
        tree = ast.parse(path.read_text())
        rel = str(path.relative_to(PKG))
        for n in ast.walk(tree):
            if isinstance(n, (ast.FunctionDef, ast.ClassDef)):
                own.add(n.name)
            elif isinstance(n, ast.Assign):
                own |= {x.id for t in n.targets for x in ast.walk(t) if isinstance(x, ast.Name)}
                own |= {x.attr for t in n.targets for x in ast.walk(t) if isinstance(x, ast.Attribute)}
            names = []
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Call) and getattr(n.value.func, "id", "") \
                    == "super" and n.attr.startswith("_") and not n.attr.startswith("__"):
                used.setdefault(f"super().{n.attr}", set()).add(rel)  # a library method hf_zero overrides
            elif isinstance(n, ast.Attribute) and not (isinstance(n.value, ast.Name) and n.value.id in ("self",
                                                                                                         "cls")):
                names = [n.attr]
            elif isinstance(n, ast.ImportFrom) and not (n.module or "").startswith("hf_zero"):
                names = [a.name for a in n.names]
            elif isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in ("getattr", "hasattr") \
                    and len(n.args) > 1 and isinstance(n.args[1], ast.Constant):
                names = [str(n.args[1].value)]
            for name in names:
                if name.startswith("_") and not name.startswith("__"):
                    used.setdefault(name, set()).add(rel)
    # A listed library name hf_zero also defines (a model class answering `_no_split_modules` as transformers' do)
    # is still a reach into the library's contract: it is not hf_zero's own.
    own -= {i.name for i in INTERNALS}
    return {k.removeprefix("super()."): v for k, v in used.items() if k.startswith("super().") or k not in own}


def test_every_private_name_hf_zero_uses_is_listed_where_it_is_used():
    listed = {i.name: set(i.used_in) for i in INTERNALS}
    assert _private_names_used() == listed


def test_listed_reasons_are_written():
    assert all(i.why and i.owner for i in (*INTERNALS, ACCELERATE_STATE_REWRITE))


def _guards():
    import torch
    import transformers
    from torch.distributed import distributed_c10d

    yield "_set_pg_timeout", lambda: list(inspect.signature(distributed_c10d._set_pg_timeout).parameters) == [
        "timeout", "group"]

    def jinja():
        from jinja2 import TemplateSyntaxError
        from transformers.utils.chat_template_utils import _compile_jinja_template

        _compile_jinja_template("{{ messages }}")
        with pytest.raises(TemplateSyntaxError):
            _compile_jinja_template("{% for %}")
        return True

    yield "_compile_jinja_template", jinja

    def mapping():
        config = transformers.LlamaConfig()
        mapped = transformers.AutoModelForCausalLM._model_mapping
        return type(config) in mapped and mapped[type(config)] is transformers.LlamaForCausalLM

    yield "_model_mapping", mapping
    yield "_no_split_modules", lambda: transformers.LlamaForCausalLM._no_split_modules == ["LlamaDecoderLayer"]
    yield "_name_or_path", lambda: transformers.PretrainedConfig(name_or_path="x")._name_or_path == "x"
    yield "_get_name", lambda: torch.nn.Linear(1, 1)._get_name() == "Linear"
    yield "_NormBase", lambda: all(issubclass(c, torch.nn.modules.batchnorm._NormBase)
                                   for c in (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d, torch.nn.SyncBatchNorm))
    yield "_get_ddp_logging_data", lambda: callable(torch.nn.parallel.DistributedDataParallel._get_ddp_logging_data)

    def tensorboard():
        """The chain launch/worker.py follows from a failing writer thread to the file it was writing."""
        import tempfile
        import threading

        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        with tempfile.TemporaryDirectory() as folder:
            writer = EventFileWriter(folder)
            try:
                threads = [t for t in threading.enumerate() if hasattr(t, "_record_writer")]
                names = {getattr(getattr(t._record_writer, "_writer", None), "filename", None) for t in threads}
                return any(n is not None and os.fsdecode(n).startswith(folder) for n in names)
            finally:
                writer.close()

    yield "_record_writer", tensorboard
    yield "_writer", tensorboard

    def argparse_actions():
        parser = argparse.ArgumentParser()
        action = parser.add_argument("--x")
        group = parser.add_argument_group("G")
        inner = group.add_argument("--y")
        return action in parser._actions and group in parser._action_groups and inner in group._group_actions

    yield "_actions", argparse_actions
    yield "_action_groups", argparse_actions
    yield "_group_actions", argparse_actions

    def accelerate_groups():
        from accelerate.commands.launch import launch_command_parser

        titles = {g.title for g in launch_command_parser()._action_groups}
        return {"DeepSpeed Arguments", "FSDP Arguments"} <= titles

    yield "_action_groups", lambda: argparse_actions() and accelerate_groups()

    def package_probe():
        """core/lean_import.py: transformers decides whether to import peft through this function, with this
        signature and answer."""
        from transformers.utils import import_utils

        params = list(inspect.signature(import_utils._is_package_available).parameters)
        return params == ["pkg_name", "return_version"] and import_utils._is_package_available("peft")[0] is True

    yield "_is_package_available", package_probe

    def ulysses_groups():
        """What train/sequence_parallel.py calls to build its batch adapter around DeepSpeed's Ulysses group."""
        from deepspeed.utils import groups

        return all(callable(getattr(groups, n, None)) for n in (
            "_get_sequence_parallel_world_size", "_get_sequence_parallel_rank", "_get_sequence_parallel_group"))

    def dpo_loss_method():
        """train/preference.py calls DPOTrainer._compute_loss on a _DPOView: it must still read only what the view
        holds, with the same parameters."""
        import re
        from types import SimpleNamespace

        from trl import DPOTrainer

        from hf_zero.train.preference import _DPOView

        method = DPOTrainer._compute_loss
        read = set(re.findall(r"self\.(\w+)", inspect.getsource(method)))
        view = _DPOView(SimpleNamespace(accelerator=None, args=None), SimpleNamespace(beta=0.1, loss_type="sigmoid"),
                        None)
        return list(inspect.signature(method).parameters) == ["self", "model", "inputs", "return_outputs"] \
            and read <= set(vars(view))

    yield "_compute_loss", dpo_loss_method
    yield "_get_sequence_parallel_world_size", ulysses_groups
    yield "_get_sequence_parallel_rank", ulysses_groups
    yield "_get_sequence_parallel_group", ulysses_groups


@pytest.mark.parametrize("name", [i.name for i in INTERNALS if i.name != "_save_checkpoint"])
def test_each_private_name_still_means_what_hf_zero_relies_on(name):
    guards = dict(_guards())
    assert guards[name](), f"{name} changed: see hf_zero/core/internals.py for what relies on it"


def test_accelerate_still_turns_fsdp_on_only_for_gpu_like_backends():
    """The day accelerate honours ACCELERATE_USE_FSDP on a MULTI_CPU state, enable_fsdp_on_cpu can go."""
    from accelerate.state import AcceleratorState
    from transformers import Trainer

    source = inspect.getsource(AcceleratorState.__init__)
    before_fsdp = source[: source.index('os.environ.get("ACCELERATE_USE_FSDP"')]
    backends = before_fsdp[before_fsdp.rindex("elif self.distributed_type in ["):]
    assert "DistributedType.MULTI_GPU" in backends and "MULTI_CPU" not in backends
    assert "self.is_fsdp_enabled = " in inspect.getsource(Trainer)
