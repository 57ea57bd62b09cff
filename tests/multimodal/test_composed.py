"""The composed model (hf_zero.train.composed) in one process: every encoder runs on every step with the loss
unchanged, one-folder save/load, the LLM's adapter alone for plain peft, and the stage parts (hf_zero.train.parts)."""

from types import SimpleNamespace

import pytest
import torch

from hf_zero.core.errors import UserError
from hf_zero.data.multimodal import add_placeholders
from hf_zero.data.multimodal_collator import MultimodalCollator
from hf_zero.plan.arguments import ModelArguments
from hf_zero.train.composed import ADAPTER_DIR, ComposedModel
from hf_zero.train.composed_build import build_encoders
from hf_zero.train.parts import PartPlan, model_parts, plan_parts

ENCODERS = {
    "points": {"class": "hf_zero.train.encoders:PointNet", "kwargs": {"hidden": 16, "width": 16, "tokens": 3},
               "input_shape": [12, 3]},
    "image": {"hf_config": {"model_type": "vit", "image_size": 8, "patch_size": 4, "num_channels": 1,
                            "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
                            "intermediate_size": 32}, "projector": {"type": "mlp", "hidden": 24}},
}
CPU = SimpleNamespace(precision="fp32", uses_deepspeed=False, zero_stage=0)


def composed(use_peft: bool, seed: int = 0):
    from hf_zero.data.chat_template import prepare_chat_template
    from hf_zero.data.model_names import get_tokenizer
    from hf_zero.train.model import build_causal_lm

    torch.manual_seed(seed)
    tok = get_tokenizer("tiny-llama")
    prepare_chat_template(tok)
    built = build_encoders(ENCODERS)
    ids = add_placeholders(tok, built[1])
    args = ModelArguments(model_name_or_path="tiny-llama", use_peft=use_peft, lora_r=4, lora_dropout=0.0)
    model = ComposedModel(build_causal_lm(args, tok, CPU), ENCODERS, ids, built)
    if use_peft:  # LoRA's B starts at zero: make the adapter matter, so a lost adapter shows in the outputs
        with torch.no_grad():
            for name, p in model.llm.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.5)
    return model.eval(), tok


def batch(model, tok, with_image: bool):
    ids = model.placeholder_ids
    rows = [[5, 6] + [ids["points"]] * 3 + [7, 8, 9], [5] + [ids["image"]] * 5 + [10, 11] if with_image else [5, 12]]
    samples = [{"input_ids": r, "labels": [-100] * (len(r) - 2) + r[-2:],
                "media": []} for r in rows]
    out = MultimodalCollator(tok, model.specs)(samples)
    g = torch.Generator().manual_seed(1)
    out["points_values"] = torch.randn(1, 12, 3, generator=g)
    out["points_rows"] = torch.tensor([0])
    if with_image:
        out["image_values"] = torch.rand(1, 1, 8, 8, generator=g)
        out["image_rows"] = torch.tensor([1])
    return out


def test_a_batch_without_images_still_runs_every_encoder_and_the_loss_is_unchanged():
    model, tok = composed(use_peft=False)
    model.train()
    calls = []
    for m, enc in model.encoders.items():
        enc.register_forward_hook(lambda *_, m=m: calls.append(m))
    inputs = batch(model, tok, with_image=False)
    assert inputs["image_values"].shape[0] == 0
    loss = model(**inputs).loss
    assert sorted(calls) == ["image", "points"]  # the image encoder ran on its dummy item
    loss.backward()
    # every parameter of every part got a gradient (zeros for the unused image path): under ZeRO-3 / FSDP every rank
    # took part in the same gathers and reductions
    assert all(p.grad is not None for n, p in model.named_parameters() if n.startswith(("encoders", "projectors")))
    assert all((p.grad == 0).all() for n, p in model.named_parameters() if n.startswith(("encoders.image",
                                                                                           "projectors.image")))
    calls.clear()
    plain = model(**inputs, keep_ranks_in_step=False).loss
    assert calls == ["points"]
    assert plain.item() == loss.item() and torch.equal(plain, loss)  # to the bit


def test_placeholders_without_items_are_refused_not_silently_text():
    model, tok = composed(use_peft=False)
    inputs = batch(model, tok, with_image=True)
    del inputs["image_values"], inputs["image_rows"]  # what a Trainer's remove_unused_columns would do
    with pytest.raises(ValueError, match="image placeholders but no image_values"):
        model(**inputs)


@pytest.mark.parametrize("use_peft", [True, False])
def test_save_then_load_gives_the_same_outputs(tmp_path, use_peft):
    model, tok = composed(use_peft)
    inputs = batch(model, tok, with_image=True)
    with torch.no_grad():
        expected = model(**inputs)
    model.save_pretrained(tmp_path / "m", tok)
    loaded = ComposedModel.from_pretrained(tmp_path / "m").eval()
    with torch.no_grad():
        got = loaded(**inputs)
    assert torch.equal(got.logits, expected.logits) and torch.equal(got.loss, expected.loss)
    other, _ = composed(use_peft, seed=1)  # a differently initialised model does differ: the load did the work
    with torch.no_grad():
        assert not torch.allclose(other(**inputs).logits, expected.logits)
    assert (tmp_path / "m" / ADAPTER_DIR).is_dir() == use_peft


