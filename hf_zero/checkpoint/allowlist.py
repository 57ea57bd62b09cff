"""What a checkpoint may unpickle beyond torch's own defaults (tensors, containers, dtypes): the types DeepSpeed, the
Trainer, accelerate and torch's distributed checkpoint write into checkpoints of the zero1/2/3, fsdp2 and ddp
profiles (found with torch.serialization.get_unsafe_globals_in_checkpoint on real ones; tests/checkpoint/
test_safe_load.py loads every file of a real checkpoint with it). hf_zero.checkpoint.safe_load enforces it."""

from __future__ import annotations

import importlib

__all__ = ["ALLOWED", "allowed_globals"]

# "module.name" of every type a checkpoint may hold beyond torch's own defaults (tensors, containers, dtypes).
ALLOWED = (
    # DeepSpeed optimizer shards (ZeRO-1/2/3) and universal checkpoints
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.utils.tensor_fragment.fragment_address",
    # the Trainer's rng_state*.pth (numpy's RNG state), as transformers.trainer_pt_utils.safe_globals allows
    "numpy._core.multiarray._reconstruct",
    "numpy.ndarray",
    "numpy.dtype",
    "numpy.dtypes.UInt32DType",
    # training_args.bin: the recipes' TrainingArguments and what they hold (under their names before the move to
    # plan/arguments.py too: a checkpoint written then records those, _MOVED)
    "hf_zero.plan.arguments.CurriculumArguments",
    "hf_zero.plan.arguments.ClassificationArguments",
    "hf_zero.plan.arguments.MultimodalArguments",
    "hf_zero.plan.vlm_args.VlmArguments",
    "hf_zero.core.config.CurriculumArguments",
    "hf_zero.data.classification.ClassificationArguments",
    "hf_zero.core.multimodal_args.MultimodalArguments",
    "transformers.training_args.OptimizerNames",
    "transformers.trainer_utils.SchedulerType",
    "transformers.trainer_utils.SaveStrategy",
    "transformers.trainer_utils.IntervalStrategy",
    "transformers.trainer_utils.HubStrategy",
    "transformers.trainer_pt_utils.AcceleratorConfig",
    "transformers.integrations.deepspeed.HfDeepSpeedConfig",
    "transformers.integrations.deepspeed.HfTrainerDeepSpeedConfig",
    "accelerate.state.PartialState",
    "accelerate.utils.dataclasses.DistributedType",
    "accelerate.utils.dataclasses.DeepSpeedPlugin",
    # sequence parallelism (zero3_sp): TrainingArguments.parallelism_config
    "accelerate.parallelism_config.ParallelismConfig",
    "accelerate.utils.dataclasses.DeepSpeedSequenceParallelConfig",
    # torch distributed checkpoint (FSDP2): the .metadata file, read by torch with plain pickle
    "torch.distributed.checkpoint.metadata.Metadata",
    "torch.distributed.checkpoint.metadata.MetadataIndex",
    "torch.distributed.checkpoint.metadata.StorageMeta",
    "torch.distributed.checkpoint.metadata.TensorProperties",
    "torch.distributed.checkpoint.metadata.TensorStorageMetadata",
    "torch.distributed.checkpoint.metadata.BytesStorageMetadata",
    "torch.distributed.checkpoint.metadata.ChunkStorageMetadata",
    "torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING",
    "torch.distributed.checkpoint.filesystem._StorageInfo",
    "torch.serialization._get_layout",
    "torch.Size",
    "pathlib.PosixPath",
)


_MOVED = {f"hf_zero.{old}.{cls}": f"hf_zero.plan.arguments.{cls}" for old, cls in (
    ("core.config", "CurriculumArguments"), ("data.classification", "ClassificationArguments"),
    ("core.multimodal_args", "MultimodalArguments"))}


def _resolve(name: str):
    module, attr = _MOVED.get(name, name).rsplit(".", 1)
    return getattr(importlib.import_module(module), attr)


def allowed_globals() -> list:
    """The allowlisted objects, each under the name checkpoints record it by (numpy's moved modules included)."""
    return [(_resolve(name), name) for name in ALLOWED]
