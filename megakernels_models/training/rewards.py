"""Reward functions for ``megakernels train --grpo --reward megakernels_models.training.rewards:NAME``, checkable
offline, called as TRL calls a reward function: ``f(prompts=[...], completions=[...], **fields)`` with one entry a
completion in each list (``fields``: the prompt file's other keys), returning one float a completion.

The embedded example task, ``arithmetic``, scores answers to single-digit sums (``examples/data/arithmetic.jsonl``,
``write_arithmetic``), on which a tiny model trained from scratch learns to answer.
"""

from __future__ import annotations

import json


def arithmetic(prompts: list[str], completions: list[str], answer: list[str], **fields) -> list[float]:
    """1 for a completion that starts with the right ``answer`` (leading whitespace ignored), else 0: no credit
    for a wrong digit, so a group whose completions are all wrong has no advantage to follow (partial credit for
    any digit would draw the policy onto one digit before it tells the sums apart).

    Raises:
        ValueError: lists of different lengths.
    """
    if not len(prompts) == len(completions) == len(answer):
        raise ValueError(
            f"arithmetic: {len(prompts)} prompts, {len(completions)} completions and {len(answer)} answers"
        )
    return [1.0 if text.lstrip().startswith(want) else 0.0 for text, want in zip(completions, answer)]


def write_arithmetic(path: str) -> int:
    """Write the prompts of every sum ``a+b=`` of two digits below 10 (``{"prompt": "3+4=", "answer": "7"}``) to
    the JSONL ``path``; returns how many."""
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(10) for b in range(10) if a + b < 10]
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return len(rows)
