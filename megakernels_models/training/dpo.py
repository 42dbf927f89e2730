"""``megakernels train --dpo``: direct preference optimisation in the trainer, against a frozen reference model.

The policy is the trained model (its chunks, wrappers and optimizer are the trainer's own, under any layout); the
reference is a second set of this rank's chunks of the same model and layout, never wrapped or stepped, loaded
from (in order) ``--dpo-ref`` (a megakernels checkpoint; a HuggingFace directory is converted once, before the
world starts, by ``train.hf_import``), else the checkpoint the run starts from (``--load``/``--load-hf``), else
built from the seed as the policy is — the policy's initial weights either way.

Each step runs the global batch's micro-batches through the reference first (the forward-only schedule, its
documents' summed log-probabilities left in each micro-batch on the last stage: ``tasks.ReferenceTask``), then
through the policy (``tasks.DPOTask``). With ``--precompute-ref`` the reference instead runs once over every packed
sample of the training and validation datasets before the first step, its sums are kept per sample
(``[samples, 2 × most pairs in a sample]`` fp32 on the last stage, gathered over data parallelism) and the
reference is freed; the datasets then carry them (``WithReference``). Both give the same losses.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.distributed as dist

import megakernels.parallel as mpu
from megakernels_models.models.tasks import DPOTask, ReferenceTask


def build_reference(task: DPOTask, args, device, path: str | None, build_chunks) -> list[torch.nn.Module]:
    """This rank's reference chunks: ``build_chunks(task, args, device)`` (the trainer's ``build_model_chunks``)
    in the compute dtype, frozen and in evaluation mode, loaded from the checkpoint at ``path`` (model only) unless
    it is None (the seed's weights). The RNG states are left as they were (a checkpoint of this layout would
    restore its own)."""
    from megakernels_models.training import checkpoint

    chunks = [c.to(args.param_dtype()) for c in build_chunks(task, args, device)]
    for c in chunks:
        c.requires_grad_(False)
        c.eval()  # no dropout in the reference (TRL's reference is in evaluation mode too)
    if path is not None:
        rng = (torch.get_rng_state(), mpu.get_rng_tracker().get_states())
        cuda = torch.cuda.get_rng_state() if device.type == "cuda" else None
        checkpoint.load(path, chunks, None, task.config)
        torch.set_rng_state(rng[0])
        mpu.get_rng_tracker().set_states(rng[1])
        if cuda is not None:
            torch.cuda.set_rng_state(cuda)
    return chunks


def reference_path(args, start_path: str | None) -> str | None:
    """The checkpoint the reference loads (module docstring): ``--dpo-ref``'s newest, else ``start_path`` (the
    checkpoint the policy loads at launch; None: the seed's weights)."""
    from megakernels_models.training import checkpoint

    if args.dpo_ref is not None:
        return checkpoint.read_latest(args.dpo_ref)
    return start_path


class DPOStep:
    """One DPO global batch: the reference's pass (unless the dataset carries its sums), then the policy's.
    Called as the trainer's ``PipelineStep`` (``metrics`` are the policy pass's)."""

    def __init__(self, policy, reference):
        self.policy, self.reference = policy, reference

    @property
    def metrics(self) -> dict[str, float]:
        return self.policy.metrics

    @property
    def stats(self):
        return self.policy.stats

    @stats.setter
    def stats(self, value):
        self.policy.stats = value

    def __call__(self, dataset, step: int, forward_only: bool = False, loss_scale: float = 1.0) -> torch.Tensor:
        micro, norm = self.policy.batches(dataset, step)
        if not isinstance(dataset, WithReference):
            if self.reference is None:
                raise RuntimeError("DPOStep: the reference was freed (--precompute-ref) but a dataset lacks its sums")
            self.reference.run(micro, norm, forward_only=True)
        return self.policy.run(micro, norm, forward_only=forward_only, loss_scale=loss_scale)


class _Packed:
    """Packed sample ``i mod n`` of a ``PreferenceDataset`` as sample ``i`` (in order), with its number."""

    def __init__(self, ds):
        self.ds = ds

    def __getitem__(self, i: int) -> dict:
        k = int(i) % len(self.ds)
        return {**self.ds.sample(k), "sample": np.int64(k)}


class WithReference:
    """A ``PreferenceDataset`` whose samples also carry the reference's sums, ``ref_logps`` (fp32 ``[seq_length +
    1]``: document ``d``'s at ``d``, zero past the sample's pairs), from ``table`` (``[packed samples, width]``)."""

    def __init__(self, ds, table: np.ndarray):
        self.ds, self.table = ds, table

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int) -> dict:
        k = self.ds.index(i)
        row = np.zeros(self.ds.seq_length + 1, dtype=np.float32)
        row[: self.table.shape[1]] = self.table[k]
        return {**self.ds[i], "ref_logps": row}


def precompute(reference, ds, device) -> WithReference:
    """``ds`` with the reference's sums of each of its packed samples (``reference``: the reference's
    ``PipelineStep``; collective over the world). Ranks that do not hold the last stage keep zeros (they never
    read them)."""
    n, args = len(ds), reference.args
    width = 2 * max(len(ds.pairs_of(k)) for k in range(n))
    table = torch.full((n, width), -math.inf, dtype=torch.float32, device=device)
    last = any(c.post_process for c in reference.chunks)
    view = _Packed(ds)
    for step in range(math.ceil(n / args.global_batch_size)):
        micro, norm = reference.batches(view, step)
        reference.run(micro, norm, forward_only=True)
        if last:
            for b in micro:
                table[b["sample"].long()] = b["ref_logps"][:, :width].float()
    if last:
        if mpu.dp_size() > 1:  # each packed sample was computed by some data-parallel rank (the same value)
            dist.all_reduce(table, op=dist.ReduceOp.MAX, group=mpu.dp_group())
        table = torch.where(torch.isinf(table), torch.zeros_like(table), table)
    else:
        table.zero_()
    return WithReference(ds, table.cpu().numpy())


def make_step(task: DPOTask, policy_step, args, device, start_path, datasets, step_class, build_chunks):
    """The DPO step of the trainer and the datasets it reads (precomputed with ``--precompute-ref``)."""
    ref_task = ReferenceTask(task)
    chunks = build_reference(task, args, device, reference_path(args, start_path), build_chunks)
    reference = step_class(ref_task, chunks, [[] for _ in chunks], args, device, policy_step.timers)
    if not args.precompute_ref:
        return DPOStep(policy_step, reference), datasets
    datasets = tuple(None if ds is None else precompute(reference, ds, device) for ds in datasets)
    del chunks, reference
    return DPOStep(policy_step, None), datasets
