"""What training did, in words: before the first step, at each stage end and after the last step, the model answers
a few held-out prompts (greedy, `sample_max_new_tokens` at most): every stage's that has prompts before the first
step and after the last (so "before -> after" compares the same prompts, whichever stage has them), the ending
stage's at the other stage ends. The answers go to `samples.jsonl` (a fresh run starts it anew; a resumed one adds
to it) and TensorBoard (text), and their exact match with the data's reference answers is logged as
`samples_<stage>_exact_match` (how often the answer contains the reference at all,
`samples_<stage>_contains_reference`; how many prompts, `samples_<stage>_prompts`).

The prompts are shared out across ranks and the answers gathered on every rank. When the weights are sharded
(ZeRO-3, FSDP) every forward pass is collective, so generation runs with `synced_gpus=True`: a rank that has
finished keeps stepping until all have. A recipe whose model answers otherwise (a composed multimodal model:
hf_zero.train.composed_generate.answer_composed_prompts) passes its own `generate`; the sharing, the scores and the
logs stay these.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

from transformers import TrainerCallback

from hf_zero.core import startup
from hf_zero.core.progress import EXACT_MATCH
from hf_zero.core.time_left import duration
from hf_zero.train.generate import contains, exact_match, generate_answers

__all__ = ["SampleCallback", "exact_match_summary", "with_stage_exact_match"]


def _text_answers(model, tokenizer, prompts: list[dict], max_new_tokens: int, synced_gpus: bool, progress):
    return generate_answers(model, tokenizer, [p["prompt"] for p in prompts], max_new_tokens, synced_gpus=synced_gpus,
                            progress=progress)


class SampleCallback(TrainerCallback):
    """`prompts`: {stage index: [{prompt, question, reference, ...}]}; `generate(model, tokenizer, prompts,
    max_new_tokens, synced_gpus, progress) -> answers`: how the model answers them (default: a causal LM's
    `generate` on each rendered prompt)."""

    def __init__(self, trainer, schedule, prompts: dict[int, list[dict]], out_dir, max_new_tokens: int,
                 generate=None):
        self.trainer, self.schedule, self.prompts = trainer, schedule, prompts
        self.path, self.max_new_tokens = Path(out_dir) / "samples.jsonl", max_new_tokens
        self.generate = generate or _text_answers

    def on_train_begin(self, args, state, control, **kwargs):
        if state.global_step == 0:  # the "before"; a resumed run had it in its first life
            if state.is_world_process_zero:  # a fresh run: no earlier life's answers in its file
                self.path.unlink(missing_ok=True)
            spans = [s for s in self.schedule.spans if self.prompts.get(s.index)]
            if spans:
                count = sum(len(self.prompts[s.index]) for s in spans)
                startup.phase(f"answering {count} held-out prompt(s) before training (greedy, up to "
                              f"{self.max_new_tokens} new tokens each)")
            self._sample(state, [(s, "start") for s in spans])
            if spans:  # back to what train/bench_probe.py's StartupCallback said comes next
                startup.phase("evaluating before training" if args.eval_on_start else "loading the first batch")

    def on_step_end(self, args, state, control, **kwargs):
        last = state.global_step >= state.max_steps  # then every stage's prompts, as before training
        self._sample(state, [(s, "end" if s.end_step == state.global_step else "after") for s in self.schedule.spans
                             if self.prompts.get(s.index) and (last or s.end_step == state.global_step)])

    def _sample(self, state, spans: list) -> None:
        """Answer the prompts of every (span, when) in one pass; log each stage's exact match."""
        import torch.distributed as dist
        from transformers.integrations import is_deepspeed_zero3_enabled

        asked = [(span, when, p) for span, when in spans for p in self.prompts.get(span.index) or []]
        if not asked:
            return
        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        share = math.ceil(len(asked) / world)
        # Every rank generates the same number of prompts (the last ones padded with repeats, answers dropped).
        mine = [asked[min(i, len(asked) - 1)][2] for i in range(rank * share, (rank + 1) * share)]
        synced = world > 1 and (is_deepspeed_zero3_enabled() or self.trainer.is_fsdp_enabled)
        began = time.monotonic()

        def progress(done: int, batches: int) -> None:  # on the start-up heartbeat's lines (before the first step)
            left = (time.monotonic() - began) / done * (batches - done)
            startup.progress(f"batch {done}/{batches} of this rank's, about {duration(left)} left")

        answers = self.generate(self.trainer.model, self.trainer.processing_class, mine, self.max_new_tokens,
                                synced, progress)
        if world > 1:
            gathered = [None] * world
            dist.all_gather_object(gathered, answers)
            answers = [a for part in gathered for a in part]
        rows = []
        for (span, when, p), answer in zip(asked, answers):
            row = {"step": state.global_step, "stage": span.name, "when": when, "question": p["question"],
                   "answer": answer, "reference": p["reference"]}
            if p.get("media"):  # a multimodal prompt's items: which image or array the answer is about
                row["media"] = [str(path) for _, path in p["media"]]
            if p["reference"] is not None:
                row["exact_match"] = exact_match(answer, p["reference"])
                row["contains_reference"] = contains(answer, p["reference"])  # right, if not in the asked-for form
            rows.append(row)
        if state.is_world_process_zero:
            self._write(rows, state.global_step)
        logs, means = {}, []
        for span, _ in spans:
            scored = [r for r in rows if r["stage"] == span.name and "exact_match" in r]
            if scored:
                means.append(sum(r["exact_match"] for r in scored) / len(scored))
                logs.update({f"samples_{span.name}_exact_match": means[-1],
                             f"samples_{span.name}_contains_reference":
                                 sum(r["contains_reference"] for r in scored) / len(scored),
                             f"samples_{span.name}_prompts": len(scored)})
        if means:
            # Trainer.log clears control.should_log, which would drop this step's own loss log: keep it.
            control, keep = self.trainer.control, self.trainer.control.should_log
            # eval_exact_match (the mean over the stages answered): TensorBoard's eval/exact_match beside
            # eval/mean_loss; the console's eval line reads the stages' own keys.
            self.trainer.log({**logs, EXACT_MATCH: sum(means) / len(means)})
            control.should_log = self.trainer.control.should_log = keep

    def _write(self, rows: list[dict], step: int) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
        writer = next((getattr(c, "tb_writer", None) for c in self.trainer.callback_handler.callbacks
                       if getattr(c, "tb_writer", None) is not None), None)
        if writer is not None:
            for stage in dict.fromkeys(r["stage"] for r in rows):
                table = "| question | answer | reference |\n|---|---|---|\n" + "\n".join(
                    "| {} | {} | {} |".format(*(str(r[k]).replace("\n", " ").replace("|", "/")[:300]
                                                for k in ("question", "answer", "reference")))
                    for r in rows if r["stage"] == stage)
                writer.add_text(f"samples/{stage}", table, step)
            writer.flush()


