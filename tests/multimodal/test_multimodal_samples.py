"""Held-out exact match for the multimodal recipe: each stage's held-out rows answered greedily by the composed model
before training, at the stage's end and after the last step; summary.json's per-stage exact_match_before /
exact_match / exact_match_after are the answers' scores in samples.jsonl, and those answers are the trained model's
greedy answers. Also: the demo's generated data, and a bad sample_prompts as one line."""

import json
import sys
from pathlib import Path

import pytest
import yaml
from testing_utils import REPO, launch_recipe, read_summary, run_cmd

RECIPE = REPO / "recipes" / "multimodal.py"
CONFIG = REPO / "recipes" / "configs" / "tiny_multimodal.yaml"
STEPS = 2


def short_config(dst: Path, **overrides) -> Path:
    data = yaml.safe_load(CONFIG.read_text())
    for stage in data["stages"]:
        paths = stage["data"] if isinstance(stage["data"], list) else [stage["data"]]
        stage.update(steps=STEPS, data=[str((CONFIG.parent / p).resolve()) for p in paths])
    data.update({"eval_samples": 4, "sample_prompts": 3, "sample_max_new_tokens": 4, **overrides})
    dst.write_text(yaml.safe_dump(data, sort_keys=False))
    return dst


def samples(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]


def mean_match(rows: list[dict], stage: str, step: int) -> float:
    scored = [r["exact_match"] for r in rows if r["stage"] == stage and r["step"] == step]
    assert len(scored) == 3, (stage, step, rows)  # sample_prompts: 3 of the stage's 4 held-out rows
    return sum(scored) / len(scored)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("mm_samples")
    out = root / "run"
    run_cmd([sys.executable, RECIPE, "--config", short_config(root / "tiny.yaml"), "--output_dir", out,
             "--disable_tqdm", "true", "--report_to", "tensorboard"])
    return out


@pytest.mark.recipe_run
def test_each_stage_records_the_exact_match_of_its_greedy_answers_before_and_after(run):
    from hf_zero.train.generate import exact_match

    s, rows = read_summary(run), samples(run)
    assert all(r["exact_match"] == exact_match(r["answer"], r["reference"]) for r in rows)
    end = 2 * STEPS
    for i, stage in enumerate(s["stages"]):
        name = stage["name"]
        assert stage["exact_match_before"] == mean_match(rows, name, 0)
        assert stage["exact_match"] == mean_match(rows, name, (i + 1) * STEPS)  # at the stage's own end
        assert stage["exact_match_after"] == mean_match(rows, name, end)
        media = {r["media"][0].split("/")[-2] for r in rows if r["stage"] == name}
        assert media == ({"shapes"} if name == "points" else {"digits", "shapes"}), media  # the stage's own rows
    # the run's line: the mean over both stages, as the curriculum recipe's summary has it
    assert s["exact_match_before"] == sum(st["exact_match_before"] for st in s["stages"]) / 2
    assert s["exact_match_after"] == sum(st["exact_match_after"] for st in s["stages"]) / 2
    assert s["exact_match_prompts"] == 6
    events = b"".join(p.read_bytes() for p in (run / "runs").rglob("events.out.tfevents*"))
    assert b"samples_points_exact_match" in events and b"samples/images" in events  # TensorBoard: score and text


@pytest.mark.recipe_run
def test_the_answers_after_training_are_the_final_models_greedy_answers(run):
    """Each answer logged after the last step, recomputed from final/ as `hf-zero generate --points/--image` forms
    its prompt (a user turn: the item's placeholder, then the question) and answers it."""
    from hf_zero.data.multimodal import load_media
    from hf_zero.train.composed_generate import composed_prompt_ids, generate_composed, load_composed

    model, tok = load_composed(run / "final")
    after = [r for r in samples(run) if r["step"] == 2 * STEPS]
    assert len(after) == 6
    for r in after:
        modality = "points" if "/shapes/" in r["media"][0] else "image"
        question = r["question"].replace(model.specs[modality].placeholder, "")
        ids = composed_prompt_ids(tok, model.specs, model.placeholder_ids, question, [modality])
        item = {modality: load_media(model.specs[modality], Path(r["media"][0]))}
        assert generate_composed(model, tok, ids, item, 4) == r["answer"], r


