"""Mixture of experts with expert parallelism (the MoE layers of Megatron-LM, Switch, GShard, Mixtral).

- ``router``    ``TopKRouter``: fp32 linear gate, top-k with or without renormalisation, load-balancing and z losses
- ``dispatch``  token permutation by expert (dropless, or a capacity with documented dropping), the expert-
                parallel all-to-all with variable splits
- ``dispatcher`` the token dispatchers (``alltoall`` with optional overlapped chunks, ``allgather``, registered
                external backends)
- ``experts``   ``GroupedMLP``: the local experts as grouped GEMMs (``megakernels.ops.grouped_gemm``), TP-sharded
- ``layer``     ``MoELayer``: the MLP replacement; ``set_aux_loss_scale``
- ``stats``     per-step auxiliary losses, expert load and drops for the logs
"""

from megakernels.parallel.moe import dispatcher, stats
from megakernels.parallel.moe.dispatch import ExpertExchange, permute, unpermute
from megakernels.parallel.moe.experts import GroupedMLP
from megakernels.parallel.moe.layer import MoELayer, set_aux_loss_scale
from megakernels.parallel.moe.router import TopKRouter

__all__ = [
    "MoELayer",
    "TopKRouter",
    "GroupedMLP",
    "ExpertExchange",
    "permute",
    "unpermute",
    "set_aux_loss_scale",
    "stats",
    "dispatcher",
]
