"""A `dpo` stage (hf_zero.data.preference, hf_zero.train.preference): preference rows read as TRL reads them and
refused one row at a time; the loss, reward metrics and reference equal TRL's own DPOTrainer on the same rows,
reference and settings; the reference cache reused by a second run and refused for other rows or another model; an
SFT -> DPO curriculum on the tiny model whose reward accuracy rises."""

import copy
import json
import random
import shutil
import sys
from types import SimpleNamespace

import pytest
import torch
from testing_utils import RECIPE, REPO, launch_recipe, read_summary, run_cmd

from hf_zero.core.config import Stage
from hf_zero.core.errors import UserError
from hf_zero.data.model_names import get_tokenizer, resolve_model_path
from hf_zero.data.preference import reference_cache_bytes
from hf_zero.data.stages import build_collator, check_stage_files, load_stage_data
from hf_zero.train.preference import PreferenceMixin, PreferenceStage, preference_stages
from hf_zero.train.reference_cache import ReferenceCache

ERROR = "hf-zero: error:"


def words(rng, n):
    return " ".join("".join(rng.choice("abcdefghij") for _ in range(rng.randint(2, 5))) for _ in range(n))


def plain_rows(n=8, seed=0):
    """Answers of different lengths, so padding and the answer masks matter."""
    rng = random.Random(seed)
    return [{"prompt": f"Question: {words(rng, rng.randint(2, 6))}\nAnswer:",
             "chosen": " " + words(rng, rng.randint(1, 5)), "rejected": " " + words(rng, rng.randint(1, 5))}
            for _ in range(n)]


def chat_rows(n=8, seed=1):
    return [{"prompt": [{"role": "user", "content": r["prompt"]}],
             "chosen": [{"role": "assistant", "content": r["chosen"].strip()}],
             "rejected": [{"role": "assistant", "content": r["rejected"].strip()}]} for r in plain_rows(n, seed)]


def write_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def dpo_stage(data, **keys):
    return Stage(name="pref", data=str(data), steps=2, objective="dpo", **keys)


# ---------------------------------------------------------------- rows and keys refused, one line each

def load(tmp_path, rows, max_len=64, **keys):
    data = write_rows(tmp_path / "pairs.jsonl", rows)
    return load_stage_data(dpo_stage(data, **keys), get_tokenizer("tiny-llama"), max_len, "text", 8, 0)


@pytest.mark.parametrize("change, want", [
    (lambda r: r.pop("rejected"), "row 3: no rejected answer"),
    (lambda r: r.update(chosen="   "), "row 3: empty chosen answer"),
    (lambda r: r.update(rejected=""), "row 3: empty rejected answer"),
    (lambda r: r.update(prompt="Question: " + "abc " * 80), "row 3: the prompt is"),
    (lambda r: r.update(chosen=["not", "a", "string"]), "row 3: prompt, chosen and rejected must all be strings"),
])
def test_a_bad_row_is_one_line_naming_it(tmp_path, change, want):
    rows = plain_rows()
    change(rows[2])
    with pytest.raises(UserError) as err:
        load(tmp_path, rows)
    line = err.value.line()
    assert line.startswith("stages[pref].data[0]: ") and want in line and "\n" not in line, line
    assert "pairs.jsonl" in line


def test_columns_and_objective_must_agree(tmp_path):
    rows = [{k: v for k, v in r.items() if k != "rejected"} for r in plain_rows()]
    with pytest.raises(UserError, match="no column `rejected`"):
        load(tmp_path, rows)
    text = write_rows(tmp_path / "text.jsonl", [{"text": "some words here"}] * 8)
    with pytest.raises(UserError, match="has no prompt/chosen/rejected rows, and the stage's objective is dpo"):
        load_stage_data(dpo_stage(text), get_tokenizer("tiny-llama"), 64, "text", 0, 0)
    pairs = write_rows(tmp_path / "pairs2.jsonl", plain_rows())
    with pytest.raises(UserError, match="set `objective: dpo` on the stage"):
        load_stage_data(Stage(name="sft", data=str(pairs), steps=2), get_tokenizer("tiny-llama"), 64, "text", 0, 0)


@pytest.mark.parametrize("keys, want", [
    ({"objective": "ppo"}, "stages[s].objective: unknown objective 'ppo'"),
    ({"beta": 0.2}, "stages[s].beta: is a preference key, and the stage's objective is sft"),
    ({"objective": "dpo", "loss_type": "kto"}, "stages[s].loss_type: unknown loss type 'kto'"),
    ({"objective": "dpo", "beta": 0}, "stages[s].beta: must be a positive number"),
    ({"objective": "dpo", "simpo_gamma": 1.0}, "stages[s].simpo_gamma: only applies with loss_type: simpo"),
    ({"objective": "dpo", "loss_type": "simpo", "sft_weight": 0.2},
     "stages[s].sft_weight: 0.2: a weight of 0 or more"),
    ({"objective": "dpo", "sft_weight": -1}, "stages[s].sft_weight: -1: a weight of 0 or more"),
    ({"sft_weight": 0.2}, "stages[s].sft_weight: is a preference key"),
])
def test_stage_keys_are_checked(keys, want):
    with pytest.raises(UserError) as err:
        Stage(name="s", data="x.jsonl", steps=1, **keys)
    assert err.value.line().startswith(want), err.value.line()


