"""The trainer's output on the logging rank: a progress bar, one JSON object per step, TensorBoard scalars.

The JSONL file starts (each run, resumed ones too) with ``{"config": ...}``, the resolved configuration
(``config_file.resolved``, what ``--print-config`` prints); then fields per step (docs/training.md): ``step, loss, lr,
grad_norm, loss_scale, tokens, tokens_per_s,
tflops_per_device, mfu, elapsed_s`` (+ ``val_loss, val_ppl`` on evaluation steps, ``skipped`` when fp16 loss
scaling skipped the update, and on the first step of a run ``memory_per_param_bytes`` and ``layout``: world
size, tp, cp, pp, dp, micro-batches per step and torchrun's restart count).

A log that cannot be written (a full disk, an unwritable path) costs one warning line and stops that log; training
and its checkpoints go on.
"""

from __future__ import annotations

import json
import math
import os
import sys


class TrainLogger:
    """Progress bar, JSONL and TensorBoard on the logging rank; does nothing elsewhere (``enabled=False``)."""

    def __init__(
        self,
        enabled: bool,
        *,
        steps: int,
        start_step: int,
        progress: bool = True,
        log_jsonl: str | None = None,
        tensorboard: str | None = None,
        config: dict | None = None,
    ):
        self.enabled, self.records = enabled, []
        self.bar = self.jsonl = self.tb = None
        if not enabled:
            return
        if progress:
            from tqdm import tqdm

            self.bar = tqdm(total=steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True)
        if log_jsonl:
            self._log_path = log_jsonl
            try:
                os.makedirs(os.path.dirname(os.path.abspath(log_jsonl)), exist_ok=True)
                self.jsonl = open(log_jsonl, "a", encoding="utf-8")
            except OSError as e:
                self._give_up("--log-jsonl", log_jsonl, e)
            if config is not None:
                self._write_jsonl({"config": config})
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb_path = tensorboard
            self.tb = SummaryWriter(tensorboard)
            if config is not None:
                self.tb.add_text("config", "```\n" + json.dumps(config, indent=1) + "\n```", start_step)

    def log(self, rec: dict | None) -> None:
        if not self.enabled or rec is None:
            return
        self.records.append(rec)
        self._write_jsonl(rec)
        if self.tb:
            try:
                for k, v in rec.items():
                    if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                        self.tb.add_scalar(f"valid/{k[4:]}" if k.startswith("val_") else f"train/{k}", v, rec["step"])
            except OSError as e:
                self.tb = self._give_up("--tensorboard", self._tb_path, e, self.tb)
        if self.bar:
            post = {"loss": f"{rec['loss']:.4f}", "tok/s": f"{rec['tokens_per_s']:.0f}"}
            if "val_loss" in rec:
                post["val"] = f"{rec['val_loss']:.4f}"
            self.bar.set_postfix(post, refresh=False)
            self.bar.update(1)

    def _write_jsonl(self, rec: dict) -> None:
        if self.jsonl is None:
            return
        try:
            self.jsonl.write(json.dumps(rec) + "\n")
            self.jsonl.flush()
        except OSError as e:
            self.jsonl = self._give_up("--log-jsonl", self._log_path, e, self.jsonl)

    @staticmethod
    def _give_up(flag: str, path: str, e: OSError, handle=None) -> None:
        """A log that cannot be written (a full disk, a bad path) is reported in one line and dropped: training and
        its checkpoints go on. Returns None (the handle's new value)."""
        print(
            f"megakernels train: warning: cannot write {flag} {path} ({e.strerror or e}); that log stops here",
            file=sys.stderr,
            flush=True,
        )
        if handle is not None:
            try:
                handle.close()
            except OSError:
                pass  # closing flushes what could not be written: the same error again
        return None

    def close(self) -> None:
        for h in (self.bar, self.jsonl, self.tb):
            if h is not None:
                try:
                    h.close()
                except OSError:
                    pass  # already reported when the write failed