def test_a_stage_without_prompts_has_no_exact_match_keys():
    from hf_zero.train.samples import exact_match_summary, with_stage_exact_match

    stages = [{"name": "text", "last_step": 2}, {"name": "points", "last_step": 4}]
    history = [{"step": 0, "samples_points_exact_match": 0.25, "samples_points_prompts": 4},
               {"step": 2, "loss": 1.0},
               {"step": 4, "samples_points_exact_match": 0.75, "samples_points_prompts": 4}]
    text, points = with_stage_exact_match(stages, history)
    assert text == {"name": "text", "last_step": 2}
    assert points == {"name": "points", "last_step": 4, "exact_match_before": 0.25, "exact_match": 0.75,
                      "exact_match_after": 0.75}
    assert exact_match_summary(history) == {"exact_match_before": 0.25, "exact_match_after": 0.75,
                                            "exact_match_prompts": 4}
    assert with_stage_exact_match(stages, [{"step": 2, "loss": 1.0}]) == stages


def test_held_out_prompts_carry_their_items_and_the_expanded_placeholder_run(tmp_path):
    """A stage's eval_data rows (not its training rows) become its prompts: the rendered prompt up to the answer, its
    files, and the ids with each placeholder repeated to its encoder's token count."""
    from hf_zero.core.config import Stage
    from hf_zero.data.chat_template import prepare_chat_template
    from hf_zero.data.model_names import get_tokenizer
    from hf_zero.data.multimodal import ModalitySpec, add_placeholders, load_multimodal_stage

    data = REPO / "recipes/data/tiny_multimodal"
    held = tmp_path / "held.jsonl"
    held.write_text("".join((data / "shapes.jsonl").read_text().splitlines(keepends=True)[:2]))
    (tmp_path / "shapes").symlink_to(data / "shapes")
    tok = get_tokenizer("tiny-llama")
    prepare_chat_template(tok)
    specs = {"points": ModalitySpec("points", (64, 3), 4)}
    ids = add_placeholders(tok, specs)
    stage = Stage(name="s", data=[str(data / "shapes.jsonl")], eval_data=[str(held)], steps=1)
    d = load_multimodal_stage(stage, tok, specs, ids, 64, 8, 0)
    assert len(d.eval_samples) == len(d.eval_prompts) == 2 and d.pool_size == 60  # no training row held out
    p = d.eval_prompts[0]
    first = json.loads(held.read_text().splitlines()[0])["messages"]
    assert p["reference"] == first[1]["content"][0]["text"] and p["media"][0][1] == str(tmp_path / first[0][
        "content"][0]["points"])
    assert p["ids"].count(ids["points"]) == 4 and d.eval_samples[0]["input_ids"][:len(p["ids"])] == p["ids"]
    assert all("_gen" not in s for src in d.sources for s in src)


@pytest.mark.recipe_run  # a recipe process (it stops before any model or data is read)
@pytest.mark.parametrize(("flag", "value", "line"), [
    ("sample_prompts", "-1", "hf-zero: error: sample_prompts: must be 0 or more, got -1; e.g. sample_prompts: 4"),
    ("sample_max_new_tokens", "0", "hf-zero: error: sample_max_new_tokens: must be 1 or more, got 0; "),
])
def test_a_negative_sample_count_is_one_line_exit_2(tmp_path, flag, value, line):
    proc = run_cmd([sys.executable, RECIPE, "--config", short_config(tmp_path / "tiny.yaml"), "--output_dir",
                    tmp_path / "o", f"--{flag}", value], check=False)
    err = [ln for ln in proc.stderr.splitlines() if ln.startswith("hf-zero: error:")]
    assert proc.returncode == 2 and len(err) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert err[0].startswith(line), err[0]
    assert not (tmp_path / "o").exists()


def test_check_refuses_a_negative_sample_count_in_the_yaml(tmp_path, capsys):
    from testing_utils import check

    rc, results = check(capsys, "--config", str(short_config(tmp_path / "tiny.yaml", sample_prompts=-2)),
                        output_dir=tmp_path / "o")
    ok, line = results["recipe"]
    assert rc == 2 and ok is False and line.endswith(": sample_prompts: must be 0 or more, got -2; e.g. "
                                                     "sample_prompts: 4 (0: none)"), line


