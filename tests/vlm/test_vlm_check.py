"""`hf-zero check` on a stock VLM's recipe: every image opened, per stage what trains, per part how many modules each
LoRA target matched, and one warning line when a stage trains the vision tower but no target is in it."""

from testing_utils import REPO, check

CONFIG = REPO / "recipes" / "configs" / "tiny_vlm.yaml"


def test_check_counts_each_lora_target_per_part(tmp_path, capsys):
    rc, results = check(capsys, "--config", str(CONFIG), output_dir=tmp_path / "o")
    ok, line = results["data"]
    assert rc == 0 and ok is True, line
    assert "align 60 rows, 60 files; tune 60 rows, 60 files" in line
    assert "stage align trains projector; stage tune trains vision_tower, projector, lora" in line
    # qkv is the Qwen2-VL vision blocks' fused attention input: the one target that reaches the vision tower
    assert ("LoRA targets matched per part: vision_tower: q_proj 0, v_proj 0, qkv 1; projector: q_proj 0, v_proj 0, "
            "qkv 0; language_model: q_proj 2, v_proj 2, qkv 0") in line


def test_check_counts_qwen3_vls_parts_with_its_deepstack_merger_in_the_projector(tmp_path, capsys):
    rc, results = check(capsys, "--config", str(CONFIG), "--model_name_or_path", "hf-zero/tiny-qwen3-vl",
                        output_dir=tmp_path / "o")
    ok, line = results["data"]
    assert rc == 0 and ok is True, line
    # the projector: the merger (24,832 weights) and the DeepStack merger, whose LayerNorm is on the merged width
    # (25,024); the vision tower: patches, positions, 2 blocks with a fused qkv each
    assert ("qwen3_vl weights per part: vision_tower 20,704 (80.88 KiB in fp32), projector 49,856 (194.75 KiB in "
            "fp32), language_model 140,416 (548.50 KiB in fp32)") in line
    assert ("LoRA targets matched per part: vision_tower: q_proj 0, v_proj 0, qkv 2; projector: q_proj 0, v_proj 0, "
            "qkv 0; language_model: q_proj 2, v_proj 2, qkv 0") in line


def test_check_warns_when_the_vision_tower_trains_but_no_target_is_in_it(tmp_path, capsys):
    from hf_zero.cli import main

    rc = main(["check", "--config", str(CONFIG), "--output-dir", str(tmp_path / "o"), "--lora_target_modules",
               "q_proj", "v_proj"])
    captured = capsys.readouterr()
    warnings = [ln for ln in captured.err.splitlines() if "warning" in ln]
    assert rc == 0 and warnings == [
        "[hf_zero] warning: lora_target_modules: no entry matched a vision tower module (its weights: fc1, fc2, "
        "norm1, norm2, proj, qkv): the stages that train vision_tower train its full weights; add its names to adapt "
        "it with LoRA"]
    assert "vision_tower: q_proj 0, v_proj 0;" in captured.out


def test_check_says_a_text_model_is_not_a_vlm_in_one_line(tmp_path, capsys):
    _, results = check(capsys, "--config", str(CONFIG), "--model_name_or_path", "tiny-llama",
                       output_dir=tmp_path / "o")
    ok, line = results["data"]
    assert ok is False and line.startswith("model_name_or_path: tiny-llama is a llama model, not a vision-language "
                                           "model hf_zero trains (qwen2_vl, qwen2_5_vl, qwen3_vl, idefics3, "
                                           "llava)"), line


def test_check_refuses_a_bound_on_image_size_that_is_not_positive(tmp_path, capsys):
    _, results = check(capsys, "--config", str(CONFIG), "--image_max_pixels", "0", output_dir=tmp_path / "o")
    ok, line = results["recipe"]
    assert ok is False and line.endswith("image_max_pixels: 0 is not a positive number of pixels; e.g. "
                                         "image_max_pixels: 262144 (512 x 512)"), line


def test_preview_shows_each_images_run_and_the_answer_it_trains(capsys):
    from hf_zero.cli import main

    assert main(["preview", "--config", str(CONFIG), "-n", "1", "--stage", "align"]) == 0
    out = capsys.readouterr().out
    assert "image <|image_pad|>, its count per image from the processor" in out
    assert "<|image_pad|> x1 at positions 6-6: " in out and out.count("digits/00360.png") == 1
    assert "<|vision_start|>{<|image_pad|> x1}<|vision_end|>What digit is this?<|im_end|>" in out
    assert "[[6<|im_end|>]]" in out


def two_image_rows(tmp_path):
    """The tiny config on rows whose third holds two images (a digit beside another)."""
    import json

    import yaml

    digits = REPO / "recipes" / "data" / "tiny_multimodal" / "digits"
    images = sorted(str(p) for p in digits.glob("*.png"))[:4]
    rows = [{"messages": [{"role": "user", "content": [*({"type": "image", "image": p} for p in pair),
                                                       {"type": "text", "text": "Which digits?"}]},
                          {"role": "assistant", "content": [{"type": "text", "text": "ok"}]}]}
            for pair in ([images[0]], [images[1]], images[2:4])]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = yaml.safe_load(CONFIG.read_text())
    config["stages"] = [{**s, "data": str(data)} for s in config["stages"]]
    path = tmp_path / "two.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def test_check_warns_when_a_row_holds_more_images_than_the_estimate_counts(tmp_path, capsys):
    """The estimate counts `items_per_row` images per row (default 1): a row with more would make it low, so the
    check names the row and the key; with the key raised, nothing to say."""
    from hf_zero.cli import main

    config = two_image_rows(tmp_path)
    assert main(["check", "--config", str(config), "--output-dir", str(tmp_path / "o")]) == 0
    warnings = [ln for ln in capsys.readouterr().err.splitlines() if "warning" in ln]
    assert warnings == ["[hf_zero] warning: items_per_row: row 3 of stages[align].data[0] holds 2 image items, the "
                        "estimate counts 1 per row; set items_per_row: 2"]
    assert main(["check", "--config", str(config), "--output-dir", str(tmp_path / "o"), "--items_per_row", "2"]) == 0
    assert "warning" not in capsys.readouterr().err


def test_check_refuses_items_per_row_that_is_not_a_positive_whole_number(tmp_path, capsys):
    """On the command line and in the YAML (where `true` and `1.5` arrive as a bool and a float)."""
    import yaml

    _, results = check(capsys, "--config", str(CONFIG), "--items_per_row", "0", output_dir=tmp_path / "o")
    lines = [results["recipe"]]
    for value in (True, 1.5):
        path = tmp_path / "c.yaml"
        path.write_text(yaml.safe_dump({**yaml.safe_load(CONFIG.read_text()), "items_per_row": value}))
        _, results = check(capsys, "--config", str(path), output_dir=tmp_path / "o")
        lines.append(results["recipe"])
    (ok, line), *from_yaml = lines
    assert ok is False and line.endswith("items_per_row: 0 is not a positive whole number; e.g. items_per_row: 2 for "
                                         "rows of up to two images"), line
    for (ok, line), value in zip(from_yaml, ("True", "1.5")):  # the YAML's types, refused where the file is read
        assert ok is False and f"items_per_row: {value} is not an integer (in {tmp_path / 'c.yaml'} line " in line
