"""Chat fine-tuning end to end on the tiny model: assistant-only loss learns the reply (and only the reply), a 2-rank
ZeRO-3 + LoRA run saves an adapter that plain peft + transformers reload with the training chat template, the
stage-end samples, `hf-zero preview` / `generate`, and bad chat rows stopped in the recipe and in `check`."""

import json
import random
import sys
from pathlib import Path

import pytest
from testing_utils import RECIPE, REPO, foreign_lines, read_summary, run_cmd

from hf_zero.cli import main

REPLY = "I am a tiny model."


def same_reply_file(path, n=200, seed=0):
    """Random user text, always the same short assistant reply."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        words = " ".join("".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 7)))
                         for _ in range(rng.randint(4, 10)))
        rows.append({"messages": [{"role": "user", "content": words}, {"role": "assistant", "content": REPLY}]})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def chat_recipe(tmp_path, data, steps=48, **extra):
    cfg = {"model_name_or_path": "tiny-llama", "max_seq_length": 96, "eval_samples": 4, "sample_prompts": 4,
           "sample_max_new_tokens": 24, "per_device_train_batch_size": 8, "seed": 0,
           "stages": [{"name": "chat", "data": str(data), "steps": steps, "learning_rate": 1.0e-2, "warmup_steps": 2,
                       "lr_schedule": "constant"}], **extra}
    path = tmp_path / "chat.yaml"
    path.write_text(json.dumps(cfg))  # JSON is YAML
    return path


@pytest.fixture(scope="module")
def same_reply_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("same")
    config = chat_recipe(root, same_reply_file(root / "same.jsonl"))
    runs = {}
    for mode in ("true", "false"):
        out = root / f"assistant_only_{mode}"
        proc = run_cmd([sys.executable, RECIPE, "--config", config, "--output_dir", out, "--disable_tqdm", "true",
                        "--assistant_only_loss", mode])
        (out / "console.log").write_text(proc.stdout + proc.stderr)  # as a log file holds it (stdout not a tty)
        runs[mode] = out
    return runs


@pytest.mark.recipe_run  # the recipe end to end in one process: make test, not make test-fast
def test_assistant_only_loss_learns_the_reply_all_tokens_does_not(same_reply_runs):
    only, every = (read_summary(same_reply_runs[m]) for m in ("true", "false"))
    assert len(only["losses"]) == len(every["losses"]) == 48
    assert only["losses"][0] > 4  # the reply is not known at the start
    assert only["losses"][-1] < 0.05 and only["eval_loss_after"] < 0.05  # the reply is all that is trained: learnt
    assert every["losses"][-1] > 1.0  # random user text keeps the all-token loss high


@pytest.mark.recipe_run  # the recipe end to end in one process: make test, not make test-fast
def test_samples_show_the_learnt_reply(same_reply_runs):
    out = same_reply_runs["true"]
    rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    start, end = [r for r in rows if r["when"] == "start"], [r for r in rows if r["when"] == "end"]
    assert len(start) == len(end) == 4 and {r["step"] for r in end} == {48}
    assert all(r["reference"] == REPLY and r["answer"] == REPLY and r["exact_match"] for r in end)
    assert not any(r["exact_match"] for r in start)
    s = read_summary(out)
    assert (s["exact_match_before"], s["exact_match_after"]) == (0.0, 1.0)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(next(out.rglob("events.out.tfevents.*")).parent), size_guidance={"tensors": 0})
    acc.Reload()
    assert "samples/chat/text_summary" in acc.Tags()["tensors"]
    assert "train/samples_chat_exact_match" in acc.Tags()["scalars"]
    # the run's purpose as scalars beside each other: held-out loss and exact match, before and at the end
    assert [(e.step, e.value) for e in acc.Scalars("eval/exact_match")] == [(0, 0.0), (48, 1.0)]
    assert [e.step for e in acc.Scalars("eval/mean_loss")] == [0, 48]
    assert acc.Scalars("eval/mean_loss")[-1].value == pytest.approx(s["eval_loss_after"])


@pytest.mark.recipe_run  # the recipe end to end in one process: make test, not make test-fast
def test_console_shows_the_answers_before_and_after(same_reply_runs):
    """Under a plain `python recipe`: hf_zero's lines only, exact match on the eval lines and the result."""
    out = same_reply_runs["true"]
    text = (out / "console.log").read_text()
    assert foreign_lines(text) == []
    evals = [ln for ln in text.splitlines() if ln.startswith("eval ")]
    assert evals[0].startswith("eval before training: chat ") and evals[0].endswith(" | exact match 0.00 of 4 prompts")
    assert evals[-1].endswith(" | exact match 1.00 of 4 prompts (before training 0.00)")
    (done,) = [ln for ln in text.splitlines() if ln.startswith("[hf_zero] done: ")]
    assert " on 4 held-out samples; exact match 0.00 -> 1.00 (4 prompts); model in " in done  # not "1 stages'"
    assert (out / "loss.png").stat().st_size > 10_000


