"""Muon inside ``ParallelOptimizer`` (``optimizer="muon"``): the hidden matrices of a 3D-parallel model stepped by
``megakernels.optim.muon``'s algorithm, over the data-, tensor- and pipeline-parallel layout.

Newton-Schulz needs a whole matrix, while the optimizer's pieces are flat ranges (``ParallelOptimizer``'s pieces:
ZeRO-1's shards of the gradient buckets, FSDP2's dim-0 shards). So each Muon matrix has one **owner** among the ranks
its pieces are spread over (the data-parallel group of its DDP wrapper under ZeRO-1, the FSDP shard group under
FSDP2), chosen so that every rank owns about the same number of elements (largest matrices first, each to the least
loaded rank: the layer-wise scheme of Megatron-Core's distributed Muon). Per step:

1. the owners receive the full gradients of their matrices: one all-gather over the group of every rank's pieces
   (padded to one length);
2. each owner advances the momentum buffer it keeps for its matrices (fp32, the only state Muon adds: 4 bytes per
   parameter, over the group) and orthogonalises the Nesterov input, per logical matrix (``split``), the matrices
   of one shape batched into one kernel call; with tensor parallelism a TP-split matrix is first gathered from the
   TP ranks to one of them (``tp_mode="exact"``: the update of the whole matrix, as the single process computes it;
   a ``"head"`` split of a column-parallel weight holds whole heads on every rank and needs no gather), or each
   rank orthogonalises its own shard (``"shard"``: cheaper, and an approximation: the shards' updates are not the
   whole matrix's);
3. the updates go back to the ranks holding each matrix's pieces: one reduce-scatter over the group of buffers that
   are zero except where the owner wrote (a sum with one non-zero term: exact), and every rank applies
   ``main = main * (1 - lr * wd) - lr * update`` to its pieces (the fp32 masters, rounded into 16-bit params).

Without ZeRO-1 or FSDP every rank owns every matrix it holds (no gathers, as with AdamW, where every data-parallel
rank steps every parameter). Pipeline stages are independent: each steps its own matrices. The global gradient norm,
clipping and the loss scale apply to Muon's gradients as to AdamW's (the gradients are divided before the momentum).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from megakernels.optim import muon as algo
from megakernels.parallel import comm, state
from megakernels.parallel import params as marks

TP_MODES = ("exact", "shard")


@dataclasses.dataclass(frozen=True)
class MuonOptions:
    """Muon's settings in ``ParallelOptimizer`` (``megakernels.optim.Muon``'s, and ``tp_mode``).

    Raises:
        ValueError / TypeError naming the field: values out of range, unknown names.
    """

    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5
    ns_coefficients: tuple[float, float, float] = algo.COEFFICIENTS
    eps: float = 1e-7
    lr_scale: str = "match_rms_adamw"
    split: str = "projection"
    ns_dtype: str = "auto"
    tp_mode: str = "exact"

    def __post_init__(self):
        algo.check_muon_hypers(
            "MuonOptions", {"lr": 0.0, "weight_decay": 0.0, **{k: v for k, v in vars(self).items() if k != "tp_mode"}}
        )
        if self.tp_mode not in TP_MODES:
            raise ValueError(f"MuonOptions: tp_mode must be one of {list(TP_MODES)}, got {self.tp_mode!r}")


@dataclasses.dataclass
class Entry:
    """One Muon matrix of this rank (its TP shard): who holds which flat range of it, who owns it."""

    param: torch.Tensor
    shape: tuple[int, ...]
    layout: algo.Layout
    decay: bool
    group: object = None  # the process group its pieces are spread over (None: this rank holds it whole)
    ranges: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # per group rank
    offsets: list[int] = dataclasses.field(default_factory=list)  # its place in each group rank's segment
    owner: int = 0  # group rank
    gathered: bool = False  # a TP-split matrix gathered to ``tp_owner`` (tp_mode exact)
    dim: int = -2  # the matrix dim split over TP (-2 rows, -1 columns)
    replicas: int = 1
    tp_owner: int = 0
    momentum: torch.Tensor | None = None

    @property
    def numel(self) -> int:
        return int(torch.Size(self.shape).numel())


def _balance(sizes: list[int], ranks: int) -> list[int]:
    """An owner per item: the largest first, each to the least loaded rank (the lowest on ties)."""
    load, owner = [0] * ranks, [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(ranks), key=lambda r: (load[r], r))
        owner[i], load[r] = r, load[r] + sizes[i]
    return owner


def _tp_split(p, options: MuonOptions, layout: algo.Layout) -> tuple[bool, int, int]:
    """(gathered over TP, the split matrix dim, replicas) of ``p`` under ``options``."""
    rec = marks.info(p)
    tp = state.tp_size() if state.is_initialized() else 1
    if not rec.tensor_parallel or tp == 1 or options.tp_mode == "shard":
        return False, -2, 1
    dim = -2 if rec.partition_dim == 0 else -1
    if dim == -2 and rec.replicas >= tp:
        return False, dim, rec.replicas  # every rank holds the whole matrix
    whole_heads = options.split == "head" and layout.head_dim is not None
    if dim == -2 and whole_heads:
        return False, dim, rec.replicas
    return True, dim, rec.replicas


class MuonPart:
    """The Muon matrices of one ``ParallelOptimizer`` (module docstring).

    Args:
        specs: per Muon parameter ``(param, group, ranges, decay)``: the process group its flat pieces are spread
            over (None: held whole here), each group rank's ``(lo, hi)`` range of it, and whether weight decay
            applies. Every rank of a group lists the group's parameters in the same order.
        options: ``MuonOptions``.
    """

    def __init__(self, specs, options: MuonOptions):
        self.options = options
        self.entries: list[Entry] = []
        self.steps = 0
        by_group: dict[int, list[Entry]] = {}
        self._groups: list[tuple[object, list[Entry]]] = []
        self._seg_of: dict[int, int] = {}  # per group: the longest rank's segment of pieces
        for p, group, ranges, decay in specs:
            layout = algo.layout_of(p)
            e = Entry(p, tuple(p.shape), layout, decay, group, list(ranges))
            e.gathered, e.dim, e.replicas = _tp_split(p, options, layout)
            self.entries.append(e)
            key = id(group)
            if key not in by_group:
                by_group[key] = []
                self._groups.append((group, by_group[key]))
            by_group[key].append(e)
        for group, entries in self._groups:
            ranks = 1 if group is None else dist.get_world_size(group)
            me = 0 if group is None else dist.get_rank(group)
            owners = _balance([e.numel for e in entries], ranks) if group is not None else [0] * len(entries)
            seg = [0] * ranks
            for e, o in zip(entries, owners):
                e.owner = o
                e.offsets = []
                for r in range(ranks):
                    e.offsets.append(seg[r])
                    lo, hi = e.ranges[r] if e.ranges else (0, e.numel)
                    seg[r] += hi - lo
            self._seg_of[id(group)] = max(seg)
            for e in entries:
                if e.owner == me:
                    e.momentum = torch.zeros(e.shape, dtype=torch.float32, device=e.param.device)
        gathered = [e for e in self.owned() if e.gathered]
        tp = state.tp_size() if state.is_initialized() else 1
        for e, t in zip(gathered, _balance([e.numel for e in gathered], tp)):
            e.tp_owner = t

    def owned(self) -> list[Entry]:
        """The entries whose momentum (and Newton-Schulz) this rank keeps."""
        return [e for e in self.entries if e.momentum is not None]

    def momentum_tensors(self) -> list[torch.Tensor]:
        return [e.momentum for e in self.owned()]

    # ---- the step ------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, pieces: dict, divisor: torch.Tensor, lr: float, weight_decay: float) -> None:
        """One Muon step: ``pieces`` maps each param to this rank's ``Piece`` of it (``main``: fp32 1-D, ``grad``,
        ``flat``); grads are divided by ``divisor`` (a scalar tensor: loss scale and clipping). Collective over the
        groups and, for gathered matrices, the TP group."""
        full = self._full_grads(pieces, divisor)
        inputs = {}
        for e in self.owned():
            u = algo.momentum_input(e.momentum, full[id(e)], self.options.momentum, self.options.nesterov)
            inputs[id(e)] = algo.split_matrices(u, e.layout, self.options.split)
        updates = self._orthogonalize(inputs)
        self._apply(pieces, updates, lr, weight_decay)
        self.steps += 1

    def _full_grads(self, pieces: dict, divisor: torch.Tensor) -> dict[int, torch.Tensor]:
        """The whole (TP-local) fp32 gradient of every owned entry, divided by ``divisor``."""
        out = {}
        for group, entries in self._groups:
            if group is None:
                for e in entries:
                    out[id(e)] = pieces[e.param].grad.float().view(e.shape) / divisor
                continue
            world, me = dist.get_world_size(group), dist.get_rank(group)
            seg = self._seg_of[id(group)]
            dev = entries[0].param.device
            send = torch.zeros(seg, dtype=torch.float32, device=dev)
            for e in entries:
                lo, hi = e.ranges[me]
                if hi > lo:
                    send[e.offsets[me] : e.offsets[me] + hi - lo] = pieces[e.param].grad.float()
            recv = comm.all_gather(send, 0, group).view(world, seg)
            for e in entries:
                if e.owner != me:
                    continue
                g = torch.empty(e.numel, dtype=torch.float32, device=dev)
                for r in range(world):
                    lo, hi = e.ranges[r]
                    g[lo:hi] = recv[r, e.offsets[r] : e.offsets[r] + hi - lo]
                out[id(e)] = g.view(e.shape) / divisor
        return out

    def _orthogonalize(self, inputs: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """Each owned entry's scaled update (its TP-local shape), gathering TP-split ones to their TP owner."""
        o = self.options
        owned = self.owned()
        gathered = [e for e in owned if e.gathered]
        tp = state.tp_size() if gathered else 1
        group = state.tp_group() if gathered else None
        me = state.tp_rank() if gathered else 0
        whole: dict[int, torch.Tensor] = {}
        for t in range(tp):  # every TP rank sends its shards of the matrices TP rank t orthogonalises
            mine = [e for e in gathered if e.tp_owner == t]
            if not mine:
                continue
            send = torch.cat([inputs[id(e)].reshape(-1) for e in mine])
            parts = [torch.empty_like(send) for _ in range(tp)] if me == t else None
            dist.gather(send, parts, dst=dist.get_global_rank(group, t), group=group)
            if me == t:
                at = 0
                for e in mine:
                    k = inputs[id(e)].numel()
                    blocks = [parts[r][at : at + k].view_as(inputs[id(e)]) for r in range(0, tp, e.replicas)]
                    whole[id(e)] = torch.cat(blocks, dim=e.dim)
                    at += k
        todo = [e for e in owned if not e.gathered or id(e) in whole]
        batches = [whole.get(id(e), inputs[id(e)]) for e in todo]
        results = algo.orthogonalize(
            batches,
            steps=o.ns_steps,
            coefficients=o.ns_coefficients,
            eps=o.eps,
            ns_dtype=o.ns_dtype,
            lr_scale=o.lr_scale,
        )
        done = {id(e): r for e, r in zip(todo, results)}
        for t in range(tp):  # and gets its own shard of each update back
            mine = [e for e in gathered if e.tp_owner == t]
            if not mine:
                continue
            out = torch.empty(sum(inputs[id(e)].numel() for e in mine), dtype=torch.float32, device=_dev(inputs))
            chunks = None
            if me == t:  # rank r's block: r // replicas of the blocks gathered (one per replica group)
                chunks = [
                    torch.cat([_block(done[id(e)], e, inputs[id(e)].shape[e.dim], r).reshape(-1) for e in mine])
                    for r in range(tp)
                ]
            dist.scatter(out, chunks, src=dist.get_global_rank(group, t), group=group)
            at = 0
            for e in mine:
                k = inputs[id(e)].numel()
                done[id(e)] = out[at : at + k].view_as(inputs[id(e)])
                at += k
        return {id(e): algo.merge_matrices(done[id(e)], e.layout, o.split, e.shape).reshape(-1) for e in owned}

    def _apply(self, pieces: dict, updates: dict[int, torch.Tensor], lr: float, weight_decay: float) -> None:
        """Send each update's ranges to the ranks holding them and step every piece of this rank."""
        for group, entries in self._groups:
            if group is None:
                for e in entries:
                    _step_piece(pieces[e.param], updates[id(e)], lr, weight_decay if e.decay else 0.0)
                continue
            world, me = dist.get_world_size(group), dist.get_rank(group)
            seg = self._seg_of[id(group)]
            dev = entries[0].param.device
            send = torch.zeros(world, seg, dtype=torch.float32, device=dev)
            for e in entries:
                if e.owner != me:
                    continue
                u = updates[id(e)]
                for r in range(world):
                    lo, hi = e.ranges[r]
                    send[r, e.offsets[r] : e.offsets[r] + hi - lo] = u[lo:hi]
            mine = comm.reduce_scatter(send.view(-1), 0, group)
            for e in entries:
                lo, hi = e.ranges[me]
                if hi > lo:
                    u = mine[e.offsets[me] : e.offsets[me] + hi - lo]
                    _step_piece(pieces[e.param], u, lr, weight_decay if e.decay else 0.0)

    # ---- checkpoints ---------------------------------------------------------------------------------------------

    def param_state(self) -> dict[torch.Tensor, torch.Tensor]:
        """``{param: momentum}`` of the entries this rank owns (the TP-local shape, fp32)."""
        return {e.param: e.momentum for e in self.owned()}

    def load_param_state(self, momenta: dict[torch.Tensor, torch.Tensor], steps: int) -> None:
        """Restore the owned entries' momenta from complete tensors (zeros where ``steps == 0`` or missing)."""
        for e in self.owned():
            m = momenta.get(e.param)
            if m is None or steps == 0:
                e.momentum.zero_()
            else:
                e.momentum.copy_(m.reshape(e.shape))
        self.steps = steps


def _block(whole: torch.Tensor, e: Entry, size: int, r: int) -> torch.Tensor:
    """TP rank ``r``'s block of a gathered update (``size`` along the split dim)."""
    return whole.narrow(e.dim, (r // e.replicas) * size, size)


def _step_piece(piece, update: torch.Tensor, lr: float, weight_decay: float) -> None:
    main = piece.main
    main.mul_(1.0 - lr * weight_decay).add_(update.to(main.device), alpha=-lr)
    if main is not piece.flat and main.data_ptr() != piece.flat.data_ptr():
        piece.flat.copy_(main)


def _dev(inputs: dict) -> torch.device:
    return next(iter(inputs.values())).device