def test_the_demo_data_holds_out_its_test_rows(tmp_path):
    from hf_zero.data.multimodal_demo import SHAPES, write_demo

    write_demo(tmp_path, shapes=20, points=32)
    rows = {name: [json.loads(line)["messages"] for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
            for name in ("shapes", "shapes_test", "digits", "digits_test")}
    assert [len(rows[n]) for n in rows] == [20, 50, 1747, 50]
    # each row: an empty system message (SmolLM2's template would write its 17-token default), the item, the answer
    assert all(m[0] == {"role": "system", "content": ""} and len(m) == 3 for n in rows for m in rows[n])
    answers = [m[2]["content"][0]["text"] for m in rows["shapes_test"]]
    assert all(answers.count(s) == 10 for s in SHAPES)
    files = {n: {m[1]["content"][0]["image"].split("/")[-1] for m in rows[n]} for n in ("digits", "digits_test")}
    assert not files["digits"] & files["digits_test"] and len(files["digits"] | files["digits_test"]) == 1797


@pytest.mark.multiproc
@pytest.mark.extended
@pytest.mark.parametrize("profile", ["zero3", "fsdp2"])
def test_answers_complete_under_sharded_weights_with_one_modality_per_rank(tmp_path, profile):
    """8 prompts shared out over 2 ranks: rank 0 answers stage points' 4 point clouds (no image: its image encoder
    runs on a zero item), rank 1 stage images' digits and shapes, before training and after the last step, each
    forward a collective over sharded weights; the run completes and scores both stages."""
    config = short_config(tmp_path / "tiny.yaml", sample_prompts=4, per_device_train_batch_size=2)
    launch_recipe(profile, tmp_path / "o", "--global_batch_size", "4", config=config, recipe=RECIPE)
    s, rows = read_summary(tmp_path / "o"), samples(tmp_path / "o")
    assert s["world_size"] == 2 and {r["step"] for r in rows} == {0, STEPS, 2 * STEPS}
    assert all(st["exact_match_before"] is not None and st["exact_match_after"] is not None for st in s["stages"])
    assert [r["stage"] for r in rows if r["step"] == 0] == ["points"] * 4 + ["images"] * 4


def test_the_placeholders_alone_do_not_make_the_embeddings_train():
    """Under LoRA a grown vocabulary trains the embeddings (a new row must learn), but a composed model never reads
    its placeholders' rows: where they are the only tokens added, the embeddings are frozen again."""
    from types import SimpleNamespace

    from hf_zero.data.chat_template import added_template_tokens, prepare_chat_template
    from hf_zero.data.model_names import get_tokenizer
    from hf_zero.data.multimodal import ModalitySpec, add_placeholders
    from hf_zero.plan.arguments import ModelArguments
    from hf_zero.train.composed import freeze_unread_embeddings
    from hf_zero.train.model import build_causal_lm

    tok = get_tokenizer("tiny-llama")
    prepare_chat_template(tok)  # tiny-llama has no chat template: ChatML's markers are added, and must train
    ids = add_placeholders(tok, {"points": ModalitySpec("points", (8, 3), 2)})
    cpu = SimpleNamespace(precision="fp32", uses_deepspeed=False, zero_stage=0)
    args = ModelArguments(model_name_or_path="tiny-llama", use_peft=True, lora_r=4, lora_dropout=0.0)
    llm = build_causal_lm(args, tok, cpu)
    embeddings = llm.get_input_embeddings().weight
    assert embeddings.requires_grad and not freeze_unread_embeddings(llm, tok, ids) and embeddings.requires_grad
    # the same model, had its tokenizer brought its own chat markers: the placeholders would be all that was added
    every_added = {t: tok.convert_tokens_to_ids(t) for t in added_template_tokens(tok)}
    assert freeze_unread_embeddings(llm, tok, every_added) and not embeddings.requires_grad
    assert not llm.get_output_embeddings().weight.requires_grad


# SmolLM2 and the demo's data built into the session's fresh cache (26 s): in the slow tier, beside the demo's own
# run (tests/commands/test_readme.py), to keep `make test` within 15 minutes. The default suite parses the config
# (tests/plan/test_config.py) and checks the embedding freeze
# (test_the_placeholders_alone_do_not_make_the_embeddings_train).
@pytest.mark.slow
def test_the_demo_config_checks_with_its_generated_data_and_lora_alone_in_the_llm(tmp_path, capsys):
    from testing_utils import check

    rc, results = check(capsys, "--config", str(REPO / "recipes/configs/multimodal_demo.yaml"),
                        output_dir=tmp_path / "o")
    assert rc == 0, results
    line = results["data"][1]
    assert "which_play 1000 rows, 0 files; shapes 1000 rows, 1000 files; digits 1747 rows, 1747 files" in line, line
    # the LoRA alone (4,884,480), not SmolLM2's 28M embedding rows beside it: only placeholders were added
    assert "stage which_play trains lora (4,884,480): 4,884,480 parameters" in line, line