def test_defaults_and_rows_of_a_dpo_stage(tmp_path):
    stage = Stage(name="s", data="x.jsonl", steps=1, objective="dpo")
    assert (stage.beta, stage.loss_type, stage.simpo_gamma) == (0.1, "sigmoid", None)
    assert Stage(name="s", data="x.jsonl", steps=1, objective="dpo", loss_type="simpo").simpo_gamma == 0.5
    data = load(tmp_path, plain_rows(6))  # eval_samples 8: a quarter of the 6 rows is held out, as in any stage
    # the training rows numbered in order, the held-out pair after them: the rows of the reference cache
    assert [s["row"] for s in data.sources[0]] == list(range(5)) and [s["row"] for s in data.eval_samples] == [5]
    assert check_stage_files(dpo_stage(tmp_path / "pairs.jsonl"), eval_samples=32) == [6]
    with pytest.raises(UserError, match="3 row.*too few to hold any out"):  # the preflight's held-out rule applies
        check_stage_files(dpo_stage(write_rows(tmp_path / "three.jsonl", plain_rows(3))), eval_samples=32)
    # eval_data: held-out pairs of their own (preference rows), numbered after the training rows
    held = write_rows(tmp_path / "held.jsonl", plain_rows(3, seed=5))
    data = load_stage_data(dpo_stage(tmp_path / "pairs.jsonl", eval_data=str(held)), get_tokenizer("tiny-llama"),
                           64, "text", 2, 0)
    assert [s["row"] for s in data.sources[0]] == list(range(6)) and [s["row"] for s in data.eval_samples] == [6, 7]
    text = write_rows(tmp_path / "text.jsonl", [{"text": "some words here"}] * 8)
    with pytest.raises(UserError, match="has no prompt/chosen/rejected rows"):
        load_stage_data(dpo_stage(tmp_path / "pairs.jsonl", eval_data=str(text)), get_tokenizer("tiny-llama"),
                        64, "text", 2, 0)


def test_check_reads_the_preference_rows_as_the_run_does(tmp_path, capsys):
    from hf_zero.cli import main

    rows = preferred_rows(8)
    good = sft_dpo_recipe(tmp_path, write_rows(tmp_path / "pairs.jsonl", rows))
    assert main(["check", "--profile", "zero2", "--config", str(good)]) == 0
    # 2 of the 8 pairs held out (eval_samples 4, at most a quarter of a source), as the run holds them out
    assert "ok data: 2 stage(s), training samples after tokenization: sft 196, pref 6 (preference)" in \
        capsys.readouterr().out
    rows[6]["rejected"] = None
    write_rows(tmp_path / "pairs.jsonl", rows)
    assert main(["check", "--profile", "zero2", "--config", str(good)]) == 2
    fail = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("FAIL data:")]
    assert len(fail) == 1 and f"stages[pref].data[0]: {tmp_path / 'pairs.jsonl'} row 7: no rejected answer" in fail[0]


def test_preview_shows_each_row_as_its_chosen_and_rejected_sequence(tmp_path, capsys):
    from hf_zero.cli import main

    config = sft_dpo_recipe(tmp_path, write_rows(tmp_path / "pairs.jsonl", preferred_rows(8)))
    assert main(["preview", "--config", str(config), "--stage", "pref", "-n", "1"]) == 0
    out = capsys.readouterr().out
    assert "pairs.jsonl: preference, loss on chosen vs rejected" in out and "6 training samples, 2 held out" in out
    assert "sample 1 chosen (" in out and "Answer:[[ yes, that is right.<|endoftext|>]]" in out
    assert "sample 1 rejected (" in out and "Answer:[[ no idea.<|endoftext|>]]" in out


