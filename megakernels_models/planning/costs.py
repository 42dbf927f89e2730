"""What a layout costs: memory per device (``--dry-run``, ``megakernels plan``) and predicted step time
(``megakernels plan``).

Memory per device, Megatron-LM's accounting:

- parameters per device from the model built once on the meta device: sharded tensors divided by tp (the vocabulary
  padded to 128·tp; key/value heads replicated when tp exceeds them), expert weights by tp·ep, layers split over
  pipeline stages; the most loaded stage is reported;
- weights + gradients + optimizer state per parameter: 16-bit training keeps 2-byte weights, 4-byte fp32 gradients
  and 12 bytes of fp32 master weight + Adam moments (18), the distributed optimizer shards the 12 over dp·cp (the
  experts' over the ranks holding the same experts); fp32 training 4 + 4 + 8; fp8 training as 16-bit (its weights
  are bf16, quantised as they are used); parameters frozen by ``--freeze`` (``Layout.frozen``) hold their weights
  only — no gradient, no optimizer state; with ``--optimizer muon`` the matrices Muon steps keep one fp32 momentum
  (and a 16-bit parameter's fp32 master: 8 bytes, 4 in fp32) instead of AdamW's 12 / 8, sharded alike;
- activations per Korthikanti et al. 2022 (``ModelConfig.activation_bytes_per_layer``; with fp8 the FP8 linears'
  saved inputs at 1 byte an element and their FP8 weight copies: ``activation_bytes_per_layer``) for a stage's
  layers, times
  the micro-batches the schedule keeps in flight on the first stage (1F1B: pp; interleaved: × (1 + (pp−1)/(pp·vpp));
  GPipe: all m; the zero-bubble schedules ``min(pp, m)`` on every rank, counted until their weight-gradient pass:
  ``in_flight_per_rank``), plus the last stage's fp32 logits — or, with the fused LM-head loss
  (``Layout.fused_linear_ce``, the trainer's default for causal LMs), one chunk of logits and, in 16 bits, dW's
  fp32 accumulator and one chunk's 16-bit product (``ops.linear_cross_entropy``).

Step time (``predict``), the sum of what cannot overlap, each term from a documented device profile
(``DEVICES``, each constant with its source), checked against published training runs by ``megakernels plan
--reproduce`` (``reproduce.py``; development set and errors: docs/parallelism.md, benchmarks/published):

- compute (``compute_time``): the FLOPs a device executes (recomputation included) at ``peak × efficiency``, the
  efficiency falling for thin GEMMs (``hidden/tp`` below 1024) and small micro-batches (fewer than 2048 tokens per
  GEMM); plus the memory-bound kernels: ``ELEMENTWISE_PASSES`` (+2 with full recomputation) times the bytes a layer
  stores for backward (``activation_bytes_per_layer``: the attention scores too without FlashAttention) at
  ``HBM_FRACTION`` of ``Device.hbm_gbps``; plus the optimizer's ``OPTIMIZER_BYTES_PER_PARAM`` per parameter
  (with Muon also its Newton-Schulz GEMMs, ``muon_ns_flops``, at the 16-bit peak × efficiency, over tp and, with
  ZeRO-1 or FSDP, the data-parallel owners);
  with fp8 (``Layout.precision``; ``check_precision`` refuses a GPU without FP8) the blocks' linears — QKV, output
  projection, MLP or experts' matrices: ``fp8_flops_per_token``, forward, data and weight gradients and their
  recomputation — run at ``Device.tflops_8`` × ``fp8_gemm_efficiency`` (``FP8_GEMM_RELATIVE``, and
  ``FP8_BLOCKWISE_GEMM`` for ``Layout.fp8_recipe`` blockwise), the rest (attention core, LM head) 16-bit, and each
  quantised tensor (``fp8_quantized_elements``) costs one memory-bound pass of ``FP8_QUANTIZE_BYTES`` an element;
  MFU stays counted against the 16-bit peak, as published tables count it;
- pipeline bubble: ``(pp−1)/(vpp·m)`` of the compute (``pipeline_bubble``: zb-h1's closed form and zb-v's
  simulated schedule at the model's forward, input- and weight-gradient FLOPs, ``config.stage_times``), plus the
  point-to-point activations of each micro-batch;
- tensor parallelism: per layer and micro-batch, forward and backward, two all-reduces (or all-gather +
  reduce-scatter with SP, the same bytes) of the ``[s/cp, b, h]`` activations in 16 bits, ring cost
  ``2(t−1)/t·bytes/bandwidth`` over NVLink inside a node, the inter-node network beyond; not overlapped; with fp8
  and SP the forward's all-gathers (before the column-parallel GEMMs) move FP8 copies, half the bytes;
- context parallelism: each layer's key/value ring (forward and backward) overlapped with the attention compute;
  what exceeds it counts, and the hidden part at ``OVERLAP_SM_SHARE`` (its kernels slow the compute they overlap;
  ``overlapped``, as for every overlapped collective below);
- data parallelism: the fp32 gradient reduction (or reduce-scatter + parameter all-gather with ZeRO-1) of a device's
  trained parameters (``--freeze``'s have no gradient), over NVLink inside a node, across nodes through the network
  adapters of the group's members in each node (``dp_gbps``: NCCL runs a ring per adapter), overlapped with the
  backward of the last micro-batch, 1/m of the compute (the compute itself counts a full backward, frozen layers
  included); ZeRO-3 (``Layout.fsdp``: FSDP2, ``--fsdp``) instead runs per micro-batch two 16-bit parameter all-gathers
  and a gradient reduce-scatter in ``fsdp_reduce_dtype`` over the shard ranks (ZeRO-2, ``Layout.zero2``: one
  all-gather; HSDP: the shard then all-reduced across the replicas), hidden behind the step's compute as far as it
  goes but for the first layer's gather and the last one's reduce-scatter of each micro-batch (tensorwise FP8 weights
  gathered in FP8, ``fp8_gathered_weights``); with ``offload_optimizer`` its shards' optimizer state is on the host;
  its memory is the sharded fp32 masters, gradients and moments (16 bytes a parameter over the shard ranks,
  ``Layout.shard_ranks``) plus the gathered 16-bit copies of two layers and one layer's gradient (ZeRO-2: of every
  layer of the stage);
- expert parallelism: the MoE all-to-alls (dispatch and combine, forward and backward) of a micro-batch's routed
  tokens;
- optimizer offload (``offload_time``): the host AdamW on this rank's share of the trained parameters (its ZeRO-1
  shard) at ``HOST_ADAMW_NS_PER_PARAM``, never overlapped (it needs every gradient and the next forward needs its
  result); the fp32 gradients device→host over PCIe (``Device.host_gbps``), overlapped with the last micro-batch's
  backward like the data-parallel reduction; the updated parameters host→device (2 bytes in 16-bit training, 4 in
  fp32), overlapped with the first micro-batch's forward, not at all under ZeRO-1 (its all-gather needs them first).
"""

from __future__ import annotations

import dataclasses
import functools

from megakernels import machines
from megakernels.ops.fp8 import RECIPES as FP8_RECIPES
from megakernels.parallel.embedding import pad_vocab_size
from megakernels.parallel.optimizer_memory import grads_summed
from megakernels.parallel.params import is_expert_parallel, is_tensor_parallel
from megakernels.parallel.pipeline.schedules import ZERO_BUBBLE
from megakernels.precisions import PRECISIONS
from megakernels_models.models.config import ModelConfig, stage_layers, stage_times


