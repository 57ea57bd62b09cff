"""Every command shown in the README or in docs/ runs, the recipe-key reference is the dataclasses' help, and the
README's links into docs/ land on a page and heading that exist."""

import importlib.util
import json
import re
from pathlib import Path

import pytest
from markdown.extensions.toc import slugify
from testing_utils import (
    ACCELERATE_LAUNCHER_LINES,
    REPO,
    docs_pages,
    foreign_lines,
    libaio_missing_reason,
    readme_commands,
    run_as_user,
    write_short_config,
)

README = (REPO / "README.md").read_text()
# `make test` is this suite itself (CI runs it through .ci/run); running it from inside would recurse. The suite never
# installs system packages: .ci/run runs scripts/system_deps.sh first, and tests/train/test_nvme.py runs it again where
# the packages are installed (test_system_deps_script_is_idempotent).
NOT_RUN_HERE = {"make test", "bash scripts/system_deps.sh"}


def _generator():
    """scripts/gen_key_reference.py, the one place that names the documented argument classes."""
    spec = importlib.util.spec_from_file_location("gen_key_reference", REPO / "scripts" / "gen_key_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_first_screen_has_the_two_commands():
    first = "\n".join(README.splitlines()[:15])
    assert "make train" in first and "make test" in first


def test_every_recipe_field_has_help_and_is_in_the_reference():
    gen = _generator()
    page = gen.PAGE.read_text()
    for dc in gen.documented_types():
        for f in gen.own_fields(dc):
            assert len(f.metadata.get("help", "")) > 10, f"{dc.__name__}.{f.name}: no help text"
            assert f"| `{f.name}` |" in page, f"{dc.__name__}.{f.name} is not in {gen.PAGE}"


def test_key_reference_is_generated_from_the_dataclasses():
    """docs/reference/recipe-keys.md is what scripts/gen_key_reference.py writes from the dataclasses today."""
    gen = _generator()
    assert gen.PAGE.read_text() == gen.render(), "regenerate it: make docs (or python scripts/gen_key_reference.py)"


def test_every_docs_page_opens_with_the_task_it_serves():
    for page in docs_pages():
        if page.parent.name == "bench":  # the bench's own report, as `hf-zero bench` writes it
            continue
        first = page.read_text().split("\n\n")[1]
        assert first.startswith("You want "), f"{page.relative_to(REPO)} opens with: {first[:80]}"


def _headings(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {slugify(re.sub(r"`", "", h), "-") for h in re.findall(r"^#+ (.+)$", text, re.M)}


def test_readme_links_into_docs_land():
    links = re.findall(r"\]\((docs/[^)#]+)(?:#([^)]+))?\)", README)
    assert len(links) >= 10
    for path, anchor in links:
        page = REPO / path
        assert page.is_file(), path
        assert not anchor or anchor in _headings(page), f"{path}#{anchor}: no such heading"


COMMANDS = [c for c in readme_commands() if c not in NOT_RUN_HERE]
# Longer than the default suite allows (the chat demo and what reads its output, the full bench): run with -m slow
# (`make test-all`), in README order.
SLOW = {"make train CONFIG=recipes/configs/smollm2_chat.yaml"}
# The multimodal demo (docs/multimodal.md: about 20 min here), its targets checked by _check_multimodal_demo
SLOW |= {"make train CONFIG=recipes/configs/multimodal_demo.yaml"}
# The preference demo (docs/preference.md), its targets checked by _check_dpo_demo
SLOW |= {"make train CONFIG=recipes/configs/smollm2_chat_dpo.yaml"}
SLOW |= {c for c in COMMANDS if "runs/smollm2_chat/" in c}
# The full default bench (~12 min here), also run with its targets checked by tests/bench/test_bench.py's slow
# test_make_bench_default; the default suite runs the quick bench through the same code (tests/bench/test_bench.py).
SLOW |= {"make bench"}
# `make train` trains SmolLM2 for 60 steps (5-10 min here): the default suite runs the same command on the same
# config cut to the tiny model and 2 steps a stage (test_make_train_on_the_tiny_model).
SLOW |= {"make train"}
# docs/vlm.md's packing measurement (scripts/vlm_packing.py: 6 runs on 2 ranks, ~5 min each model here); its rows and a
# 2-step run of the script are tests/vlm/test_vlm_packing_script.py
SLOW |= {c for c in COMMANDS if c.startswith("python scripts/vlm_packing.py")}


# Commands that start a launcher and its ranks: kept out of `make test-fast` (tests/conftest.py checks the split).
LAUNCHES = {c for c in COMMANDS
            if re.search(r"\b(make train|hf-zero train|accelerate launch|make bench|scripts/vlm_packing\.py)", c)
            and "--dry-run" not in c and "--help" not in c}
# ... and those that read what a launch wrote (`hf-zero export runs/tiny_ckpt`): they run after it, in README order.
WRITTEN = {run for c in LAUNCHES for run in re.findall(r"runs/\w+", c)}
# a config without --output_dir writes runs/<its name> (hf_zero.plan's default output folder)
WRITTEN |= {f"runs/{name}" for c in LAUNCHES if "--output_dir" not in c
            for name in re.findall(r"--config \S*?(\w+)\.yaml", c)}
LAUNCHES |= {c for c in COMMANDS if any(run in c for run in WRITTEN)}


# The launches `make test` keeps (tests/conftest.py's DEFAULT_LAUNCHES has the rest): resume on another number of
# ranks (runs/tiny_ckpt: 2 ranks, then 1, then its export) and sequence parallelism's profile (zero3_sp). The other
# launching commands are `extended`: `make test-extended` and `make test-all` run them, in README order.
DEFAULT = {c for c in LAUNCHES if "runs/tiny_ckpt" in c or "--profile zero3_sp" in c}


# Heavy in one process (seconds each: SmolLM2's weights read or converted, a nested `make`, the docs build, a
# multi-node dry run that starts the launcher's planning): `make test` runs them, `make test-fast` leaves them out.
HEAVY = {c for c in COMMANDS if "smollm2" in c or c.startswith("make ") or "multinode" in c
         or c.startswith("hf-zero init --model tiny-llama --data")
         # a real VLM's vision tower at its real widths, run on the CPU for its saved bytes (~30 s each)
         or "qwen25_vl_3b" in c}


def _marks(cmd):
    return ([pytest.mark.slow] * (cmd in SLOW) + [pytest.mark.multiproc] * (cmd in LAUNCHES)
            + [pytest.mark.extended] * (cmd in LAUNCHES - DEFAULT) + [pytest.mark.recipe_run] * (cmd in HEAVY))


@pytest.mark.parametrize("cmd", [pytest.param(c, marks=_marks(c)) for c in COMMANDS])
def test_readme_command_runs(cmd, readme_checkout, readme_runs):
    if "zero3_nvme" in cmd and "--dry-run" not in cmd and (reason := libaio_missing_reason()):
        pytest.skip(reason)
    proc = readme_runs[cmd]  # run here, or already by a test that reads more of the same run (tests/conftest.py)
    assert proc.returncode == 0, f"{cmd}\n{(proc.stdout + proc.stderr)[-3000:]}"
    assert "Traceback" not in proc.stderr
    CHECKS.get(cmd, lambda p, where: None)(proc, readme_checkout)


def _check_make_train(proc, where, run=Path("runs") / "smollm2_shakespeare"):
    s = json.loads((where / run / "summary.json").read_text())
    assert s["profile"] == "cpu" and s["world_size"] == 2 and s["use_peft"]
    assert s["eval_loss_after"] < s["eval_loss_before"]
    assert "[hf_zero] profile cpu: no GPU found" in proc.stdout
    assert (where / run / "final" / "adapter_model.safetensors").is_file()
    lines = proc.stdout.strip().splitlines()
    last = lines[-4]  # the result, then where the curves are and the commands that use the model
    assert last.startswith(f"[hf_zero] done: eval loss {s['eval_loss_before']:.4f} -> {s['eval_loss_after']:.4f}")
    assert re.fullmatch(rf'  try it: hf-zero generate --adapter \S*{run / "final"} --prompt "\.\.\."', lines[-2])
    return s


@pytest.mark.multiproc
def test_make_train_on_the_tiny_model(readme_checkout, tmp_path):
    """The README's first command, `make train` (the cpu profile, 2 ranks, LoRA on the Shakespeare curriculum), on
    its own config with the tiny model and 2 steps a stage instead of SmolLM2 and 60 steps (`make test-all` runs the
    full one)."""
    config = write_short_config(REPO / "recipes" / "configs" / "smollm2_shakespeare.yaml", tmp_path / "short.yaml",
                                [2, 2, 2], model_name_or_path="tiny-llama", eval_samples=4,
                                output_dir=str(tmp_path / "run"))
    proc = run_as_user(f"make train CONFIG={config}", readme_checkout, tmp_path / "hf_home")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert proc.stdout.splitlines()[0] == f".venv/bin/hf-zero train --config {config}"  # make's echo: one line
    s = _check_make_train(proc, tmp_path, run=Path("run"))
    assert [st["name"] for st in s["stages"]] == ["lines", "passages", "sonnets"] and s["total_steps"] == 6


def _check_dry_run(proc, where):
    line = proc.stdout.strip().splitlines()[-1]
    assert "h100x8.yaml" in line and "--mixed_precision bf16" in line and "HF_ZERO_PROFILE=" in line


def _check_estimate_recipe(proc, where):
    """The recipe's longest stage sets the length; the recommendation is a profile and a command that runs."""
    assert "micro-batch 2 x 192 tokens (stage sonnets" in proc.stdout
    assert "recommended: profile single_gpu" in proc.stdout
    assert proc.stdout.strip().splitlines()[-1].strip() == \
        "hf-zero train --profile single_gpu --nproc 1 --config recipes/configs/smollm2_shakespeare.yaml"


def _check_estimate_lora_8b(proc, where):
    """Llama-3.1-8B LoRA on one 24 GiB GPU fits single_gpu once its frozen base is held in bf16."""
    ddp = next(line for line in proc.stdout.splitlines() if line.startswith("ddp "))
    assert ddp.split()[-7:-4] == ["15.67", "GiB", "forward"], ddp  # peak/GPU, as the README's table says
    assert "recommended: profile single_gpu" in proc.stdout


def _check_estimate_qlora_8b(proc, where):
    """On a 12 GiB GPU nothing 16-bit fits on one process: QLoRA, said so."""
    ddp = next(line for line in proc.stdout.splitlines() if line.startswith("ddp 4-bit"))
    assert ddp.split()[-7:-4] == ["6.65", "GiB", "forward"], ddp  # peak/GPU, as the estimate page's table says
    assert "recommended: profile single_gpu" in proc.stdout and "QLoRA (add load_in_4bit: true" in proc.stdout


def _check_test_gpu(proc, where):
    from hf_zero.plan.profiles import gpu_count

    if gpu_count() == 0:  # every GPU test skipped, with the reason, and nothing counted as passed
        assert "no CUDA GPU on this machine" in proc.stdout and " passed" not in proc.stdout, proc.stdout[-2000:]


def _check_chat_demo(proc, where):
    s = json.loads((where / "runs" / "smollm2_chat" / "summary.json").read_text())
    assert (s["profile"], s["world_size"], s["use_peft"]) == ("cpu", 2, True)
    assert s["exact_match_after"] >= s["exact_match_before"] + 0.3 and s["eval_loss_after"] < s["eval_loss_before"]
    assert (where / "runs" / "smollm2_chat" / "final" / "chat_template.jinja").is_file()


def _answer(proc) -> str:
    return proc.stdout.strip().splitlines()[-1]


def _check_generate(proc, where):
    from hf_zero.data.builtin import WHICH_PLAY_TITLES

    if "--adapter runs/smollm2_chat/final" in proc.args:  # trained: a title, as asked
        assert _answer(proc) in WHICH_PLAY_TITLES.values(), _answer(proc)
    else:  # as shipped: a sentence about the passage
        assert len(_answer(proc).split()) > 5, _answer(proc)


def _check_export_run(proc, where):
    assert "[hf_zero] exporting runs/tiny_ckpt/final: the finished run's model" in proc.stdout
    assert (where / "runs" / "tiny_final_hf" / "model.safetensors").is_file()


def _check_profile_switch(proc, where):
    assert "checkpoint-10: zero3 on 2 ranks -> fsdp2 on 1 rank; converting once (kept inside the checkpoint)" \
        in proc.stdout
    assert json.loads((where / "runs" / "tiny_switch" / "summary.json").read_text())["world_size"] == 1


def _check_help_recipe(proc, where):
    assert "  --max_seq_length (default: 128)" in proc.stdout and "TrainingArguments field" in proc.stdout


def _check_long_context_gpu(proc, where):
    """Llama 3.1 8B at 128k tokens on 8 x 40 GiB (offline: hf_zero ships its shape): sp_size 4, as docs/profiles.md
    shows."""
    assert "recommended: profile zero3_sp, --nproc 8" in proc.stdout and "zero3_sp at sp_size 4" in proc.stdout
    assert "ctx128k  131072  59.80 GiB  38.85 GiB  28.38 GiB  23.14 GiB        sp 4" in proc.stdout


def _check_long_context(proc, where):
    s = json.loads((where / "runs" / "tiny_long_context" / "summary.json").read_text())
    assert (s["profile"], s["world_size"], s["sp_size"], s["dp_size"], s["global_batch"]) == ("zero3_sp", 2, 2, 1, 2)
    assert [st["name"] for st in s["stages"]] == ["ctx32", "ctx64", "ctx128"]
    assert s["eval_loss_after"] < s["eval_loss_before"]


def _check_multimodal_demo(proc, where):
    """Issue 43's targets: shapes >= 0.9, digits >= 0.8, the text task after the last step within 0.1 of its value
    at its own stage's end."""
    s = json.loads((where / "runs" / "multimodal_demo" / "summary.json").read_text())
    text, shapes, digits = s["stages"]
    assert (s["profile"], s["world_size"]) == ("cpu", 2)
    assert shapes["exact_match_after"] >= 0.9 and digits["exact_match_after"] >= 0.8, s["stages"]
    assert text["exact_match_after"] >= text["exact_match"] - 0.1, s["stages"]


def _check_dpo_demo(proc, where):
    """Issue 45's targets: held-out reward accuracy >= 0.9 after the preference stage, and the SFT stage's exact match
    after the last step no lower than at the SFT stage's end."""
    s = json.loads((where / "runs" / "smollm2_chat_dpo" / "summary.json").read_text())
    (pref,) = s["preference"]
    sft = s["stages"][0]
    assert (s["profile"], s["world_size"], pref["held_out_pairs"]) == ("cpu", 2, 50)
    assert pref["held_out_reward_accuracy_after"] >= 0.9, pref
    assert sft["exact_match_after"] >= sft["exact_match"], s["stages"]


def _check_dpo_estimate(proc, where):
    assert "stage prefer (dpo, sigmoid): 2 sequences per row (chosen + rejected)" in proc.stdout, proc.stdout
    assert "no reference model in memory" in proc.stdout


def _check_multimodal_preview(proc, where):
    assert "    <points> x4 at positions 5-8: " in proc.stdout and "{<image> x5}What digit is this?" in proc.stdout


def _check_multimodal_packing(proc, where):
    assert "  packing: 52 samples in 18 rows of 128 tokens, 88.5% text" in proc.stdout


def _check_vlm_estimate(proc, where):
    assert "vlm (qwen2_vl): an image of 16x16 pixels (the largest the processor lets through) is 4 tokens" \
        in proc.stdout and "gradients and optimizer state for vision_tower, projector, lora (23,520 " in proc.stdout


def _check_vlm_packing(proc, where):
    """Packed rows carry more non-padding tokens a step than unpacked ones, the same count in every repeat."""
    written = Path(re.search(r"written: (\S+)", proc.stdout).group(1))
    result = json.loads(written.read_text())
    assert result["same_tokens_every_repeat"] and result["tokens_per_step_gain"] > 1.5, result


def _check_vlm_real_estimate(proc, where):
    """Qwen2.5-VL-3B offline, from the shape hf_zero ships: the model, its image and the peaks and recommendation
    docs/vlm.md's "A real model" gives (1 x 24 GiB; 4 x L40, 48 GiB)."""
    out = proc.stdout
    assert "Qwen/Qwen2.5-VL-3B-Instruct: 3,821,265,152 params, trainable 66,642,176 (LoRA r=16)" in out, out
    assert "vlm (qwen2_5_vl): an image of 672x672 pixels (the largest the processor lets through) is 576 tokens" in out
    peaks = {line.split()[0]: " ".join(line.split()[-7:-5]) for line in out.splitlines()
             if line.split() and line.split()[0] in ("ddp", "zero3", "fsdp2")}
    four = "--gpus-per-node 4" in proc.args
    assert peaks == ({"ddp": "12.16 GiB", "zero3": "6.75 GiB", "fsdp2": "6.95 GiB"} if four else
                     {"ddp": "11.91 GiB", "zero3": "11.81 GiB", "fsdp2": "12.94 GiB"}), peaks
    command = (" --profile zero2 --nproc 4 --precision bf16 --config recipes/configs/qwen25_vl_3b.yaml "
               "--per_device_train_batch_size 8 --gradient_accumulation_steps 1" if four else
               " --profile single_gpu --nproc 1 --config recipes/configs/qwen25_vl_3b.yaml "
               "--per_device_train_batch_size 2 --gradient_accumulation_steps 4")
    assert "hf-zero train" + command in [line.strip() for line in out.splitlines()], out
    assert ("peak 37.7 GiB in bf16 of 48.0 GiB" if four else "peak 15.7 GiB in bf16 of 24.0 GiB") in out


def _check_multimodal_check(proc, where):
    assert "stage points trains encoder.points (6,464), projector.points (2,112): 8,576 parameters" in proc.stdout


def _check_multimodal_estimate(proc, where):
    assert "multimodal: encoders and projectors encoder.points 6,464, encoder.image 9,344" in proc.stdout


CHECKS = {
    "hf-zero preview --config recipes/configs/tiny_multimodal.yaml -n 1": _check_multimodal_preview,
    "hf-zero preview --config recipes/configs/tiny_multimodal.yaml -n 0 --packing true --max_seq_length 128":
        _check_multimodal_packing,
    "hf-zero estimate --config recipes/configs/tiny_vlm.yaml --profile cpu": _check_vlm_estimate,
    **{f"hf-zero estimate --config recipes/configs/qwen25_vl_3b.yaml --gpus-per-node {n} --gpu-memory {m}GiB":
       _check_vlm_real_estimate for n, m in ((1, 24), (4, 48))},
    **{c: _check_vlm_packing for c in readme_commands() if c.startswith("python scripts/vlm_packing.py")},
    "hf-zero check --config recipes/configs/tiny_multimodal.yaml": _check_multimodal_check,
    "hf-zero estimate --config recipes/configs/tiny_multimodal.yaml --profile cpu": _check_multimodal_estimate,
    "make train": _check_make_train,
    "hf-zero train --profile zero3_sp --config recipes/configs/tiny_long_context.yaml": _check_long_context,
    "hf-zero estimate --config recipes/configs/long_context_gpu.yaml --gpus-per-node 8 --gpu-memory 80GiB":
        _check_long_context_gpu,
    "make test-gpu": _check_test_gpu,
    "make train CONFIG=recipes/configs/smollm2_chat.yaml": _check_chat_demo,
    "make train CONFIG=recipes/configs/multimodal_demo.yaml": _check_multimodal_demo,
    "make train CONFIG=recipes/configs/smollm2_chat_dpo.yaml": _check_dpo_demo,
    "hf-zero estimate --config recipes/configs/smollm2_chat_dpo.yaml --gpus-per-node 1 --gpu-memory 24GiB":
        _check_dpo_estimate,
    **{c: _check_generate for c in readme_commands() if c.startswith("hf-zero generate")},
    "hf-zero train --profile h100x8 --precision bf16 --config recipes/configs/smollm2_shakespeare.yaml --dry-run":
        _check_dry_run,
    "hf-zero estimate --config recipes/configs/smollm2_shakespeare.yaml --gpus-per-node 1 --gpu-memory 24GiB":
        _check_estimate_recipe,
    "hf-zero estimate --model benchmarks/models/llama-3.1-8b --use-peft --gradient-checkpointing --seq-len 2048 "
    "--gpus-per-node 1 --gpu-memory 24GiB": _check_estimate_lora_8b,
    "hf-zero estimate --model benchmarks/models/llama-3.1-8b --use-peft --gradient-checkpointing --seq-len 2048 "
    "--gpus-per-node 1 --gpu-memory 12GiB": _check_estimate_qlora_8b,
    "hf-zero export runs/tiny_ckpt --out runs/tiny_final_hf --overwrite": _check_export_run,
    "hf-zero train --help-recipe": _check_help_recipe,
    "accelerate launch --config_file accelerate_configs/fsdp2.yaml --num_processes 1 recipes/curriculum.py --config "
    "recipes/configs/tiny_curriculum.yaml --output_dir runs/tiny_switch --global_batch_size 4 --save_strategy steps "
    "--save_steps 5 --resume_from_checkpoint runs/tiny_switch/checkpoint-10": _check_profile_switch,
}


# A README command for each command and entry point whose console must hold only hf_zero's lines (foreign_lines in
# testing_utils.py), with the lines that are someone else's by design: a plain `accelerate launch`'s own launcher.
CONSOLE = {
    "hf-zero check --profile fsdp2 --config recipes/configs/tiny_curriculum.yaml": (),
    "hf-zero preview --config recipes/configs/smollm2_chat.yaml -n 1": (),
    "hf-zero estimate --model tiny-llama --gpus-per-node 8 --precision bf16": (),
    next(c for c in COMMANDS if c.startswith("hf-zero generate --model")): (),  # its last line is the answer
    "hf-zero export runs/tiny_ckpt/checkpoint-15 --out runs/tiny_ckpt_hf --overwrite": (),  # DeepSpeed's zero_to_fp32
    "accelerate launch --config_file accelerate_configs/zero3.yaml recipes/curriculum.py --config "
    "recipes/configs/tiny_curriculum.yaml --output_dir runs/tiny_zero3": ACCELERATE_LAUNCHER_LINES,  # ZeRO-3's save
    "accelerate launch --config_file accelerate_configs/zero2.yaml recipes/classify.py --config "
    "recipes/configs/tiny_classify.yaml": ACCELERATE_LAUNCHER_LINES,  # a model loaded with new weights (its head)
    next(c for c in COMMANDS if c.startswith("make train PROFILE=zero3")): (r"\S*hf-zero train ",),  # make's echo
}


@pytest.mark.parametrize("cmd", [pytest.param(c, marks=_marks(c)) for c in CONSOLE])
def test_console_holds_only_hf_zero_lines(cmd, readme_runs):
    """No library warning, progress bar or notice, on every path: the `hf-zero` commands, `make`, the recipes' ranks
    under a plain `accelerate launch` (the runs test_readme_command_runs made)."""
    for earlier in COMMANDS[:COMMANDS.index(cmd)]:  # what the command reads is written by an earlier one
        if earlier in LAUNCHES and set(re.findall(r"runs/\w+", earlier)) & set(re.findall(r"runs/\w+", cmd)):
            assert readme_runs[earlier].returncode == 0
    proc = readme_runs[cmd]
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    stdout = proc.stdout.strip().splitlines()
    if cmd.startswith("hf-zero generate"):
        stdout = stdout[:-1]
    assert foreign_lines("\n".join(stdout) + "\n" + proc.stderr, *CONSOLE[cmd]) == []


def test_readme_commands_are_all_known():
    """Guard against an edit that silently drops the main job, or the docs pages, from the tested commands."""
    assert "make train" in COMMANDS and any(c.startswith("accelerate launch") for c in COMMANDS)
    assert "make docs" in COMMANDS and any(c.startswith("hf-zero estimate") for c in COMMANDS)