@pytest.mark.recipe_run
def test_init_makes_a_dpo_stage_of_preference_rows_and_its_lora_run_learns(tmp_path, capsys):
    """`hf-zero init --data pairs.jsonl` (what `hf-zero train --model M --data pairs.jsonl` runs): one dpo stage,
    LoRA as every init recipe; the recipe trains it on one process."""
    import yaml

    from hf_zero.cli import main

    pairs = write_rows(tmp_path / "pairs.jsonl", preferred_rows(16))
    assert main(["init", "--model", "tiny-llama", "--data", str(pairs)]) == 0
    text = capsys.readouterr().out
    assert "16 rows, preference (loss on chosen vs rejected)" in text
    recipe = yaml.safe_load(text)
    assert recipe["use_peft"] is True
    assert recipe["stages"] == [{"name": "pairs", "data": str(pairs), "epochs": 1, "objective": "dpo", "beta": 0.1,
                                 "loss_type": "sigmoid"}]
    recipe.update(learning_rate=1.0e-2, per_device_train_batch_size=4, lora_dropout=0.0, save_final_model=False)
    recipe["stages"][0]["beta"] = 0.5
    config = tmp_path / "init.yaml"
    config.write_text(yaml.safe_dump(recipe))
    recipe_run = run_cmd([sys.executable, RECIPE, "--config", config, "--output_dir", tmp_path / "run",
                          "--disable_tqdm", "true"])
    s = read_summary(tmp_path / "run")
    # the init recipe's eval_samples (4) hold 4 pairs out: 12 rows train, 3 steps of 4
    assert s["use_peft"] is True and s["total_steps"] == 3, recipe_run.stdout[-2000:]
    (pref,) = s["preference"]
    assert pref["reference"] == "computed" and abs(pref["reward_margin_first"]) < 1e-4
    assert pref["reward_accuracy_last"] == 1.0 and pref["reward_margin_last"] > pref["reward_margin_first"]
    assert (pref["held_out_pairs"], pref["held_out_reward_accuracy_before"]) == (4, 0.0)
    assert pref["held_out_reward_accuracy_after"] == 1.0


# ---------------------------------------------------------------- TRL's DPOTrainer on the same rows

