"""What training did, in words: before the first step and at each stage end, the model answers a few held-out prompts
of the stage (greedy, `sample_max_new_tokens` at most). The answers go to `samples.jsonl` and TensorBoard (text), and
their exact match with the data's reference answers is logged as `samples_<stage>_exact_match` (and how often the
answer contains the reference at all, `samples_<stage>_contains_reference`).

The prompts are shared out across ranks and the answers gathered on every rank. When the weights are sharded
(ZeRO-3, FSDP) every forward pass is collective, so generation runs with `synced_gpus=True`: a rank that has
finished keeps stepping until all have.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from transformers import TrainerCallback

from hf_zero.core.console import EXACT_MATCH
from hf_zero.train.generate import contains, exact_match, generate_answers

__all__ = ["SampleCallback", "exact_match_summary"]


class SampleCallback(TrainerCallback):
    def __init__(self, trainer, schedule, prompts: dict[int, list[dict]], out_dir, max_new_tokens: int):
        self.trainer, self.schedule, self.prompts = trainer, schedule, prompts
        self.path, self.max_new_tokens = Path(out_dir) / "samples.jsonl", max_new_tokens

    def on_train_begin(self, args, state, control, **kwargs):
        if state.global_step == 0:  # the "before"; a resumed run had it in its first life
            self._sample(state, self.schedule.spans[0], "start")

    def on_step_end(self, args, state, control, **kwargs):
        for span in self.schedule.spans:
            if state.global_step == span.end_step:
                self._sample(state, span, "end")

    def _sample(self, state, span, when: str) -> None:
        import torch.distributed as dist
        from transformers.integrations import is_deepspeed_zero3_enabled

        prompts = self.prompts.get(span.index) or []
        if not prompts:
            return
        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        share = math.ceil(len(prompts) / world)
        # Every rank generates the same number of prompts (the last ones padded with repeats, answers dropped).
        mine = [prompts[min(i, len(prompts) - 1)]["prompt"] for i in range(rank * share, (rank + 1) * share)]
        synced = world > 1 and (is_deepspeed_zero3_enabled() or self.trainer.is_fsdp_enabled)
        answers = generate_answers(self.trainer.model, self.trainer.processing_class, mine, self.max_new_tokens,
                                   synced_gpus=synced)
        if world > 1:
            gathered = [None] * world
            dist.all_gather_object(gathered, answers)
            answers = [a for part in gathered for a in part]
        rows = []
        for p, answer in zip(prompts, answers):
            row = {"step": state.global_step, "stage": span.name, "when": when, "question": p["question"],
                   "answer": answer, "reference": p["reference"]}
            if p["reference"] is not None:
                row["exact_match"] = exact_match(answer, p["reference"])
                row["contains_reference"] = contains(answer, p["reference"])  # right, if not in the asked-for form
            rows.append(row)
        scored = [r["exact_match"] for r in rows if "exact_match" in r]
        named = [r["contains_reference"] for r in rows if "exact_match" in r]
        if state.is_world_process_zero:
            self._write(rows, state.global_step, span.name)
        if scored:
            # Trainer.log clears control.should_log, which would drop this step's own loss log: keep it.
            control, keep = self.trainer.control, self.trainer.control.should_log
            # eval_exact_match: TensorBoard's eval/exact_match beside eval/mean_loss, and the console's eval line.
            self.trainer.log({f"samples_{span.name}_exact_match": sum(scored) / len(scored),
                              f"samples_{span.name}_contains_reference": sum(named) / len(named),
                              EXACT_MATCH: sum(scored) / len(scored)})
            control.should_log = self.trainer.control.should_log = keep

    def _write(self, rows: list[dict], step: int, stage: str) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
        writer = next((getattr(c, "tb_writer", None) for c in self.trainer.callback_handler.callbacks
                       if getattr(c, "tb_writer", None) is not None), None)
        if writer is not None:
            table = "| question | answer | reference |\n|---|---|---|\n" + "\n".join(
                "| {} | {} | {} |".format(*(str(r[k]).replace("\n", " ").replace("|", "/")[:300]
                                            for k in ("question", "answer", "reference"))) for r in rows)
            writer.add_text(f"samples/{stage}", table, step)
            writer.flush()


def exact_match_summary(log_history: list[dict]) -> dict:
    """exact_match_before / exact_match_after (mean over the stages sampled at that moment) for summary.json."""
    logged = [(h["step"], v) for h in log_history for k, v in h.items()
              if k.startswith("samples_") and k.endswith("_exact_match") and "step" in h]
    if not logged:
        return {}
    first, last = logged[0][0], logged[-1][0]
    mean = lambda step: sum(v for s, v in logged if s == step) / sum(1 for s, _ in logged if s == step)  # noqa: E731
    return {"exact_match_before": mean(first) if first == 0 else None, "exact_match_after": mean(last)}
