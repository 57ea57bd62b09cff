"""Stock vision-language models' data: the multimodal chat rows of hf_zero.data.multimodal (the same rows, checks and
tokenization), with the model's own image token and processor.

Each image item stands in the rendered conversation as the family's image token, which becomes the run its processor
writes for that image (Qwen2-VL, Qwen3-VL: `<|vision_start|>` + one `<|image_pad|>` per merged patch +
`<|vision_end|>`, their count from the image's size after the processor's resizing; Idefics3/SmolVLM:
`<fake_token_around_image><global-img>` + `image_seq_len` x `<image>` per tile + the row/column markers). The
collator runs the image processor on the batch's images in reading order, which is the order the model fills its
image tokens in.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

from hf_zero.core.errors import UserError
from hf_zero.data.multimodal import ModalitySpec
from hf_zero.data.multimodal_collator import MultimodalCollator

__all__ = ["FAMILIES", "Family", "family_of", "VlmProcessing", "VlmCollator", "is_vlm_config", "default_targets",
           "vlm_lora_targets"]


@dataclass(frozen=True)
class Family:
    """What hf_zero knows of a family of stock VLMs: its image token and the module names of its parts."""

    name: str
    image_token: str
    vision_tower: str  # dotted prefix of the vision tower's parameters (the projector's excluded)
    projector: str  # the projector (Qwen2-VL's merger, Idefics3's connector)
    language_model: tuple  # the language model's prefixes (its LM head included)
    mrope: bool = False  # multimodal RoPE (Qwen2-VL, Qwen3-VL): packed rows need its positions per conversation
    # Qwen3-VL's DeepStack mergers: they map intermediate vision layers into the language model's first layers, so
    # they belong to the projector (as the merger does; ms-swift's aligner too)
    deepstack: str = ""

    @property
    def projectors(self) -> tuple[str, ...]:
        """Every prefix of the projector part."""
        return (self.projector, self.deepstack) if self.deepstack else (self.projector,)


_QWEN = Family("qwen2_vl", "<|image_pad|>", "model.visual.", "model.visual.merger.",
               ("model.language_model.", "lm_head."), mrope=True)
FAMILIES = {
    "qwen2_vl": _QWEN,
    "qwen2_5_vl": Family("qwen2_5_vl", **{k: getattr(_QWEN, k) for k in ("image_token", "vision_tower", "projector",
                                                                         "language_model", "mrope")}),
    "qwen3_vl": Family("qwen3_vl", "<|image_pad|>", "model.visual.", "model.visual.merger.",
                       ("model.language_model.", "lm_head."), mrope=True,
                       deepstack="model.visual.deepstack_merger_list."),
    "idefics3": Family("idefics3", "<image>", "model.vision_model.", "model.connector.",
                       ("model.text_model.", "lm_head.")),
    "llava": Family("llava", "<image>", "model.vision_tower.", "model.multi_modal_projector.",
                    ("model.language_model.", "lm_head.")),
}


def is_vlm_config(config) -> bool:
    model_type = config.get("model_type") if isinstance(config, dict) else getattr(config, "model_type", None)
    return model_type in FAMILIES


def family_of(config, name: str) -> Family:
    model_type = getattr(config, "model_type", None)
    if model_type not in FAMILIES:
        raise UserError("model_name_or_path", f"{name} is a {model_type} model, not a vision-language model hf_zero "
                        f"trains ({', '.join(FAMILIES)})", "use a Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Idefics3/SmolVLM or "
                        "LLaVA model, or recipes/multimodal.py to compose an LLM with encoders")
    return FAMILIES[model_type]


def default_targets(family: Family) -> str:
    """LoRA's targets when the recipe names none: the language model's attention and MLP projections (a regex, which
    peft matches against full module names, so no vision tower module is caught by a shared name)."""
    inner = re.escape(family.language_model[0].removeprefix("model."))  # the bare model's name (AutoModel's) too
    return rf".*{inner}.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"


def vlm_lora_targets(config, targets):
    """The targets LoRA gets for a model: the recipe's, else for a VLM default_targets (peft knows none for them)."""
    return targets if targets or not is_vlm_config(config) else default_targets(FAMILIES[config.model_type])