def tiny_models(tokenizer):
    """(policy, reference): the tiny model and a copy moved away from it, so the log-ratios are not zero."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(resolve_model_path("tiny-llama"), dtype=torch.float32)
    if len(tokenizer) > ref.get_input_embeddings().weight.shape[0]:
        ref.resize_token_embeddings(len(tokenizer))
    policy = copy.deepcopy(ref)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return policy.train(), ref.eval()


class _Rest:
    def compute_loss(self, *args, **kwargs):
        raise AssertionError("a preference batch went past PreferenceMixin")

    def add_callback(self, callback):
        self.callbacks = [callback]


class _OneStageTrainer(PreferenceMixin, _Rest):
    """PreferenceMixin with what it reads of a CurriculumTrainer: a one-stage schedule at step 0."""

    def __init__(self, model, stage, samples, tokenizer, output_dir):
        from accelerate import Accelerator

        from hf_zero.data.curriculum import build_schedule

        self.model, self.accelerator, self.processing_class = model, Accelerator(cpu=True), tokenizer
        self.args = SimpleNamespace(output_dir=str(output_dir), per_device_eval_batch_size=3,
                                    device=torch.device("cpu"))
        super().__init__(preference={0: PreferenceStage(0, stage, samples)})
        self.schedule = build_schedule([stage], [len(samples)], 4, 1e-3)
        self.state = SimpleNamespace(global_step=0)


def trl_dpo(policy, ref, rows, tokenizer, tmp_path, loss_type, beta, sft_weight=None):
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    losses = {"loss_type": [loss_type, "sft"], "loss_weights": [1.0, sft_weight]} if sft_weight else \
        {"loss_type": [loss_type]}
    args = DPOConfig(output_dir=str(tmp_path / "trl"), beta=beta, **losses, bf16=False, use_cpu=True,
                     per_device_train_batch_size=len(rows), precompute_ref_log_probs=True, report_to=[],
                     max_length=64, dataset_num_proc=None)
    return DPOTrainer(model=policy, ref_model=ref, args=args, train_dataset=Dataset.from_list(rows),
                      processing_class=tokenizer)


@pytest.mark.parametrize("form, loss_type, beta, sft_weight", [
    ("plain", "sigmoid", 0.1, None), ("plain", "ipo", 0.3, None), ("chat", "sigmoid", 0.5, None),
    ("chat", "sigmoid", 0.1, 0.5)])  # sft_weight: TRL's loss_type [sigmoid, sft], loss_weights [1, 0.5]
def test_loss_and_metrics_equal_trls_dpo_trainer(tmp_path, form, loss_type, beta, sft_weight):
    rows = plain_rows() if form == "plain" else chat_rows()
    tokenizer = get_tokenizer("tiny-llama")
    stage = dpo_stage(write_rows(tmp_path / "pairs.jsonl", rows), loss_type=loss_type, beta=beta,
                      sft_weight=sft_weight)
    data = load_stage_data(stage, tokenizer, 64, "text", 0, 0)  # a chat source gives the tokenizer its template
    samples = preference_stages([stage], [data])[0].samples
    policy, ref = tiny_models(tokenizer)
    theirs = trl_dpo(copy.deepcopy(policy), copy.deepcopy(ref), rows, tokenizer, tmp_path, loss_type, beta, sft_weight)
    their_rows = [theirs.train_dataset[i] for i in range(len(rows))]
    assert [s["prompt_ids"] for s in samples] == [r["prompt_ids"] for r in their_rows]
    # tokenized as DPOTrainer tokenizes, and cut at max_seq_length as its collator cuts at max_length
    our_batch, their_batch = build_collator(tokenizer, preference=True)(samples), theirs.data_collator(their_rows)
    for key in ("input_ids", "attention_mask", "completion_mask"):
        assert torch.equal(our_batch[key], their_batch[key]), key
    assert torch.equal(our_batch["pref_row"], torch.arange(len(rows)))
    their_loss = theirs.compute_loss(theirs.model, their_batch).item()
    their_metrics = {k: v[0] for k, v in theirs._metrics["train"].items()}

    ours = _OneStageTrainer(ref, stage, samples, tokenizer, tmp_path / "out")
    reference = ours._stage_reference(ours.preference[0], ref)  # the stage's start: `ref` is the model then
    their_ref = torch.tensor([[r["ref_chosen_logps"], r["ref_rejected_logps"]] for r in their_rows])
    torch.testing.assert_close(reference, their_ref, rtol=1e-5, atol=1e-5)
    our_loss = ours.compute_loss(policy, our_batch).item()
    assert our_loss == pytest.approx(their_loss, abs=1e-5)
    assert abs(their_loss - {"sigmoid": 0.6931, "ipo": (1 / (2 * beta)) ** 2}[loss_type]) > 1e-3  # not trivial
    if sft_weight:  # the sft term is in: the same pairs without it give another loss
        alone = dpo_stage(tmp_path / "pairs.jsonl", loss_type=loss_type, beta=beta)
        plain = _OneStageTrainer(ref, alone, samples, tokenizer, tmp_path / "alone")
        plain._stage_reference(plain.preference[0], ref)
        assert plain.compute_loss(policy, our_batch).item() < our_loss - 0.1
    for key in ("rewards/accuracies", "rewards/margins", "rewards/chosen", "logps/chosen", "logps/rejected"):
        assert ours._pref_metrics[key][0] == pytest.approx(their_metrics[key], rel=1e-5, abs=1e-5), key


def test_simpo_equals_trls_cpo_trainer_and_takes_no_reference(tmp_path):
    """SimPO is TRL's CPOTrainer with loss_type simpo and cpo_alpha 0: its loss and reward metrics on its own batch
    (CPO tokenizes with BOS, so the batch is CPO's, fed to the dpo stage's loss as a preference batch)."""
    from datasets import Dataset
    from trl.experimental.cpo import CPOConfig, CPOTrainer

    tokenizer = get_tokenizer("tiny-llama")
    rows = plain_rows()
    stage = dpo_stage(write_rows(tmp_path / "pairs.jsonl", rows), loss_type="simpo", beta=2.0, simpo_gamma=0.3)
    policy, _ = tiny_models(tokenizer)
    args = CPOConfig(output_dir=str(tmp_path / "cpo"), loss_type="simpo", cpo_alpha=0.0, beta=2.0, simpo_gamma=0.3,
                     bf16=False, use_cpu=True, report_to=[], per_device_train_batch_size=len(rows), max_length=64)
    cpo = CPOTrainer(model=copy.deepcopy(policy), args=args, train_dataset=Dataset.from_list(rows),
                     processing_class=tokenizer)
    batch = cpo.data_collator([cpo.train_dataset[i] for i in range(len(rows))])
    their_loss, their_metrics = cpo.get_batch_loss_metrics(cpo.model.train(), batch)
    cat = CPOTrainer.concatenated_inputs(batch, padding_value=tokenizer.pad_token_id)
    ours_batch = {"input_ids": cat["concatenated_input_ids"], "attention_mask": cat["concatenated_attention_mask"],
                  "completion_mask": (cat["concatenated_labels"] != -100).long(),
                  "pref_row": torch.arange(len(rows))}
    ours = _OneStageTrainer(policy, stage, [], tokenizer, tmp_path / "out")
    loss = ours.compute_loss(policy, ours_batch)
    assert loss.item() == pytest.approx(their_loss.item(), abs=1e-5)
    for key in ("rewards/accuracies", "rewards/margins", "rewards/chosen", "logps/chosen", "logps/rejected"):
        assert ours._pref_metrics[key][0] == pytest.approx(their_metrics[key], rel=1e-5, abs=1e-5), key
    loss.backward()
    assert policy.lm_head.weight.grad is not None
    # reference-free: no reference callback, nothing computed or written
    assert not hasattr(ours, "callbacks") and not (tmp_path / "out" / "reference_logps").exists()


# ---------------------------------------------------------------- the cache: reused, refused

def test_cache_refuses_other_rows_and_another_model(tmp_path):
    tokenizer = get_tokenizer("tiny-llama")
    stage = dpo_stage(write_rows(tmp_path / "pairs.jsonl", plain_rows()))
    samples = preference_stages([stage], [load_stage_data(stage, tokenizer, 64, "text", 0, 0)])[0].samples
    policy, ref = tiny_models(tokenizer)
    pstage = PreferenceStage(0, stage, samples)
    calls = []

    def compute():
        calls.append(1)
        return torch.zeros(len(samples), 2)

    cache = ReferenceCache(tmp_path, pstage)
    assert cache.get(ref, ref, at_start=True, compute=compute)[1] == "computed" and calls == [1]
    written = sum(f.stat().st_size for f in (tmp_path / "reference_logps").iterdir())
    assert abs(written - reference_cache_bytes(len(samples))) < 64, written  # what `hf-zero estimate` says
    assert cache.get(ref, ref, at_start=True, compute=compute)[1] == "reused" and calls == [1]
    assert cache.get(policy, policy, at_start=False, compute=compute)[1] == "reused"  # mid-stage: weights moved on
    with pytest.raises(UserError) as err:
        cache.get(policy, policy, at_start=True, compute=compute)
    assert "made from another model" in err.value.line() and "pref.json" in err.value.field
    other = PreferenceStage(0, stage, samples[:-1])
    with pytest.raises(UserError, match=r"made from other rows \(8 rows.*\(7 rows"):
        ReferenceCache(tmp_path, other).get(ref, ref, at_start=True, compute=compute)
    shutil.rmtree(tmp_path / "reference_logps")
    with pytest.raises(UserError, match="missing: stage pref's reference is computed at its start"):
        cache.get(ref, ref, at_start=False, compute=compute)
    assert calls == [1]


# ---------------------------------------------------------------- SFT -> DPO in one run

def sft_dpo_recipe(root, pairs, out_name="run"):
    cfg = {"model_name_or_path": "tiny-llama", "max_seq_length": 64, "eval_samples": 4, "sample_prompts": 0,
           "per_device_train_batch_size": 4, "seed": 0, "save_final_model": False,
           "save_strategy": "steps", "save_steps": 5,  # a checkpoint inside the preference stage
           "stages": [{"name": "sft", "data": str(REPO / "recipes/data/tiny/short.jsonl"), "steps": 2},
                      {"name": "pref", "data": str(pairs), "steps": 6, "objective": "dpo", "beta": 0.5,
                       "learning_rate": 5.0e-3, "lr_schedule": "constant"}]}
    path = root / "sft_dpo.yaml"
    path.write_text(json.dumps(cfg))  # JSON is YAML
    return path


def preferred_rows(n=32, seed=0):
    rng = random.Random(seed)
    return [{"prompt": f"Question: {words(rng, rng.randint(3, 6))}\nAnswer:", "chosen": " yes, that is right.",
             "rejected": " no idea."} for _ in range(n)]


def recipe(config, out, check=True):
    return run_cmd([sys.executable, RECIPE, "--config", config, "--output_dir", out, "--disable_tqdm", "true"],
                   check=check)


@pytest.fixture(scope="module")
def sft_dpo_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft_dpo")
    config = sft_dpo_recipe(root, write_rows(root / "pairs.jsonl", preferred_rows()))
    proc = recipe(config, root / "run")
    return root, config, proc


@pytest.mark.recipe_run
def test_sft_then_dpo_in_one_run_raises_reward_accuracy(sft_dpo_run):
    root, _, proc = sft_dpo_run
    s = read_summary(root / "run")
    assert [row["name"] for row in s["stages"]] == ["sft", "pref"] and s["total_steps"] == 8
    (pref,) = s["preference"]
    # 4 of the 32 pairs held out (eval_samples 4), as any stage's held-out slice
    assert (pref["stage"], pref["loss_type"], pref["beta"], pref["rows"], pref["reference"]) == \
        ("pref", "sigmoid", 0.5, 28, "computed")
    # the first preference step: the policy is the reference, so nothing is preferred yet (a margin of rounding:
    # the reference's batches were padded differently)
    assert abs(pref["reward_margin_first"]) < 1e-4 and pref["reward_accuracy_first"] < 1.0
    # the held-out pairs: no pair won at the stage's start (every reward 0), all of them at its end
    assert pref["held_out_pairs"] == 4 and (pref["held_out_reward_accuracy_before"],
                                           pref["held_out_reward_margin_before"]) == (0.0, 0.0)
    assert pref["held_out_reward_accuracy_after"] == 1.0 and pref["held_out_reward_margin_after"] > 1.0
    assert "held-out reward accuracy 0.00 -> 1.00 (4 pairs, stage pref); " in proc.stdout
    assert "[hf_zero] stage pref: held-out reward accuracy 1.00, margin " in proc.stdout
    assert pref["reward_accuracy_last"] == 1.0 and pref["reward_margin_last"] > 1.0
    losses = s["losses"]
    assert losses[2] == pytest.approx(0.6931, abs=1e-3) and losses[-1] < 0.3  # log 2, then learnt
    history = json.loads((root / "run" / "log_history.json").read_text())
    assert all("rewards/accuracies" in h for h in history if "loss" in h and h["step"] > 2)
    assert not any("rewards/accuracies" in h for h in history if "loss" in h and h["step"] <= 2)
    assert "stage pref: reference log-probs of 32 rows (4 of them held out) computed (" in proc.stdout
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(next((root / "run").rglob("events.out.tfevents.*")).parent))
    acc.Reload()
    for tag in ("train/rewards/accuracies", "train/rewards/margins", "train/logps/chosen", "train/logps/rejected"):
        assert [e.step for e in acc.Scalars(tag)] == list(range(3, 9)), tag
    assert acc.Scalars("train/rewards/accuracies")[-1].value == 1.0
    steps = {int(ln.split()[1].split("/")[0]): ln for ln in proc.stdout.splitlines() if ln.startswith("step ")}
    assert "reward acc" not in steps[2] and "margin 0.000" in steps[3]
    assert "reward acc 1.00" in steps[8]


@pytest.mark.recipe_run
def test_a_resume_inside_the_stage_reuses_the_cache(sft_dpo_run, tmp_path):
    """Stopped after checkpoint-5 (3 steps into the preference stage): the resumed run reads the cache, and its
    steps are the uninterrupted run's."""
    root, config, _ = sft_dpo_run
    out = tmp_path / "resumed"
    shutil.copytree(root / "run", out)
    for name in ("summary.json", "log_history.json"):
        (out / name).unlink()
    for extra in [p for p in out.glob("checkpoint-*") if p.name != "checkpoint-5"]:
        shutil.rmtree(extra)
    (out / "latest_checkpoint").write_text("checkpoint-5\n")
    before = (out / "reference_logps" / "pref.safetensors").read_bytes()
    proc = recipe(config, out)
    assert "stage pref: reference log-probs of 32 rows (4 of them held out) reused" in proc.stdout
    assert (out / "reference_logps" / "pref.safetensors").read_bytes() == before
    s, full = read_summary(out), read_summary(root / "run")
    assert s["resumed_from"].endswith("checkpoint-5") and s["preference"][0]["reference"] == "reused"
    for key in ("held_out_reward_accuracy_before", "held_out_reward_accuracy_after", "held_out_reward_margin_after"):
        assert s["preference"][0][key] == pytest.approx(full["preference"][0][key], abs=1e-5), key
    assert len(s["losses"]) == 8 and s["losses"] == pytest.approx(full["losses"], abs=1e-6)  # 6-8 trained again