def exact_match_summary(log_history: list[dict]) -> dict:
    """exact_match_before / exact_match_after (mean over the stages sampled at that moment: every stage with
    prompts, at both) and exact_match_prompts (how many prompts after) for summary.json."""
    logged = [(h["step"], k[len("samples_"):-len("_exact_match")], v) for h in log_history for k, v in h.items()
              if k.startswith("samples_") and k.endswith("_exact_match") and "step" in h]
    if not logged:
        return {}
    first, last = logged[0][0], logged[-1][0]
    at = {step: {name: v for s, name, v in logged if s == step} for step in (first, last)}
    counts = {h["step"]: h for h in log_history if "step" in h and any(k.endswith("_prompts") for k in h)}
    prompts = sum(v for k, v in counts.get(last, {}).items() if k.startswith("samples_") and k.endswith("_prompts"))
    return {"exact_match_before": sum(at[first].values()) / len(at[first]) if first == 0 else None,
            "exact_match_after": sum(at[last].values()) / len(at[last]), "exact_match_prompts": prompts or None}


def with_stage_exact_match(stages: list[dict], log_history: list[dict]) -> list[dict]:
    """Each stage row of summary.json's `stages` (hf_zero.train.trainer.stage_table) with its own prompts' exact
    match as its held-out loss is given: `exact_match_before` (before the first step; None for a resumed run),
    `exact_match` (at the stage's end) and `exact_match_after` (after the last step). A stage without prompts gets
    none of these keys."""
    logged = {}
    for h in log_history:
        for k, v in h.items():
            if k.startswith("samples_") and k.endswith("_exact_match") and "step" in h:
                logged.setdefault(k[len("samples_"):-len("_exact_match")], {})[h["step"]] = v
    out = []
    for row in stages:
        at = logged.get(row["name"])
        if at:
            row = {**row, "exact_match_before": at.get(0), "exact_match": at.get(row["last_step"]),
                   "exact_match_after": at[max(at)] if max(at) > 0 else None}
        out.append(row)
    return out
