"""Sequence parallelism (DeepSpeed Ulysses): one sequence split over `sp_size` ranks, as a profile setting.

A DeepSpeed profile asks for it in accelerate's own `parallelism_config` section (accelerate_configs/zero3_sp.yaml):

    parallelism_config:
      parallelism_config_sp_backend: deepspeed
      parallelism_config_sp_size: 2

The ranks then form world / sp_size data-parallel groups of sp_size ranks each; a group trains one micro-batch at a
time, each rank holding 1/sp_size of its tokens (and of their activations) outside attention. The batch plan counts
data-parallel ranks (world = dp x sp). transformers' Trainer drives it through accelerate's ParallelismConfig
(`sp_backend="deepspeed"`); hf_zero/train/sequence_parallel.py adapts the loss and the batches.

What cannot work is refused here, in one line, before a launch (`hf-zero check`) and at a recipe's start.
FSDP2 + torch context parallelism (`parallelism_config_cp_size`) is refused on CPU: torch's context parallelism
only maps the CUDA flash / memory-efficient SDPA kernels, and the CPU's SDPA op has no sharding rule.
"""

from __future__ import annotations

from hf_zero.core.errors import UserError
from hf_zero.data.model_names import get_model_config

__all__ = ["SP_SECTION", "SP_SIZE_KEY", "sp_size_of", "verify_profile_sp", "verify_sequence_parallel",
           "verify_recipe_sp", "verify_recipe_kind", "parallelism_config", "ULYSSES_ATTENTION"]

SP_SECTION = "parallelism_config"
SP_SIZE_KEY = "parallelism_config_sp_size"
# What DeepSpeed's UlyssesSPAttentionHF can wrap (deepspeed/runtime/sequence_parallel/ulysses_sp.py refuses eager,
# accelerate's DeepSpeedSequenceParallelConfig refuses eager and flex_attention). None: transformers' default, sdpa.
ULYSSES_ATTENTION = ("sdpa", "flash_attention_2", "flash_attention_3")
FLASH = ("flash_attention_2", "flash_attention_3")


def sp_size_of(raw: dict) -> int:
    """The sequence-parallel size a profile YAML asks for (1: none)."""
    section = raw.get(SP_SECTION) or {}
    return int(section.get(SP_SIZE_KEY, 1) or 1) if isinstance(section, dict) else 1


def verify_profile_sp(raw: dict, name: str, gpus: int | None = None) -> None:
    """The profile's own `parallelism_config`: sp_size a positive integer, the DeepSpeed backend, on a DeepSpeed
    profile; torch context parallelism refused where it cannot run."""
    section = raw.get(SP_SECTION) or {}
    if not section:
        return
    where = f"profile {name}: {SP_SECTION}"
    size = section.get(SP_SIZE_KEY, 1)
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise UserError(f"{where}.{SP_SIZE_KEY}", f"{size!r} is not a positive integer", "e.g. 2")
    backend = section.get("parallelism_config_sp_backend", "deepspeed")
    if size > 1 and backend != "deepspeed":
        raise UserError(f"{where}.parallelism_config_sp_backend", f"{backend!r} is not a sequence-parallel backend",
                        "use deepspeed (Ulysses)")
    if size > 1 and str(raw.get("distributed_type")) != "DEEPSPEED":
        raise UserError(f"{where}.{SP_SIZE_KEY}", f"Ulysses sequence parallelism needs a DeepSpeed profile, "
                        f"{name} is {raw.get('distributed_type')}", "start from accelerate_configs/zero3_sp.yaml")
    cp = section.get("parallelism_config_cp_size", 1)
    if cp not in (None, 1):
        if gpus is None:
            import torch  # heavy, and only a profile asking for context parallelism needs it

            gpus = torch.cuda.device_count()
        why = ("needs CUDA: torch's context parallelism maps only the CUDA flash/efficient SDPA kernels"
               if gpus == 0 else "is not offered by hf_zero yet")
        raise UserError(f"{where}.parallelism_config_cp_size", f"{cp}: FSDP2 context parallelism {why}",
                        "use Ulysses instead: parallelism_config_sp_size on a DeepSpeed profile (zero3_sp)")


