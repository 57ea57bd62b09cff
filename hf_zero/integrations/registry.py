"""The room's index: every place hf_zero reaches into a library, with what it uses, where, why no public API does,
the versions it was checked against, and when it can go.

INTERNALS lists the private names (a leading underscore) hf_zero reads or writes; PATCHES the library objects it
changes at run time by a public name (a function swapped, an attribute set on a library's module, class or object).
tests/test_library_internals.py guards each entry, so that a library upgrade that renames or reshapes one fails
there, loudly, instead of in a run; it fails on any private name or patch in hf_zero/ that is not listed here, on
any that lives outside hf_zero/integrations/ and is not on its list of reaches still to move, and on any entry
without its reason, versions and end.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Reach", "Internal", "INTERNALS", "PATCHES", "ACCELERATE_STATE_REWRITE", "CHECKED"]

# The versions every entry was last checked against (.venv of 2026-11-27).
TORCH, TRANSFORMERS, ACCELERATE = "torch 2.13.0", "transformers 5.23.0", "accelerate 1.15.0"
DEEPSPEED, PEFT, TRL = "deepspeed 0.19.8", "peft 0.21.2", "trl 1.16.0"
BNB, GGUF = "bitsandbytes 0.50.2", "gguf 0.19.0"
HUB, TENSORBOARD = "huggingface_hub (with transformers 5.23.0)", "tensorboard (with torch 2.13.0)"
PYTHON = "Python 3.11"
CHECKED = (TORCH, TRANSFORMERS, ACCELERATE, DEEPSPEED, PEFT, TRL, BNB, GGUF)


@dataclass(frozen=True)
class Reach:
    name: str = field(metadata={"help": "the private name, or the patched attribute (attribute, function or class)"})
    owner: str = field(metadata={"help": "the library object it belongs to"})
    used_in: tuple[str, ...] = field(metadata={"help": "hf_zero's modules that use it, relative to hf_zero/"})
    why: str = field(metadata={"help": "what it gives that no public API does"})
    versions: str = field(default="", metadata={"help": "the library versions it was checked against"})
    until: str = field(default="", metadata={"help": "when it can go: the upstream issue, PR, version or API"})


Internal = Reach  # the name tests and older notes use for a private-name entry

INTERNALS: tuple[Reach, ...] = (
    Reach("_save_checkpoint", "transformers.Trainer", ("checkpoint/staging.py",),
          "the only point between 'every rank wrote its files' and 'the folder is visible': crash-safe checkpoints"
          " (also guarded by tests/checkpoint/test_trainer_hooks.py)", TRANSFORMERS,
          "when the Trainer offers a public hook after all ranks saved and before the folder is final"),
    Reach("_set_pg_timeout", "torch.distributed.distributed_c10d", ("integrations/torch.py",),
          "accelerate creates the CPU process group without a timeout and DeepSpeed ignores its own once a group "
          "exists; torch has no public setter for an existing group's timeout", f"{TORCH}, {ACCELERATE}",
          "when accelerate passes InitProcessGroupKwargs' timeout to the gloo group, or torch offers a public setter"),
    Reach("_compile_jinja_template", "transformers.utils.chat_template_utils", ("integrations/transformers.py",),
          "compiles a chat template exactly as apply_chat_template will, so a broken template is one line before "
          "any data is tokenized", TRANSFORMERS, "when transformers offers a public template validator"),
    Reach("_model_mapping", "transformers auto classes (AutoModelForCausalLM, ...)",
          ("integrations/transformers.py", "train/composed_count.py"),
          "which model class a config maps to, without building the model (from_config would allocate it)",
          TRANSFORMERS, "when the auto classes offer a public config -> class lookup"),
    Reach("_no_split_modules", "transformers.PreTrainedModel", ("integrations/transformers.py",),
          "the layer classes accelerate wraps for FSDP2 when the profile names none: read the same attribute "
          "accelerate reads (a composed multimodal model answers it with its LLM's)", f"{TRANSFORMERS}, {ACCELERATE}",
          "when accelerate's FSDP2 auto-wrap reads a public attribute or function"),
    Reach("_name_or_path", "transformers.PretrainedConfig", ("integrations/transformers.py",),
          "where the base model resolved on this machine, recorded in the checkpoint's metadata", TRANSFORMERS,
          "when PretrainedConfig exposes name_or_path as a public attribute (its property reads this one)"),
    Reach("_get_name", "torch.nn.Module", ("integrations/torch.py",),
          "the model's class name as torch prints it, matched against transformers' causal-LM class names", TORCH,
          "replaceable today by type(model).__name__ for plain models; kept while wrapped models print theirs"),
    Reach("_NormBase", "torch.nn.modules.batchnorm", ("integrations/torch.py",),
          "the base class of every BatchNorm variant, whose running statistics are per rank under DeepSpeed", TORCH,
          "when torch exports a public base class of its batch norms"),
    Reach("_get_ddp_logging_data", "torch.nn.parallel.DistributedDataParallel", ("integrations/torch.py",),
          "the size of DDP's gradient buckets (a second copy of every gradient), for the bench's memory account",
          TORCH, "when DDP reports its bucket sizes publicly"),
    Reach("_record_writer", "torch.utils.tensorboard.SummaryWriter's writer thread", ("integrations/torch.py",),
          "the file a failing TensorBoard thread was writing, so a full disk is one line naming it", TENSORBOARD,
          "when tensorboard's writer thread names its file in the error it raises"),
    Reach("_writer", "torch.utils.tensorboard's record writer", ("integrations/torch.py",),
          "(with _record_writer) the file a failing TensorBoard thread was writing", TENSORBOARD,
          "with _record_writer"),
    Reach("_actions", "argparse.ArgumentParser (HfArgumentParser)", ("integrations/parsers.py",),
          "the recipe's flags and their types, to check YAML keys and values as the command line would be",
          f"{PYTHON}, {TRANSFORMERS}", "when argparse offers a public list of a parser's actions"),
    Reach("_action_groups", "argparse.ArgumentParser (accelerate's launch parser)", ("integrations/parsers.py",),
          "the keys accelerate understands under deepspeed_config: / fsdp_config:, read from its own parser",
          f"{PYTHON}, {ACCELERATE}", "when accelerate publishes the keys its config sections accept"),
    Reach("_group_actions", "argparse's argument group", ("integrations/parsers.py",),
          "(with _action_groups) the arguments of one group of accelerate's launch parser", PYTHON,
          "with _action_groups"),
    Reach("_is_package_available", "transformers.utils.import_utils", ("integrations/lean_import.py",),
          "the one place transformers asks whether peft is installed: told no while TrainingArguments and the "
          "Trainer load, it skips the peft import (~4 s in the launcher, ~1 s in a rank) no full fine-tune uses",
          TRANSFORMERS, "when transformers imports peft lazily (weighed: 3-4 s of a 10 s start-up in the launcher)"),
    Reach("_get_sequence_parallel_world_size", "deepspeed.utils.groups", ("integrations/deepspeed.py",),
          "the Ulysses group DeepSpeed set up for the Trainer: hf_zero rebuilds the Trainer's batch adapter around "
          "it (equal-length batches for gloo, the resume skip) and has no public handle on the group",
          f"{DEEPSPEED}, {ACCELERATE}", "when accelerate's Ulysses adapter pads group batches and skips on resume"),
    Reach("_get_sequence_parallel_rank", "deepspeed.utils.groups", ("integrations/deepspeed.py",),
          "(with _get_sequence_parallel_world_size) this rank's place in its Ulysses group", DEEPSPEED,
          "with _get_sequence_parallel_world_size"),
    Reach("_get_sequence_parallel_group", "deepspeed.utils.groups", ("integrations/deepspeed.py",),
          "(with _get_sequence_parallel_world_size) the process group the adapter gathers batches over", DEEPSPEED,
          "with _get_sequence_parallel_world_size"),
    Reach("_compute_loss", "trl.DPOTrainer (trl 1.16)", ("integrations/trl.py",),
          "TRL 1.16 writes the DPO losses (sigmoid, ipo) and their reward metrics inside this method, with no "
          "function of its own: a dpo stage calls it on a view of the attributes it reads, so the loss is TRL's, "
          "not a copy", TRL, "when TRL exposes its DPO losses as functions"),
    Reach("_base", "torch.Tensor", ("integrations/torch.py",),
          "the storage a saved activation views, so that the bytes autograd keeps for a composed model's encoders "
          "and a VLM's vision tower are counted once per storage, and the recorder of a run's saved bytes leaves a "
          "weight saved as a view (a linear's `weight.t()`) out of the activations", TORCH,
          "when torch.Tensor exposes the viewed base publicly"),
    Reach("_get_metadata_path", "torch.distributed.checkpoint.filesystem.FileSystemReader", ("integrations/torch.py",),
          "the `.metadata` file DCP is about to unpickle with plain pickle, checked first under the safe-load guard",
          TORCH, "with the read_metadata wrap: when torch reads DCP metadata with a restricted unpickler"),
    Reach("_last_lr", "torch.optim.lr_scheduler.LRScheduler", ("integrations/torch.py",),
          "the LR a resumed scheduler reports (get_last_lr) and the Trainer logs: set with the new base LRs when a "
          "resume changes the stages' LR or the checkpoint has another number of param groups", TORCH,
          "when LRScheduler offers a public way to re-base a loaded scheduler"),
    Reach("_attn_implementation", "transformers.PretrainedConfig",
          ("integrations/transformers.py",),
          "the attention kernel a model was built with (read by Ulysses, the activation estimate and the bench), "
          "and the one a classifier is built with (set before from_config, which takes no attn_implementation for "
          "every model class)", TRANSFORMERS, "when PretrainedConfig exposes attn_implementation publicly"),
)

# Changes to library objects made by a public name. `name` is the attribute hf_zero assigns.
PATCHES: tuple[Reach, ...] = (
    Reach("load", "torch (torch.load, torch.serialization.load)", ("integrations/torch.py",),
          "for a resume, an export or a conversion, every torch.load in the process reads weights-only and names "
          "the file it refuses; restored on exit", TORCH, "when torch.load defaults to weights_only everywhere "
          "(torch 2.6 did) and names the refused file in its error"),
    Reach("read_metadata", "torch.distributed.checkpoint.filesystem.FileSystemReader", ("integrations/torch.py",),
          "DCP reads `.metadata` with plain pickle.load: under the guard it unpickles with the weights-only rules",
          TORCH, "when torch's FileSystemReader reads its metadata with a restricted unpickler"),
    Reach("PeftModel, PeftMixedModel", "transformers.trainer_utils, transformers.trainer",
          ("integrations/lean_import.py",),
          "stand-in classes while peft is hidden from transformers' import (with _is_package_available), and "
          "is_peft_available.cache_clear() after", TRANSFORMERS, "with _is_package_available"),
    Reach("free_grad_in_param_list", "DeepSpeed's ZeRO-1/2 optimizer (instance)", ("integrations/deepspeed.py",),
          "a memory snapshot just before ZeRO frees the source gradients; restored after the measured step",
          DEEPSPEED, "when DeepSpeed offers a hook before it frees the gradients"),
    Reach("GGUFReader, get_tensor_name_map", "gguf", ("integrations/gguf.py",),
          "one reader per GGUF file and a cached name map while transformers converts SmolLM2's GGUF (it opens the "
          "file three times); restored on exit", f"{GGUF}, {TRANSFORMERS}",
          "when transformers' GGUF loader opens a file once"),
    Reach("HF_HUB_OFFLINE", "huggingface_hub.constants", ("integrations/huggingface_hub.py",),
          "offline for the rest of the process once the hub is unreachable (read at each call by huggingface_hub "
          "and transformers), instead of a timeout per call", HUB, "when huggingface_hub fails fast when offline"),
    Reach("forward", "the model's LM head (torch.nn.Linear instance)", ("integrations/torch.py",),
          "for one forward the head returns the fused cross-entropy instead of the logits; restored on exit",
          f"{TORCH}, {TRANSFORMERS}", "when transformers' causal-LM models accept a loss kernel for their head"),
    Reach("save_pretrained", "peft.PeftModel (instance)", ("integrations/peft.py",),
          "every save of a LoRA model with new token rows includes the embedding layers (peft decides from a config "
          "it may not reach offline)", PEFT, "when peft's save_embedding_layers='auto' compares vocab sizes locally"),
    Reach("support_avx512bf16_for_cpu", "bitsandbytes Linear4bit (instance)", ("integrations/bitsandbytes.py",),
          "bitsandbytes repacks a 4-bit weight for its AVX512-BF16 kernel at an eval forward and breaks training's "
          "shapes and checkpoints: a trained model keeps its storage layout", BNB,
          "when bitsandbytes repacks only in inference mode"),
    Reach("forward", "a vision-language model (transformers PreTrainedModel instance)",
          ("integrations/transformers.py",),
          "a batch without images still runs the vision tower on a blank image (x 0, the loss unchanged): under "
          "ZeRO-3 and FSDP2 a rank that skipped it while another ran it would hang in the parameter gathering",
          TRANSFORMERS, "when transformers' VLMs can run the vision tower on image-free batches"),
    Reach("sp_attn_implementation", "accelerate's ParallelismConfig.sp_handler", ("integrations/accelerate.py",),
          "Ulysses wraps the attention the model really uses (DeepSpeed compares the two names)",
          f"{ACCELERATE}, {DEEPSPEED}", "when accelerate reads the model's attention itself"),
    Reach("module_state_dict", "DeepSpeed's engine (instance)", ("integrations/deepspeed.py",),
          "while a LoRA checkpoint is saved, exclude_frozen_parameters leaves out every name of a tied frozen weight, "
          "not only the first (DeepSpeed keeps the tied lm_head); the class's method again after",
          DEEPSPEED, "when DeepSpeed's module_state_dict drops every name of an excluded parameter"),
    Reach("type", "argparse actions of transformers' HfArgumentParser", ("integrations/parsers.py",),
          "a field typed `str | bool` takes `true`/`false` as booleans and anything else as text; HfArgumentParser "
          "reads such a field as a bool and refuses its words", f"{PYTHON}, {TRANSFORMERS}",
          "when HfArgumentParser parses Union[str, bool] fields"),
    Reach("fp32_partitioned_groups_flat (optimizer state, param_groups)", "DeepSpeed's ZeRO-3 optimizer",
          ("train/callbacks.py",), "after a universal-checkpoint resume under ZeRO-3, each group's Adam step is "
          "its own tensor again and the groups' hyper-parameters are the saved ones (~2e-4 loss drift otherwise); "
          "changed in place, no assignment", DEEPSPEED,
          "when DeepSpeed's universal loading restores per-group steps and hyper-parameters under ZeRO-3"),
    Reach("UlyssesSPDataLoaderAdapter (subclassed)", "deepspeed.runtime.sequence_parallel.ulysses_sp",
          ("train/sequence_parallel.py",), "accelerate's Ulysses batch adapter replaced by one that pads each group's "
          "batches to one length (gloo) and skips what a resumed run trained", f"{DEEPSPEED}, {ACCELERATE}",
          "when accelerate's adapter pads group batches and skips on resume"),
    Reach("distributed_type, fsdp_plugin, is_fsdp_enabled", "accelerate.AcceleratorState, transformers.Trainer",
          ("integrations/accelerate.py",), "accelerate 1.15 honours ACCELERATE_USE_FSDP only for GPU-like "
          "backends: on CPU it would train plain DDP under an FSDP profile", f"{ACCELERATE}, {TRANSFORMERS}",
          "the day accelerate honours ACCELERATE_USE_FSDP on a MULTI_CPU state"),
)

ACCELERATE_STATE_REWRITE = PATCHES[-1]