@dataclasses.dataclass(frozen=True)
class Layout:
    """A parallel layout and its batch: what a ``megakernels train`` command sets."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    vpp: int = 1
    micro_batch_size: int = 1
    global_batch_size: int = 1
    sequence_parallel: bool = False
    distributed_optimizer: bool = False
    offload_optimizer: bool = False
    fsdp: bool = False  # ZeRO-3 (``--fsdp``): parameters, gradients and optimizer state sharded by FSDP2
    zero2: bool = False  # ZeRO-2 (``--zero 2``): FSDP2 keeping each layer's gathered parameters until its backward
    fsdp_degree: int = 0  # HSDP (``--fsdp-degree``): shard over this many data-parallel ranks (0: all of dp·cp)
    fsdp_reduce_dtype: str = "fp32"  # ``--fsdp-reduce-dtype``: the gradient reduce-scatter's dtype (fp32 | bf16)
    recompute: str = "none"
    precision: str = "bf16"  # fp32 | bf16 | fp16 | fp8 (``PRECISIONS``)
    fp8_recipe: str = "tensorwise"  # with fp8: tensorwise | blockwise (``FP8_RECIPES``)
    schedule: str = "1f1b"
    flash: bool = True
    frozen: tuple[str, ...] = ()  # --freeze's name parts (Task.is_frozen): weights without gradients or optimizer
    fused_linear_ce: bool = True  # --no-fused-linear-ce: a causal LM's loss holds the whole logits (Megatron-LM's)
    optimizer: str = "adamw"  # --optimizer: muon keeps one fp32 momentum for the hidden matrices, not two moments
    muon_ns_steps: int = 5  # --muon-ns-steps: Newton-Schulz iterations per step (its GEMM time)

    @property
    def placement(self) -> str:
        """Where the pipeline chunks sit: ``"v"`` for zb-v (rank r: stages r and 2·pp−1−r), else ``"interleaved"``."""
        return "v" if self.schedule == "zb-v" else "interleaved"

    def __post_init__(self):
        if self.precision not in PRECISIONS:
            raise ValueError(f"Layout: precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if self.fp8_recipe not in FP8_RECIPES:
            raise ValueError(f"Layout: fp8_recipe must be one of {', '.join(FP8_RECIPES)}, got {self.fp8_recipe!r}")

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    @property
    def sharded(self) -> bool:
        """Whether FSDP2 shards the parameters (ZeRO-2 or ZeRO-3)."""
        return self.fsdp or self.zero2

    def shard_ranks(self, experts: bool = False, ep: int = 1) -> int:
        """The ranks a parameter (an expert's: its data-parallel ranks, dp·cp / ep) is sharded over."""
        ranks = self.dp * self.cp // (ep if experts else 1)
        return max(1, min(ranks, self.fsdp_degree) if self.fsdp_degree else ranks)

    @property
    def microbatches(self) -> int:
        return self.global_batch_size // (self.micro_batch_size * self.dp)

    @classmethod
    def of(cls, args, cfg=None) -> Layout:
        """The layout of validated trainer arguments (``arguments.TrainArgs``) for model ``cfg`` (which decides
        the LM head's default, ``TrainArgs.fused_head``; without it the fused head unless it was turned off)."""
        return cls(
            tp=args.tp,
            pp=args.pp,
            dp=args.data_parallel_size(),
            cp=args.cp,
            ep=args.ep,
            vpp=args.pipeline_chunks(),
            micro_batch_size=args.micro_batch_size,
            global_batch_size=args.global_batch_size,
            sequence_parallel=args.sequence_parallel,
            distributed_optimizer=args.zero_stage() == 1,
            fsdp=args.zero_stage() == 3,
            zero2=args.zero_stage() == 2,
            fsdp_degree=args.fsdp_degree or 0,
            fsdp_reduce_dtype=args.fsdp_reduce_dtype,
            offload_optimizer=args.offload_optimizer,
            recompute=args.recompute,
            precision=args.precision,
            fp8_recipe=args.fp8_recipe,
            schedule=args.schedule,
            flash=args.attention == "flash",
            frozen=args.frozen_parts(),
            fused_linear_ce=args.fused_head(cfg) if cfg is not None else args.fused_linear_ce is not False,
            optimizer=args.optimizer,
            muon_ns_steps=args.muon_ns_steps,
        )


@dataclasses.dataclass(frozen=True)
class Device:
    """A GPU in its system: peak dense TFLOP/s (16-bit, fp32, fp8; 0 where the GPU has no fp8), the efficiency large
    GEMMs reach, memory, and bandwidths in GB/s per device: inside a node (NVLink through NVSwitch, per direction)
    and across nodes (the node's network adapters shared by its ``gpus_per_node`` GPUs, ``inter_gbps`` each); the
    latency of one message; ``sources``: (constant, where it comes from) pairs."""

    name: str
    tflops_16: float
    tflops_32: float
    efficiency: float
    memory_gb: float
    intra_gbps: float
    inter_gbps: float
    latency_s: float = 10e-6
    host_gbps: float = 25.0  # host <-> device (PCIe), GB/s per direction and GPU, pinned memory
    tflops_8: float = 0.0
    hbm_gbps: float = 0.0  # device memory bandwidth (data sheet); 0: not modelled (the CPU profile)
    gpus_per_node: int = 8
    sources: tuple[tuple[str, str], ...] = ()

    def network_gbps(self, gpus_per_node: int | None = None) -> float:
        """GB/s of the inter-node network per GPU when ``gpus_per_node`` GPUs share a node's adapters (the
        system's own node: ``inter_gbps``)."""
        return self.inter_gbps * self.gpus_per_node / (gpus_per_node or self.gpus_per_node)

    @classmethod
    def of(cls, gpu: machines.GPU, efficiency: float, intra_gbps: float, inter_gbps: float, **system) -> Device:
        """The device of one part of ``megakernels.machines`` (its peaks, memory and HBM bandwidth) in a system
        (its NVLink, network, host link and node size, ``system``)."""
        return cls(
            gpu.key.split("-")[0],
            gpu.bf16_dense / 1e12,
            gpu.fp32 / 1e12,
            efficiency,
            gpu.memory_bytes / 1e9,
            intra_gbps,
            inter_gbps,
            tflops_8=gpu.fp8_dense / 1e12,
            hbm_gbps=gpu.hbm / 1e9,
            **system,
        )


_HOPPER_SYSTEM = (
    ("tflops_*, memory_gb, hbm_gbps", "megakernels.machines (the datasheets)"),
    ("intra_gbps", "NVLink 4 through NVSwitch: 900 GB/s per GPU, both directions together (450 each way); DGX H100"),
    ("inter_gbps", "DGX H100 / HGX H200: 8 ConnectX-7 400 Gb/s NDR InfiniBand adapters per 8-GPU node (50 GB/s each)"),
    ("host_gbps", "PCIe Gen5 x16: 64 GB/s a direction, ~50 sustained from pinned memory"),
    ("efficiency", "the part's mma_sustained (MAMF: H100 SXM 80.1 %) x TRAINING_GEMM_FRACTION (calibrated)"),
)
# efficiency: the fraction of the dense peak a training step's 16-bit GEMMs sustain (``compute_time``): the part's
# ``mma_sustained`` (the best large bf16 GEMM's measured fraction of the peak, ``megakernels.machines``) times
# ``TRAINING_GEMM_FRACTION``, the share of it a training step keeps (launch gaps between kernels, GEMM shapes that do
# not fill the GPU, clocks under power limits), calibrated on the development set's A100 rows (Narayanan et al. 2021
# Table 1, benchmarks/published: the value whose median signed error over the 10 rows is closest to 0). V100 (no
# sustained-GEMM measurement): 0.4, calibrated on its only development rows (Shoeybi et al. 2019's weak scaling),
# which measure 2019 Megatron-LM, so runs of later software are under-predicted.
TRAINING_GEMM_FRACTION = 0.72


def _gemm_efficiency(gpu: machines.GPU) -> float:
    """A measured part's ``efficiency``: its ``mma_sustained`` × ``TRAINING_GEMM_FRACTION``."""
    return round(gpu.mma_sustained * TRAINING_GEMM_FRACTION, 4)


_G = machines.GPUS
DEVICES = {
    "h200": Device.of(_G["H200"], _gemm_efficiency(_G["H200"]), 450.0, 50.0, host_gbps=50.0, sources=_HOPPER_SYSTEM),
    "h100": Device.of(
        _G["H100-SXM"], _gemm_efficiency(_G["H100-SXM"]), 450.0, 50.0, host_gbps=50.0, sources=_HOPPER_SYSTEM
    ),
    "a100": Device.of(
        _G["A100-SXM4-80GB"],
        _gemm_efficiency(_G["A100-SXM4-80GB"]),
        300.0,
        25.0,
        host_gbps=25.0,
        sources=(
            ("tflops_*, memory_gb, hbm_gbps", "megakernels.machines (the A100 80GB SXM datasheet)"),
            ("intra_gbps", "NVLink 3 through NVSwitch: 600 GB/s per GPU, both directions together (300 each way)"),
            (
                "inter_gbps",
                "DGX A100 (Selene, Narayanan et al. 2021 §5): 8 Mellanox 200 Gb/s HDR InfiniBand adapters per "
                "8-GPU node for application traffic (25 GB/s each)",
            ),
            ("host_gbps", "PCIe Gen4 x16: 32 GB/s a direction, ~25 sustained"),
            ("efficiency", "the part's mma_sustained (MAMF: 85.9 %) x TRAINING_GEMM_FRACTION (calibrated)"),
        ),
    ),
    "v100": Device.of(
        _G["V100-SXM2-32GB"],
        0.4,
        150.0,
        6.25,
        host_gbps=12.0,
        gpus_per_node=16,
        sources=(
            ("tflops_*, memory_gb, hbm_gbps", "megakernels.machines (the V100 SXM2 datasheet)"),
            (
                "intra_gbps",
                "DGX-2H: NVLink 2 through NVSwitch, 300 GB/s per GPU both directions together (Shoeybi et al. "
                "2019 §5: '300 GB/sec bandwidth between GPUs inside a server via NVSwitch')",
            ),
            (
                "inter_gbps, gpus_per_node",
                "DGX-2H: 16 GPUs and 8 100 Gb/s InfiniBand adapters per node (Shoeybi et al. 2019 §5: '100 GB/sec "
                "of interconnect bandwidth between servers using 8 InfiniBand adapters per server'): 6.25 GB/s "
                "per GPU",
            ),
            ("host_gbps", "PCIe Gen3 x16: 16 GB/s a direction, ~12 sustained"),
        ),
    ),
}
# The host AdamW step (``--offload-optimizer``) per parameter of a rank, in ns: a property of the host (its cores and
# memory bandwidth per rank), not of the GPU. The default is plain data: what ``megakernels bench --ops
# adamw_offload`` measured for our C++ CPU AdamW (bf16, 64 tensors of 1M) on a 2-core development machine, a
# pessimistic figure for a training node, where each rank has several cores; measure the target host with the same
# command and pass it to ``megakernels plan --host-adamw-ns``.
HOST_ADAMW_NS_PER_PARAM = 5.6
# Allowance beyond the model: the CUDA context, NCCL and cuBLAS workspaces, and allocator fragmentation.
RESERVED_GB, FRAGMENTATION = 2.0, 0.10


def bytes_per_param(
    layout: Layout, experts: bool = False, ep: int = 1, muon: bool = False
) -> tuple[float, float, float]:
    """(weights, gradients, optimizer state) bytes per parameter on one device; the optimizer state is 0 there with
    ``offload_optimizer`` (``host_bytes_per_param``). ``muon``: of a matrix Muon steps (one fp32 momentum instead
    of two moments; ``optimizer_memory.muon_bytes_per_param``)."""
    half = layout.precision != "fp32"
    if layout.sharded:  # FSDP2: fp32 sharded masters (the parameters), fp32 sharded gradients, sharded moments
        n = layout.shard_ranks(experts, ep)
        return 4 / n, 4 / n, 0.0 if layout.offload_optimizer else (4 if muon else 8) / n
    weight_b, grad_b, opt_b = (2, 4, 12) if half else (4, 4, 8)
    if muon:
        opt_b = 8 if half else 4
    chunks = 2 if layout.placement == "v" else layout.vpp
    if not grads_summed(layout.world, layout.microbatches, chunks, half, layout.offload_optimizer):
        grad_b = 2  # 16-bit gradient buffers: nothing is summed into them
    if layout.offload_optimizer:
        opt_b = 0
    if layout.distributed_optimizer:
        ranks = layout.dp * layout.cp // (ep if experts else 1)
        opt_b = opt_b / max(ranks, 1)
    return weight_b, grad_b, opt_b


def host_bytes_per_param(layout: Layout, experts: bool = False, ep: int = 1) -> float:
    """Host bytes per parameter of one rank with ``offload_optimizer``: fp32 master, two moments and a gradient
    copy (16; ``megakernels.parallel.optimizer_memory.host_bytes_per_param``), divided like the optimizer state under
    ZeRO-1 and FSDP; 0 without offload."""
    if not layout.offload_optimizer:
        return 0.0
    if layout.sharded:
        return 16.0 / layout.shard_ranks(experts, ep)
    ranks = layout.dp * layout.cp // (ep if experts else 1) if layout.distributed_optimizer else 1
    return 16.0 / max(ranks, 1)


@functools.cache
def params_per_stage(
    model_key,
    tp: int,
    pp: int,
    vpp: int,
    ep: int = 1,
    experts_only: bool = False,
    frozen: tuple[str, ...] | None = None,
    placement: str = "interleaved",
    muon_only: bool = False,
) -> list[int]:
    """Parameters each pipeline stage holds per device (``model_key``: a ``MetaModel``); with ``frozen`` (``--freeze``'s
    name parts) only the trained ones, those ``Task.is_frozen`` leaves out; with ``muon_only`` only the matrices
    Muon steps (``megakernels.optim.muon.muon_param_groups``). Under the V placement (zb-v) the first and the last
    stage, embedding and output layer, are both on rank 0."""
    from megakernels.parallel.pipeline.schedules import stage_owner
    from megakernels_models.models.registry import task_for

    model, cfg = model_key.model, model_key.config
    skip = (lambda name: task_for(cfg).is_frozen(name, list(frozen))) if frozen else (lambda name: False)
    last = stage_owner(placement, pp, pp * vpp - 1, vpp)[0]  # the rank of the last stage
    owner = {}
    for r, chunks in enumerate(stage_layers(cfg.num_layers, pp, vpp, placement)):
        for layers in chunks:
            for i in layers:
                owner[i] = r
    vocab_local = pad_vocab_size(cfg.vocab_size, tp) // tp
    kv_copies = max(1, tp // cfg.num_kv_heads)  # key/value heads replicated when tp exceeds them
    stages = [0] * pp
    muon = model_key.muon_names if muon_only else None
    for name, p in model.named_parameters():
        if (experts_only and not is_expert_parallel(p)) or skip(name) or (muon is not None and name not in muon):
            continue
        if is_expert_parallel(p):  # the experts' output bias is replicated over TP (whole on every TP rank)
            n = p.numel() // (1 if name.endswith("experts.fc2_bias") else tp) // ep
        elif name in ("embedding.word.weight", "output_layer.weight"):
            n = vocab_local * cfg.hidden_size
        elif name == "mlm_bias":
            n = vocab_local
        elif name.endswith("attention.kv.weight") or name.endswith("attention.kv.bias"):
            n = p.numel() * kv_copies // tp
        elif is_tensor_parallel(p):
            n = p.numel() // tp
        else:
            n = p.numel()
        layer = name.split(".")[1] if name.startswith(("layers.", "cross.")) else None
        if layer is not None:  # a language layer, or the cross-attention layer after it (vlm)
            stages[owner[int(layer)]] += n
        elif name.startswith(("embedding.", "vision.", "projector.")):  # vlm: the encoder is on the first stage
            stages[0] += n
        else:
            stages[last] += n
    table_on_last = cfg.tie_embeddings or cfg.mtp_layers  # the head's table, or multi-token prediction's lookups
    if pp > 1 and table_on_last and not experts_only and not muon_only and not skip("embedding.word.weight"):
        stages[last] += vocab_local * cfg.hidden_size  # the last stage's copy of the word embedding
    return stages


class MetaModel:
    """The model of ``config`` on the meta device, built once (hashable for the caches).

    Raises:
        ArgumentError: a weight of ``config`` would be larger than a tensor can be (2**63 bytes: even the meta
            device cannot describe it).
    """

    def __init__(self, config: ModelConfig):
        from megakernels.parallel.launch import single_process_world
        from megakernels_models.models.registry import task_for
        from megakernels_models.settings import ArgumentError

        self.config = config
        with single_process_world(parallel=True):
            try:
                self.model = task_for(config).build_chunk(0, device="meta", attention="torch")
            except RuntimeError as e:
                if "overflow" not in str(e):
                    raise
                raise ArgumentError(
                    f"the model's sizes (hidden {config.hidden_size}, ffn {config.ffn_hidden_size}, vocabulary "
                    f"{config.vocab_size}) make a weight larger than a tensor can be ({e})"
                ) from None
        self.parameters = sum(p.numel() for p in self.model.parameters())
        self.expert_parameters = sum(p.numel() for p in self.model.parameters() if is_expert_parallel(p))
        from megakernels.optim.muon import muon_param_groups

        chosen = {id(p) for g in muon_param_groups(self.model) if g["use_muon"] for p in g["params"]}
        # the parameters --optimizer muon steps with Muon, by name
        self.muon_names = frozenset(n for n, p in self.model.named_parameters() if id(p) in chosen)

    @property
    def active_parameters(self) -> int:
        cfg = self.config
        return (
            self.parameters - self.expert_parameters + self.expert_parameters * cfg.moe_top_k // max(cfg.num_experts, 1)
        )


def in_flight(layout: Layout) -> float:
    """Micro-batches whose activations the first stage holds at once."""
    return in_flight_per_rank(layout)[0]


def in_flight_per_rank(layout: Layout) -> list[float]:
    """Micro-batches (through a rank's share of the layers) whose activations each pipeline rank holds at once: 1F1B
    ``min(pp, m) − r`` (at least 1), interleaved ``pp (1 + (pp−1)/(pp·vpp))`` on rank 0 and one less per later rank,
    GPipe all m on rank 0 (the same rule after it: the accounting as it was); zb-h1 and zb-v ``min(pp, m)`` on every
    rank (1F1B's first-stage peak; their schedules keep it, counting a micro-batch until its weight-gradient pass,
    though its B already freed part of it: a bound), which ``simulate``'s ``peak_activations`` confirms
    (tests/parallel/test_zero_bubble.py)."""
    m, pp = layout.microbatches, layout.pp
    if layout.schedule in ZERO_BUBBLE:
        return [float(min(pp, m))] * pp
    if layout.vpp > 1:
        first = pp * (1 + (pp - 1) / (pp * layout.vpp))
    elif layout.schedule == "gpipe":
        first = m
    else:
        first = min(pp, m)
    return [first if r == 0 else max(1.0, first - r) for r in range(pp)]


def pipeline_bubble(cfg: ModelConfig, layout: Layout) -> float:
    """The pipeline bubble as a fraction of the compute: ``(pp−1)/(vpp·m)`` for 1F1B and interleaving (GPipe's too);
    for the zero-bubble schedules at the stage's forward, input- and weight-gradient times from the model's FLOPs
    (``config.stage_times``): zb-h1's closed form (``schedules.bubble_fraction``), zb-v's schedule simulated
    (planned for those times, as the trainer plans it). Simulating costs ``O(pp²·m)``, so zb-v is simulated at most
    at ``ZB_V_SIMULATED_STAGES`` stages (longer pipelines: that idle time scaled by ``(pp−1)/7``) and, past
    ``8·pp`` micro-batches, its idle time extrapolated linearly from ``4·pp`` and ``8·pp`` (constant where the steady
    state has no bubble, as at equal F, B and W; growing with m where B outweighs what the memory bound lets the
    other passes hide, as with full recomputation, where it can saturate later: then an overestimate). Checked
    against the simulation in tests/parallel/test_zero_bubble.py."""
    m, pp = layout.microbatches, layout.pp
    if pp == 1:
        return 0.0
    if layout.schedule not in ZERO_BUBBLE:
        return (pp - 1) / (layout.vpp * m)
    from megakernels.parallel.pipeline import schedules

    times = stage_times(cfg, layout.recompute)
    if layout.schedule == "zb-h1":
        return schedules.bubble_fraction("zb-h1", pp, m, None, *times)
    return zb_v_idle(pp, m, times) / (m * (times[0] + times[1]))


ZB_V_SIMULATED_STAGES = 8  # pipeline_bubble: zb-v's schedule simulated at up to this many stages


def zb_v_idle(pp: int, m: int, times: tuple) -> float:
    """zb-v's idle time per rank over a step of ``m`` micro-batches (``times``' units), as ``pipeline_bubble``
    estimates it."""
    stages = min(pp, ZB_V_SIMULATED_STAGES)
    scale = (pp - 1) / (stages - 1)
    if m <= 8 * stages:
        return _zb_v_idle(stages, m, times) * scale
    a, b = _zb_v_idle(stages, 4 * stages, times), _zb_v_idle(stages, 8 * stages, times)
    # the list scheduler's idle time wanders by ~10 % from one m to the next: only a clear growth is a trend
    slope = (b - a) / (4 * stages) if b > 1.15 * a else 0.0
    return (max(a, b) + slope * (m - 8 * stages)) * scale


@functools.lru_cache(maxsize=256)
def _zb_v_idle(pp: int, m: int, times: tuple) -> float:
    """zb-v's idle time per rank (in ``times``' units) over ``m`` micro-batches."""
    from megakernels.parallel.pipeline import schedules

    sim = schedules.simulate("zb-v", pp, m, None, *times)
    return sim["total_time"] - sim["useful_time"]


def memory(meta: MetaModel, layout: Layout) -> dict:
    """Memory per device: ``{"per_stage": [bytes], "worst": stage, "breakdown": {...}, "parameters_per_device",
    "expert_bytes"}`` (see the module docstring)."""
    cfg, L = meta.config, layout
    where = L.placement
    stages = params_per_stage(meta, L.tp, L.pp, L.vpp, L.ep, placement=where)
    expert_stages = params_per_stage(meta, L.tp, L.pp, L.vpp, L.ep, True, placement=where)
    trained = params_per_stage(meta, L.tp, L.pp, L.vpp, L.ep, frozen=L.frozen, placement=where) if L.frozen else stages
    trained_experts = (
        params_per_stage(meta, L.tp, L.pp, L.vpp, L.ep, True, L.frozen, placement=where) if L.frozen else expert_stages
    )
    w, g, o = bytes_per_param(L)
    _, _, eo = bytes_per_param(L, experts=True, ep=L.ep)
    _, _, mo = bytes_per_param(L, muon=True)
    _, _, meo = bytes_per_param(L, experts=True, ep=L.ep, muon=True)
    muon_stages = muon_expert_stages = [0] * L.pp
    if L.optimizer == "muon":
        muon_stages = params_per_stage(meta, L.tp, L.pp, L.vpp, L.ep, False, L.frozen, where, muon_only=True)
        muon_expert_stages = params_per_stage(meta, L.tp, L.pp, L.vpp, L.ep, True, L.frozen, where, muon_only=True)
    bytes_el = 2 if L.precision != "fp32" else 4
    per_layer = activation_bytes_per_layer(cfg, L)
    layers = cfg.num_layers // L.pp
    flights = in_flight_per_rank(L)
    flight = flights[0]
    last = L.pp - 1 if L.placement != "v" else 0  # the rank of the last stage (the logits)
    v_local = pad_vocab_size(cfg.vocab_size, L.tp) // L.tp
    tokens = cfg.seq_length // L.cp * L.micro_batch_size
    logits = tokens * v_local * 4
    from megakernels.ops.linear_cross_entropy import default_chunk_tokens
    from megakernels_models.models.registry import family

    if L.fused_linear_ce and family(cfg).causal:  # ops.linear_cross_entropy: a chunk at a time (docs/parallelism.md)
        chunk = min(tokens, default_chunk_tokens(v_local))
        logits = chunk * v_local * bytes_el + (v_local * cfg.hidden_size * 6 if chunk < tokens and bytes_el < 4 else 0)
    out = []
    encoder = 0.0
    enc = cfg.encoder_config()
    if enc is not None:  # e.g. a vision encoder's layers, on the first stage (the LM's layers see n + s tokens)
        encoder = activation_bytes_per_layer(enc, L, encoder=True) * enc.num_layers
        per_layer *= cfg.tokens_per_sample / cfg.seq_length
    for r, (n, t, e, mt, me) in enumerate(zip(stages, trained, trained_experts, muon_stages, muon_expert_stages)):
        # the last stage: its logits chunk, and each multi-token prediction module a layer and its own logits
        mtp = cfg.mtp_layers if r == last else 0
        act = (per_layer * (layers + mtp) + (encoder if r == 0 else 0.0)) * flights[r]
        if r == last:
            act += logits * (1 + mtp)
        weights = n * w
        if L.sharded:  # the gathered compute copies: ZeRO-3 two layers (this one and the prefetched next) and one
            # layer's unsharded gradient; ZeRO-2 every layer of the stage, kept from its forward to its backward
            per = n / max(1, layers) * bytes_el
            weights += per * (layers + 1 if L.zero2 else 3)
        dense_adam, expert_adam = t - e - (mt - me), e - me
        state = dense_adam * o + (mt - me) * mo + expert_adam * eo + me * meo
        out.append({"weights": weights, "grads": t * g, "optimizer": state, "activations": act})
    totals = [sum(x.values()) for x in out]
    worst = max(range(L.pp), key=lambda r: totals[r])
    host = max(
        (t - e) * host_bytes_per_param(L) + e * host_bytes_per_param(L, True, L.ep)
        for t, e in zip(trained, trained_experts)
    )
    return {
        "per_stage": totals,
        "worst": worst,
        "breakdown": out[worst],
        "total": totals[worst],
        "host_optimizer_bytes": host,
        "parameters_per_device": max(stages),
        "trained_parameters_per_device": max(trained),
        "expert_bytes": max(e * (w + g + eo) for e in expert_stages),
        "activations_per_layer": per_layer,
        "in_flight": flight,
    }


def fits(total_bytes: float, device: Device) -> bool:
    """Whether ``total_bytes`` of model state fits ``device`` with the allowance (``RESERVED_GB``, fragmentation)."""
    return total_bytes * (1 + FRAGMENTATION) + RESERVED_GB * 1e9 <= device.memory_gb * 1e9


def _ring(bytes_: float, n: int, gbps: float, latency: float = 0.0) -> float:
    """Seconds of an all-reduce of ``bytes_`` over ``n`` ranks: the ring's ``2(n−1)/n`` of the bytes at
    ``gbps``, plus a fixed ``latency`` per collective."""
    return 0.0 if n <= 1 else 2.0 * (n - 1) / n * bytes_ / (gbps * 1e9) + latency


# Calibrated on the development set (benchmarks/published, docs/parallelism.md): HBM traffic of the
# memory-bound kernels per training pass of a layer's stored activations, and the fraction of HBM bandwidth they
# reach (``HBM_FRACTION`` of the data sheet's, a little under a plain copy's share, ``machines.COPY_FRACTION``).
ELEMENTWISE_PASSES = 5.0  # forward writes and reads each stored tensor (2), backward reads it and its gradient
# and writes the gradient (3); full recomputation repeats the forward (+2)
HBM_FRACTION = 0.8
OPTIMIZER_BYTES_PER_PARAM = 32.0  # AdamW: reads 16-bit weight, fp32 grad, master, two moments (18); writes 14


# FP8 training (``Layout.precision == "fp8"``): the transformer blocks' linears run their forward, data- and
# weight-gradient GEMMs on e4m3 operands at ``Device.tflops_8``; embeddings, the LM head, the attention core, norms
# and softmax stay 16-bit. The constants below and where each comes from:
#
# FP8_GEMM_RELATIVE: the fraction of the FP8 peak a GEMM reaches over the fraction of the 16-bit peak the same GEMM
# reaches in bf16, so that an FP8 GEMM runs at ``peak_8 × efficiency × FP8_GEMM_RELATIVE`` (the shape penalties of
# ``gemm_efficiency`` apply to both alike, an assumption). Measured: Transformer Engine's GEMM profiling tutorial
# (https://github.com/NVIDIA/TransformerEngine docs/examples/gemm_profiling/gemm_profiling.rst, "Worked Example: 5B
# Model on H200") times the 12 GEMMs of a layer (hidden 4096, MLP 16384, 15 872 tokens) on an H200 NVL with the
# operands already quantised: 31.968 ms a layer in bf16, 16.785 ms in FP8 with per-tensor (current) scaling — 1.90×
# for a 2× peak ratio, 0.95. In TFLOP/s: 601 in bf16 (0.72 of the NVL's 835 dense) and 1146 in FP8 (0.69 of 1670).
# Cross-check: DeepGEMM (https://github.com/deepseek-ai/DeepGEMM README, first release) reaches 1358 TFLOP/s on an
# H800 (dense FP8 peak 1979) for M=4096, N=7168, K=16384 with 1×128 / 128×128 block scaling, also 0.69 of the peak.
FP8_GEMM_RELATIVE = 0.95
# FP8_BLOCKWISE_GEMM: what block scaling (1×128 activation tiles, 128×128 weight blocks: DeepSeek-V3, arXiv
# 2412.19437 §3.3) costs the GEMM beyond per-tensor scaling: its main loop promotes the tensor cores' partial sums to
# fp32 registers on the CUDA cores every 128 of K (4 WGMMAs) and applies the two scales there, which the report
# describes as the shortest interval "without introducing substantial overhead" and DeepGEMM overlaps with the MMAs
# of the other warpgroup (its FFMA interleaving alone gained "10%+ in some cases"). Measured, derived: the same
# Transformer Engine tutorial's H200 NVL runs with quantisation included (no pre-quantised block kernel exists on
# Hopper's cuBLAS) give 20.285 ms a layer with per-tensor current scaling, 22.882 ms with block scaling; the
# per-tensor quantisation took 20.285 − 16.785 = 3.5 ms, and block scaling's, at this model's 4 bytes an element
# against 6 (``FP8_QUANTIZE_BYTES``), 2.33 ms; so the block-scaled GEMMs took 22.882 − 2.33 = 20.55 ms against
# 16.785: 0.82 of the per-tensor GEMMs' speed.
FP8_BLOCKWISE_GEMM = 0.82
# FP8_QUANTIZE_BYTES: HBM bytes per element of one quantisation pass (memory-bound, at ``HBM_FRACTION`` of the
# bandwidth): it reads the 16-bit tensor and writes an FP8 copy and an FP8 transposed copy (1 + 1 bytes; Hopper's FP8
# GEMMs take only K-major operands, so each GEMM that needs the other orientation reads the transposed copy); the
# scales (4 bytes a tensor, or per 128 elements) are left out. Per-tensor scaling reads the tensor twice (its amax
# first, then the cast: 2·2 + 2 = 6); block scaling computes each tile's scale in the same pass (2 + 2 = 4).
# Quantised per layer and micro-batch: forward, the input activation and the weight of every FP8 linear; backward,
# their output gradients; full recomputation repeats the forward's. Cross-check: the tutorial's per-tensor
# quantisation time above (3.5 ms a layer) is more than this model counts for that layer (1.9 ms at 0.8 of 4.8 TB/s):
# its benchmark quantises every GEMM's operands on their own (each input twice), a training step each tensor once.
# These are the bytes of one pass writing both copies (``megakernels.ops.fp8.fp8_quantize(transpose=True)``); the
# layers of ``megakernels.parallel.fp8`` copy the FP8 transpose in a pass of its own (+2 bytes an element) and
# quantise a blockwise input's transpose afresh (+3), which this model does not count.
FP8_QUANTIZE_BYTES = {"tensorwise": 6.0, "blockwise": 4.0}


def check_precision(layout: Layout, device: Device) -> None:
    """Refuse fp8 on a GPU without FP8 tensor cores.

    Raises:
        ValueError: ``layout.precision`` is fp8 and ``device.tflops_8`` is 0 (A100, V100).
    """
    if layout.precision == "fp8" and not device.tflops_8:
        raise ValueError(
            f"--precision fp8 needs FP8 tensor cores, which the {device.name} does not have (no FP8 peak in "
            "costs.DEVICES): use --precision bf16, or a GPU with FP8 (h100, h200)"
        )


def _forward_flops_per_token(cfg: ModelConfig) -> dict[str, float]:
    """``{"layers_gemm", "attention", "head"}`` forward FLOPs per token, as ``cfg.flops_per_token`` counts them (a
    vision-language model: per text token, its encoder and projector included in ``layers_gemm``)."""
    if cfg.encoder_config() is not None:
        from megakernels_models.models.vlm.costs import vlm_forward_flops_per_sample

        return {k: v / cfg.seq_length for k, v in vlm_forward_flops_per_sample(cfg).items()}
    return cfg.forward_flops_per_token()


def fp8_flops_per_token(cfg: ModelConfig, recompute: str = "none") -> float:
    """Training FLOPs per token that FP8 GEMMs run: the blocks' linears (``layers_gemm`` less the MoE router, which
    stays 16-bit), forward, data and weight gradients (3× their forward) and, with full recomputation, their forward
    again. The rest of ``cfg.flops_per_token(recompute)`` (attention core, LM head) stays 16-bit."""
    router = 2.0 * cfg.hidden_size * cfg.num_experts * cfg.num_moe_layers
    forward = _forward_flops_per_token(cfg)["layers_gemm"] - router
    return forward * (4.0 if recompute == "full" else 3.0)


def _fp8_linears(cfg: ModelConfig, layout: Layout) -> dict:
    """The FP8 linears of a layer (averaged over the layers, MoE layers by their share) as ``(replicated, split)``
    element widths per token — replicated: held whole by every tensor-parallel rank (the branch inputs and outputs;
    divided by tp only with sequence parallelism, which quantises the sequence shard before its all-gather), split:
    divided by tp:

    - ``"inputs"``: quantised in forward; ``"grads"``: the output gradients, quantised in backward;
    - ``"fp8_saved"``: the FP8 copies of inputs kept for the weight gradient, 1 byte an element, and ``"freed"``: the
      16-bit inputs the layer no longer keeps because of them (2 bytes an element). What the trainer keeps
      (``megakernels.parallel.fp8``): every linear its input's FP8 copy, except that with the blockwise recipe a
      column-parallel linear under sequence parallelism keeps its 16-bit sequence shard (its backward gathers and
      quantises it again) and the experts' grouped GEMMs their 16-bit rows; a MoE layer's branch input stays 16-bit
      for the router, so the shared experts' FP8 copy of it comes in addition;

    and ``"weights"``: the elements of the layer's FP8 weights on one device (quantised in every forward; their
    transposed FP8 copies are kept for the backward of that micro-batch)."""
    h, q, kv, f, mm = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.ffn_hidden_size, cfg.mlp_matrices
    blockwise = layout.fp8_recipe == "blockwise"
    column_kept = 0.0 if (blockwise and layout.sequence_parallel) else 1.0  # column-parallel inputs kept in FP8
    attention_w = h * (q + 2 * kv) + q * h
    # dense: QKV's and the MLP's inputs (the norms' outputs, column-parallel), the output projection's and the last
    # MLP matrix's inputs (row-parallel)
    dense_saved = (2.0 * h * column_kept, q + f)
    dense = {
        "inputs": (2.0 * h, q + f),
        "grads": (2.0 * h, q + 2.0 * kv + (mm - 1) * f),
        "fp8_saved": dense_saved,
        "freed": dense_saved,
        "weights": (attention_w + mm * h * f) / layout.tp,
    }
    share = cfg.num_moe_layers / cfg.num_layers
    if not share:
        return dense
    fe, k, shared = cfg.moe_ffn_hidden_size, cfg.moe_top_k, cfg.moe_shared_experts
    sh = 1.0 if shared else 0.0
    experts_kept = 0.0 if blockwise else 1.0
    # a MoE layer's MLP: each token's top_k expert rows (h into the first matrices, fe into the last) and the shared
    # experts' MLP (a column- and a row-parallel linear)
    moe = {
        "inputs": (h + sh * h, q + k * h + (k + shared) * fe),
        "grads": (h + sh * h, q + 2.0 * kv + k * h + (k + shared) * (mm - 1) * fe),
        "fp8_saved": ((h + sh * h) * column_kept, q + experts_kept * k * (h + fe) + shared * fe),
        "freed": (h * column_kept, q + experts_kept * k * (h + fe) + shared * fe),
        "weights": (attention_w + (cfg.num_experts / layout.ep + shared) * mm * h * fe) / layout.tp,
    }

    def mix(a, b):
        if isinstance(a, tuple):
            return tuple((1 - share) * x + share * y for x, y in zip(a, b))
        return (1 - share) * a + share * b

    return {key: mix(dense[key], moe[key]) for key in dense}


def fp8_gathered_weights(cfg: ModelConfig, layout: Layout) -> float:
    """Elements of a layer's weights (averaged over the layers) that FSDP all-gathers in FP8 on one device, 1 byte
    instead of 2: the attention's and the dense and shared-expert MLPs' linears under the tensorwise recipe
    (``megakernels.parallel.fp8_gather``); the routed experts and every blockwise weight are gathered in 16 bits."""
    if layout.precision != "fp8" or layout.fp8_recipe != "tensorwise" or not layout.sharded:
        return 0.0
    h, q, kv, mm = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.mlp_matrices
    attention = h * (q + 2 * kv) + q * h
    share = cfg.num_moe_layers / cfg.num_layers
    shared = mm * h * cfg.moe_ffn_hidden_size * cfg.moe_shared_experts if share else 0.0
    return ((1 - share) * (attention + mm * h * cfg.ffn_hidden_size) + share * (attention + shared)) / layout.tp


def _per_device(widths: tuple[float, float], layout: Layout) -> float:
    replicated, split = widths
    return replicated / (layout.tp if layout.sequence_parallel else 1) + split / layout.tp


def fp8_quantized_elements(cfg: ModelConfig, layout: Layout) -> dict[str, float]:
    """Elements one device quantises per layer and micro-batch under fp8: ``{"forward": inputs + weights,
    "backward": output gradients}`` (``FP8_QUANTIZE_BYTES``; all 0 for other precisions)."""
    if layout.precision != "fp8":
        return {"forward": 0.0, "backward": 0.0}
    linears = _fp8_linears(cfg, layout)
    tokens = cfg.seq_length // layout.cp * layout.micro_batch_size
    return {
        "forward": tokens * _per_device(linears["inputs"], layout) + linears["weights"],
        "backward": tokens * _per_device(linears["grads"], layout),
    }


def activation_bytes_per_layer(cfg: ModelConfig, layout: Layout, encoder: bool = False) -> float:
    """``cfg.activation_bytes_per_layer`` at ``layout`` (its micro-batch, tp, sequence parallelism, recomputation,
    attention and cp; ``encoder``: a vision encoder's layers, without sequence or context parallelism) in its
    precision: 4-byte elements in fp32, 2 otherwise. With fp8 (``_fp8_linears``) the inputs the FP8 linears keep
    take 1 byte an element instead of 2 — the QKV and first MLP matrices' inputs, the output projection's and the
    last MLP matrix's — and each layer adds its FP8 weights' transposed copies (1 byte a weight, per micro-batch in
    flight); none of it under full recomputation, which keeps only each layer's input and recomputes the rest."""
    L = dataclasses.replace(layout, sequence_parallel=False, cp=1) if encoder else layout
    full = cfg.activation_bytes_per_layer(
        L.micro_batch_size, L.tp, L.sequence_parallel, L.recompute, 4 if L.precision == "fp32" else 2, L.flash, L.cp
    )
    if L.precision != "fp8" or L.recompute == "full":
        return full
    linears = _fp8_linears(cfg, L)
    tokens = cfg.seq_length // L.cp * L.micro_batch_size
    saved = tokens * (2.0 * _per_device(linears["freed"], L) - _per_device(linears["fp8_saved"], L))
    return full - saved + linears["weights"]


def gemm_efficiency(cfg: ModelConfig, layout: Layout, device: Device) -> float:
    """The fraction of peak the step's GEMMs reach: ``device.efficiency``, less for thin GEMMs (``hidden/tp`` below
    1024: ×(width/1024)^0.3) and small micro-batches (fewer than 2048 tokens: ×(tokens/2048)^0.2)."""
    width = cfg.hidden_size / layout.tp
    tokens = layout.micro_batch_size * cfg.seq_length / layout.cp
    return device.efficiency * min(1.0, width / 1024) ** 0.3 * min(1.0, tokens / 2048) ** 0.2


def fp8_gemm_efficiency(cfg: ModelConfig, layout: Layout, device: Device) -> float:
    """The fraction of the FP8 peak the FP8 GEMMs reach: ``gemm_efficiency`` × ``FP8_GEMM_RELATIVE``, and ×
    ``FP8_BLOCKWISE_GEMM`` with the blockwise recipe."""
    recipe = FP8_BLOCKWISE_GEMM if layout.fp8_recipe == "blockwise" else 1.0
    return gemm_efficiency(cfg, layout, device) * FP8_GEMM_RELATIVE * recipe


def compute_parts(meta: MetaModel, layout: Layout, device: Device) -> dict[str, float]:
    """Seconds a device computes per step, by part: ``{"gemm_16_s", "gemm_fp8_s", "elementwise_s", "quantize_s",
    "optimizer_s"}`` (see ``compute_time``).

    Raises:
        ValueError: fp8 on a GPU without FP8 tensor cores (``check_precision``).
    """
    cfg, L = meta.config, layout
    check_precision(L, device)
    tokens = L.global_batch_size * cfg.seq_length
    half = L.precision != "fp32"
    peak = (device.tflops_16 if half else device.tflops_32) * 1e12
    fp8 = fp8_flops_per_token(cfg, L.recompute) if L.precision == "fp8" else 0.0
    gemm_16 = (cfg.flops_per_token(L.recompute) - fp8) * tokens / L.world / (peak * gemm_efficiency(cfg, L, device))
    gemm_fp8 = fp8 * tokens / L.world / (device.tflops_8 * 1e12 * fp8_gemm_efficiency(cfg, L, device)) if fp8 else 0.0
    parts = {"gemm_16_s": gemm_16, "gemm_fp8_s": gemm_fp8, "elementwise_s": 0.0, "quantize_s": 0.0, "optimizer_s": 0.0}
    if not device.hbm_gbps:
        return parts
    bw = device.hbm_gbps * 1e9 * HBM_FRACTION
    # the norms, activations and softmax keep writing 16-bit outputs under fp8: their traffic is the 16-bit layer's
    stored = cfg.activation_bytes_per_layer(
        L.micro_batch_size, L.tp, L.sequence_parallel, "none", 2 if half else 4, L.flash, L.cp
    )
    passes = ELEMENTWISE_PASSES + (2.0 if L.recompute == "full" else 0.0)
    layer_passes = cfg.num_layers / L.pp * L.microbatches
    parts["elementwise_s"] = stored * passes * layer_passes / bw
    quantized = fp8_quantized_elements(cfg, L)
    forward = quantized["forward"] * (2.0 if L.recompute == "full" else 1.0)
    parts["quantize_s"] = (forward + quantized["backward"]) * FP8_QUANTIZE_BYTES[L.fp8_recipe] * layer_passes / bw
    params = max(params_per_stage(meta, L.tp, L.pp, L.vpp, L.ep, placement=L.placement))
    state = OPTIMIZER_BYTES_PER_PARAM - (24.0 * (1 - 1 / (L.dp * L.cp)) if L.distributed_optimizer else 0.0)
    parts["optimizer_s"] = params * state / bw
    if L.optimizer == "muon":  # Newton-Schulz's GEMMs, in bf16, on the device's share of the matrices
        owners = L.dp * L.cp if (L.distributed_optimizer or L.sharded) else 1
        flops = max(muon_ns_flops(meta, L.pp, L.vpp, L.placement, L.muon_ns_steps)) / (L.tp * owners)
        parts["optimizer_s"] += flops / (device.tflops_16 * 1e12 * gemm_efficiency(cfg, L, device))
    return parts


@functools.cache
def muon_ns_flops(model_key, pp: int, vpp: int, placement: str, steps: int) -> list[float]:
    """Newton-Schulz FLOPs of one Muon step per pipeline stage (the whole model's matrices, before tp and the
    data-parallel owners divide them): per logical matrix ``[m, n]`` (``split="projection"``; m <= n after the
    transpose) and iteration, ``X Xᵀ`` and ``A A`` as one triangle each (``m² n`` and ``m³``) and ``B X``
    (``2 m² n``)."""
    from megakernels.optim.muon import layout_of, split_matrices

    cfg = model_key.config
    owner = {}
    for r, chunks in enumerate(stage_layers(cfg.num_layers, pp, vpp, placement)):
        for layers in chunks:
            for i in layers:
                owner[i] = r
    out = [0.0] * pp
    for name, p in model_key.model.named_parameters():
        if name not in model_key.muon_names:
            continue
        blocks = split_matrices(p, layout_of(p), "projection")
        m, n = sorted(blocks.shape[-2:])
        flops = blocks.shape[0] * steps * (3.0 * m * m * n + m * m * m)
        layer = name.split(".")[1] if name.startswith(("layers.", "cross.")) else None
        out[owner[int(layer)] if layer is not None else 0] += flops
    return out


def compute_time(meta: MetaModel, layout: Layout, device: Device) -> tuple[float, float, float, float]:
    """Seconds a device computes per step: ``(total, gemm, memory_bound, optimizer)``.

    GEMMs (every FLOP of ``flops_per_token(recompute)``) run at ``peak × efficiency``, less for thin GEMMs
    (``hidden/tp`` below 1024) and small micro-batches (fewer than 2048 tokens); with fp8 the blocks' linears
    (``fp8_flops_per_token``) at the FP8 peak × ``fp8_gemm_efficiency`` instead. The memory-bound kernels (norms,
    activations, dropout, softmax, residual adds, the attention scores where FlashAttention does not keep them out
    of memory) move ``ELEMENTWISE_PASSES`` (+2 with full recomputation) times the bytes a 16-bit layer stores for
    backward (``activation_bytes_per_layer`` without recomputation) at ``HBM_FRACTION`` of the HBM bandwidth; with
    fp8 the quantisation passes add ``FP8_QUANTIZE_BYTES`` per element of ``fp8_quantized_elements`` (memory_bound
    includes them); the optimizer step moves ``OPTIMIZER_BYTES_PER_PARAM`` per parameter of the device (its ZeRO
    shard's 12-byte state only)."""
    p = compute_parts(meta, layout, device)
    gemm = p["gemm_16_s"] + p["gemm_fp8_s"]
    memory_bound = p["elementwise_s"] + p["quantize_s"]
    return gemm + memory_bound + p["optimizer_s"], gemm, memory_bound, p["optimizer_s"]


# The share of a GPU's compute that a collective's kernels take while they run beside it (NCCL's channels are thread
# blocks on the SMs, 16-32 per ring collective on A100/H100: 15-30 % of the SMs, and their memory traffic). Compute
# that a collective overlaps is slowed by it: an overlapped collective is not free, and one a layout runs every
# micro-batch (FSDP's all-gathers and reduce-scatters) costs more than one a step (DDP's all-reduce).
OVERLAP_SM_SHARE = 0.15


def overlapped(comm: float, window: float) -> float:
    """Seconds a collective of ``comm`` seconds adds to a step when it runs beside ``window`` seconds of compute:
    what exceeds the window, plus ``OVERLAP_SM_SHARE`` of the part that hides (the compute it slows)."""
    hidden = min(comm, window)
    return comm - hidden + OVERLAP_SM_SHARE * hidden


def dp_gbps(layout: Layout, device: Device, gpus_per_node: int = 8) -> float:
    """GB/s of a data-parallel group's ring. Inside a node, NVLink. Across nodes NCCL runs one ring per network
    adapter, so the group's traffic leaves a node through the adapters of the group's members in it: the
    ``gpus_per_node / (tp·cp)`` ranks of one group a node hold (data-parallel ranks are ``tp·cp`` apart) share
    the node with the other ``tp·cp`` groups, each getting ``network_gbps`` per member."""
    L = layout
    if L.world <= gpus_per_node:
        return device.intra_gbps
    members = max(1, min(L.dp * L.cp, gpus_per_node // (L.tp * L.cp)))
    return min(device.intra_gbps, device.network_gbps(gpus_per_node) * members)


def predict(
    meta: MetaModel,
    layout: Layout,
    device: Device,
    gpus_per_node: int = 8,
    host_adamw_ns: float = HOST_ADAMW_NS_PER_PARAM,
) -> dict:
    """Predicted seconds per optimizer step and its parts (see the module docstring); ``host_adamw_ns``: the
    host AdamW's ns per parameter with ``offload_optimizer``."""
    cfg, L = meta.config, layout
    tokens = L.global_batch_size * cfg.seq_length
    half = L.precision != "fp32"
    peak = (device.tflops_16 if half else device.tflops_32) * 1e12
    parts = compute_parts(meta, L, device)
    gemm_s = parts["gemm_16_s"] + parts["gemm_fp8_s"]
    memory_s = parts["elementwise_s"] + parts["quantize_s"]
    optimizer_s = parts["optimizer_s"]
    compute = gemm_s + memory_s + optimizer_s
    m = L.microbatches
    bubble_fraction = pipeline_bubble(cfg, L)
    bubble = bubble_fraction * compute
    act_bytes = cfg.seq_length // L.cp * L.micro_batch_size * cfg.hidden_size * (2 if half else 4)
    net = device.network_gbps(gpus_per_node)
    # tensor parallelism: TP groups are consecutive ranks; a group wider than a node crosses the network
    tp_bw = device.intra_gbps if L.tp <= gpus_per_node else net
    layers_per_device = cfg.num_layers / L.pp
    lat = device.latency_s
    # per layer: forward two all-reduces (with SP each an all-gather before the column-parallel GEMM and a
    # reduce-scatter after the row-parallel one, half a ring each), backward two more, full recomputation the
    # forward's again; with fp8 and SP the forward's all-gathers move the FP8 copies (half the bytes)
    half_ring = _ring(act_bytes, L.tp, tp_bw) / 2
    gathers = 0.5 if (L.precision == "fp8" and L.sequence_parallel) else 1.0
    forward = 2 * half_ring * gathers + 2 * half_ring
    repeats = 2.0 if L.recompute == "full" else 1.0
    collectives = 4 * (1.5 if L.recompute == "full" else 1.0) * (lat if L.tp > 1 else 0.0)
    tp_comm = m * layers_per_device * (forward * repeats + 4 * half_ring + collectives)
    # pipeline: one activation forward and one gradient backward per micro-batch and stage boundary
    pp_bw = net if L.tp * L.cp * L.dp >= gpus_per_node else device.intra_gbps
    pp_comm = 0.0 if L.pp == 1 else 2 * m * L.vpp * (act_bytes / L.tp / (pp_bw * 1e9) + lat)
    # context parallelism: the key/value ring, overlapped with the attention
    cp_comm = 0.0
    if L.cp > 1:
        kv_bytes = 2 * act_bytes * cfg.kv_size / cfg.hidden_size / L.tp
        ring = 3 * (L.cp - 1) * kv_bytes / (device.intra_gbps * 1e9) * m * layers_per_device
        eff = gemm_efficiency(cfg, L, device)
        attention = cfg.forward_flops_per_token()["attention"] * 3 * tokens / L.world / (peak * eff)
        cp_comm = overlapped(ring, attention)
    # data parallelism: gradients of this device's trained parameters (frozen ones have none), overlapped with the
    # last micro-batch's backward
    params = memory(meta, L)["trained_parameters_per_device"]
    dp_ranks = L.dp * L.cp
    dp_bw = dp_gbps(L, device, gpus_per_node)
    if not L.sharded:
        dp_exposed = overlapped(_ring(params * 4, dp_ranks, dp_bw, lat), compute / max(m, 1) * 2 / 3)
    else:  # ZeRO-3: every micro-batch all-gathers the 16-bit parameters for forward and again for backward
        # (ZeRO-2: once) and reduce-scatters its gradients in the reduce dtype (each half a ring all-reduce over the
        # shard ranks), one layer ahead of the compute (FSDP2's prefetch): hidden behind the step's compute as far as
        # it goes, but for the first layer's all-gather and the last one's reduce-scatter of each micro-batch. No
        # gradient all-reduce at the end: every micro-batch's gradients are reduce-scattered already.
        # HSDP: each reduced shard is then all-reduced across the replicas.
        shard, reduce_b = L.shard_ranks(), (2 if L.fsdp_reduce_dtype == "bf16" else 4)
        gathered = params * 2 - fp8_gathered_weights(cfg, L) * layers_per_device  # FP8 weights: 1 byte
        gather = _ring(gathered, shard, dp_bw, lat) / 2
        scatter = _ring(params * reduce_b, shard, dp_bw, lat) / 2 + _ring(
            params / shard * reduce_b, dp_ranks // shard, dp_bw, lat
        )
        per_micro = (1 if L.zero2 else 2) * gather + scatter
        edge = (gather + scatter) / max(1, layers_per_device)
        dp_exposed = overlapped(m * per_micro, compute) + m * edge
    # expert parallelism: dispatch + combine all-to-alls, forward and backward, of the routed tokens
    ep_comm = 0.0
    if cfg.num_experts and L.ep > 1:
        routed = act_bytes / L.tp * cfg.moe_top_k * (L.ep - 1) / L.ep
        ep_bw = device.intra_gbps if L.ep * L.tp * L.cp <= gpus_per_node else net
        ep_comm = 4 * routed / (ep_bw * 1e9) * m * cfg.num_moe_layers / L.pp
    offload = offload_time(params, L, device, compute, host_adamw_ns)
    step = compute + bubble + tp_comm + pp_comm + cp_comm + dp_exposed + ep_comm + offload["offload_s"]
    model_flops = cfg.flops_per_token("none") * tokens
    return {
        "step_s": step,
        "compute_s": compute,
        "gemm_s": gemm_s,
        "memory_bound_s": memory_s,
        **parts,  # compute_s's split: gemm_16_s + gemm_fp8_s + elementwise_s + quantize_s + optimizer_s
        "optimizer_s": optimizer_s,
        "bubble_s": bubble,
        "tp_s": tp_comm,
        "pp_s": pp_comm,
        "cp_s": cp_comm,
        "dp_s": dp_exposed,
        "ep_s": ep_comm,
        **offload,
        "tokens_per_s": tokens / step,
        "mfu": model_flops / step / L.world / peak,
        "bubble_fraction": bubble_fraction,
    }


def offload_time(
    params: float, layout: Layout, device: Device, compute: float, host_adamw_ns: float = HOST_ADAMW_NS_PER_PARAM
) -> dict:
    """Seconds a step spends on the offloaded optimizer beyond the rest (all 0 without ``offload_optimizer``):
    ``{"offload_s": host_s + d2h_s + h2d_s, "host_adam_s", "d2h_s", "h2d_s"}`` (the transfers: what is not hidden).

    ``params``: parameters on the device; ``compute``: the step's compute seconds. A rank steps ``params`` (ZeRO-1:
    ``params / (dp·cp)``; FSDP: its shard, ``params / shard ranks``) at ``host_adamw_ns`` each; its gradients go to
    the host (4 bytes each) behind the last micro-batch's backward (2/3 of a micro-batch's compute; FSDP: at step
    time, in full) and its updated parameters come back (2 bytes each in 16-bit training, 4 in fp32 and in FSDP's
    fp32 masters) behind the first micro-batch's forward (1/3), or in full under ZeRO-1 and FSDP.
    """
    zero = {"offload_s": 0.0, "host_adam_s": 0.0, "d2h_s": 0.0, "h2d_s": 0.0}
    if not layout.offload_optimizer:
        return zero
    L, bw = layout, device.host_gbps * 1e9
    owned = params / (L.dp * L.cp) if L.distributed_optimizer else params
    if L.sharded:
        owned = params / L.shard_ranks()
    micro = compute / max(L.microbatches, 1)
    host = owned * host_adamw_ns * 1e-9
    d2h = owned * 4 / bw if L.sharded else max(0.0, owned * 4 / bw - micro * 2 / 3)
    h2d = owned * (2 if L.precision != "fp32" and not L.sharded else 4) / bw
    if not (L.distributed_optimizer or L.sharded):
        h2d = max(0.0, h2d - micro / 3)
    return {"offload_s": host + d2h + h2d, "host_adam_s": host, "d2h_s": d2h, "h2d_s": h2d}


def describe_offload(prediction: dict, host_adamw_ns: float) -> str:
    """The optimizer-offload part of a ``predict`` result, in words (the plan and the dry run print it)."""
    return (
        f"{prediction['offload_s']:.3f} s = host AdamW {prediction['host_adam_s']:.3f} s ({host_adamw_ns:g} ns "
        f"per parameter) + gradients to the host {prediction['d2h_s']:.3f} s + parameters to the device "
        f"{prediction['h2d_s']:.3f} s not hidden"
    )