@pytest.mark.recipe_run
def test_a_second_run_reuses_the_cache_and_other_rows_are_refused(sft_dpo_run, tmp_path):
    root, config, _ = sft_dpo_run
    cached = root / "run" / "reference_logps"
    again = tmp_path / "again"
    again.mkdir()
    shutil.copytree(cached, again / "reference_logps")
    before = (again / "reference_logps" / "pref.safetensors").read_bytes()
    proc = recipe(config, again)
    assert "stage pref: reference log-probs of 32 rows (4 of them held out) reused" in proc.stdout
    assert (again / "reference_logps" / "pref.safetensors").read_bytes() == before
    assert read_summary(again)["losses"] == pytest.approx(read_summary(root / "run")["losses"], abs=1e-6)
    assert read_summary(again)["preference"][0]["reference"] == "reused"

    rows = preferred_rows()
    rows[5]["chosen"] = " yes, quite right."
    changed = sft_dpo_recipe(tmp_path, write_rows(tmp_path / "pairs.jsonl", rows))
    other = tmp_path / "other"
    other.mkdir()
    shutil.copytree(cached, other / "reference_logps")
    proc = recipe(changed, other, check=False)
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith(ERROR)]
    assert proc.returncode == 2 and len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "reference_logps/pref.json: made from other rows" in errors[0]
    assert "step 1/" not in proc.stdout  # refused before the first step, not at the stage's start


