"""The held-out numbers of the same weights do not depend on how the held-out set is batched or over how many ranks
it is shared (issue 40): the loss is the token-weighted mean over the whole set (the last, uneven batch and the rows
accelerate repeats to even it out included exactly once), and the answered prompts are the same prompts."""

import json

import pytest
import torch
import yaml
from testing_utils import REPO, launch_recipe

from hf_zero.train.held_out import HeldOutLossMixin, row_losses

TOL = 1e-6


def _rows():
    """7 rows of very different lengths, prompts masked: an odd count, so a batch of 2 leaves a row of 1."""
    g = torch.Generator().manual_seed(0)
    rows = []
    for n in (3, 40, 7, 25, 12, 31, 5):
        ids = torch.randint(3, 200, (n,), generator=g).tolist()
        labels = [-100] * (n // 3) + ids[n // 3:]
        rows.append({"input_ids": ids, "attention_mask": [1] * n, "labels": labels})
    return rows


def _one_by_one(model, rows) -> float:
    """The definition: every counted token of the set weighs the same (each row alone, no padding)."""
    total = tokens = 0.0
    with torch.no_grad():
        for r in rows:
            out = model(input_ids=torch.tensor([r["input_ids"]]), labels=torch.tensor([r["labels"]]))
            counted = sum(1 for x in r["labels"][1:] if x != -100)
            total, tokens = total + out.loss.item() * counted, tokens + counted
    return total / tokens


def test_row_losses_shift_and_ignore_as_the_model_does():
    g = torch.Generator().manual_seed(1)
    logits, labels = torch.randn(3, 6, 11, generator=g), torch.randint(0, 11, (3, 6), generator=g)
    labels[1, :4] = -100
    rows = row_losses(logits, labels)
    for i in range(3):
        want = torch.nn.functional.cross_entropy(logits[i, :-1], labels[i, 1:], ignore_index=-100, reduction="sum")
        assert rows[i, 0].item() == pytest.approx(want.item(), abs=1e-5)
        assert rows[i, 1].item() == (labels[i, 1:] != -100).sum().item()


@pytest.mark.parametrize("batch", [1, 2, 3, 8])
def test_eval_loss_is_the_token_weighted_mean_over_the_whole_set(tmp_path, quiet_env, batch):
    """In one process, any eval batch size: the same number, the definition's. The Trainer's own mean of batch means
    (each repeated eval_batch_size times) weighs a short batch like a long one."""
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    from hf_zero.data.model_names import get_tiny_llama_path, get_tokenizer
    from hf_zero.data.stages import build_collator

    class HeldOutTrainer(HeldOutLossMixin, Trainer):
        pass

    model = AutoModelForCausalLM.from_pretrained(get_tiny_llama_path()).eval()
    rows = _rows()
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], disable_tqdm=True,
                             per_device_eval_batch_size=batch)
    collator = build_collator(get_tokenizer("tiny-llama"))
    got = HeldOutTrainer(model=model, args=args, eval_dataset=rows, data_collator=collator).evaluate()
    want = _one_by_one(model, rows)
    assert got["eval_loss"] == pytest.approx(want, abs=TOL)
    if batch in (2, 3):  # what the Trainer alone reports: not the set's mean
        plain = Trainer(model=model, args=args, eval_dataset=rows, data_collator=collator).evaluate()
        assert abs(plain["eval_loss"] - want) > 1e-3


# ---------------------------------------------------------------- the same weights on 1 and 2 ranks

def _config(tmp_path):
    """One chat stage of one step; 7 of its 12 rows held out (evaluated 2 per rank and batch: the last batch uneven
    on 1 rank and on 2), their 3 prompts answered before training (2 ranks: 2 + 2, one repeated)."""
    data = {
        "model_name_or_path": "tiny-llama", "max_seq_length": 64, "eval_samples": 7, "sample_prompts": 5,
        "sample_max_new_tokens": 8,
        "stages": [{"name": "chat", "data": str(REPO / "recipes" / "data" / "tiny" / "chat.jsonl"), "steps": 1}],
        "per_device_train_batch_size": 2, "per_device_eval_batch_size": 2, "global_batch_size": 4,
        "learning_rate": 1.0e-3, "seed": 42, "dataloader_num_workers": 0, "save_strategy": "no",
        "save_final_model": False,
    }
    path = tmp_path / "eval_only.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _before_training(out):
    """The evaluation at step 0 (the same weights on any rank count): losses, exact match, the answers."""
    history = json.loads((out / "log_history.json").read_text())
    numbers = {k: v for h in history if h.get("step") == 0 for k, v in h.items()
               if k.endswith(("_loss", "_exact_match", "_contains_reference"))}
    answers = [(r["question"], r["answer"]) for r in map(json.loads, (out / "samples.jsonl").read_text().splitlines())
               if r["when"] == "start"]
    return numbers, answers


@pytest.mark.multiproc
@pytest.mark.parametrize("profile", ["zero2", "zero3", "fsdp2"])
def test_eval_numbers_are_the_same_on_1_and_2_ranks(tmp_path, profile):
    config = _config(tmp_path)
    seen = {}
    for nproc in (1, 2):
        out = tmp_path / f"{nproc}-ranks"
        launch_recipe(profile, out, config=config, nproc=nproc)
        seen[nproc] = _before_training(out)
    (one, one_answers), (two, two_answers) = seen[1], seen[2]
    assert "eval_chat_loss" in one and "samples_chat_exact_match" in one, one
    assert one.keys() == two.keys()
    for key in one:
        assert abs(one[key] - two[key]) <= TOL, (key, one[key], two[key])
    assert len(one_answers) == 3 and one_answers == two_answers