def verify_sequence_parallel(sp: int, world: int, config=None, lengths=(), attn_implementation=None,
                             packing: bool = False) -> str:
    """What Ulysses cannot run, each one line: sp_size not dividing the world, attention heads (and kv heads) not
    divisible by sp_size, a sequence length not divisible by sp_size, an attention Ulysses cannot wrap, packed rows
    without flash attention. `lengths`: (field, max_seq_length) pairs of the recipe and its stages."""
    if sp <= 1:
        return "off"
    if world % sp:
        raise UserError("sp_size", f"{sp} does not divide the {world} ranks (world = data-parallel x sp_size)",
                        f"launch a multiple of {sp} processes or change parallelism_config_sp_size")
    if config is not None:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = getattr(text, "num_attention_heads", None)
        kv = getattr(text, "num_key_value_heads", None) or heads
        if isinstance(heads, int) and heads % sp:
            raise UserError("sp_size", f"the model's {heads} attention heads do not divide over sp_size {sp} (each "
                            "rank attends with heads / sp_size heads)", "use an sp_size that divides the heads")
        if isinstance(kv, int) and kv % sp and sp % kv:
            raise UserError("sp_size", f"the model's {kv} key/value heads and sp_size {sp}: neither divides the "
                            "other", "use an sp_size that divides the key/value heads, or a multiple of them")
    for field, value in lengths:
        if isinstance(value, int) and value % sp:
            raise UserError(field, f"{value} is not divisible by sp_size {sp} (each rank holds length / sp_size "
                            "tokens)", f"use a multiple of {sp}, e.g. {value - value % sp or sp}")
    if attn_implementation is not None and attn_implementation not in ULYSSES_ATTENTION:
        raise UserError("attn_implementation", f"{attn_implementation} cannot run under Ulysses sequence "
                        "parallelism (it needs the whole attention mask)",
                        f"use one of: {', '.join(ULYSSES_ATTENTION)}")
    if packing and attn_implementation not in FLASH:
        raise UserError("packing", "packed rows under sequence parallelism need flash attention: Ulysses drops the "
                        "block-diagonal mask sdpa uses, so documents would attend across their boundaries",
                        "set packing: false, or attn_implementation: flash_attention_2 on GPUs")
    return f"Ulysses over {sp} ranks: {world // sp} data-parallel group(s) of {sp}"


def verify_recipe_sp(sp: int, world: int, model_args, training_kwargs: dict, stages) -> str:
    """verify_sequence_parallel for a recipe: its model's config, its lengths (recipe and stages), attention and
    packing."""
    if sp <= 1:
        return "off"
    config = None
    if model_args is not None and getattr(model_args, "model_name_or_path", None):
        config = get_model_config(model_args.model_name_or_path)
    lengths = [("max_seq_length", training_kwargs.get("max_seq_length")),
               *((f"stages[{s.name}].max_seq_length", s.max_seq_length) for s in stages or [])]
    return verify_sequence_parallel(sp, world, config, lengths, getattr(model_args, "attn_implementation", None),
                                    bool(training_kwargs.get("packing")))


def verify_recipe_kind(sp: int, arguments_class) -> None:
    """Ulysses splits token sequences with per-token labels: the causal-LM recipe's. A classifier's one label per
    sample would fail inside DeepSpeed's batch adapter after the launch."""
    from hf_zero.plan.arguments import CurriculumArguments

    if sp > 1 and not issubclass(arguments_class, CurriculumArguments):
        raise UserError("profile", "sequence parallelism (parallelism_config_sp_size > 1) runs the causal-LM recipe "
                        f"(curriculum.py) only, not one whose arguments are {arguments_class.__name__}",
                        "use a profile without parallelism_config_sp_size")


def parallelism_config(sp: int, attn_implementation: str | None = None):
    """accelerate's ParallelismConfig for TrainingArguments (None without SP). Variable lengths: each micro-batch is
    padded only to the longest in its SP group (hf_zero/train/sequence_parallel.py)."""
    if sp <= 1:
        return None
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DeepSpeedSequenceParallelConfig

    handler = DeepSpeedSequenceParallelConfig(sp_seq_length_is_variable=True,
                                              sp_attn_implementation=attn_implementation or "sdpa")
    return ParallelismConfig(sp_backend="deepspeed", sp_size=sp, sp_handler=handler)