# ---------------------------------------------------------------- every profile on 2 ranks (extended)

PROFILES_2_RANKS = ("ddp", "zero2", "zero3", "zero3_offload", "fsdp2")


@pytest.fixture(scope="module")
def profile_runs(tmp_path_factory):
    """The SFT -> DPO curriculum on 2 CPU ranks under each profile (4 per rank, 8 a step)."""
    root = tmp_path_factory.mktemp("pref_profiles")
    config = sft_dpo_recipe(root, write_rows(root / "pairs.jsonl", preferred_rows()))
    runs = {}
    for profile in PROFILES_2_RANKS:
        launch_recipe(profile, root / profile, config=config)
        runs[profile] = root / profile
    return runs


@pytest.mark.multiproc
def test_every_profile_gives_the_same_preference_steps(profile_runs):
    from safetensors.torch import load_file

    base = read_summary(profile_runs["ddp"])
    ref = load_file(str(profile_runs["ddp"] / "reference_logps" / "pref.safetensors"))["logps"]
    for profile, out in profile_runs.items():
        s = read_summary(out)
        assert (s["world_size"], s["total_steps"]) == (2, 8), profile
        assert s["losses"] == pytest.approx(base["losses"], abs=1e-4), profile  # SFT steps, then the preference ones
        assert s["preference"][0]["reward_accuracy_last"] == 1.0, profile
        logps = load_file(str(out / "reference_logps" / "pref.safetensors"))["logps"]
        torch.testing.assert_close(logps, ref, rtol=1e-5, atol=1e-4, msg=profile)


