"""Prompts for reinforcement learning (``megakernels train --grpo --data FILE.jsonl``): one JSON object a line with a
string ``prompt`` (tokenised whole by the run's tokenizer, no special tokens added) and any other fields, which the
reward function receives beside the completions (TRL's convention: a list per field, one entry a completion).

``PromptDataset(path, tokenizer, seed)``: ``dataset[i]`` is prompt number ``i`` of an endless sequence of epochs,
each a new seeded order of the file's prompts: ``(ids, text, fields)``.
"""

from __future__ import annotations

import json
import os

import numpy as np

from megakernels_models.data.datasets import Epochs


def read_prompts(path: str) -> list[dict]:
    """The prompt objects of the JSONL ``path`` (blank lines skipped).

    Raises:
        FileNotFoundError: no such file.
        ValueError: a line that is not a JSON object with a non-empty string ``prompt`` (``path:line: rule``), or no
            prompt at all.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--data {path}: no such file (a JSONL of prompts for --grpo)")
    out = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not a JSON object ({e.msg} at column {e.colno})") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str) or not obj["prompt"]:
                raise ValueError(f'{path}:{lineno}: expected {{"prompt": TEXT, ...}} with a non-empty string prompt')
            out.append(obj)
    if not out:
        raise ValueError(f"--data {path}: no prompts")
    return out


class PromptDataset:
    """The prompts of ``path`` tokenised by ``tokenizer`` (module docstring).

    Attributes: ``prompts`` (the objects), ``ids`` (each prompt's int64 token ids), ``longest`` (tokens).

    Raises:
        FileNotFoundError, ValueError: as ``read_prompts``; a prompt that encodes to no tokens (its line).
    """

    def __init__(self, path: str, tokenizer, seed: int):
        self.path, self.prompts = path, read_prompts(path)
        self.ids = [np.asarray(tokenizer.encode(p["prompt"]), dtype=np.int64) for p in self.prompts]
        empty = [k for k, ids in enumerate(self.ids) if len(ids) == 0]
        if empty:
            raise ValueError(f"--data {path}: prompt {empty[0]} encodes to no tokens")
        self.longest = max(len(ids) for ids in self.ids)
        self._order = Epochs(len(self.prompts), int(seed))

    def __len__(self) -> int:
        return len(self.prompts)

    def __getitem__(self, i: int) -> tuple[np.ndarray, str, dict]:
        k = self._order(int(i))
        p = self.prompts[k]
        return self.ids[k], p["prompt"], {f: v for f, v in p.items() if f != "prompt"}
