"""Recipe arguments: dataclasses documented field by field, parsed by `HfArgumentParser`.

As in TRL (`SFTConfig`), a recipe's own arguments extend `TrainingArguments` (`CurriculumArguments` here,
`ClassificationArguments` for the classifier) and the model's are a separate class (`ModelArguments`, TRL's
`ModelConfig` names). `--config recipe.yaml` sets defaults, command-line flags override them, and an unknown key in
either is a one-line error naming the key (with the closest known key). The YAML's `stages:` list is the one nested
value; it is read into `Stage` objects with the same strictness. The TrainingArguments subclass is built once, in
each rank, after the run plan has settled precision, accumulation and the DeepSpeed config (train/run.py): its
`__post_init__` hands that config to DeepSpeed (arming zero.Init), so it must not be built before.
"""

from __future__ import annotations

import difflib
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path

import yaml
from transformers import TrainingArguments

from hf_zero.core.errors import UserError

__all__ = ["ModelArguments", "CurriculumArguments", "Stage", "parse_recipe_args", "recipe_fields",
           "HF_ZERO_TRAINING_DEFAULTS", "load_yaml_config"]


@dataclass
class ModelArguments:
    """Model and LoRA. LoRA fields use TRL's names so recipes move between TRL and hf_zero unchanged."""

    model_name_or_path: str = field(
        default="tiny-llama",
        metadata={"help": "Local folder, hub id (when online) or offline name: tiny-llama, smollm2-135m-instruct, minilm."},
    )
    tokenizer_name_or_path: str | None = field(default=None, metadata={"help": "Tokenizer if not the model's own."})
    attn_implementation: str | None = field(
        default=None, metadata={"help": "eager, sdpa or flash_attention_2 (GPU only); default: the model's choice."}
    )
    use_peft: bool = field(default=False, metadata={"help": "Train LoRA adapters instead of all weights."})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank; higher = more trainable parameters and memory."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA scaling numerator (scale = alpha / r)."})
    lora_dropout: float = field(default=0.05, metadata={"help": "Dropout on the LoRA input; 0 for exact parity tests."})
    lora_target_modules: list[str] | None = field(
        default=None, metadata={"help": "Module names to adapt (e.g. q_proj v_proj); default: peft's for the model."}
    )


@dataclass
class CurriculumArguments(TrainingArguments):
    """The curriculum recipe's arguments: every TrainingArguments field, then the data shared by all stages (the
    stages themselves come from the YAML's `stages:` list)."""

    max_seq_length: int = field(default=128, metadata={"help": "Tokens per sample unless a stage sets its own."})
    text_field: str = field(default="text", metadata={"help": "Column holding the text in every data file."})
    dataset_format: str = field(
        default="auto",
        metadata={"help": "auto (from the columns), text, prompt_completion or conversational (TRL's formats)."},
    )
    prompt_field: str = field(default="prompt", metadata={"help": "Column holding the prompt (string or messages)."})
    completion_field: str = field(
        default="completion", metadata={"help": "Column holding the completion (string or messages)."}
    )
    messages_field: str = field(
        default="messages", metadata={"help": "Column holding a conversation: a list of {role, content} messages."}
    )
    assistant_only_loss: bool = field(
        default=True, metadata={"help": "Conversations: loss on the assistant replies only (false: every token)."}
    )
    completion_only_loss: bool = field(
        default=True, metadata={"help": "Prompt/completion data: loss on the completion only (false: every token)."}
    )
    chat_template: str | None = field(
        default=None,
        metadata={"help": "A .jinja file, `chatml`, or a model whose template to use; default: the tokenizer's own, "
                          "else ChatML. Saved with the model or adapter."},
    )
    sample_prompts: int = field(
        default=4,
        metadata={"help": "Held-out prompts answered (greedy) at the start and at each stage end, logged to "
                          "samples.jsonl and TensorBoard with exact match (0: none)."},
    )
    sample_max_new_tokens: int = field(default=32, metadata={"help": "Longest generated answer, in tokens."})
    eval_samples: int = field(
        default=32, metadata={"help": "Samples held out per stage for per-stage eval loss/perplexity (0: none)."}
    )
    global_batch_size: int | None = field(
        default=None,
        metadata={"help": "Fix the global batch: gradient accumulation = global / (micro batch x world size)."},
    )
    fresh_start: bool = field(
        default=False, metadata={"help": "Ignore checkpoints in output_dir and start from step 0."}
    )
    packing: bool = field(
        default=False,
        metadata={"help": "Pack each stage's documents whole into rows of max_seq_length tokens (less padding); "
                          "document boundaries are kept (positions restart, no attention or loss across them)."},
    )
    save_final_model: bool = field(
        default=True,
        metadata={"help": "Write the trained model (or LoRA adapter) to output_dir/final and verify it; false for "
                          "benchmarks and sweeps that only need the logs."},
    )
    measure_memory: bool = field(
        default=False,
        metadata={"help": "Write the parameter/gradient/optimizer bytes each rank holds at step 1 to "
                          "output_dir/memory_rank{R}.json (also HF_ZERO_MEASURE_MEMORY=1)."},
    )
    fused_cross_entropy: str | bool = field(
        default="auto",
        metadata={"help": "Training loss without the full logits (chunks of tokens; Liger's kernel on CUDA when "
                          "installed): auto = on for models where it is exact, true = on or an error, false = off."},
    )

    @staticmethod
    def clean_values(values: dict) -> None:
        """Checked and normalized as soon as the YAML and flags are read (parse_recipe_args), so `hf-zero check`
        reports it too: a YAML gives a bool or "auto", a flag a string."""
        value = values.get("fused_cross_entropy", "auto")
        mode = {"true": True, "false": False, "auto": "auto"}.get(value.lower()) if isinstance(value, str) else value
        if mode not in ("auto", True, False):
            raise UserError("fused_cross_entropy", f"{value!r} is not auto, true or false", "e.g. fused_cross_entropy: auto")
        values["fused_cross_entropy"] = mode

    def __post_init__(self):
        values = {"fused_cross_entropy": self.fused_cross_entropy}
        self.clean_values(values)
        self.fused_cross_entropy = values["fused_cross_entropy"]
        super().__post_init__()