# ---------------------------------------------------------------- the reference on 2 ranks: each its own rows

SHARES = '''
import json, sys
import torch
from accelerate import Accelerator
from transformers import AutoModelForCausalLM
from hf_zero.data.model_names import get_tokenizer, resolve_model_path
from hf_zero.train.preference_logps import answer_logps

acc = Accelerator(cpu=True)
tokenizer = get_tokenizer("tiny-llama")
model = AutoModelForCausalLM.from_pretrained(resolve_model_path("tiny-llama"), dtype=torch.float32)
if len(tokenizer) > model.get_input_embeddings().weight.shape[0]:
    model.resize_token_embeddings(len(tokenizer))
forwarded = []
model.register_forward_hook(lambda m, args, kw, out: forwarded.append(kw["input_ids"].shape[0]), with_kwargs=True)
samples = json.loads(open(sys.argv[1]).read())
logps = answer_logps(model, samples, 2, torch.device("cpu"), tokenizer.pad_token_id, acc)
out = {"world": acc.num_processes, "sequences": sum(forwarded), "logps": logps.tolist()}
open(f"{sys.argv[2]}.{acc.process_index}.json", "w").write(json.dumps(out))
'''


@pytest.mark.multiproc
def test_two_ranks_each_compute_their_own_rows_and_gather_all(tmp_path):
    """7 rows on 2 ranks: each rank forwards its share (4 rows, the second padded with a repeated row), and both
    hold every row's log-probabilities, those of one process; the held-out reward accuracy from them is one
    process's (every pair once, the padding dropped)."""
    from hf_zero.train.preference_logps import answer_logps
    from hf_zero.train.preference_report import pair_rewards

    tokenizer = get_tokenizer("tiny-llama")
    stage = dpo_stage(write_rows(tmp_path / "pairs.jsonl", plain_rows(7)))
    samples = preference_stages([stage], [load_stage_data(stage, tokenizer, 64, "text", 0, 0)])[0].samples
    (tmp_path / "samples.json").write_text(json.dumps(samples))
    (tmp_path / "shares.py").write_text(SHARES)
    _, ref = tiny_models(tokenizer)  # the offline model built here, in one process, before the ranks read it
    run_cmd([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", tmp_path / "shares.py",
             tmp_path / "samples.json", tmp_path / "out"], timeout=600)
    ranks = [json.loads((tmp_path / f"out.{r}.json").read_text()) for r in (0, 1)]
    assert [r["world"] for r in ranks] == [2, 2]
    assert [r["sequences"] for r in ranks] == [2 * 4, 2 * 4]  # 4 rows each (chosen + rejected), not all 7
    assert ranks[0]["logps"] == ranks[1]["logps"]
    one = answer_logps(ref, samples, 2, torch.device("cpu"), tokenizer.pad_token_id)
    gathered = torch.tensor(ranks[0]["logps"])
    assert gathered.shape == (7, 4) and torch.equal(gathered[:, 2:], one[:, 2:])  # the answers' token counts
    torch.testing.assert_close(gathered, one, rtol=1e-5, atol=1e-5)
    policy = one.clone()
    policy[:, 0] += torch.tensor([1.0, -1.0, 1.0, 1.0, -1.0, 1.0, 1.0])  # 5 of 7 pairs won
    for stage_ in (stage, dpo_stage(tmp_path / "pairs.jsonl", loss_type="simpo")):
        assert pair_rewards(stage_, policy, gathered[:, :2]) == pytest.approx(pair_rewards(stage_, policy, one[:, :2]))
    assert pair_rewards(stage, policy, one[:, :2])[0] == pytest.approx(5 / 7)


# ---------------------------------------------------------------- hf-zero estimate of a dpo stage

def test_estimate_counts_two_sequences_a_row_and_the_reference_cache(tmp_path, capsys):
    """The dpo stage's activations are those of 2 x micro-batch sequences: twice the same recipe's with an SFT stage
    of the same length (both with full logits, as a preference batch has); its cache's size on disk is printed."""
    from hf_zero.cli import main

    dpo = json.loads(sft_dpo_recipe(tmp_path, write_rows(tmp_path / "pairs.jsonl", preferred_rows(32))).read_text())
    dpo["fused_cross_entropy"] = False
    sft = copy.deepcopy(dpo)
    sft["stages"][1] = {"name": "pref", "data": dpo["stages"][0]["data"], "steps": 6}
    simpo = copy.deepcopy(dpo)
    simpo["stages"][1]["loss_type"] = "simpo"

    def estimate(cfg, name, *flags):
        path = tmp_path / f"{name}.yaml"
        path.write_text(json.dumps(cfg))
        assert main(["estimate", "--config", str(path), "--profile", "zero2", *flags]) == 0
        return capsys.readouterr().out

    ours, theirs = (json.loads(estimate(c, n, "--json")) for c, n in ((dpo, "dpo"), (sft, "sft")))
    act = [r["strategies"][0]["gpu_bytes_per_rank"]["activations"] for r in (ours, theirs)]
    assert act[0] == 2 * act[1] and ours["inputs"]["sequences_per_row"] == 2, act
    (pref,) = ours["inputs"]["preference"]
    assert (pref["stage"], pref["reference_rows"], pref["cache_bytes"]) == ("pref", 32, reference_cache_bytes(32))
    assert theirs["inputs"]["preference"] == []
    text = estimate(dpo, "dpo")
    assert "(stage pref, the most tokens a row: chosen + rejected;" in text
    assert ("  stage pref (dpo, sigmoid): 2 sequences per row (chosen + rejected) with full logits, the peak counted "
            f"so; reference log-probs cached on disk: {reference_cache_bytes(32)} B for 32 rows "
            "(output_dir/reference_logps/pref.safetensors), no reference model in memory") in text
    assert "stage pref (dpo, simpo): 2 sequences per row" in (text := estimate(simpo, "simpo"))
    assert "reference-free: no reference log-probs" in text


