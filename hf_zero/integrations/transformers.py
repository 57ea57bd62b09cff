"""transformers' private names hf_zero reads or writes (entries in registry.py)."""

from __future__ import annotations

__all__ = ["attn_implementation", "set_attn_implementation", "model_mapping", "no_split_modules",
           "config_name_or_path", "compile_chat_template", "add_to_embeddings_without_images", "without_zero3_init"]


def attn_implementation(config) -> str | None:
    """The attention kernel a model built from `config` uses ("sdpa", "eager", ...), None if the config has none.

    Reads PretrainedConfig._attn_implementation (transformers 5.23.0): the model sets it when it resolves the kernel
    and there is no public getter. Can go when PretrainedConfig exposes attn_implementation publicly."""
    return getattr(config, "_attn_implementation", None)


def set_attn_implementation(config, value: str) -> None:
    """Build models from `config` with the attention kernel `value`.

    Writes PretrainedConfig._attn_implementation (transformers 5.23.0): AutoModelFor*.from_config takes no
    attn_implementation for every model class (a classifier's image models among them), the config's attribute is
    what they all read. Can go with attn_implementation."""
    config._attn_implementation = value


def model_mapping(auto):
    """`auto`'s config class -> model class mapping (an AutoModelFor* class), to pick a model class without building
    the model (from_config would allocate it, and partition it under zero.Init).

    The auto classes' _model_mapping (transformers 5.23.0); can go when they offer a public config -> class lookup."""
    return auto._model_mapping


def no_split_modules(model) -> list | None:
    """The layer classes `model` says must not be split (what accelerate wraps for FSDP2), None if it says none.

    PreTrainedModel._no_split_modules (transformers 5.23.0, read by accelerate 1.15.0 the same way); can go when
    accelerate's FSDP2 auto-wrap reads a public attribute. A composed model answers it for its LLM
    (train/composed.py defines the property, as transformers' models do: the contract, not a reach)."""
    return getattr(model, "_no_split_modules", None)


def config_name_or_path(config) -> str | None:
    """Where the model of `config` was loaded from on this machine (PretrainedConfig._name_or_path, transformers
    5.23.0), None without a config; can go when the config exposes it publicly."""
    return getattr(config, "_name_or_path", None)


def compile_chat_template(template: str):
    """Compile `template` exactly as apply_chat_template will (a jinja2 TemplateSyntaxError if it does not parse).

    transformers.utils.chat_template_utils._compile_jinja_template (transformers 5.23.0); can go when transformers
    offers a public template validator."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    return _compile_jinja_template(template)


def add_to_embeddings_without_images(model, extra) -> None:
    """Every forward of `model` (a vision-language model instance) without `pixel_values` that computes a loss adds
    `extra(model)` (hf_zero.train.vlm: the vision tower's output on a blank image, x 0) to the input embeddings,
    right after they are computed: where an image batch runs the vision tower and scatters its output into them
    (Qwen2-VL's and Idefics3's forward embed the tokens, then encode the images). So ZeRO-3's and FSDP2's gathering
    meets the same modules in the same order on every rank, and backward takes the same path (the language model's
    input needs a gradient in both); x + 0 is x, the loss is unchanged to the bit. The instance's forward is
    replaced to know whether the batch has images (transformers' VLM forward skips the vision tower when it has
    none, and takes no hook for it); can go when transformers' VLMs can run the vision tower on image-free
    batches."""
    original, state = model.forward, {}

    def after_embeddings(module, args, output):
        if state.pop("armed", False):
            return output + extra(model).to(output.dtype)
        return None

    def forward(*args, **kwargs):
        if "hooked" not in state:  # at the first forward: after the engine's own hooks (ZeRO-3 releases and
            # prefetches in its post-forward hook; running the vision tower before it changes what it gathers)
            state["hooked"] = model.get_input_embeddings().register_forward_hook(after_embeddings)
        state["armed"] = kwargs.get("pixel_values") is None and kwargs.get("labels") is not None
        try:
            return original(*args, **kwargs)
        finally:
            state.pop("armed", None)

    model.forward = forward


def without_zero3_init():
    """A context in which transformers builds models without deepspeed.zero.Init even where ZeRO-3 is armed (a
    rank's TrainingArguments): for the meta-device models hf_zero counts, whose composite classes (vision-language
    models) build their parts with from_config inside their own __init__. transformers.modeling_utils.set_zero3_state
    is the flag transformers itself sets while zero.Init is active, to skip nested ones (transformers 5.23.0)."""
    from transformers.modeling_utils import set_zero3_state

    return set_zero3_state()
