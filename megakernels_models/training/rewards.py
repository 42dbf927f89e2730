"""Reward functions for ``megakernels train --grpo --reward megakernels_models.training.rewards:NAME``, checkable
offline, called as TRL calls a reward function: ``f(prompts=[...], completions=[...], **fields)`` with one entry a
completion in each list (``fields``: the prompt file's other keys), returning one float a completion.

The embedded example task, ``arithmetic``, scores answers to single-digit sums (``examples/data/arithmetic.jsonl``,
``write_arithmetic``): a tiny model trained from scratch learns first to answer with a digit, then the right one.
"""

from __future__ import annotations

import json


def arithmetic(prompts: list[str], completions: list[str], answer: list[str], **fields) -> list[float]:
    """1 for a completion that is the right ``answer`` (surrounding whitespace ignored), 0.5 for one that starts
    with it, 0.1 for one that starts with another digit, else 0.

    Raises:
        ValueError: lists of different lengths.
    """
    if not len(prompts) == len(completions) == len(answer):
        raise ValueError(
            f"arithmetic: {len(prompts)} prompts, {len(completions)} completions and {len(answer)} answers"
        )
    out = []
    for text, want in zip(completions, answer):
        got = text.strip()
        if got == want:
            out.append(1.0)
        elif got.startswith(want):
            out.append(0.5)
        elif got[:1].isdigit():
            out.append(0.1)
        else:
            out.append(0.0)
    return out


def write_arithmetic(path: str) -> int:
    """Write the prompts of every sum ``a+b=`` of two digits below 10 (``{"prompt": "3+4=", "answer": "7"}``) to
    the JSONL ``path``; returns how many."""
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(10) for b in range(10) if a + b < 10]
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return len(rows)