def test_the_sequence_parallel_table_counts_a_dpo_rows_two_sequences(tmp_path, capsys):
    """On 2 GPUs the per-stage Ulysses table weighs a dpo stage as the rest of the estimate does: its row puts
    chosen and rejected through the model, so its peak is above an SFT stage's of the same length."""
    from hf_zero.cli import main

    dpo = json.loads(sft_dpo_recipe(tmp_path, write_rows(tmp_path / "pairs.jsonl", preferred_rows(32))).read_text())
    dpo["fused_cross_entropy"] = False
    sft = copy.deepcopy(dpo)
    sft["stages"][1] = {"name": "pref", "data": dpo["stages"][0]["data"], "steps": 6}
    tables = []
    for cfg, name in ((dpo, "dpo"), (sft, "sft")):
        path = tmp_path / f"{name}.yaml"
        path.write_text(json.dumps(cfg))
        assert main(["estimate", "--config", str(path), "--gpus-per-node", "2", "--json"]) == 0
        tables.append({r["stage"]: r for r in json.loads(capsys.readouterr().out)["sequence_parallel"]["stages"]})
    ours, theirs = tables
    assert (ours["pref"]["sequences_per_row"], theirs["pref"]["sequences_per_row"]) == (2, 1)
    assert all(ours["pref"]["peak_bytes"][sp] > theirs["pref"]["peak_bytes"][sp] for sp in ours["pref"]["peak_bytes"])
    first = next(iter(ours))  # the SFT stage before it: the same either way
    assert ours[first]["peak_bytes"] == theirs[first]["peak_bytes"]


@pytest.mark.multiproc
def test_a_dpo_stage_resumes_on_another_rank_count_and_profile(tmp_path):
    """zero3 on 2 ranks (each computes the reference of half the rows), stopped after checkpoint-5 (3 steps into the
    dpo stage) and resumed under fsdp2 on 1 rank: the cache is read as it is, not computed again, and the steps and
    the held-out reward accuracy are the uninterrupted run's."""
    config = sft_dpo_recipe(tmp_path, write_rows(tmp_path / "pairs.jsonl", preferred_rows()))
    full = tmp_path / "zero3"
    proc = launch_recipe("zero3", full, "--global_batch_size", "8", config=config)
    # 28 training rows and 4 held-out pairs: 14 + 2 on each rank
    assert ("reference log-probs of 32 rows (4 of them held out) computed on 2 ranks, at most 16 rows each"
            in proc.stdout), proc.stdout[-3000:]
    out = tmp_path / "fsdp2"
    shutil.copytree(full, out)
    for name in ("summary.json", "log_history.json"):
        (out / name).unlink()
    for extra in [p for p in out.glob("checkpoint-*") if p.name != "checkpoint-5"]:
        shutil.rmtree(extra)
    (out / "latest_checkpoint").write_text("checkpoint-5\n")
    before = (out / "reference_logps" / "pref.safetensors").read_bytes()
    resumed = launch_recipe("fsdp2", out, "--global_batch_size", "8", config=config, nproc=1)
    assert "checkpoint-5: zero3 on 2 ranks -> fsdp2 on 1 rank" in resumed.stdout
    assert "stage pref: reference log-probs of 32 rows (4 of them held out) reused" in resumed.stdout
    assert (out / "reference_logps" / "pref.safetensors").read_bytes() == before
    s, ref = read_summary(out), read_summary(full)
    assert (s["world_size"], ref["world_size"]) == (1, 2) and s["resumed_from"].endswith("checkpoint-5")
    assert s["losses"] == pytest.approx(ref["losses"], abs=1e-4)  # steps 6-8 trained again, on 1 rank
    (pref,), (theirs,) = s["preference"], ref["preference"]
    assert pref["reference"] == "reused" and theirs["held_out_reward_accuracy_after"] == 1.0
    for key in ("held_out_reward_accuracy_before", "held_out_reward_accuracy_after", "held_out_reward_margin_after"):
        assert pref[key] == pytest.approx(theirs[key], abs=1e-4), key
