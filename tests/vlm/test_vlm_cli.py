"""`hf-zero train --model <a tiny VLM> --data rows.jsonl`, as a user types it, without a YAML: the YAML it builds
names the vlm recipe, and one rank trains on the image chat rows (the multimodal recipe's digits), the loss on the
answers only."""

import json
import sys

import pytest
from testing_utils import REPO, read_summary, run_cmd

DIGITS = REPO / "recipes" / "data" / "tiny_multimodal" / "digits.jsonl"


@pytest.mark.multiproc
@pytest.mark.parametrize("model", ["hf-zero/tiny-qwen2-vl", "hf-zero/tiny-smolvlm"])
def test_train_with_model_and_data_trains_a_vlm_on_one_rank(tmp_path, model):
    out = tmp_path / "run"
    proc = run_cmd([sys.executable, "-m", "hf_zero.cli", "train", "--profile", "ddp", "--nproc", "1", "--model", model,
                    "--data", DIGITS, "--max_steps", "4", "--output_dir", out, "--disable_tqdm", "true"])
    console = proc.stdout + proc.stderr
    assert "(built from --model and --data" in console and "[hf_zero] done:" in console, console[-3000:]
    s = read_summary(out)
    assert s["vlm_family"] == {"hf-zero/tiny-qwen2-vl": "qwen2_vl", "hf-zero/tiny-smolvlm": "idefics3"}[model]
    assert (s["world_size"], len(s["losses"])) == (1, 4) and s["use_peft"]
    assert s["parts"]["digits"] == {"vision_tower": 0.0, "projector": 0.0, "lora": 1.0}  # the default: lora alone
    config = json.loads((out / "final" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == model and config["modules_to_save"] is None
