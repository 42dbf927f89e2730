"""What the mixture-of-experts layers did in this step, for the logs: auxiliary losses, expert load, drops.

Every layer's forward (in training) calls ``record``; the trainer calls ``summary(group)`` once per step, which
combines the records of the ranks in ``group`` (the pipeline stages, which hold different layers) and clears them.
Losses are averaged over the (layer, micro-batch) forwards. ``max_expert_load`` is the most assignments one expert
got in one layer and micro-batch, ``mean_expert_load`` the average per expert (equal when perfectly balanced);
``dropped_fraction`` the share of assignments over capacity.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_records: list[tuple] = []


def record(
    aux_loss: torch.Tensor, z_loss: torch.Tensor, tokens_per_expert: torch.Tensor, dropped, assignments: int
) -> None:
    """Keeps a layer's numbers as they are (tensors stay on their device: nothing is read back to the host until
    ``summary``); ``dropped`` an int or a 0-dim tensor."""
    _records.append((aux_loss.detach(), z_loss.detach(), tokens_per_expert.detach(), dropped, assignments))


def clear() -> None:
    _records.clear()


def summary(group=None) -> dict | None:
    """This step's ``{moe_aux_loss, moe_z_loss, max_expert_load, mean_expert_load, dropped_fraction}`` over the
    ranks of ``group`` (collective: every member calls it), then cleared; None when no layer recorded anything."""
    recs, _records[:] = list(_records), []
    # sums: aux, z, forwards, dropped, assignments, mean load; and the max load
    sums = torch.zeros(6, dtype=torch.float64)
    peak = torch.zeros(1, dtype=torch.float64)
    for aux, z, load, dropped, assignments in recs:
        load = load.double().cpu()
        sums += torch.tensor(
            [float(aux), float(z), 1.0, float(dropped), assignments, load.mean().item()], dtype=torch.float64
        )
        peak = torch.maximum(peak, load.max().reshape(1))
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(sums, group=group)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    n = sums[2].item()
    if n == 0:
        return None
    return {
        "moe_aux_loss": sums[0].item() / n,
        "moe_z_loss": sums[1].item() / n,
        "max_expert_load": peak.item(),
        "mean_expert_load": sums[5].item() / n,
        "dropped_fraction": sums[3].item() / max(sums[4].item(), 1.0),
    }