@dataclass
class Stage:
    """One curriculum stage. Exactly one of `epochs` / `steps` sets its length."""

    name: str = field(metadata={"help": "Unique stage name; used in logs, TensorBoard tags and summary.json."})
    data: list[str] = field(
        metadata={"help": "One or more data sources: local jsonl/json/csv/parquet/txt, builtin:..., or a hub id."}
    )
    weights: list[float] | None = field(
        default=None, metadata={"help": "Mixture weights, one per data source (normalised); default: equal."}
    )
    epochs: float | None = field(default=None, metadata={"help": "Passes over the stage's data."})
    steps: int | None = field(default=None, metadata={"help": "Optimizer steps in this stage."})
    learning_rate: float | None = field(default=None, metadata={"help": "Peak LR of the stage (default: --learning_rate)."})
    warmup_steps: int = field(default=0, metadata={"help": "Linear warmup at the start of the stage."})
    lr_schedule: str = field(default="cosine", metadata={"help": "Decay within the stage: cosine, linear or constant."})
    min_lr_ratio: float = field(default=0.1, metadata={"help": "LR at the end of the stage, as a fraction of its peak."})
    max_seq_length: int | None = field(default=None, metadata={"help": "Tokens per sample in this stage."})
    eval_data: list[str] | None = field(
        default=None, metadata={"help": "Held-out data of the stage (its first eval_samples rows) instead of a slice "
                                        "of `data`."}
    )

    def __post_init__(self):
        if isinstance(self.data, str):
            self.data = [self.data]
        if isinstance(self.eval_data, str):
            self.eval_data = [self.eval_data]
        where = f"stages[{self.name}]"
        # Numbers first, each named: a word where a number belongs would otherwise fail a comparison below.
        for key, whole in (("steps", True), ("epochs", False), ("learning_rate", False), ("warmup_steps", True),
                           ("min_lr_ratio", False), ("max_seq_length", True)):
            value = getattr(self, key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or whole and not float(value).is_integer()):
                raise UserError(f"{where}.{key}", f"{value!r} is not {'a whole number' if whole else 'a number'}",
                                f"e.g. {key}: {1 if whole else 0.5}")
        for key in ("weights",):
            value = getattr(self, key)
            if value is not None and (not isinstance(value, list)
                                      or any(isinstance(w, bool) or not isinstance(w, (int, float)) for w in value)):
                raise UserError(f"{where}.{key}", f"{value!r} is not a list of numbers", "e.g. weights: [3, 1]")
        if (self.epochs is None) == (self.steps is None):
            raise UserError(f"{where}.steps", "give exactly one of `steps` or `epochs`", "e.g. steps: 10")
        if self.steps is not None and self.steps <= 0 or self.epochs is not None and self.epochs <= 0:
            raise UserError(f"{where}.steps", "must be positive", "e.g. steps: 10 or epochs: 1")
        if self.weights is not None and len(self.weights) != len(self.data):
            raise UserError(f"{where}.weights", f"{len(self.weights)} weights for {len(self.data)} data sources",
                            "give one weight per entry of `data`")
        if self.lr_schedule not in ("cosine", "linear", "constant"):
            raise UserError(f"{where}.lr_schedule", f"unknown schedule {self.lr_schedule!r}", "use cosine, linear or constant")
        from hf_zero.core.validate import positive

        rules = (("learning_rate", self.learning_rate is None or positive(self.learning_rate), "must be a positive "
                  "number", "e.g. learning_rate: 1.0e-4"),
                 ("warmup_steps", self.warmup_steps >= 0, "cannot be negative", "e.g. warmup_steps: 0"),
                 ("min_lr_ratio", 0 <= self.min_lr_ratio <= 1, "must be between 0 and 1", "e.g. min_lr_ratio: 0.1"),
                 ("max_seq_length", self.max_seq_length is None or self.max_seq_length >= 2, "must be at least 2",
                  "e.g. max_seq_length: 128"),
                 ("weights", self.weights is None or (min(self.weights) >= 0 and sum(self.weights) > 0),
                  "must be non-negative with a positive sum", "e.g. weights: [1, 1]"))
        for key, ok, problem, fix in rules:
            if not ok:
                raise UserError(f"{where}.{key}", f"{problem}, got {getattr(self, key)!r}", fix)