def _idefics3_image_text(rows: int, cols: int, seq: int) -> str:
    """One image as Idefics3Processor writes it (its replace_image_token): each tile's `seq` image tokens after its
    row/column marker, then the whole image's after `<global-img>`."""
    fake, image, whole = "<fake_token_around_image>", "<image>", f"<global-img>{'<image>' * seq}"
    if rows == 0 and cols == 0:
        return f"{fake}{whole}{fake}"
    tiles = "".join("".join(f"{fake}<row_{r + 1}_col_{c + 1}>{image * seq}" for c in range(cols)) + "\n"
                    for r in range(rows))
    return f"{tiles}\n{fake}{whole}{fake}"


def _open_rgb(path: Path):
    from PIL import Image

    with Image.open(path) as img:
        return img.convert("RGB")


class VlmProcessing:
    """The model's tokenizer and image processor, with the recipe's bound on image size (`image_max_pixels`)."""

    def __init__(self, folder: str, tokenizer, max_pixels: int | None = None):
        from transformers import AutoConfig, AutoImageProcessor

        self.folder, self.config = folder, AutoConfig.from_pretrained(folder)
        self.family = family_of(self.config, folder)
        self.tokenizer = tokenizer
        self.images = AutoImageProcessor.from_pretrained(folder)
        self.kwargs = {}  # what every call of the image processor adds: the size bound
        if max_pixels is not None:
            if self.family.name == "llava":  # every image is resized and cropped to one size
                crop = self.images.crop_size
                if crop["height"] * crop["width"] > max_pixels:
                    raise UserError("image_max_pixels", f"{max_pixels} is below this LLaVA's one image size "
                                    f"({crop['height']} x {crop['width']}, which its processor gives every image)",
                                    "remove image_max_pixels, or raise it")
            elif self.family.name == "idefics3":
                tile = self.images.max_image_size["longest_edge"]
                self.kwargs["size"] = {"longest_edge": max(tile, math.isqrt(max_pixels) // tile * tile)}
            else:
                low = min(self.images.size["shortest_edge"], max_pixels)
                self.kwargs["size"] = {"shortest_edge": low, "longest_edge": max_pixels}
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.family.image_token)
        # LLaVA: image tokens beyond the patches, as LlavaProcessor counts them (its processor_config.json's
        # num_additional_image_tokens, CLIP's CLS; one less under the "default" strategy, which drops CLS)
        self.extra_tokens = 0
        if self.family.name == "llava":
            settings = Path(folder) / "processor_config.json"
            saved = json.loads(settings.read_text()) if settings.is_file() else {}
            self.extra_tokens = int(saved.get("num_additional_image_tokens", 0)) - (
                self.config.vision_feature_select_strategy == "default")

    def spec(self) -> dict:
        """{"image": ModalitySpec} for hf_zero.data.multimodal: the family's image token, expanded per image."""
        return {"image": ModalitySpec("image", (3, 16, 16), 1, token=self.family.image_token, expand=self.expand)}

    def expand(self, path: Path) -> list[int]:
        """The ids one image becomes in the text, as the family's processor writes them."""
        img = _open_rgb(path)
        if self.family.name == "idefics3":
            out = self.images(images=[[img]], return_row_col_info=True, **self.kwargs)
            vision = self.config.vision_config
            seq = int((vision.image_size // vision.patch_size) ** 2 / self.config.scale_factor ** 2)
            text = _idefics3_image_text(out["rows"][0][0], out["cols"][0][0], seq)
            return self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if self.family.name == "llava":  # as LlavaProcessor counts: patches, + CLS, - CLS under "default"
            _, _, height, width = self.images(images=[img], return_tensors="pt")["pixel_values"].shape
            patch = self.config.vision_config.patch_size
            return [self.image_token_id] * ((height // patch) * (width // patch) + self.extra_tokens)
        grid = self.images(images=[img], return_tensors="pt", **self.kwargs)["image_grid_thw"][0]
        tokens = int(grid.prod()) // self.images.merge_size ** 2
        return [self.config.vision_start_token_id, *[self.image_token_id] * tokens, self.config.vision_end_token_id]

    def pixels(self, rows: list[list[Path]], input_ids) -> dict:
        """The image tensors of a batch (each row's image files, in reading order) as the model's forward takes it."""
        if not any(rows):
            return {}
        if self.family.name == "idefics3":
            out = self.images(images=[[_open_rgb(p) for p in row] for row in rows], return_tensors="pt",
                              **self.kwargs)
            return {"pixel_values": out["pixel_values"], "pixel_attention_mask": out["pixel_attention_mask"]}
        out = self.images(images=[_open_rgb(p) for row in rows for p in row], return_tensors="pt", **self.kwargs)
        if self.family.name == "llava":
            return {"pixel_values": out["pixel_values"]}
        # multimodal RoPE (Qwen2-VL's get_rope_index) finds each image's positions by this mask: 1 on image tokens
        return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"],
                "mm_token_type_ids": (input_ids == self.image_token_id).long()}


class VlmCollator(MultimodalCollator):
    """hf_zero's multimodal collator for the text (padding, labels; packed rows' positions), and the model's own
    image tensors.

    Packed rows of Qwen2-VL and Qwen3-VL need their multimodal RoPE per conversation: `rope_index` (the model's own
    `get_rope_index`, hf_zero.train.vlm.rope_index_of) numbers each conversation of a row from 0 as if it were alone,
    and the row's 1-D positions go first, (4, rows, length) as transformers' Qwen2-VL and Qwen3-VL read packed rows:
    their mask keeps conversations apart by the 1-D positions' restarts. Idefics3's and LLaVA's positions are 1-D:
    the text path's."""

    def __init__(self, processing: VlmProcessing, rope_index=None):
        super().__init__(processing.tokenizer, {})
        self.processing, self.rope_index = processing, rope_index

    def __call__(self, samples: list[dict]) -> dict:
        batch = super().__call__(samples)
        rows = [[Path(p) for kind, p in s.get("media", ()) if kind == "image"] for s in samples]
        batch = {**batch, **self.processing.pixels(rows, batch["input_ids"])}
        if "position_ids" in batch and self.processing.family.mrope:
            batch["position_ids"] = self._mrope_positions(batch)
        return batch

    def _mrope_positions(self, batch: dict):
        import itertools

        import torch

        if self.rope_index is None:
            raise ValueError("packed Qwen2-VL rows need the model's get_rope_index (VlmCollator(rope_index=...))")
        ids, text = batch["input_ids"], batch["position_ids"]
        types = (ids == self.processing.image_token_id).long()
        grids = iter(batch.get("image_grid_thw", torch.zeros(0, 3, dtype=torch.long)))
        out = torch.zeros(3, *ids.shape, dtype=torch.long)
        for r in range(len(ids)):
            starts = [int(i) for i in torch.nonzero(text[r] == 0).flatten()] + [ids.shape[1]]
            for a, b in zip(starts, starts[1:]):  # one conversation (or the padding) as if alone
                images = sum(1 for kind, _ in itertools.groupby(types[r, a:b].tolist()) if kind)
                thw = torch.stack([next(grids) for _ in range(images)]) if images else None
                out[:, r, a:b] = self.rope_index(ids[r:r + 1, a:b], types[r:r + 1, a:b], image_grid_thw=thw)[0][:, 0]
        return torch.cat([text[None], out])
