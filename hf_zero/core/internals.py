"""Every place hf_zero reaches into a library's private names (a leading underscore), in one list: what it uses,
where, and why no public API does. tests/test_library_internals.py guards each entry, so that a library upgrade
that renames or reshapes one fails there, loudly, instead of in a run; and it fails on any private name used in
hf_zero/ that is not listed here.

Not a private name, but the same kind of reach: `enable_fsdp_on_cpu` (train/fsdp.py) rewrites accelerate's state
(distributed_type, fsdp_plugin) and the Trainer's `is_fsdp_enabled`, because accelerate 1.15 turns FSDP on only for
GPU-like backends; its guard checks that accelerate still does so (the rewrite can go the day it does not).
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Internal", "INTERNALS", "ACCELERATE_STATE_REWRITE"]


@dataclass(frozen=True)
class Internal:
    name: str = field(metadata={"help": "the private name (attribute, function or class)"})
    owner: str = field(metadata={"help": "the library object it belongs to"})
    used_in: tuple[str, ...] = field(metadata={"help": "hf_zero's modules that use it, relative to hf_zero/"})
    why: str = field(metadata={"help": "what it gives that no public API does"})


INTERNALS: tuple[Internal, ...] = (
    Internal("_save_checkpoint", "transformers.Trainer", ("checkpoint/staging.py",),
             "the only point between 'every rank wrote its files' and 'the folder is visible': crash-safe checkpoints"
             " (also guarded by tests/checkpoint/test_trainer_hooks.py)"),
    Internal("_set_pg_timeout", "torch.distributed.distributed_c10d", ("core/distributed.py",),
             "accelerate creates the CPU process group without a timeout and DeepSpeed ignores its own once a group "
             "exists; torch has no public setter for an existing group's timeout"),
    Internal("_compile_jinja_template", "transformers.utils.chat_template_utils", ("data/chat_template.py",),
             "compiles a chat template exactly as apply_chat_template will, so a broken template is one line before "
             "any data is tokenized"),
    Internal("_model_mapping", "transformers auto classes (AutoModelForCausalLM, ...)",
             ("estimate/model_count.py", "train/classifier.py"),
             "which model class a config maps to, without building the model (from_config would allocate it)"),
    Internal("_no_split_modules", "transformers.PreTrainedModel", ("plan/fsdp.py", "train/composed.py"),
             "the layer classes accelerate wraps for FSDP2 when the profile names none: read the same attribute "
             "accelerate reads (a composed multimodal model answers it with its LLM's)"),
    Internal("_name_or_path", "transformers.PretrainedConfig", ("checkpoint/write.py",),
             "where the base model resolved on this machine, recorded in the checkpoint's metadata"),
    Internal("_get_name", "torch.nn.Module", ("train/fused_ce.py",),
             "the model's class name as torch prints it, matched against transformers' causal-LM class names"),
    Internal("_NormBase", "torch.nn.modules.batchnorm", ("train/classifier.py",),
             "the base class of every BatchNorm variant, whose running statistics are per rank under DeepSpeed"),
    Internal("_get_ddp_logging_data", "torch.nn.parallel.DistributedDataParallel", ("train/bench_probe.py",),
             "the size of DDP's gradient buckets (a second copy of every gradient), for the bench's memory account"),
    Internal("_record_writer", "torch.utils.tensorboard.SummaryWriter's writer thread", ("launch/worker.py",),
             "the file a failing TensorBoard thread was writing, so a full disk is one line naming it"),
    Internal("_writer", "torch.utils.tensorboard's record writer", ("launch/worker.py",),
             "(with _record_writer) the file a failing TensorBoard thread was writing"),
    Internal("_actions", "argparse.ArgumentParser (HfArgumentParser)", ("core/validate.py", "plan/parse.py"),
             "the recipe's flags and their types, to check YAML keys and values as the command line would be"),
    Internal("_action_groups", "argparse.ArgumentParser (accelerate's launch parser)", ("preflight/check_rules.py",),
             "the keys accelerate understands under deepspeed_config: / fsdp_config:, read from its own parser"),
    Internal("_group_actions", "argparse's argument group", ("preflight/check_rules.py",),
             "(with _action_groups) the arguments of one group of accelerate's launch parser"),
    Internal("_is_package_available", "transformers.utils.import_utils", ("core/lean_import.py",),
             "the one place transformers asks whether peft is installed: told no while TrainingArguments and the "
             "Trainer load, it skips the peft import (~4 s in the launcher, ~1 s in a rank) no full fine-tune uses"),
    Internal("_get_sequence_parallel_world_size", "deepspeed.utils.groups", ("train/sequence_parallel.py",),
             "the Ulysses group DeepSpeed set up for the Trainer: hf_zero rebuilds the Trainer's batch adapter around "
             "it (equal-length batches for gloo, the resume skip) and has no public handle on the group"),
    Internal("_get_sequence_parallel_rank", "deepspeed.utils.groups", ("train/sequence_parallel.py",),
             "(with _get_sequence_parallel_world_size) this rank's place in its Ulysses group"),
    Internal("_get_sequence_parallel_group", "deepspeed.utils.groups", ("train/sequence_parallel.py",),
             "(with _get_sequence_parallel_world_size) the process group the adapter gathers batches over"),
    Internal("_compute_loss", "trl.DPOTrainer (trl 1.16)", ("train/preference.py",),
             "TRL 1.16 writes the DPO losses (sigmoid, ipo) and their reward metrics inside this method, with no "
             "function of its own: a dpo stage calls it on a view of the attributes it reads, so the loss is TRL's, "
             "not a copy"),
)

ACCELERATE_STATE_REWRITE = Internal(
    "AcceleratorState.distributed_type / fsdp_plugin, Trainer.is_fsdp_enabled", "accelerate, transformers",
    ("train/fsdp.py",), "accelerate 1.15 honours ACCELERATE_USE_FSDP only for GPU-like backends: on CPU it would "
    "train plain DDP under an FSDP profile")
