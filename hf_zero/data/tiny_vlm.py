"""hf_zero's tiny stock vision-language models, built offline from transformers' own config and processor classes:

- `hf-zero/tiny-qwen2-vl`: Qwen2-VL (`Qwen2VLForConditionalGeneration`: a 1-layer vision tower whose `merger` is its
  projector, a 2-layer Qwen2 language model with multimodal RoPE) and `Qwen2VLProcessor` (its PIL image processor,
  16 x 16 pixels by default: 4 image tokens).
- `hf-zero/tiny-smolvlm`: SmolVLM as SmolVLM-256M is built (`Idefics3ForConditionalGeneration`: a 1-layer SigLIP-style
  vision tower, the pixel-shuffle `connector`, a 2-layer Llama) and `Idefics3Processor` (16 x 16 tiles, no splitting:
  4 image tokens).
- `hf-zero/tiny-llava`: LLaVA-1.5 as llava-hf builds it (`LlavaForConditionalGeneration`: a 1-layer CLIP vision tower,
  the MLP `multi_modal_projector`, a 2-layer Llama; the last layer's patches, CLS dropped) and `LlavaProcessor`
  (images resized and cropped to 8 x 8: 2 x 2 patches, 4 image tokens).
- `hf-zero/tiny-qwen3-vl`: Qwen3-VL (`Qwen3VLForConditionalGeneration`: a 2-layer vision tower with learned,
  interpolated positions, its `merger` and one DeepStack merger after its first layer, whose features are added
  into the language model's first layer; a 2-layer Qwen3 language model, hidden 64, with interleaved multimodal
  RoPE) and the Qwen2-VL image processor the real ones use, at the tiny Qwen2-VL's sizes (4 image tokens at most).

Each uses the tiny Llama's tokenizer (hf_zero/data/tiny_assets) with the family's image tokens and ChatML markers added
as special tokens, and ChatML as chat template. Each is written once into the hub cache under its hub id (as the
tiny Llamas are: hf_zero.data.model_names), so plain `AutoModelForImageTextToText.from_pretrained("hf-zero/tiny-
qwen2-vl")` and `AutoProcessor.from_pretrained(...)` load it offline with no hf_zero import (the Qwen ones' processors
where torchvision is installed: they need a video processor; without it `AutoImageProcessor` and `AutoTokenizer`).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from hf_zero.data.cache import build_hub_snapshot, hub_snapshot_dir, model_folder_problem

__all__ = ["TINY_VLMS", "TINY_VLM_REVISION", "is_tiny_vlm", "get_tiny_vlm_path", "tiny_vlm_folder",
           "qwen_tokenizer"]

# short name -> hub id; the revision names the build, so a change in how they are built gets a new snapshot.
TINY_VLMS = {"tiny-qwen2-vl": "hf-zero/tiny-qwen2-vl", "tiny-smolvlm": "hf-zero/tiny-smolvlm",
             "tiny-llava": "hf-zero/tiny-llava", "tiny-qwen3-vl": "hf-zero/tiny-qwen3-vl"}
TINY_VLM_REVISION = hashlib.sha1(b"hf_zero config-built vlm v1").hexdigest()
_TEXT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=512)
_CHATML = ["<|im_start|>", "<|im_end|>"]
_TINY_TOKENIZER_DIR = Path(__file__).resolve().parent / "tiny_assets" / "tiny_tokenizer"  # the tiny Llamas' one
_QWEN_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"  # an image item, as Qwen2-VL's template writes it
_QWEN_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


def _short(name: str) -> str | None:
    return next((short for short, hub in TINY_VLMS.items() if name in (short, hub)), None)


def is_tiny_vlm(name: str) -> bool:
    return _short(str(name)) is not None


def _tokenizer(tokens: list[str], image: str):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(_TINY_TOKENIZER_DIR))
    tokenizer.add_special_tokens({"additional_special_tokens": _CHATML + tokens})
    tokenizer.chat_template = chat_template(image)
    return tokenizer


def qwen_tokenizer():
    """The tiny Qwen VLMs' tokenizer (the tiny Llama's, with Qwen's image tokens and ChatML), built in memory: what
    hf_zero.train.vlm_count counts a real Qwen VLM's images with when hf_zero ships only its shape (no tokenizer
    offline). No number depends on it: the count looks up `<|image_pad|>` in it and counts that id in the run the
    image processor's arithmetic sizes."""
    return _tokenizer(_QWEN_TOKENS, _QWEN_IMAGE)


