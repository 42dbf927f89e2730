"""Process groups of 3D parallelism: tensor (tp) × context (cp) × data (dp) × pipeline (pp), plus virtual
pipeline stages (vpp).

Global ranks are laid out with tp innermost, then cp, then dp, then pp (Megatron-LM's order), so the ranks of one
tensor-parallel group are adjacent and stay inside a node, where the bandwidth for TP's per-layer all-reduces is,
and a context-parallel ring is the next-closest ranks:

    rank = pp_rank · (dp · cp · tp) + dp_rank · (cp · tp) + cp_rank · tp + tp_rank

Example, world 16 with tp 2, pp 4 (dp 2): tp groups [0,1] [2,3] ...; dp groups [0,2] [1,3] [4,6] ...; pp groups
[0,4,8,12] [1,5,9,13] [2,6,10,14] [3,7,11,15]; embedding groups (first + last pipeline stage, which share the
word embedding when the output layer is tied to it) [0,12] [1,13] [2,14] [3,15].

Context-parallel ranks hold different tokens of the same samples, so gradients are reduced (and ZeRO-1 shards its
state) over the data-and-context group ``dp_cp_group()`` (dp · cp ranks; the dp group itself when cp is 1).

Every group is made in one place, ``initialize`` (through ``_new_groups``), eagerly and in the same order on every
rank: the layout's groups, this rank's ``tp_replica_group`` for every divisor of tp, and the gloo group of the
trainer's background checkpoint writes (``checkpoint_group()``). Nothing else makes a group (a constructor never
does: with pipeline parallelism the stages build different layers). A family of groups that partitions the world
(every rank in exactly one of them) is made with ``use_local_synchronization`` where torch has it: each rank only
creates its own group, and only its members synchronise. The embedding groups (middle stages are in none) are made
by every rank: torch names a locally synchronised group after the count of groups the rank made before it, so the
counts must stay equal across ranks. The module holds one state object; ``destroy()`` waits for every rank
(a barrier) and then destroys the groups, so ``initialize`` may run again, e.g. with another layout in the same
world.
"""

from __future__ import annotations

import dataclasses
import datetime
import inspect
import itertools
import os
import sys

import torch
import torch.distributed as dist

from megakernels.parallel.layout import LayoutError, ParallelLayout
from megakernels.validation import positive_int


@dataclasses.dataclass
class _State:
    tp: int
    pp: int
    dp: int
    vpp: int | None
    tp_rank: int
    pp_rank: int
    dp_rank: int
    tp_group: object
    pp_group: object
    dp_group: object
    model_parallel_group: object
    cp: int
    cp_rank: int
    cp_group: object
    dp_cp_group: object
    ep: int
    ep_rank: int
    ep_group: object
    edp_group: object
    tp_cp_group: object
    embedding_group: object | None
    pp_ranks: list[int]
    embedding_ranks: list[int]
    groups: list
    owns_world: bool
    vpp_rank: int | None = None
    placement: str = "interleaved"
    tp_replica_groups: dict = dataclasses.field(default_factory=dict)
    checkpoint_group: object = None
    timeout: datetime.timedelta | None = None  # of every group's collectives (None: torch's default)


_state: _State | None = None

# torch >= 2.1 takes use_local_synchronization; the check keeps older or stripped-down builds working.
_LOCAL_SYNC = "use_local_synchronization" in inspect.signature(dist.new_group).parameters


def _new_groups(rank_lists, timeout, backend=None, partition: bool = True) -> list:
    """The one place this package creates process groups: one per list of ``rank_lists`` (in that order, the same
    on every rank); returns this rank's (None for a list without it).

    ``partition``: the lists split the world (every rank in exactly one). Then, where torch supports it, the
    groups are made with local synchronisation: a rank creates only its own, and only its members synchronise.
    Otherwise every rank takes part in making every group (``torch.distributed.new_group`` is then collective
    over the world), which keeps torch's count of groups made (its names for locally synchronised groups) equal
    on every rank."""
    rank, made = dist.get_rank(), []
    local = partition and _LOCAL_SYNC
    for ranks in rank_lists:
        if local and rank not in ranks:
            made.append(None)
            continue
        kwargs = {"use_local_synchronization": True} if local else {}
        g = dist.new_group(list(ranks), timeout=timeout, backend=backend, **kwargs)
        made.append(g if rank in ranks else None)
    return made