@pytest.mark.recipe_run  # the recipe end to end in one process: make test, not make test-fast
def test_generate_answers_with_the_saved_template(same_reply_runs, capsys):
    final = same_reply_runs["true"] / "final"
    assert (final / "chat_template.jinja").is_file()
    assert main(["generate", "--model", str(final), "--chat", "--prompt", "xq zzv blorp",
                 "--max-new-tokens", "24"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == REPLY


def test_preview_marks_the_trained_tokens(tmp_path, capsys):
    config = chat_recipe(tmp_path, same_reply_file(tmp_path / "same.jsonl", n=20))
    assert main(["preview", "--config", str(config), "-n", "1", "--max_seq_length", "90"]) == 0
    out = capsys.readouterr().out
    assert "data[0] " in out and "conversational, loss on answers only" in out
    assert "20 rows -> 20 samples; 0 truncated, 0 dropped" in out
    assert f"<|im_start|>assistant\n    [[{REPLY}<|im_end|>]]" in out
    assert out.count("[[") == 2  # the legend, and the reply: nothing else carries loss
    assert "tokens per sample: min " in out and "% carry loss" in out


@pytest.fixture(scope="module")
def chat_demo_run(tmp_path_factory):
    """recipes/configs/smollm2_chat.yaml as `make train CONFIG=...` runs it (hf-zero train, 2 ranks), with the tiny
    model and 3 steps instead of SmolLM2 and the full run (the README's slow test runs that), under ZeRO-3: one run
    for the demo config and for a ZeRO-3 + LoRA adapter saved with its chat template. (The default profile, cpu,
    runs `make train` in tests/commands/test_readme.py.)"""
    import yaml

    root = tmp_path_factory.mktemp("chat_demo")
    config = yaml.safe_load((REPO / "recipes" / "configs" / "smollm2_chat.yaml").read_text())
    out = root / "run"
    config.update(model_name_or_path="tiny-llama", max_seq_length=512, eval_samples=8, sample_prompts=4,
                  output_dir=str(out))
    config["stages"][0].update(steps=3, warmup_steps=1)  # a warmup as long as the stage is refused
    path = root / "smollm2_chat.yaml"
    path.write_text(yaml.safe_dump(config))
    proc = run_cmd([sys.executable, "-m", "hf_zero.cli", "train", "--profile", "zero3", "--config", path,
                    "--disable_tqdm", "true"])
    return out, proc


@pytest.mark.multiproc
def test_zero3_lora_adapter_reloads_with_its_chat_template(chat_demo_run):
    out, _ = chat_demo_run
    s = read_summary(out)
    assert (s["zero_stage"], s["world_size"], s["use_peft"], s["zero3_partitioned_at_build"]) == (3, 2, True, True)
    final = out / "final"
    assert (final / "chat_template.jinja").is_file() and (final / "adapter_config.json").is_file()
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert [r["when"] for r in samples] == ["start"] * 4 + ["end"] * 4  # generated by both ranks, gathered
    # What training saw, tokenized by hf_zero's pipeline with hf_zero's tokenizer set-up
    from hf_zero.core.config import Stage
    from hf_zero.data.builtin import resolve_data_path
    from hf_zero.data.chat import FormatOptions
    from hf_zero.data.model_names import get_tokenizer
    from hf_zero.data.stages import load_stage_data

    data = "builtin:shakespeare/which_play"
    stage = Stage(name="which_play", data=[data], steps=1)
    trained = load_stage_data(stage, get_tokenizer("tiny-llama"), 512, "text", 0, 0, formats=FormatOptions())
    row = json.loads(Path(resolve_data_path(data)).read_text().splitlines()[0])["messages"]
    from hf_zero.data.model_names import resolve_model_path

    # the adapter names its base by its hub id (the offline model's, in the hub cache); its folder is passed along
    assert json.loads((final / "adapter_config.json").read_text())["base_model_name_or_path"] == "hf-zero/tiny-llama"
    code = (  # plain peft + transformers, outside the repository: hf_zero is not imported
        "import json, sys, torch; from transformers import AutoModelForCausalLM, AutoTokenizer;"
        "from peft import PeftModel;"
        f"final = {str(final)!r}; row = json.loads(sys.argv[1]); base = sys.argv[2];"
        "tok = AutoTokenizer.from_pretrained(final);"
        "m = AutoModelForCausalLM.from_pretrained(base); m.resize_token_embeddings(len(tok));"
        "m = PeftModel.from_pretrained(m, final);"
        "ids = tok.apply_chat_template(row, tokenize=True, return_dict=True)['input_ids'];"
        "prompt = tok.apply_chat_template(row[:-1], tokenize=False, add_generation_prompt=True);"
        "loss = float(m(torch.tensor([ids]), labels=torch.tensor([ids])).loss);"
        "print(json.dumps({'ids': list(ids), 'prompt': prompt, 'loss': loss, 'vocab': len(tok)}))"
    )
    proc = run_cmd([sys.executable, "-c", code, json.dumps(row), resolve_model_path("tiny-llama")], cwd="/")
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["ids"] == trained.sources[0][0]["input_ids"]
    system, user = row[0]["content"], row[1]["content"]
    assert got["prompt"] == (f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n"
                             "<|im_start|>assistant\n")
    assert got["vocab"] == 514 and 0 < got["loss"] < 20
    from safetensors.torch import load_file

    saved = load_file(str(final / "adapter_model.safetensors"))
    # the two template tokens' rows were trained and saved with the adapter (embedding and untied LM head)
    assert saved["base_model.model.model.embed_tokens.weight"].shape[0] == 514
    assert saved["base_model.model.lm_head.weight"].shape[0] == 514


def test_bad_chat_row_stops_recipe_and_check(tmp_path, capsys):
    data = same_reply_file(tmp_path / "bad.jsonl", n=10)
    lines = data.read_text().splitlines()
    lines[4] = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"content": "no role"}]})
    data.write_text("\n".join(lines) + "\n")
    config = chat_recipe(tmp_path, data)
    want = f"stages[chat].data[0]: {data} row 5: messages[1] has no 'role'"
    proc = run_cmd([sys.executable, RECIPE, "--config", config, "--output_dir", tmp_path / "o"], check=False)
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("hf-zero: error:")]
    assert proc.returncode == 2 and len(errors) == 1 and want in errors[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert main(["check", "--profile", "zero2", "--config", str(config)]) == 2
    fail = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("FAIL data:")]
    assert len(fail) == 1 and want in fail[0]


@pytest.mark.multiproc
def test_chat_demo_config_on_the_tiny_model(chat_demo_run):
    out, proc = chat_demo_run
    s = read_summary(out)
    assert (s["profile"], s["world_size"], s["use_peft"], s["total_steps"]) == ("zero3", 2, True, 3)
    assert 0 <= s["exact_match_before"] <= 1 and 0 <= s["exact_match_after"] <= 1
    rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert [(r["step"], r["when"]) for r in rows] == [(0, "start")] * 4 + [(3, "end")] * 4
    # the held-out questions are the eval_data file's, answered by plays' titles
    from hf_zero.data.builtin import WHICH_PLAY_TITLES, resolve_data_path

    titles = set(WHICH_PLAY_TITLES.values())
    held_out = [json.loads(line)["messages"]
                for line in open(resolve_data_path("builtin:shakespeare/which_play_test"))]
    asked = {m[1]["content"]: m[2]["content"] for m in held_out}
    assert all(r["reference"] in titles and asked[r["question"]] == r["reference"] for r in rows)
    assert (out / "final" / "chat_template.jinja").is_file()
    assert (out / "final" / "adapter_model.safetensors").is_file()
    assert "stage 1/1 'which_play' starts at step 1" in proc.stdout
