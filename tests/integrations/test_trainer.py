"""The HF Trainer with ``optimizers=(FusedAdamW(...), scheduler)`` on a patched model: it trains, and a run resumed
from one of its checkpoints (model, FusedAdamW state, scheduler) ends where the uninterrupted run ends."""

from __future__ import annotations

import accelerate  # noqa: F401  (the test extra's; imported, never skipped)
import torch

import megakernels.integrations.transformers as mkt
from megakernels.optim import FusedAdamW
from tests.integrations import hf_models as H

BATCH, SEQ, LR, WARMUP = 8, 16, 3e-3, 2


class Sequences(torch.utils.data.Dataset):
    """The accelerate example's counting sequences as the Trainer's dict samples."""

    def __init__(self, num: int):
        self.ids = H.accelerate_example().dataset(num, SEQ).tensors[0]

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class OptimizerAtStart:
    """A Trainer callback keeping the optimizer's state as training begins (after a resume has loaded it)."""

    def __init__(self):
        from transformers import TrainerCallback

        outer = self

        class Callback(TrainerCallback):
            def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
                outer.state = {
                    k: {n: v.clone() for n, v in s.items()} for k, s in optimizer.state_dict()["state"].items()
                }

        self.callback, self.state = Callback(), None


def _trainer(out_dir, max_steps: int, save_steps: int, callbacks=()):
    from transformers import Trainer, TrainingArguments, get_linear_schedule_with_warmup

    model = H.accelerate_example().build_model(0)
    mkt.apply(model)
    optimizer = FusedAdamW(model.parameters(), lr=LR, weight_decay=0.01)
    scheduler = get_linear_schedule_with_warmup(optimizer, WARMUP, max_steps)
    args = TrainingArguments(
        output_dir=str(out_dir),
        max_steps=max_steps,
        per_device_train_batch_size=BATCH,
        logging_steps=1,
        save_strategy="steps",
        save_steps=save_steps,
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    return Trainer(
        model=model,
        args=args,
        train_dataset=Sequences(1024),
        optimizers=(optimizer, scheduler),
        callbacks=list(callbacks),
    )


def _losses(trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def test_trainer_with_fused_adamw_trains_a_patched_model(tmp_path):
    trainer = _trainer(tmp_path, max_steps=20, save_steps=100)
    trainer.train()
    losses = _losses(trainer)
    assert len(losses) == 20
    assert isinstance(trainer.optimizer.optimizer, FusedAdamW)
    assert sum(losses[-5:]) / 5 < 0.8 * losses[0], losses


def test_trainer_resumes_from_its_checkpoint_with_the_fused_adamw_state(tmp_path):
    full = _trainer(tmp_path / "full", max_steps=6, save_steps=3)
    full.train()
    checkpoint = tmp_path / "full" / "checkpoint-3"
    saved = torch.load(checkpoint / "optimizer.pt", weights_only=False)["state"]

    start = OptimizerAtStart()
    resumed = _trainer(tmp_path / "resumed", max_steps=6, save_steps=3, callbacks=[start.callback])
    resumed.train(resume_from_checkpoint=str(checkpoint))

    assert start.state.keys() == saved.keys() and saved
    for idx, s in saved.items():
        assert float(start.state[idx]["step"]) == 3
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(start.state[idx][key], s[key])
    assert len(_losses(resumed)) == 6  # steps 1-3 from the checkpoint's trainer state, 4-6 trained again
    torch.testing.assert_close(_losses(resumed)[3:], _losses(full)[3:], rtol=1e-5, atol=0)
    for (name, p), q in zip(resumed.model.named_parameters(), full.model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