def test_the_llm_adapter_alone_loads_with_plain_peft(tmp_path):
    from peft import AutoPeftModelForCausalLM

    model, tok = composed(use_peft=True)
    model.save_pretrained(tmp_path / "m", tok)
    plain = AutoPeftModelForCausalLM.from_pretrained(tmp_path / "m" / ADAPTER_DIR).eval()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        assert torch.allclose(plain(input_ids=ids).logits, model.llm(input_ids=ids).logits, atol=1e-6)
        with plain.disable_adapter():  # the base alone differs: what matched was the trained adapter
            assert not torch.allclose(plain(input_ids=ids).logits, model.llm(input_ids=ids).logits)


def test_parts_per_stage_and_one_line_for_an_unknown_part():
    model, _ = composed(use_peft=True)
    parts = model_parts(model)
    assert sorted(parts) == ["encoder.image", "encoder.points", "lora", "projector.image", "projector.points"]
    assert not any("lora_" not in n and "embed" not in n and "lm_head" not in n for n, _ in parts["lora"])

    def stage(name, **kw):
        return SimpleNamespace(**{"name": name, "train": None, "learning_rates": None, "learning_rate": 1e-3, **kw})

    plan = PartPlan([stage("a", train=["projector.points"]),
                     stage("b", train=["projector", "lora"], learning_rates={"projector": 3e-3, "lora": 5e-4})],
                    list(parts), 2e-3)
    assert plan.factors[0] == {"encoder.points": 0, "encoder.image": 0, "projector.points": 1.0,
                               "projector.image": 0, "lora": 0}
    assert plan.factors[1] == {"encoder.points": 0, "encoder.image": 0, "projector.points": 3.0,
                               "projector.image": 3.0, "lora": 0.5}
    with pytest.raises(UserError) as err:
        PartPlan([stage("b", train=["projector", "vision_tower"])], list(parts), 1e-3)
    assert err.value.line().startswith("stages[b].train: unknown part 'vision_tower'; use one of ")
    assert "encoder.points" in err.value.line() and "\n" not in err.value.line()
    with pytest.raises(UserError, match=r"stages\[b\].learning_rates.lora: -1 is not a positive number"):
        PartPlan([stage("b", learning_rates={"lora": -1})], list(parts), 1e-3)
    # a part that trains in no stage is frozen outright: no gradient, no optimizer state
    plan_parts(model, [stage("a", train=["projector.points"]), stage("b", train=["lora"])], 1e-3)
    assert all(not p.requires_grad for _, p in parts["encoder.image"] + parts["encoder.points"])
    assert all(p.requires_grad for _, p in parts["projector.points"] + parts["lora"])


def test_encoders_by_import_path_refuse_in_one_line():
    with pytest.raises(UserError, match=r"^encoders.points.class: cannot import 'no_such_pkg.enc:Net'"):
        build_encoders({"points": {"class": "no_such_pkg.enc:Net", "input_shape": [4, 3]}})
    with pytest.raises(UserError, match=r"^encoders.points.kwargs: "):
        build_encoders({"points": {"class": "hf_zero.train.encoders:PointNet", "kwargs": {"depth": 3},
                                   "input_shape": [4, 3]}})
    with pytest.raises(UserError, match=r"^encoders.points: needs exactly one of `class`"):
        build_encoders({"points": {"input_shape": [4, 3]}})


def test_stage_parts_outside_the_multimodal_recipe_are_refused_not_ignored():
    from hf_zero.core.config import Stage
    from hf_zero.plan.arguments import CurriculumArguments
    from hf_zero.train.recipe_steps import start

    stages = [Stage(name="s", data=["x.jsonl"], steps=2, learning_rates={"projector": 1e-3})]
    args = CurriculumArguments.__new__(CurriculumArguments)  # only its type and seed are read before the refusal
    args.seed = 0
    with pytest.raises(UserError) as err:
        start(SimpleNamespace(stages=stages, training_args=args), False, "")
    assert err.value.line().startswith("stages[s].learning_rates: says what trains per part of a composed model")


def test_tied_embeddings_are_written_once_and_tied_again(tmp_path):
    """SmolLM2 ties its LM head to its embeddings: saved once (safetensors refuses shared tensors), tied on load."""
    from safetensors import safe_open
    from transformers import LlamaConfig, LlamaForCausalLM

    llm = LlamaForCausalLM(LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                       num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=True))
    model = ComposedModel(llm, {"points": ENCODERS["points"]}, {"points": 39}).eval()
    inputs = {"input_ids": torch.tensor([[1, 39, 39, 39, 4]]), "points_values": torch.randn(1, 12, 3),
              "points_rows": torch.tensor([0])}
    model.save_pretrained(tmp_path / "m")
    with safe_open(tmp_path / "m" / "model.safetensors", "pt") as f:
        assert "llm.lm_head.weight" not in set(f.keys())
    loaded = ComposedModel.from_pretrained(tmp_path / "m").eval()
    assert loaded.llm.lm_head.weight is loaded.llm.model.embed_tokens.weight
    with torch.no_grad():
        assert torch.equal(loaded(**inputs).logits, model(**inputs).logits)


