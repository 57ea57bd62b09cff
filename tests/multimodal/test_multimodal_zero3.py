"""The ZeRO-3 hang peers suffer (Qwen3-VL#126, ms-swift#8171): in one step one rank has only text rows and the other
only image rows. Under ZeRO-3 and FSDP2 an encoder's forward gathers its parameters in collectives, so a rank that
skipped the encoder would leave the other waiting (measured without the zero items: ZeRO-3 on gloo fails with "Is
there a distributed collective mismatch in your code?"); the composed model runs every encoder on every rank (a zero
item where a batch has none), and the run completes."""

import json
import textwrap

import pytest
import yaml
from testing_utils import REPO, launch_recipe, read_summary

# The recipe, with the sample order forced: within each step's global batch of 4, the first micro-batch (rank 0)
# comes from source 0 (text rows) and the second (rank 1) from source 1 (image rows); accelerate hands micro-batch
# i of a step to rank i. Each rank records what its batches held.
WRAPPER = textwrap.dedent('''\
    import json, os, runpy, sys
    import hf_zero.train.recipe_steps as steps
    from hf_zero.data.multimodal_collator import MultimodalCollator

    original = steps.build_sample_order

    def forced(schedule, source_sizes, weights, seed):
        order = original(schedule, source_sizes, weights, seed)
        half = schedule.global_batch // 2
        for k in range(len(order)):
            src = 0 if k % schedule.global_batch < half else 1
            order[k, 1], order[k, 2] = src, k % source_sizes[order[k, 0]][src]
        return order

    steps.build_sample_order = forced
    collate = MultimodalCollator.__call__

    def recording(self, samples):
        batch = collate(self, samples)
        with open(os.path.join(os.environ["FORCED_SPLIT_LOG"], f"rank{os.environ.get('RANK', '0')}.jsonl"), "a") as f:
            f.write(json.dumps({m: batch[f"{m}_values"].shape[0] for m in self.specs}) + "\\n")
        return batch

    MultimodalCollator.__call__ = recording
    sys.argv[0] = RECIPE
    runpy.run_path(RECIPE, run_name="__main__")
''')


@pytest.mark.multiproc
@pytest.mark.parametrize("profile,packing", [("zero3", False), ("fsdp2", False), ("zero3", True)])
def test_text_only_rank_beside_image_only_rank_completes(tmp_path, profile, packing):
    """Packed (each source packed apart, as a stage with weights is): rank 0's rows hold text conversations only,
    rank 1's several image conversations each."""
    text = tmp_path / "text.jsonl"
    text.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Say {w}."},
                                                     {"role": "assistant", "content": w}]}) + "\n"
                            for w in ("one", "two", "three", "four", "five", "six", "seven", "eight")))
    config = yaml.safe_load((REPO / "recipes/configs/tiny_multimodal.yaml").read_text())
    config.update(eval_samples=0, per_device_train_batch_size=2, stages=[
        {"name": "mixed", "data": [str(text), str(REPO / "recipes/data/tiny_multimodal/digits.jsonl")], "steps": 3,
         "learning_rate": 3.0e-3, "train": ["encoder.image", "projector", "lora"],
         **({"weights": [1, 1]} if packing else {})}], packing=packing, max_seq_length=128 if packing else 64)
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    wrapper = tmp_path / "multimodal.py"  # the YAML names the multimodal recipe: the script's name must match
    wrapper.write_text(f"RECIPE = {str(REPO / 'recipes' / 'multimodal.py')!r}\n" + WRAPPER)
    logs = tmp_path / "batches"
    logs.mkdir()
    out = tmp_path / "run"
    launch_recipe(profile, out, config=tmp_path / "cfg.yaml", recipe=wrapper, timeout=900,
                  env={"FORCED_SPLIT_LOG": str(logs), "PYTHONPATH": str(REPO)})
    seen = {r: [json.loads(line) for line in (logs / f"rank{r}.jsonl").read_text().splitlines()] for r in (0, 1)}
    assert len(seen[0]) == len(seen[1]) == 3
    assert all(b == {"points": 0, "image": 0} for b in seen[0])  # rank 0: text only, both encoders on zero items
    assert all(b["points"] == 0 and b["image"] >= (6 if packing else 2) for b in seen[1])  # rank 1: images only
    s = read_summary(out)
    assert s["profile"] == profile and s["world_size"] == 2 and len(s["losses"]) == 3
    from hf_zero.train.composed import ComposedModel

    model = ComposedModel.from_pretrained(out / "final")  # gathered from the shards: every tensor whole
    assert all(p.numel() > 0 for p in model.parameters())
    assert model.specs["image"].tokens == 5
