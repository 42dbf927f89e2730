"""Tensor and sequence parallelism the Megatron-LM way (docs/parallelism.md).

- ``state``     ``initialize(tp, pp, dp, vpp, cp)`` / ``destroy()``; tp, cp, pp, dp, model-parallel and embedding
                groups; ranks ordered tp innermost, then cp, then dp, then pp; pipeline neighbours; ``check_divisible``
- ``mappings``  the conjugate operators f (copy to the TP region) and g (reduce from it), scatter/gather along the
                hidden dim, and the sequence-parallel all-gather / reduce-scatter along dim 0 of ``[s, b, h]``
- ``linear``    ``ColumnParallelLinear`` (f fused in, backward overlapping its collective with the weight-gradient
                GEMM) and ``RowParallelLinear``
- ``embedding`` ``VocabParallelEmbedding`` (vocabulary padded to 128·tp without changing the math)
- ``lm_head``   the output layer (``parallel_lm_logits``, ``ParallelLMHead``, tied or not) and the vocab-parallel
                cross-entropy of ``megakernels.ops.cross_entropy`` over the TP group
- ``blocks``    ``ParallelMLP``, ``ParallelSelfAttention`` and ``ParallelCrossAttention``
- ``params``    the marks each parameter carries (tensor-parallel dim/stride, sequence-parallel, shared
                embedding) and what they mean to gradient sums, the grad norm and checkpoints
- ``init``      layout-independent initialisation: a seed defines the full weight; each rank generates its shard
- ``random``    the RNG tracker: dropout that differs per TP rank inside TP regions and not outside
- ``ddp``       ``DistributedDataParallel``: fp32 ``main_grad`` buffers, bucketed all-reduce / reduce-scatter
                overlapped with backward; ``finalize_model_grads`` (DP sync, sequence-parallel and embedding sums)
- ``optimizer`` ``ParallelOptimizer``: AdamW on fp32 main params, bf16/fp16 masters, fp16 loss scaling, global
                grad-norm clipping over tp/pp/dp, the distributed optimizer (ZeRO-1); ``memory_bytes_per_param``
- ``comm``      the collectives behind them, with an event recorder for tests
- ``context``   context parallelism: the load-balanced sequence split and ring attention
- ``pipeline``  subpackage (import it itself): pipeline schedules (gpipe, 1f1b, interleaved, zb-h1, zb-v) and
                ``forward_backward``

Works on gloo (CPU) and nccl (CUDA) with the same code.
"""

from megakernels.parallel.blocks import ParallelCrossAttention, ParallelMLP, ParallelSelfAttention
from megakernels.parallel.comm import record_events
from megakernels.parallel.ddp import DistributedDataParallel, finalize_model_grads
from megakernels.parallel.embedding import VocabParallelEmbedding, pad_vocab_size
from megakernels.parallel.init import full_weight, init_method_normal, init_shard_, scaled_init_method_normal
from megakernels.parallel.linear import (
    ColumnParallelLinear,
    LinearWithAsyncComm,
    RowParallelLinear,
    allreduce_sequence_parallel_grads,
    linear_with_async_comm,
)
from megakernels.parallel.lm_head import ParallelLMHead, parallel_lm_logits, vocab_parallel_cross_entropy
from megakernels.parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from megakernels.parallel.optimizer import ParallelOptimizer, memory_bytes_per_param
from megakernels.parallel.params import (
    is_sequence_parallel,
    is_shared_embedding,
    is_tensor_parallel,
    mark_fused,
    mark_sequence_parallel,
    mark_shared_embedding,
    mark_tensor_parallel,
)
from megakernels.parallel.random import RNGStatesTracker, get_rng_tracker, model_parallel_seed
from megakernels.parallel.state import (
    check_divisible,
    checkpoint_group,
    cp_group,
    cp_rank,
    cp_size,
    destroy,
    divide,
    dp_cp_group,
    dp_cp_size,
    dp_group,
    dp_rank,
    dp_size,
    embedding_group,
    embedding_ranks,
    ep_group,
    ep_rank,
    ep_size,
    expert_dp_group,
    group_timeout,
    initialize,
    is_in_embedding_group,
    is_initialized,
    is_pp_first_stage,
    is_pp_last_stage,
    model_parallel_group,
    pipeline_placement,
    pp_group,
    pp_next_rank,
    pp_prev_rank,
    pp_rank,
    pp_ranks,
    pp_size,
    set_vpp_rank,
    tp_group,
    tp_rank,
    tp_replica_group,
    tp_size,
    vpp_rank,
    vpp_size,
)

__all__ = [
    # state
    "initialize",
    "destroy",
    "is_initialized",
    "tp_group",
    "pp_group",
    "dp_group",
    "model_parallel_group",
    "cp_group",
    "cp_rank",
    "cp_size",
    "dp_cp_group",
    "dp_cp_size",
    "tp_replica_group",
    "checkpoint_group",
    "group_timeout",
    "ep_group",
    "ep_rank",
    "ep_size",
    "expert_dp_group",
    "embedding_group",
    "embedding_ranks",
    "is_in_embedding_group",
    "tp_rank",
    "tp_size",
    "pp_rank",
    "pp_size",
    "dp_rank",
    "dp_size",
    "vpp_rank",
    "vpp_size",
    "set_vpp_rank",
    "pipeline_placement",
    "pp_ranks",
    "pp_next_rank",
    "pp_prev_rank",
    "is_pp_first_stage",
    "is_pp_last_stage",
    "check_divisible",
    "divide",
    # mappings
    "copy_to_tensor_model_parallel_region",
    "reduce_from_tensor_model_parallel_region",
    "scatter_to_tensor_model_parallel_region",
    "gather_from_tensor_model_parallel_region",
    "scatter_to_sequence_parallel_region",
    "gather_from_sequence_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    # layers
    "ColumnParallelLinear",
    "RowParallelLinear",
    "LinearWithAsyncComm",
    "linear_with_async_comm",
    "allreduce_sequence_parallel_grads",
    "VocabParallelEmbedding",
    "pad_vocab_size",
    "parallel_lm_logits",
    "vocab_parallel_cross_entropy",
    "ParallelLMHead",
    "ParallelCrossAttention",
    "ParallelMLP",
    "ParallelSelfAttention",
    # data parallelism and the optimizer step
    "DistributedDataParallel",
    "finalize_model_grads",
    "ParallelOptimizer",
    "memory_bytes_per_param",
    # parameter marks
    "mark_fused",
    "mark_tensor_parallel",
    "mark_sequence_parallel",
    "mark_shared_embedding",
    "is_tensor_parallel",
    "is_sequence_parallel",
    "is_shared_embedding",
    # init, random, comm
    "init_method_normal",
    "scaled_init_method_normal",
    "init_shard_",
    "full_weight",
    "RNGStatesTracker",
    "get_rng_tracker",
    "model_parallel_seed",
    "record_events",
]
