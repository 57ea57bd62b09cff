"""The recipes' argument classes moved from core/ (core/config.py, core/multimodal_args.py) and
data/classification.py to plan/arguments.py. A checkpoint written before the move records training_args.bin's class
under its old module; hf_zero's allowlisted loader still reads it, as the class it is now."""

import pytest
import torch

import hf_zero.core.config as core_config
from hf_zero.checkpoint.safe_load import safe_load
from hf_zero.plan.arguments import CurriculumArguments


@pytest.fixture
def written_before_the_move(tmp_path, monkeypatch):
    """training_args.bin as a run before the move wrote it: the class pickled as hf_zero.core.config's."""
    args = CurriculumArguments(output_dir=str(tmp_path / "run"), use_cpu=True, max_seq_length=96)
    with monkeypatch.context() as m:
        m.setattr(CurriculumArguments, "__module__", "hf_zero.core.config")
        m.setattr(core_config, "CurriculumArguments", CurriculumArguments, raising=False)
        path = tmp_path / "training_args.bin"
        torch.save(args, path)
    assert not hasattr(core_config, "CurriculumArguments")  # the move as it stands: core has no such class
    assert b"hf_zero.core.config" in path.read_bytes()
    return path


def test_training_args_pickled_under_the_old_module_still_load(written_before_the_move):
    loaded = safe_load(written_before_the_move)
    assert type(loaded) is CurriculumArguments and loaded.max_seq_length == 96
