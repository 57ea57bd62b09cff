"""Stock VLMs on hf_zero's multimodal data path, in one process (no recipe run): the tiny models load with plain
transformers, an image item becomes exactly the run the family's processor writes, the loss is on the answers only,
image_max_pixels bounds the visual tokens, a text-only batch still runs the vision tower with the loss unchanged, and
LoRA targets are counted per part."""

import importlib.util
import itertools
import json
from pathlib import Path

import pytest
import torch
from testing_utils import REPO

from hf_zero.core.config import Stage
from hf_zero.data.chat import IGNORE
from hf_zero.data.model_names import get_tokenizer, resolve_model_path
from hf_zero.data.multimodal import add_placeholders, encode_multimodal_rows, read_rows
from hf_zero.data.vlm import VlmCollator, VlmProcessing
from hf_zero.train.parts import PartPlan
from hf_zero.train.vlm import (
    keep_vision_in_step,
    part_names,
    part_of,
    target_counts,
    unread_vision,
    vision_warning,
    vlm_parts,
)

DIGITS = REPO / "recipes" / "data" / "tiny_multimodal" / "digits.jsonl"
MODELS = ("hf-zero/tiny-qwen2-vl", "hf-zero/tiny-smolvlm", "hf-zero/tiny-llava", "hf-zero/tiny-qwen3-vl")
QWENS = ("hf-zero/tiny-qwen2-vl", "hf-zero/tiny-qwen3-vl")  # the same image processor and token runs


def processing(name: str, max_pixels=None) -> VlmProcessing:
    return VlmProcessing(resolve_model_path(name), get_tokenizer(name), max_pixels)


def encode(proc: VlmProcessing, rows: list, folder: Path, max_len: int = 512):
    specs = proc.spec()
    ids = add_placeholders(proc.tokenizer, specs)
    samples, report = encode_multimodal_rows(rows, proc.tokenizer, specs, ids, max_len, "data", "rows", folder)
    return samples, report


def digit_rows(n: int = 4) -> list:
    return read_rows(str(DIGITS), "data", "messages")[:n]


@pytest.mark.parametrize("name", MODELS)
def test_the_tiny_vlms_load_with_plain_transformers(name):
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    folder = resolve_model_path(name)  # built once into the hub cache under its hub id
    model = AutoModelForImageTextToText.from_pretrained(name)  # by hub id, offline, no hf_zero
    assert type(model).__name__ == {"hf-zero/tiny-qwen2-vl": "Qwen2VLForConditionalGeneration",
                                    "hf-zero/tiny-smolvlm": "Idefics3ForConditionalGeneration",
                                    "hf-zero/tiny-llava": "LlavaForConditionalGeneration",
                                    "hf-zero/tiny-qwen3-vl": "Qwen3VLForConditionalGeneration"}[name]
    tok = AutoTokenizer.from_pretrained(name)
    assert len(tok) == model.config.get_text_config().vocab_size and tok.chat_template
    assert AutoImageProcessor.from_pretrained(folder) is not None
    from transformers import AutoProcessor

    if name in QWENS and importlib.util.find_spec("torchvision") is None:
        # the Qwen processors need a video processor, which needs torchvision: not installed here
        with pytest.raises(ImportError, match="Torchvision"):
            AutoProcessor.from_pretrained(name)
        return
    assert type(AutoProcessor.from_pretrained(name)).__name__ == {
        "hf-zero/tiny-qwen2-vl": "Qwen2VLProcessor", "hf-zero/tiny-smolvlm": "Idefics3Processor",
        "hf-zero/tiny-llava": "LlavaProcessor", "hf-zero/tiny-qwen3-vl": "Qwen3VLProcessor"}[name]


@pytest.mark.parametrize("name", ["hf-zero/tiny-smolvlm", "hf-zero/tiny-llava"])
def test_an_image_is_the_run_the_familys_own_processor_writes(name):
    """The same conversation through hf_zero's data path and through the family's processor (Idefics3Processor,
    LlavaProcessor: its chat template given the list form, its image token expanded by itself): the same ids."""
    from PIL import Image
    from transformers import AutoProcessor

    proc = processing(name)
    row = digit_rows(1)[0]
    (sample,), _ = encode(proc, [row], DIGITS.parent)
    hf = AutoProcessor.from_pretrained(name)
    text = hf.apply_chat_template(row)
    with Image.open(DIGITS.parent / row[0]["content"][0]["image"]) as img:
        images = [[img.convert("RGB")]] if name.endswith("smolvlm") else [img.convert("RGB")]
        theirs = hf(text=[text], images=images, add_special_tokens=False)["input_ids"][0]
    assert sample["input_ids"] == list(theirs)
    # SmolVLM: 16 x 16 pixels, 4 x 4 patches, pixel-shuffled by 2; LLaVA: 8 x 8 pixels, 2 x 2 patches, CLS dropped
    assert sample["input_ids"].count(proc.image_token_id) == 4