# What hf_zero changes in TrainingArguments' defaults (the YAML and flags still override them): per-step loss
# logs for exact stage tables, TensorBoard, and no surprise hub pushes or wandb.
HF_ZERO_TRAINING_DEFAULTS = {
    "logging_steps": 1,
    "report_to": ["tensorboard"],
    "save_strategy": "no",
    "eval_strategy": "no",
    "learning_rate": 1e-3,
    "per_device_train_batch_size": 2,
    "per_device_eval_batch_size": 4,
    "disable_tqdm": None,  # decided at start: a progress bar on a terminal, one line per step in a log file
    "include_num_input_tokens_seen": "non_padding",  # tokens/s in every logging step
    "save_only_model": False,
    "lr_scheduler_type": "constant",
    "warmup_steps": 0,
}


def _unknown_key_error(key: str, known: list[str], where: str) -> UserError:
    close = difflib.get_close_matches(key, known, n=1)
    hint = f"did you mean `{close[0]}`?" if close else "remove it or check the spelling"
    return UserError(key, f"unknown key in {where}", hint)


def load_yaml_config(path: str) -> dict:
    p = Path(path)
    if not p.is_file():
        raise UserError("--config", f"{path} does not exist", "pass a recipe YAML, e.g. recipes/configs/tiny_curriculum.yaml")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise UserError(f"--config {path}{where}", f"not valid YAML: {problem}",
                        "fix the indentation or quoting there") from None
    if not isinstance(data, dict):
        raise UserError("--config", f"{path} must hold a mapping of key: value")
    return data


def build_stage(item: dict, i: int, where: str | None, lines: dict | None = None) -> Stage:
    """Stage(**item), its mistakes located: `(in recipe.yaml line 7)`."""
    from hf_zero.core.validate import at_line

    try:
        return Stage(**item)
    except TypeError as err:  # a value of the wrong kind, e.g. `steps: ten`
        raise UserError(f"stages[{item.get('name', i)}]", f"a value has the wrong type ({str(err).splitlines()[0]}) "
                        f"{at_line(where, lines, f'stages[{i}]')}", "see the README's YAML reference") from None
    except UserError as err:
        key = err.field.rsplit(".", 1)[-1]
        raise UserError(err.field, f"{err.problem} {at_line(where, lines, f'stages[{i}].{key}', f'stages[{i}]')}",
                        err.fix) from None


def parse_stages(raw, where: str, lines: dict | None = None) -> list[Stage]:
    if raw is None:
        return []
    if not isinstance(raw, list) or not raw:
        raise UserError("stages", f"must be a non-empty list in {where}", "see recipes/configs/tiny_curriculum.yaml")
    known = [f.name for f in fields(Stage)]
    stages, seen = [], set()
    for i, item in enumerate(raw):
        if not isinstance(item, dict) or "name" not in item or "data" not in item:
            raise UserError(f"stages[{i}]", "each stage needs at least `name` and `data`", "see the README's YAML reference")
        for key in item:
            if key not in known:
                raise _unknown_key_error(f"stages[{item['name']}].{key}", known, where)
        if item["name"] in seen:
            raise UserError(f"stages[{item['name']}].name", "stage names must be unique", "rename one of them")
        seen.add(item["name"])
        stages.append(build_stage(item, i, where, lines))
    return stages