def _positive_int(name: str, value) -> int:
    return positive_int(value, name, where="initialize")


def _world_timeout() -> datetime.timedelta | None:
    """The timeout the default process group was made with, where this torch exposes it (None otherwise)."""
    try:
        device = torch.device("cuda" if dist.get_backend() == "nccl" else "cpu")
        found = dist.group.WORLD._get_backend(device).options._timeout
    except (AttributeError, RuntimeError, ValueError):
        return None
    return found if isinstance(found, datetime.timedelta) else None


def _init_world_from_env(timeout: datetime.timedelta | None) -> None:
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeError(
            "initialize: torch.distributed is not initialised and the torchrun environment is "
            f"incomplete (missing {', '.join(missing)}); call torch.distributed.init_process_group "
            "first or launch with torchrun"
        )
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=timeout)


def initialize(
    tp: int = 1,
    pp: int = 1,
    dp: int | None = None,
    vpp: int | None = None,
    cp: int = 1,
    ep: int = 1,
    timeout: float | None = None,
    placement: str = "interleaved",
) -> None:
    """Create the tensor-, context-, pipeline-, data-parallel, model-parallel and embedding groups of this world.

    Initialises ``torch.distributed`` itself from torchrun's environment (nccl when CUDA is available, else gloo)
    when no default process group exists yet; ``destroy()`` then also tears that down.

    Args:
        tp: tensor-parallel size (ranks sharding each layer).
        pp: pipeline-parallel size (stages).
        dp: data-parallel size; defaults to ``world_size // (tp · cp · pp)``, and must equal it when given.
        vpp: virtual pipeline stages (model chunks) per rank for the interleaved schedule; ``None`` for none.
        cp: context-parallel size (ranks splitting each sequence, ``megakernels.parallel.context``).
        ep: expert-parallel size: groups of ``ep`` consecutive data-parallel ranks split the experts of a
            mixture-of-experts layer between them (``megakernels.parallel.moe``); must divide dp.
        timeout: seconds a collective of these groups waits for a peer before it raises; None: the default process
            group's own where torch exposes it, else torch's default (30 minutes for gloo). (A group made without one
            does not inherit the world's, so a rank that stopped would hold its peers for torch's default.)
        placement: where the virtual pipeline stages sit: ``"interleaved"`` (stage ``chunk·pp + rank``) or ``"v"``
            (the zb-v schedule's: two chunks per rank, stages r and ``2·pp−1−r`` on rank r; vpp None or 2). Under
            the V the first and the last stage are both on pipeline rank 0, so its embedding group is that rank
            alone (its two copies of a tied embedding are summed locally: ``ddp.sum_partial_grads``).

    Raises:
        ValueError: a size that is not a positive int, ``world_size`` not divisible by ``tp · cp · pp``, a ``dp``
            that does not make ``tp · cp · pp · dp == world_size``, or ``vpp > 1`` with ``pp == 1``.
        RuntimeError: called twice without ``destroy()``, or no process group and no torchrun environment.
    """
    global _state
    if timeout is not None and not timeout > 0:
        raise ValueError(f"initialize: timeout must be > 0 seconds (or None), got {timeout}")
    wait = None if timeout is None else datetime.timedelta(seconds=timeout)
    if _state is not None:
        raise RuntimeError(
            f"initialize: already initialised (tp={_state.tp}, pp={_state.pp}, dp={_state.dp}); "
            "call megakernels.parallel.destroy() first"
        )
    owns_world = not dist.is_initialized()
    if owns_world:
        _init_world_from_env(wait)
    if wait is None:  # the world's own: a group made without a timeout would wait torch's default instead
        wait = _world_timeout()
    world, rank = dist.get_world_size(), dist.get_rank()
    try:
        layout = ParallelLayout.build(world, tp=tp, cp=cp, pp=pp, ep=ep, vpp=vpp, dp=dp, placement=placement)
    except LayoutError as e:
        if owns_world:
            dist.destroy_process_group()
        raise LayoutError(f"initialize: {e}") from None
    tp, cp, pp, dp, ep, vpp = layout.tp, layout.cp, layout.pp, layout.dp, layout.ep, layout.vpp

    # outermost to innermost in the rank order; the data-parallel rank is g·ep + e (e: rank in its expert group)
    sizes = {"p": pp, "g": dp // ep, "e": ep, "c": cp, "t": tp}

    def at(p: int, g: int, e: int, c: int, t: int) -> int:
        return ((p * dp + g * ep + e) * cp + c) * tp + t

    groups, mine = [], {}

    def make(kind: str, varying: str, keep=None):
        """One group per value of the dimensions not in ``varying``, over every value of those in it (ranks in the
        rank order); ``keep`` filters a group's ranks (the lists then need not partition the world)."""
        fixed = [k for k in sizes if k not in varying]
        lists = []
        for f in itertools.product(*(range(sizes[k]) for k in fixed)):
            ranks = [
                at(**dict(zip(fixed, f)), **dict(zip(varying, v)))
                for v in itertools.product(*(range(sizes[k]) for k in varying))
            ]
            lists.append(sorted(set(keep(ranks))) if keep else ranks)
        add(kind, lists, partition=keep is None)

    def add(kind: str, lists, backend=None, partition: bool = True):
        for ranks, g in zip(lists, _new_groups(lists, wait, backend=backend, partition=partition)):
            if g is not None:
                groups.append(g)
                mine[kind], mine[kind + "_ranks"] = g, ranks

    make("tp", "t")
    make("dp", "ge")
    make("cp", "c")
    if cp > 1:
        make("dp_cp", "gec")
    if cp > 1 and tp > 1:
        make("tp_cp", "ct")  # the ranks holding different tokens of the same micro-batch
    if ep > 1:
        make("ep", "e")
        make("edp", "gc")  # the ranks holding the same experts: their gradients are reduced over it
    make("pp", "p")
    make("mp", "pt")
    # the first and last pipeline stage (which share a tied word embedding): under the V both are pipeline rank 0
    make("emb", "p", keep=lambda ranks: (ranks[0],) if layout.placement == "v" else (ranks[0], ranks[-1]))
    # the ranks of a tensor-parallel group holding the same replicated block (tp_replica_group), for each size
    replicas = [c for c in range(2, tp) if tp % c == 0]
    for c in replicas:
        add(f"replicas{c}", [list(range(s, s + c)) for s in range(0, world, c)])
    # the trainer's background checkpoint writes: gloo (CPU copies) and apart from the training's collectives
    add("checkpoint", [list(range(world))], backend="gloo")

    tp_rank, cp_rank = rank % tp, (rank // tp) % cp
    dp_rank, pp_rank = (rank // (tp * cp)) % dp, rank // (tp * cp * dp)
    _state = _State(
        tp=tp,
        pp=pp,
        dp=dp,
        vpp=vpp,
        tp_rank=tp_rank,
        pp_rank=pp_rank,
        dp_rank=dp_rank,
        ep=ep,
        ep_rank=dp_rank % ep,
        ep_group=mine.get("ep"),
        tp_cp_group=mine.get("tp_cp", mine["cp"] if cp > 1 else (mine["tp"] if tp > 1 else None)),
        edp_group=mine.get("edp", mine.get("dp_cp", mine["dp"])),
        tp_group=mine["tp"],
        pp_group=mine["pp"],
        dp_group=mine["dp"],
        model_parallel_group=mine["mp"],
        cp=cp,
        cp_rank=cp_rank,
        cp_group=mine["cp"],
        dp_cp_group=mine.get("dp_cp", mine["dp"]),
        embedding_group=mine.get("emb"),
        pp_ranks=mine["pp_ranks"],
        embedding_ranks=mine.get("emb_ranks", []),
        groups=groups,
        tp_replica_groups={**{c: mine[f"replicas{c}"] for c in replicas}, tp: mine["tp"], 1: None},
        checkpoint_group=mine["checkpoint"],
        owns_world=owns_world,
        vpp_rank=0 if vpp is not None else None,
        placement=layout.placement,
        timeout=wait,
    )


def destroy(barrier: bool | None = None) -> None:
    """Destroy the groups created by ``initialize`` (and the default group if ``initialize`` created it).

    Collective: every rank calls it. A barrier first, so that no rank tears down a group a peer still uses (the
    peer's collective on it would fail or hang). ``barrier=None`` (the default) skips it while an exception is
    propagating through the caller (``finally:`` after an error): the peers of a failing rank may never come, and
    the error must not wait for them, nor be replaced by the barrier's timeout."""
    global _state
    if _state is None:
        return
    state, _state = _state, None
    if barrier is None:
        barrier = sys.exc_info()[0] is None
    if barrier:
        dist.barrier(group=state.checkpoint_group)  # gloo, over the whole world: no device synchronisation
    for g in state.groups:
        dist.destroy_process_group(g)
    forget_meshes()
    if state.owns_world and dist.is_initialized():
        dist.destroy_process_group()


def adopt_group(group) -> None:
    """Destroy ``group`` (made after ``initialize``, e.g. FSDP's HSDP sub-groups) with the others in ``destroy``."""
    _get().groups.append(group)


def is_initialized() -> bool:
    """Whether ``initialize`` has run (and ``destroy`` has not)."""
    return _state is not None


def _get() -> _State:
    if _state is None:
        raise RuntimeError(
            "megakernels.parallel is not initialised: call megakernels.parallel.initialize(tp, pp) "
            "after torch.distributed.init_process_group (or under torchrun)"
        )
    return _state


# ---- accessors -------------------------------------------------------------------------------------------------


def tp_group():
    """The tensor-parallel process group of this rank."""
    return _get().tp_group


def pp_group():
    """The pipeline-parallel process group of this rank."""
    return _get().pp_group


def dp_group():
    """The data-parallel process group of this rank."""
    return _get().dp_group


def cp_group():
    """The context-parallel process group of this rank (ranks holding different tokens of the same samples)."""
    return _get().cp_group


def dp_cp_group():
    """Data- and context-parallel ranks together: gradients are reduced and ZeRO-1 state is sharded over them."""
    return _get().dp_cp_group


def ep_group():
    """The expert-parallel group of this rank (None when ep is 1): ranks that split a MoE layer's experts and
    exchange tokens by all-to-all."""
    return _get().ep_group


def expert_dp_group():
    """The ranks holding the same experts (data- and context-parallel ranks at the same place of their expert
    group): expert gradients are reduced, and their ZeRO-1 state sharded, over it (``dp_cp_group()`` when ep is
    1)."""
    return _get().edp_group


def tp_cp_group():
    """The tensor- and context-parallel ranks of one data-parallel replica (they hold different tokens of the same
    micro-batch under sequence and context parallelism); None when tp and cp are 1."""
    return _get().tp_cp_group


def ep_rank() -> int:
    return _get().ep_rank


def ep_size() -> int:
    return _get().ep


def tp_replica_group(replicas: int):
    """This rank's group of ``replicas`` consecutive tensor-parallel ranks (which hold the same block of a
    parameter replicated within the TP group, e.g. a key/value head shared by several query-head shards).

    Made by ``initialize`` for every divisor of tp (the tp group itself for ``replicas == tp``); None for 1 (no
    replicas).

    Raises:
        ValueError: ``replicas`` does not divide the tensor-parallel size.
    """
    s = _get()
    _positive_int("replicas", replicas)
    if s.tp % replicas:
        raise ValueError(f"tp_replica_group: replicas={replicas} does not divide the tensor-parallel size {s.tp}")
    return s.tp_replica_groups[replicas]


def checkpoint_group():
    """A gloo group over the whole world for the trainer's background checkpoint writes: collectives of a second
    thread must not interleave with the training's on the same group, and they move CPU copies."""
    return _get().checkpoint_group


def group_timeout() -> float | None:
    """Seconds a collective of these groups waits for a peer (``initialize``'s ``timeout``; None: torch's)."""
    wait = _get().timeout
    return None if wait is None else wait.total_seconds()


def model_parallel_group():
    """tp × pp ranks holding one full model replica (e.g. for a global gradient norm)."""
    return _get().model_parallel_group


def embedding_group():
    """First and last pipeline stage of this rank's pipeline (one rank when pp == 1): the ranks that hold the word
    embedding when the output layer is tied to it, and all-reduce its gradient. ``None`` on a middle stage."""
    return _get().embedding_group


def embedding_ranks() -> list[int]:
    """Global ranks of ``embedding_group()`` (empty on a middle stage)."""
    return list(_get().embedding_ranks)


def is_in_embedding_group() -> bool:
    """Whether this rank is a first or last pipeline stage."""
    return dist.get_rank() in _get().embedding_ranks


def tp_rank() -> int:
    return _get().tp_rank


def tp_size() -> int:
    return _get().tp


def pp_rank() -> int:
    return _get().pp_rank


def pp_size() -> int:
    return _get().pp


def dp_rank() -> int:
    return _get().dp_rank


def dp_size() -> int:
    return _get().dp


def cp_rank() -> int:
    return _get().cp_rank


def cp_size() -> int:
    return _get().cp


def dp_cp_size() -> int:
    """dp · cp: the ranks a gradient is reduced over."""
    s = _get()
    return s.dp * s.cp


def vpp_size() -> int | None:
    """Virtual pipeline stages (model chunks) per rank, ``None`` without interleaving."""
    return _get().vpp


def vpp_rank() -> int | None:
    """The model chunk the interleaved schedule is running now (``None`` without interleaving)."""
    return _get().vpp_rank


def set_vpp_rank(rank: int) -> None:
    """Set the current model chunk; raises ValueError outside ``0 .. vpp_size()-1`` or without interleaving."""
    s = _get()
    if s.vpp is None or not 0 <= rank < s.vpp:
        raise ValueError(f"set_vpp_rank: rank must be in 0..{(s.vpp or 1) - 1} with vpp={s.vpp}, got {rank}")
    s.vpp_rank = rank


def pipeline_placement() -> str:
    """Where the virtual stages sit: ``"interleaved"`` or ``"v"`` (``initialize``'s ``placement``)."""
    return _get().placement


def pp_ranks() -> list[int]:
    """Global ranks of this rank's pipeline, stage 0 first."""
    return list(_get().pp_ranks)


def pp_next_rank() -> int:
    """Global rank of the next pipeline stage (wrapping from the last stage to the first)."""
    s = _get()
    return s.pp_ranks[(s.pp_rank + 1) % s.pp]


def pp_prev_rank() -> int:
    """Global rank of the previous pipeline stage (wrapping from the first stage to the last)."""
    s = _get()
    return s.pp_ranks[(s.pp_rank - 1) % s.pp]


def is_pp_first_stage(ignore_virtual: bool = False) -> bool:
    """Whether this rank runs the first stage (and, with virtual stages, unless ``ignore_virtual``, model chunk 0)."""
    s = _get()
    if not ignore_virtual and s.vpp is not None and s.vpp_rank != 0:
        return False
    return s.pp_rank == 0


def is_pp_last_stage(ignore_virtual: bool = False) -> bool:
    """Whether this rank runs the last stage (and, with virtual stages, unless ``ignore_virtual``, its last chunk):
    the last pipeline rank, or under the V placement rank 0 (its chunk 1)."""
    s = _get()
    if not ignore_virtual and s.vpp is not None and s.vpp_rank != s.vpp - 1:
        return False
    return s.pp_rank == (0 if s.placement == "v" else s.pp - 1)


# ---- validation ------------------------------------------------------------------------------------------------


def check_divisible(tp: int | None = None, **sizes: int) -> None:
    """Check that each named size splits evenly over ``tp`` ranks (default ``tp_size()``).

        check_divisible(num_heads=16, ffn_hidden_size=4096)

    Raises:
        ValueError: naming the size and the rule, e.g. ``num_heads=4 is smaller than the tensor-parallel size 8``
            or ``num_heads=12 is not divisible by the tensor-parallel size 8``.
    """
    tp = tp_size() if tp is None else tp
    for name, value in sizes.items():
        positive_int(value, name)
        if value < tp:
            raise ValueError(
                f"{name}={value} is smaller than the tensor-parallel size {tp}: each of the {tp} "
                f"ranks needs at least one"
            )
        if value % tp:
            raise ValueError(f"{name}={value} is not divisible by the tensor-parallel size {tp}")


def divide(numerator: int, denominator: int, what: str = "size") -> int:
    """``numerator // denominator``, raising ValueError naming ``what`` unless it divides exactly."""
    if numerator % denominator:
        raise ValueError(f"{what}={numerator} is not divisible by {denominator}")
    return numerator // denominator


def forget_meshes() -> None:
    """Drop DTensor's cached sharding decisions, which hold the meshes (and so the process groups) of the last
    layout: a new layout over the same ranks compares equal to the old mesh and would otherwise be served the
    old, destroyed groups (``destroy`` calls this)."""
    if "torch.distributed.tensor" not in sys.modules:
        return
    from torch.distributed.tensor import DTensor

    prop = DTensor._op_dispatcher.sharding_propagator
    prop.propagate_op_sharding.cache_clear()
    prop._propagate_tensor_meta_cached.cache_clear()