@pytest.mark.parametrize("name", QWENS)
def test_qwen_vl_images_are_wrapped_and_sized_by_the_processor(name):
    proc = processing(name)
    (sample,), report = encode(proc, digit_rows(1), DIGITS.parent)
    ids, cfg = sample["input_ids"], proc.config
    start = ids.index(cfg.vision_start_token_id)
    # an 8 x 8 digit is resized to the processor's minimum area (64 pixels): one merged 8 x 8 patch, one token
    assert ids[start:start + 3] == [cfg.vision_start_token_id, proc.image_token_id, cfg.vision_end_token_id]
    # the loss is on the answer and its end-of-turn marker only
    trained = [t for t, label in zip(ids, sample["labels"]) if label != IGNORE]
    assert proc.tokenizer.decode(trained) == "6<|im_end|>" and report.loss_tokens == len(trained)


@pytest.mark.parametrize("name", QWENS)
def test_image_max_pixels_bounds_the_visual_tokens(tmp_path, name):
    from PIL import Image

    Image.new("RGB", (32, 32), (200, 10, 10)).save(tmp_path / "big.png")
    row = [{"role": "user", "content": [{"type": "image", "image": "big.png"}, {"type": "text", "text": "Color?"}]},
           {"role": "assistant", "content": [{"type": "text", "text": "red"}]}]
    counts = {}
    for bound in (None, 64):  # the processor's own bound (256 pixels: 16 x 16), then 64 (8 x 8)
        proc = processing(name, bound)
        (sample,), _ = encode(proc, [row], tmp_path)
        counts[bound] = sample["input_ids"].count(proc.image_token_id)
        batch = VlmCollator(proc)([sample])
        assert int(batch["image_grid_thw"].prod()) == 4 * counts[bound]  # the collator sizes as the text says
    assert counts == {None: 4, 64: 1}


@pytest.mark.parametrize("name", MODELS)
def test_a_text_only_batch_runs_the_vision_tower_and_keeps_the_loss(name):
    """Under ZeRO-3 a rank whose batch has no image must still gather the vision tower's parameters: the blank image
    forward adds exactly 0 to the loss and gives the vision tower a (zero) gradient."""
    from transformers import AutoModelForImageTextToText

    proc = processing(name)
    text_row = [{"role": "user", "content": "What digit is this?"}, {"role": "assistant", "content": "7"}]
    (sample,), _ = encode(proc, [text_row], DIGITS.parent)
    batch = VlmCollator(proc)([sample])
    assert "pixel_values" not in batch
    torch.manual_seed(0)
    plain = AutoModelForImageTextToText.from_pretrained(resolve_model_path(name))
    kept = AutoModelForImageTextToText.from_pretrained(resolve_model_path(name))
    keep_vision_in_step(kept, proc.family, proc)
    loss_plain, loss_kept = plain(**batch).loss, kept(**batch).loss
    assert torch.equal(loss_plain, loss_kept)
    loss_kept.backward()
    unread = unread_vision(kept.config, proc.family)  # LLaVA's final CLIP norm: its projector reads a layer before
    assert bool(unread) == name.endswith("llava")
    vision = [p for n, p in kept.named_parameters() if n.startswith(proc.family.vision_tower)
              and not (n + ".").startswith(unread)]
    assert vision and all(p.grad is not None for p in vision)
    loss_plain.backward()
    assert all(p.grad is None for n, p in plain.named_parameters() if n.startswith(proc.family.vision_tower))


@pytest.mark.parametrize("name", MODELS)
def test_an_image_batch_trains_through_every_part(name):
    from transformers import AutoModelForImageTextToText

    proc = processing(name)
    samples, _ = encode(proc, digit_rows(2), DIGITS.parent)
    model = AutoModelForImageTextToText.from_pretrained(resolve_model_path(name))
    model(**VlmCollator(proc)(samples)).loss.backward()
    for part, params in vlm_parts(model, proc.family, use_peft=False).items():
        assert any(p.grad is not None and p.grad.abs().sum() > 0 for _, p in params), part
    # Qwen3-VL: each DeepStack merger too (its features go into a language model layer whose output a later one reads)
    deepstack = [p for n, p in model.named_parameters() if proc.family.deepstack and
                 n.startswith(proc.family.deepstack)]
    assert bool(deepstack) == name.endswith("qwen3-vl") and all(p.grad.abs().sum() > 0 for p in deepstack)