def parse_recipe_args(dataclass_types: tuple, argv: list[str] | None = None, yaml_values: dict | None = None):
    """Parse `--config YAML` plus flags into the given dataclasses, the last one the recipe's TrainingArguments
    subclass.

    Returns (instances..., stages, training_kwargs, config path): the last class is *not* yet built, only its values
    (checked by its `clean_values`): the run plan decides part of them first, so it is constructed exactly once.
    `yaml_values` replaces the file's content (hf-zero check parses a copy without the keys it already reported);
    paths still resolve against the file.
    """
    from transformers import HfArgumentParser

    argv = list(sys.argv[1:] if argv is None else argv)
    config_path, argv = pop_flag(argv, "--config")
    if yaml_values is None:
        yaml_values = load_yaml_config(config_path) if config_path else {}
    from hf_zero.core.validate import check_values, check_yaml_types, resolve_recipe_paths, yaml_lines

    yaml_values = resolve_recipe_paths(yaml_values, config_path)
    lines = yaml_lines(config_path)
    stages = parse_stages(yaml_values.pop("stages", None), config_path or "the command line", lines)
    yaml_values.pop("recipe", None)  # which recipe the YAML is for: read by the tools (hf_zero.core.shipped), not by it

    class _Parser(HfArgumentParser):
        def error(self, message):
            # "argument --learning_rate: invalid float value: 'x'" -> field --learning_rate, where it came from
            flag, _, problem = message.partition(": ") if message.startswith("argument ") else ("", "", message)
            raise UserError(flag.replace("argument ", "").split("/")[0] or "command line",
                            f"{problem} (on the command line)", "run with --help for the list of flags")

    *model_types, training_type = dataclass_types
    parser = _Parser(dataclass_types)
    _accept_str_or_bool(parser, dataclass_types)
    known = {a.dest for a in parser._actions}
    for key in yaml_values:
        if key not in known:
            raise _unknown_key_error(key, sorted(known), config_path)
    check_yaml_types(parser, yaml_values, config_path, lines)
    defaults = {k: v for k, v in HF_ZERO_TRAINING_DEFAULTS.items() if k in known}
    defaults["output_dir"] = f"runs/{Path(config_path).stem}" if config_path else "runs/default"
    if "ddp_timeout" in known:  # minutes, not torch's 30: a stuck rank fails the run soon (hf_zero/core/distributed.py)
        from hf_zero.core.distributed import dist_timeout

        defaults["ddp_timeout"] = dist_timeout()
    parser.set_defaults(**{**defaults, **yaml_values})
    namespace, remaining = parser.parse_known_args(argv)
    if remaining:
        flag = next((r for r in remaining if r.startswith("-")), remaining[0])
        raise _unknown_key_error(flag, sorted("--" + k for k in known), "the command line")
    values = vars(namespace)
    check_values(values, argv, config_path, lines)
    instances = []
    for dtype in model_types:
        names = {f.name for f in fields(dtype) if f.init}
        instances.append(dtype(**{k: values.pop(k) for k in list(values) if k in names}))
    training_names = {f.name for f in fields(training_type) if f.init}
    training_kwargs = {k: v for k, v in values.items() if k in training_names}
    if hasattr(training_type, "clean_values"):
        training_type.clean_values(training_kwargs)
    return (*instances, stages, training_kwargs, config_path)


def recipe_fields(recipe_type, training_kwargs: dict):
    """The recipe's own values (not TrainingArguments') as attributes, for tools that read a recipe without
    building its TrainingArguments (check, preview, the bench's plan)."""
    from types import SimpleNamespace

    own = {f.name for f in fields(recipe_type)} - {f.name for f in fields(TrainingArguments)}
    return SimpleNamespace(**{k: v for k, v in training_kwargs.items() if k in own})


def _str_or_bool(value: str):
    low = value.lower()
    return {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False}.get(low, value)


def _accept_str_or_bool(parser, dataclass_types) -> None:
    """HfArgumentParser reads a `str | bool` field (e.g. include_num_input_tokens_seen: "non_padding") as a
    bool and rejects its string values; give those flags a type that takes both."""
    import typing

    mixed = set()
    for dtype in dataclass_types:
        hints = typing.get_type_hints(dtype)
        for f in fields(dtype):
            args = set(typing.get_args(hints.get(f.name)))
            if {str, bool} <= args:
                mixed.add(f.name)
    for action in parser._actions:
        if action.dest in mixed:
            action.type = _str_or_bool


def pop_flag(argv: list[str], flag: str) -> tuple[str | None, list[str]]:
    """`flag`'s value (`--flag V` or `--flag=V`, the last one wins as argparse has it) and argv without it: the tools
    read `--config` before the recipe's own parser sees the rest."""
    import argparse

    class _Parser(argparse.ArgumentParser):
        def error(self, message):
            raise UserError(flag, "needs a value", f"{flag} PATH")

    parser = _Parser(add_help=False, allow_abbrev=False)
    parser.add_argument(flag, dest="value")
    namespace, rest = parser.parse_known_args(argv)
    return namespace.value, rest