def _qwen2_vl(folder: Path) -> None:
    import torch
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer = qwen_tokenizer()
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in _QWEN_TOKENS}
    head_dim = _TEXT["hidden_size"] // _TEXT["num_attention_heads"]
    config = Qwen2VLConfig(
        text_config=dict(**_TEXT, vocab_size=len(tokenizer), rope_parameters={
            "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [head_dim // 4, head_dim // 8,
                                                                            head_dim // 8]},
            pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
            bos_token_id=tokenizer.eos_token_id, attention_dropout=0.0),
        vision_config=dict(depth=1, embed_dim=32, hidden_size=_TEXT["hidden_size"], num_heads=2, mlp_ratio=2,
                           patch_size=4, spatial_merge_size=2, temporal_patch_size=2),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False)
    torch.manual_seed(0)
    Qwen2VLForConditionalGeneration(config).save_pretrained(folder)
    # Images of 8 x 8 to 16 x 16 pixels (multiples of patch x merge = 8): 1 to 4 image tokens each.
    images = Qwen2VLImageProcessorPil(patch_size=4, merge_size=2, temporal_patch_size=2,
                                      size={"shortest_edge": 64, "longest_edge": 256})
    # The processor's parts, not Qwen2VLProcessor: it needs a video processor, which needs torchvision; AutoProcessor
    # builds the processor from these where torchvision is installed.
    images.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def _qwen3_vl(folder: Path) -> None:
    import torch
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    tokenizer = qwen_tokenizer()
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in _QWEN_TOKENS}
    hidden, heads = 64, 4
    # Interleaved MRoPE as Qwen3-VL's configs set it: the rotary frequencies split 2:1:1 between the temporal, height
    # and width positions (24/20/20 of 64 in the real models), interleaved by transformers.
    config = Qwen3VLConfig(
        text_config=dict(hidden_size=hidden, intermediate_size=128, num_hidden_layers=2, num_attention_heads=heads,
                         num_key_value_heads=2, head_dim=hidden // heads, max_position_embeddings=512,
                         vocab_size=len(tokenizer), rope_parameters={
                             "rope_type": "default", "rope_theta": 10000.0, "mrope_interleaved": True,
                             "mrope_section": [hidden // heads // 4, hidden // heads // 8, hidden // heads // 8]},
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                         bos_token_id=tokenizer.eos_token_id, attention_dropout=0.0),
        # 2 vision layers, DeepStack after the first (an intermediate layer, as in the real models), its features
        # added after the language model's first layer: added after its last, image positions' outputs would reach
        # no loss (the merger got a zero gradient). The learned position grid 4 x 4: the patches of the largest
        # default image (16 x 16 pixels).
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4,
                           spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=hidden,
                           num_position_embeddings=16, deepstack_visual_indexes=[0]),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False)
    torch.manual_seed(0)
    Qwen3VLForConditionalGeneration(config).save_pretrained(folder)
    # The real models' processor is Qwen2-VL's image processor at patch 16 (image mean and std 0.5); here patch 4 as
    # the tiny Qwen2-VL's: 8 x 8 to 16 x 16 pixels, 1 to 4 image tokens. Its parts, not Qwen3VLProcessor, which
    # cannot be built without torchvision; where it is installed AutoProcessor builds one from them, with
    # Qwen3VLVideoProcessor (its frame timestamps) by the video settings saved here.
    sizes = dict(patch_size=4, merge_size=2, temporal_patch_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    Qwen2VLImageProcessorPil(**sizes, size={"shortest_edge": 64, "longest_edge": 256}).save_pretrained(folder)
    Qwen3VLVideoProcessor(**sizes).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def _smolvlm(folder: Path) -> None:
    import torch
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration, Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    tokenizer = _tokenizer(["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"], "<image>")
    # 16 x 16 tiles of 4 x 4 patches (16 positions), pixel-shuffled by 2: 4 image tokens per tile.
    size, patch, scale = 16, 4, 2
    config = Idefics3Config(
        text_config=dict(model_type="llama", **_TEXT, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.eos_token_id,
                         attention_dropout=0.0, tie_word_embeddings=False),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           image_size=size, patch_size=patch),
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"), scale_factor=scale, tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    Idefics3ForConditionalGeneration(config).save_pretrained(folder)
    images = Idefics3ImageProcessorPil(do_image_splitting=False, size={"longest_edge": size},
                                       max_image_size={"longest_edge": size})
    Idefics3Processor(image_processor=images, tokenizer=tokenizer, image_seq_len=(size // patch) ** 2 // scale ** 2,
                      chat_template=tokenizer.chat_template).save_pretrained(folder)


def _llava(folder: Path) -> None:
    import torch
    from transformers import LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor
    from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil

    tokenizer = _tokenizer(["<image>"], "<image>")
    size, patch = 8, 4
    config = LlavaConfig(
        text_config=dict(model_type="llama", **_TEXT, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.eos_token_id,
                         attention_dropout=0.0, tie_word_embeddings=False),
        vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, image_size=size, patch_size=patch, projection_dim=32),
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"), vision_feature_layer=-1,
        vision_feature_select_strategy="default", tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    LlavaForConditionalGeneration(config).save_pretrained(folder)
    images = LlavaImageProcessorPil(size={"shortest_edge": size}, crop_size={"height": size, "width": size})
    # CLIP's CLS position is one more output, which the "default" strategy drops: (8 / 4)^2 = 4 image tokens
    processor = LlavaProcessor(image_processor=images, tokenizer=tokenizer, patch_size=patch,
                               vision_feature_select_strategy="default", num_additional_image_tokens=1,
                               chat_template=tokenizer.chat_template)
    processor.save_pretrained(folder)


def chat_template(image: str) -> str:
    """ChatML as hf_zero's default (CHATML_TEMPLATE: `{% generation %}` around what an assistant turn trains), for
    the tokenizer and the processor alike: content as a string (hf_zero's data path renders items first) or a list
    of items (transformers' multimodal form, `apply_chat_template`), an image item written as the family writes it."""
    content = ("{% if message['content'] is string %}{{ message['content'] }}{% else %}"
               "{% for item in message['content'] %}{% if item['type'] == 'text' %}{{ item['text'] }}"
               f"{{% elif item['type'] == 'image' %}}{{{{ '{image}' }}}}{{% endif %}}{{% endfor %}}{{% endif %}}")
    return ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
            "{% if message['role'] == 'assistant' %}{% generation %}" + content + "{{ '<|im_end|>' }}"
            "{% endgeneration %}{{ '\\n' }}{% else %}" + content + "{{ '<|im_end|>\\n' }}{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


_BUILDERS = {"tiny-qwen2-vl": _qwen2_vl, "tiny-smolvlm": _smolvlm, "tiny-llava": _llava, "tiny-qwen3-vl": _qwen3_vl}


def tiny_vlm_folder(name: str) -> Path:
    return hub_snapshot_dir(TINY_VLMS[_short(name)], TINY_VLM_REVISION)


def get_tiny_vlm_path(name: str) -> Path:
    """The tiny VLM's snapshot (weights, config, processor), written once."""
    short = _short(name)
    return build_hub_snapshot(TINY_VLMS[short], TINY_VLM_REVISION, _BUILDERS[short], verify=model_folder_problem)