def test_lora_targets_are_counted_per_part_and_a_missed_vision_tower_is_said():
    from transformers import AutoModelForImageTextToText

    qwen, smol = processing(MODELS[0]), processing(MODELS[1])
    q_model = AutoModelForImageTextToText.from_pretrained(resolve_model_path(MODELS[0]))
    s_model = AutoModelForImageTextToText.from_pretrained(resolve_model_path(MODELS[1]))
    # Qwen2-VL's vision blocks have a fused qkv: q_proj/v_proj miss them; SigLIP's (Idefics3) have q_proj/v_proj
    q = target_counts(q_model, qwen.family, ["q_proj", "v_proj", "qkv"])
    s = target_counts(s_model, smol.family, ["q_proj", "v_proj"])
    assert q == {"vision_tower": {"q_proj": 0, "v_proj": 0, "qkv": 1}, "projector": {"q_proj": 0, "v_proj": 0,
                 "qkv": 0}, "language_model": {"q_proj": 2, "v_proj": 2, "qkv": 0}}
    assert s["vision_tower"] == {"q_proj": 1, "v_proj": 1} and s["language_model"] == {"q_proj": 2, "v_proj": 2}
    # Qwen3-VL: the same fused qkv in its 2 vision blocks; its DeepStack mergers are the projector's, as its merger
    qwen3 = processing("hf-zero/tiny-qwen3-vl")
    q3_model = AutoModelForImageTextToText.from_pretrained(resolve_model_path("hf-zero/tiny-qwen3-vl"))
    assert target_counts(q3_model, qwen3.family, ["q_proj", "qkv", "linear_fc1"]) == {
        "vision_tower": {"q_proj": 0, "qkv": 2, "linear_fc1": 2}, "projector": {"q_proj": 0, "qkv": 0,
                                                                               "linear_fc1": 2},
        "language_model": {"q_proj": 2, "qkv": 0, "linear_fc1": 0}}
    assert {part_of(n, qwen3.family) for n, _ in q3_model.named_parameters() if ".deepstack_merger_list." in n} == {
        "projector"}
    missed = target_counts(q_model, qwen.family, ["q_proj", "v_proj"])
    assert "no entry matched a vision tower module" in vision_warning(missed, True, ["qkv", "proj"])
    assert vision_warning(missed, False, ["qkv"]) is None and vision_warning(q, True, ["qkv"]) is None


def test_the_parts_a_stage_names_are_the_families_own():
    stages = [Stage(name="a", data="x.jsonl", steps=1, train=["projector"]),
              Stage(name="b", data="x.jsonl", steps=1)]
    names = part_names(use_peft=True)
    plan = PartPlan(stages, names, 1e-3, default=names[-1:])
    assert plan.factors == [{"vision_tower": 0.0, "projector": 1.0, "lora": 0.0},
                            {"vision_tower": 0.0, "projector": 0.0, "lora": 1.0}]
    from hf_zero.core.errors import UserError

    with pytest.raises(UserError, match=r"unknown part 'merger'; use one of vision_tower, projector, lora"):
        PartPlan([Stage(name="a", data="x.jsonl", steps=1, train=["merger"])], names, 1e-3)


def test_one_stage_yaml_of_a_vlm_names_the_vlm_recipe(tmp_path):
    from hf_zero.plan.one_stage import data_recipe_flags

    text = data_recipe_flags("hf-zero/tiny-smolvlm", [str(DIGITS)])
    assert "\nrecipe: vlm" in text and "model_name_or_path: hf-zero/tiny-smolvlm" in text
    assert "recipe:" not in data_recipe_flags("tiny-llama", [str(REPO / "recipes" / "data" / "tiny" /
                                                                 "short.jsonl")])
    assert json.loads(DIGITS.read_text().splitlines()[0])["messages"]  # the multimodal recipe's own rows


@pytest.mark.parametrize("name", MODELS)
def test_packed_image_rows_give_each_conversation_the_losses_it_has_alone(name):
    """Packing (`packing: true`): image conversations go whole into rows with their images; in one forward each has
    the per-token losses it has alone: Idefics3's 1-D positions restart per conversation, Qwen2-VL's multimodal RoPE
    is numbered per conversation by the model's own get_rope_index."""
    from testing_utils import packed_losses_match_alone
    from transformers import AutoModelForImageTextToText

    from hf_zero.data.packing import pack_documents, pad_id
    from hf_zero.train.vlm import rope_index_of

    proc = processing(name)
    text_row = [{"role": "user", "content": "What digit is seven?"}, {"role": "assistant", "content": "7"}]
    samples, _ = encode(proc, [*digit_rows(6), text_row], DIGITS.parent)
    rows = pack_documents(samples, 160, pad_id(proc.tokenizer))
    assert len(rows) <= len(samples) // 3
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_pretrained(resolve_model_path(name)).eval()
    def items_of(ids):  # one run of image tokens per image (these tiny images are not split into tiles)
        return sum(1 for t, _ in itertools.groupby(ids) if t == proc.image_token_id)

    collate = VlmCollator(proc, rope_index_of(model))
    assert packed_losses_match_alone(model, rows, collate, items_of) == len(samples)
    if proc.family.mrope:
        positions = collate(rows)["position_ids"]
        assert positions.shape == (4, len(rows), 160)  # 1-D positions first, as transformers reads packed rows
        with pytest.raises(ValueError, match="get_rope_index"):
            VlmCollator(proc)(rows)
