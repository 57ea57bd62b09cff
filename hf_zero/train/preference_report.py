"""What a dpo stage reports beyond its steps' metrics: its held-out pairs' reward accuracy (measured by
hf_zero.train.preference at the stage's start and end, over the whole held-out set whatever the rank count), the
`preference` entry of summary.json, and the done line's words."""

from __future__ import annotations

import torch

from hf_zero.core.config import Stage

__all__ = ["HELD_OUT", "pair_rewards", "preference_summary", "preference_words"]

# Logged at a dpo stage's first and last step, `<key>/<stage>`: its held-out pairs' reward accuracy and mean margin.
HELD_OUT = ("held_out_reward_accuracy", "held_out_reward_margin")


def pair_rewards(stage: Stage, logps: torch.Tensor, reference: torch.Tensor | None) -> tuple[float, float]:
    """(reward accuracy, mean margin) of held-out pairs, TRL's implicit rewards: beta x (log-prob - the
    reference's) for sigmoid and ipo, beta x the answer's mean log-probability for simpo (CPOTrainer's). Every
    pair counts once; a tie is not a win (TRL's `chosen_rewards > rejected_rewards`)."""
    if stage.loss_type == "simpo":
        rewards = stage.beta * logps[:, :2].double() / logps[:, 2:].double().clamp(min=1)
    else:
        rewards = stage.beta * (logps[:, :2].double() - reference.double())
    return (rewards[:, 0] > rewards[:, 1]).double().mean().item(), (rewards[:, 0] - rewards[:, 1]).mean().item()



def preference_summary(log_history: list[dict], schedule, preference: dict, status: dict) -> dict:
    """summary.json's `preference`: per dpo stage, its settings, the reference's fate, the reward accuracy and
    margin at its first and last logging step, and its held-out pairs' reward accuracy and margin at its start
    (`_before`) and end (`_after`; None until it is measured)."""
    if not preference:
        return {}
    rows = []
    for index, pstage in preference.items():
        span, stage = schedule.spans[index], pstage.stage.name
        logs = [h for h in log_history if "rewards/accuracies" in h and span.start_step < h["step"] <= span.end_step]

        def held_out(key: str, step: int):
            return next((h[f"{key}/{stage}"] for h in log_history if h.get("step") == step and f"{key}/{stage}" in h),
                        None)

        rows.append({
            "stage": stage, "loss_type": pstage.stage.loss_type, "beta": pstage.stage.beta,
            "sft_weight": pstage.stage.sft_weight,
            "rows": len(pstage.samples), "reference": status.get(stage, "none (reference-free)"),
            **{f"{name}_{at}": (logs[i][key] if logs else None) for name, key in
               (("reward_accuracy", "rewards/accuracies"), ("reward_margin", "rewards/margins"))
               for at, i in (("first", 0), ("last", -1))},
            "held_out_pairs": len(pstage.held_out),
            **{f"{key}_{at}": held_out(key, step) for key in HELD_OUT
               for at, step in (("before", span.start_step), ("after", span.end_step))},
        })
    return {"preference": rows}


def preference_words(summary: dict) -> str:
    """The done line's part for the dpo stages with held-out pairs: reward accuracy before -> after the stage."""
    words = []
    for row in summary.get("preference", []):
        before, after = row["held_out_reward_accuracy_before"], row["held_out_reward_accuracy_after"]
        if after is not None:
            words.append(f"held-out reward accuracy {'?' if before is None else f'{before:.2f}'} -> {after:.2f} "
                         f"({row['held_out_pairs']:,} pairs, stage {row['stage']}); ")
    return "".join(words)