def test_a_canonical_pointnet_reads_a_cloud_the_same_in_any_pose_and_size():
    """The demo's PointNet (canonical=True): a cloud turned, moved and scaled gives the same tokens, so the encoder
    spends its few steps on what the shape is; the plain one does not (it learnt the demo's shapes at chance)."""
    from hf_zero.data.multimodal_demo import sample_shape
    from hf_zero.train.encoders import PointNet

    torch.manual_seed(0)
    cloud = torch.from_numpy(sample_shape("cone", 256, __import__("numpy").random.default_rng(3)))[None]
    q, r = torch.linalg.qr(torch.randn(3, 3))
    turned = cloud @ (q * torch.sign(torch.diagonal(r))).T * 1.7 + torch.tensor([0.3, -2.0, 0.5])
    canonical, plain = PointNet(hidden=16, width=8, tokens=2, canonical=True), PointNet(hidden=16, width=8, tokens=2)
    with torch.no_grad():
        assert torch.allclose(canonical(cloud), canonical(turned[:, torch.randperm(256)]), atol=1e-4)
        assert not torch.allclose(plain(cloud), plain(turned), atol=1e-2)
    assert canonical.point_mlp[0].in_features == 4  # x, y, z on the cloud's own axes, and the distance from its centre


def test_packed_rows_give_each_conversation_the_losses_it_has_alone():
    """Packing (`packing: true`): conversations with point clouds and images go whole into rows with their items;
    in one forward each has the per-token losses it has alone (positions restart, no token attends across)."""
    from testing_utils import REPO, packed_losses_match_alone

    from hf_zero.data.multimodal import encode_multimodal_rows, read_rows
    from hf_zero.data.packing import pack_documents, pad_id

    model, tok = composed(use_peft=True)
    folder = REPO / "recipes" / "data" / "tiny_multimodal"
    samples = []
    for name in ("shapes", "digits"):
        rows = read_rows(str(folder / f"{name}.jsonl"), "data", "messages")[:6]
        samples += encode_multimodal_rows(rows, tok, model.specs, model.placeholder_ids, 128, "data", name,
                                          folder)[0]
    rows = pack_documents(samples, 160, pad_id(tok))
    assert len(rows) <= len(samples) // 3 and all(r["media"] for r in rows)
    runs = {model.placeholder_ids[m]: s.tokens for m, s in model.specs.items()}

    def items_of(ids):
        return sum(ids.count(t) // n for t, n in runs.items())

    assert packed_losses_match_alone(model, rows, MultimodalCollator(tok, model.specs), items_of) == len(samples)


@pytest.mark.parametrize("kind", ["vit", "clip"])
def test_a_pretrained_encoder_is_loaded_with_its_weights_by_folder(tmp_path, kind):
    """`pretrained: <hub id or folder>`: the transformers model with its own weights (of a vision-text pair like CLIP,
    its vision tower), its input shape from its config; counted on the meta device without them; one line for a
    folder that is not a model."""
    from transformers import CLIPConfig, CLIPModel, ViTConfig, ViTModel

    from hf_zero.data.multimodal_check import declared_specs

    torch.manual_seed(3)
    vision = dict(image_size=8, patch_size=4, num_channels=1, hidden_size=16, num_hidden_layers=1,
                  num_attention_heads=2, intermediate_size=32)
    if kind == "vit":
        saved = ViTModel(ViTConfig(**vision), add_pooling_layer=False)
        expected = saved.state_dict()
    else:
        saved = CLIPModel(CLIPConfig(vision_config=vision, text_config=dict(hidden_size=16, num_hidden_layers=1,
                                                                            num_attention_heads=2,
                                                                            intermediate_size=32)))
        expected = saved.vision_model.state_dict()
    saved.save_pretrained(tmp_path / "enc")
    entry = {"image": {"pretrained": str(tmp_path / "enc")}}
    modules, specs = build_encoders(entry)
    assert specs["image"].input_shape == (1, 8, 8) and specs["image"].tokens == 5  # 2 x 2 patches + CLS
    got = modules["image"].state_dict()
    assert set(got) == set(expected) and all(torch.equal(got[k], v) for k, v in expected.items())
    assert declared_specs(entry)["image"].input_shape == (1, 8, 8)  # the light check reads config.json alone
    with torch.device("meta"):
        counted, _ = build_encoders(entry)
    assert sum(p.numel() for p in counted["image"].parameters()) == sum(v.numel() for v in expected.values())
    with pytest.raises(UserError) as err:
        build_encoders({"image": {"pretrained": str(tmp_path)}})
    assert err.value.line().startswith("encoders.image.pretrained: cannot read ") and "\n" not in err.value.line()
