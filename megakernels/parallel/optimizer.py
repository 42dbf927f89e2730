"""The optimizer step of 3D-parallel training: AdamW on fp32 main params from the ``main_grad`` buffers of
``DistributedDataParallel``, with mixed precision, fp16 loss scaling, global grad-norm clipping and, optionally, the
distributed optimizer (ZeRO-1). With ``optimizer="muon"`` the hidden matrices are stepped by Muon instead
(``megakernels.parallel.muon``: whole matrices owned per data-parallel rank, tensor-parallel gathers), the rest by
AdamW as before.

Main params. AdamW always runs in fp32 on 1-D "main" tensors, one per contiguous piece of a parameter that this rank
updates: a view of the param itself when it is fp32 (no copy), an fp32 master copy when it is bf16/fp16 (the
update is then rounded into the param). Grads are views of ``p.main_grad``. Weight decay is off for 1-D params
(biases, norm weights) and on for the rest.

- Non-distributed: every rank updates every param (whole params), after an all-reduce DDP sync.
- Distributed (ZeRO-1, ``reduce_scatter=True`` DDP): data-parallel rank ``r`` owns the ``r``-th ``1/dp`` of every
  bucket, split at param boundaries into pieces (so weight decay stays per param); it keeps masters and moments
  for those pieces only, steps them on the reduce-scattered grads, then all-gathers the updated params over dp
  into every rank's param buffer. Memory per param (fp32 grads): bf16/fp16 params 2 + 4 + 12/dp bytes
  (params, grads, fp32 master + two moments) instead of 18; fp32 params 4 + 4 + 8/dp instead of 16.

One step (``step()``), all on the device except where noted:

1. fp16: ``found_inf`` = any main grad / scale not finite (this rank's pieces), MAX over the whole world, read on
   the host (the one host sync of the step): every rank must agree to skip. On overflow: skip, back off, return.
2. Global grad norm: sum of squares of the grads this rank counts (``params.counts_in_grad_norm``: a
   tensor-parallel param on every TP rank, a replicated one on TP rank 0 only, the duplicate tied embedding never),
   summed over the model-parallel group (the whole world under ZeRO-1, where each dp rank holds a disjoint
   piece), square root, ÷ loss scale.
3. One coefficient ``min(1, clip_grad / (norm + 1e-6))`` and the loss scale fold into FusedAdamW's ``grad_scale``,
   so unscaling and clipping cost no pass of their own. A non-finite norm skips the update on every rank (the
   kernel reads the flag on the device; the norm is the same everywhere). A finite norm means finite grads, and a
   ``grad_scale`` >= 1 keeps them finite once divided, so FusedAdamW's own check pass over the grads runs only
   with a loss scale below 1.
4. bf16/fp16: masters rounded into the params (by the AdamW kernel, in the pass of step 3); ZeRO-1: params
   all-gathered. Then the norm is read on the host.

With ``offload`` the gradients reach the host per bucket during backward, step 3 runs the C++ CPU AdamW on the host
state, and step 4's copies go host-to-device per bucket, overlapped with the next forward
(``megakernels.parallel.offload``).

A trainer, per optimizer step (``chunks``: the DDP-wrapped model chunks of this rank)::

    opt = ParallelOptimizer(chunks, lr=..., weight_decay=..., distributed=zero1, precision=..., clip_grad=...)
    schedule = WarmupCosineSchedule(lr, min_lr, warmup_steps, total_steps)
    for step in range(1, total_steps + 1):
        schedule.apply(opt, step)
        opt.zero_grad()                                  # every chunk's zero_grad_buffer()
        for i, mb in enumerate(micro_batches):           # or a pipeline schedule's backward passes
            for c in chunks:
                c.set_grad_sync(i == len(micro_batches) - 1)
            (loss(mb) * opt.loss_scale).backward()
        finalize_model_grads(chunks)                     # DP sync, sequence-parallel and tied-embedding sums
        stepped, grad_norm = opt.step()                  # log opt.lr, opt.loss_scale, grad_norm
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from megakernels.ops import multi_tensor as _mt
from megakernels.optim import qk_clip
from megakernels.optim.adamw import FusedAdamW
from megakernels.optim.loss_scaler import DynamicLossScaler
from megakernels.optim.multi_tensor import group_by_device_dtype, multi_tensor_l2norm
from megakernels.parallel import fsdp, state
from megakernels.parallel.ddp import DistributedDataParallel
from megakernels.parallel.muon import MuonOptions, MuonPart
from megakernels.parallel.offload import HostCopies
from megakernels.parallel.optimizer_memory import host_bytes_per_param, memory_bytes_per_param  # noqa: F401
from megakernels.parallel.params import counts_in_grad_norm, is_expert_parallel
from megakernels.precisions import DTYPES
from megakernels.validation import finite_number

OPTIMIZERS = ("adamw", "muon")


class Piece(NamedTuple):
    """A contiguous piece ``param.view(-1)[lo:hi]`` that this rank updates."""

    param: torch.Tensor
    lo: int
    hi: int
    flat: torch.Tensor  # the piece of the param (param dtype), a view
    main: torch.Tensor  # fp32, 1-D: ``flat`` itself for fp32 params, else its fp32 master copy
    grad: torch.Tensor  # the piece of ``param.main_grad``, a view
    counted: bool  # whether it counts towards the global grad norm on this rank


class ParallelOptimizer:
    """AdamW for data/tensor/pipeline-parallel models: mixed precision, loss scaling, global clipping, ZeRO-1.

    Args:
        models: a ``DistributedDataParallel`` model, a list of them (model chunks), or (non-distributed only) an
            iterable of params that carry ``main_grad``.
        lr, betas, eps, weight_decay: AdamW's (``weight_decay`` applies to params with ``dim() > 1`` only).
        distributed: ZeRO-1; the DDP wrappers must use ``reduce_scatter=True`` (and must not otherwise).
        precision: ``'fp32'`` (fp32 params), ``'bf16'`` or ``'fp16'`` (params of that dtype or fp32; fp32 masters).
        clip_grad: clip the global grad norm to this (0: no clipping; the norm is computed and returned anyway).
        loss_scaler: for ``'fp16'`` (default ``DynamicLossScaler()``); the trainer multiplies the loss by
            ``loss_scale`` before backward.
        no_decay: params for which it returns True get no weight decay (default: those of fewer than 2 dims,
            biases and norm weights).
        offload: keep the fp32 masters, the Adam moments and a gradient copy in host memory (pinned for CUDA
            params) and step them with the multi-threaded C++ CPU AdamW; the gradients go device-to-host per DDP
            bucket as soon as it is reduced, and the updated values host-to-device per bucket, waited for by the
            next forward (side streams on CUDA; ``megakernels.parallel.offload``). Under FSDP (``ShardedModel``
            wrappers) each rank offloads its shards: their gradients go to the host at step time and the updated
            shards are back on the device when ``step`` returns (FSDP's all-gathers read them). On the CPU the
            trajectory is the same, bit for bit, as without it.
        optimizer: ``"adamw"`` or ``"muon"`` (Muon for the matrices ``muon_params`` selects, AdamW for the rest,
            both at ``lr`` and ``weight_decay``; not with ``offload``).
        muon: Muon's settings (``MuonOptions``; default ``MuonOptions()``).
        muon_params: with ``"muon"``, the params Muon steps: a predicate on a param, or None for
            ``megakernels.optim.muon.is_muon_matrix`` over the wrapped modules (hidden matrices; not embeddings,
            output tables or routers).
        qk_clip_tau: > 0: MuonClip (``megakernels.optim.qk_clip``): every step measures each attention head's
            largest logit (its maximum over the data- and context-parallel ranks) and, after the update, scales
            the query/key rows of the heads above ``tau`` in the masters and params; ``max_logit`` and
            ``clipped_heads`` report the step's (over the whole world). Any optimizer; 0: off.

    Raises:
        TypeError: ``models`` of another kind. ValueError naming the argument and the rule: an unknown precision, a
        param dtype the precision does not allow, ``clip_grad < 0``, a loss scaler without fp16, DDP wrappers whose
        ``reduce_scatter`` does not match ``distributed``, a param without ``main_grad``, an unknown ``optimizer``,
        ``"muon"`` with ``offload`` or with plain params; FusedAdamW's own checks of lr, betas, eps, weight_decay.
    """

    def __init__(
        self,
        models,
        *,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        distributed: bool = False,
        precision: str = "fp32",
        clip_grad: float = 0.0,
        loss_scaler: DynamicLossScaler | None = None,
        no_decay=None,
        offload: bool = False,
        optimizer: str = "adamw",
        muon: MuonOptions | None = None,
        muon_params=None,
        qk_clip_tau: float = 0.0,
    ) -> None:
        cls = type(self).__name__
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"{cls}: optimizer must be one of {list(OPTIMIZERS)}, got {optimizer!r}")
        if optimizer == "muon" and offload:
            raise ValueError(f"{cls}: offload steps AdamW on the host; optimizer='muon' runs on the device")
        self.optimizer = optimizer
        if precision not in DTYPES:
            raise ValueError(f"{cls}: precision must be one of {list(DTYPES)}, got {precision!r}")
        finite_number(clip_grad, "clip_grad", where=cls)
        if loss_scaler is not None and precision != "fp16":
            raise ValueError(f"{cls}: loss_scaler is only used with precision='fp16', got precision={precision!r}")
        self.precision, self.distributed, self.clip_grad = precision, bool(distributed), float(clip_grad)
        self.loss_scaler = (loss_scaler or DynamicLossScaler()) if precision == "fp16" else None
        self.fsdp = False
        self.models, params = self._unpack(models)
        allowed = {torch.float32} if self.fsdp else {torch.float32, DTYPES[precision]}
        for p in params:
            if p.dtype not in allowed:
                raise ValueError(
                    f"{cls}: precision={precision!r} allows params of dtype "
                    f"{sorted(map(str, allowed))}, got a param of dtype {p.dtype}"
                )
            if not self.fsdp and not hasattr(p, "main_grad"):
                raise ValueError(
                    f"{cls}: a param has no main_grad; wrap the model in DistributedDataParallel "
                    "(it allocates the fp32 grad buffers, also for one rank)"
                )
        self.device = params[0].device if params else torch.device("cpu")
        self.offload = bool(offload)
        pinned = self.offload and self.device.type == "cuda"
        tp_rank = state.tp_rank() if state.is_initialized() else 0
        is_muon = self._muon_rule(muon_params) if optimizer == "muon" else (lambda p: False)
        excluded_of = (lambda p: p.dim() < 2) if no_decay is None else no_decay
        self.pieces: list[Piece] = []
        decay, no_decay_group = [], []
        for p, lo, hi in self._owned(params):
            if self.fsdp:  # this rank's FSDP shard: the fp32 master itself; its gradient is FSDP's (``_grads``)
                flat = fsdp.local(p).detach().view(-1)
                grad = torch.zeros_like(flat)
            else:
                flat = p.detach().view(-1)[lo:hi]
                grad = p.main_grad.view(-1)[lo:hi]
            if self.offload:  # host master and gradient copy (the C++ CPU AdamW steps them)
                main = torch.empty(hi - lo, dtype=torch.float32, pin_memory=pinned).copy_(flat)
                main.grad = torch.empty(hi - lo, dtype=torch.float32, pin_memory=pinned)
            else:
                main = flat if p.dtype == torch.float32 else flat.float().clone()
                if grad.dtype == torch.float32:
                    main.grad = grad
            counted = counts_in_grad_norm(p, tp_rank) and (not self.fsdp or fsdp.is_primary(p))
            self.pieces.append(Piece(p, lo, hi, flat, main, grad, counted))
            if not is_muon(p):
                (no_decay_group if excluded_of(p) else decay).append(main)
        self._adam = FusedAdamW(
            [{"params": decay}, {"params": no_decay_group, "weight_decay": 0.0}],
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
        )
        self._muon = None
        if optimizer == "muon":
            specs = [(p, *self._spread(p), not excluded_of(p)) for p in params if is_muon(p)]
            self._muon = MuonPart(specs, muon or MuonOptions())
            self._muon_group = {"params": [], "lr": lr, "weight_decay": weight_decay}
        muon_ids = {id(e.param) for e in self._muon.entries} if self._muon is not None else set()
        self._masters = [piece for piece in self.pieces if piece.main is not piece.flat]
        adam_masters = [piece for piece in self._masters if id(piece.param) not in muon_ids]
        # 16-bit main_grad buffers of 16-bit params (DistributedDataParallel(grad_dtype=None)): the kernel reads them
        # as they are, no fp32 copy (``_grads``)
        self._half_grads = {
            piece.main: piece.grad
            for piece in self._masters
            if not self.offload and not self.fsdp and piece.grad.dtype == piece.flat.dtype
        }
        if not self.offload:  # the AdamW kernel rounds each updated master into its 16-bit param in the same pass
            self._adam.set_rounded_copies(
                {piece.main: piece.flat for piece in adam_masters},
                {m: g for m, g in self._half_grads.items() if m in {piece.main for piece in adam_masters}},
            )
        self.qk_clip_tau = finite_number(qk_clip_tau, "qk_clip_tau", where=cls)
        self.max_logit, self.clipped_heads = None, None
        self._clipped = []
        if self.qk_clip_tau > 0:
            if not self.models:
                raise ValueError(f"{cls}: qk_clip_tau needs the wrapped models (their attention blocks)")
            for m in self.models:
                qk_clip.check(m.module)
                self._clipped += qk_clip.track(m.module)
        # under FSDP no data-parallel buckets to copy early: every gradient shard is copied at step time
        models = [] if self.fsdp else self.models
        self._copies = HostCopies(self.pieces, models, self.device) if self.offload else None

    def _unpack(self, models):
        if isinstance(models, DistributedDataParallel):
            models = [models]
        elif isinstance(models, nn.Module):
            raise TypeError(
                f"{type(self).__name__}: models must be DistributedDataParallel wrappers or params; got "
                f"a plain {type(models).__name__} (wrap it in DistributedDataParallel)"
            )
        items = list(models)
        if items and all(isinstance(m, fsdp.ShardedModel) for m in items):
            if self.distributed:
                raise ValueError(
                    f"{type(self).__name__}: distributed=True (ZeRO-1) with FSDP-sharded models: the state is "
                    "sharded by FSDP already"
                )
            self.fsdp = True
            return items, list(dict.fromkeys(p for m in items for p in m.params))
        if items and all(isinstance(m, DistributedDataParallel) for m in items):
            for i, m in enumerate(items):
                if m.reduce_scatter != self.distributed:
                    raise ValueError(
                        f"{type(self).__name__}: models[{i}] has reduce_scatter={m.reduce_scatter}, "
                        f"distributed={self.distributed} needs reduce_scatter={self.distributed}"
                    )
            params = list(dict.fromkeys(p for m in items for b in m.buckets for p in b.params))
            return items, params
        if not all(isinstance(p, torch.Tensor) for p in items):
            raise TypeError(f"{type(self).__name__}: models must be DistributedDataParallel wrappers or params")
        if self.distributed:
            raise ValueError(
                f"{type(self).__name__}: distributed=True needs DistributedDataParallel wrappers "
                "with reduce_scatter=True, got params"
            )
        return [], list(dict.fromkeys(p for p in items if p.requires_grad))

    def _muon_rule(self, muon_params):
        """The predicate of the params Muon steps: ``muon_params``, else ``is_muon_matrix`` over the modules."""
        if muon_params is not None:
            return muon_params
        if not self.models:
            raise ValueError(
                f"{type(self).__name__}: optimizer='muon' with plain params needs muon_params (which are matrices)"
            )
        from megakernels.optim.muon import muon_param_groups

        chosen = set()
        for m in self.models:
            for group in muon_param_groups(m.module):
                if group["use_muon"]:
                    chosen.update(id(p) for p in group["params"])
        return lambda p: id(p) in chosen

    def _spread(self, p) -> tuple[object, list[tuple[int, int]]]:
        """(the process group ``p``'s flat pieces are spread over, each of its ranks' ``(lo, hi)`` of ``p``):
        ZeRO-1's bucket shards, FSDP's dim-0 shards (``fsdp.local_range``' rule), or (None, whole) otherwise."""
        n = p.numel()
        if self.fsdp:
            group = p._megakernels_fsdp_group
            world = dist.get_world_size(group)
            rows, row = p.shape[0], n // max(p.shape[0], 1)
            chunk = -(-rows // world)
            return group, [(min(rows, r * chunk) * row, min(rows, (r + 1) * chunk) * row) for r in range(world)]
        if not self.distributed:
            return None, [(0, n)]
        for m in self.models:
            for b in m.buckets:
                for q, at in zip(b.params, b.offsets):
                    if q is p:
                        spans = []
                        for r in range(m.dp_size):
                            first, last = r * b.shard_size, (r + 1) * b.shard_size
                            lo, hi = max(first, at) - at, min(last, at + n) - at
                            spans.append((lo, hi) if lo < hi else (0, 0))
                        return m.group, spans
        raise ValueError(f"{type(self).__name__}: a Muon param is in no bucket of the models")

    def _owned(self, params):
        """(param, lo, hi) flat ranges this rank updates: whole params, under ZeRO-1 the intersections of the
        params with this rank's shard of each bucket, under FSDP each param's local shard (``fsdp.local_range``)."""
        if self.fsdp:
            return [(p, *fsdp.local_range(p)) for p in params]
        if not self.distributed:
            return [(p, 0, p.numel()) for p in params]
        owned = []
        for m in self.models:
            for b in m.buckets:
                first, last = m.dp_rank * b.shard_size, (m.dp_rank + 1) * b.shard_size
                for p, at in zip(b.params, b.offsets):
                    lo, hi = max(first, at) - at, min(last, at + p.numel()) - at
                    if lo < hi:
                        owned.append((p, lo, hi))
        return owned

    # ---- the step ------------------------------------------------------------------------------------------------

    @property
    def param_groups(self) -> list[dict]:
        """FusedAdamW's groups: ``[decayed (dim > 1), not decayed]``, and with Muon a third holding Muon's ``lr``
        and ``weight_decay`` (set ``lr`` here, e.g. by an LR schedule)."""
        return self._adam.param_groups + ([self._muon_group] if self._muon is not None else [])

    @property
    def lr(self) -> float:
        return self._adam.param_groups[0]["lr"]

    @property
    def loss_scale(self) -> float:
        """The current loss scale (1.0 without fp16)."""
        return self.loss_scaler.scale if self.loss_scaler is not None else 1.0

    def _grads(self) -> list[torch.Tensor]:
        """The fp32 grads on the params' device (for the checks and the norm)."""
        if self.fsdp:  # FSDP assigns each step's sharded gradient (None where a param got none)
            for i, piece in enumerate(self.pieces):
                g = piece.param.grad
                grad = fsdp.local(g).view(-1) if g is not None else torch.zeros_like(piece.flat)
                self.pieces[i] = piece._replace(grad=grad)  # in place: the host copies read the same list
                if not self.offload:
                    piece.main.grad = grad
            return [piece.grad for piece in self.pieces]
        if self.offload:
            return [piece.grad.float() if piece.grad.dtype != torch.float32 else piece.grad for piece in self.pieces]
        grads = []
        for piece in self.pieces:
            if piece.main in self._half_grads:  # read in 16 bits by the norm and the AdamW kernel
                grads.append(piece.grad)
                continue
            if piece.grad.dtype != torch.float32:  # 16-bit main_grad buffers of fp32 params: fp32 grads
                piece.main.grad = piece.grad.float()
            grads.append(piece.main.grad)
        return grads

    def _world_max(self, flag: torch.Tensor) -> None:
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)

    def _found_inf(self, grads, scale: float) -> bool:
        flag = torch.zeros((), dtype=torch.float32, device=self.device)
        scale_t = torch.tensor(scale, dtype=torch.float32, device=self.device)
        for (device, _dtype), idx in group_by_device_dtype(grads).items():
            _mt.nonfinite_check_([grads[i] for i in idx], flag, scale_t.to(device))
        self._world_max(flag)
        return bool(flag.item())

    def grad_norm_squared(self, grads: list[torch.Tensor] | None = None) -> torch.Tensor:
        """The global sum of squares of the (still loss-scaled) main grads, every param counted once over the
        whole model (see the module docstring); an fp32 scalar on the params' device, no host sync."""
        grads = self._grads() if grads is None else grads

        def sumsq(expert: bool) -> torch.Tensor:
            counted = [
                g for g, piece in zip(grads, self.pieces) if piece.counted and is_expert_parallel(piece.param) == expert
            ]
            local = multi_tensor_l2norm(counted).to(self.device) if counted else torch.zeros((), device=self.device)
            return local.float() ** 2

        if self.distributed or self.fsdp:
            # every element has one owner in the world: tp × cp × pp × dp ranks hold disjoint pieces (FSDP: the
            # shards of one replica, ``counted`` only there)
            total = sumsq(False) + sumsq(True)
            if dist.is_initialized() and dist.get_world_size() > 1:
                dist.all_reduce(total)
            return total
        dense, experts = sumsq(False), sumsq(True)
        if state.is_initialized() and state.ep_size() > 1:  # each expert-parallel rank holds other experts
            dist.all_reduce(experts, group=state.ep_group())
        total = dense + experts
        group = state.model_parallel_group() if state.is_initialized() else None
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(total, group=group)
        return total

    @torch.no_grad()
    def step(self) -> tuple[bool, float | None]:
        """Unscale, check, clip and apply one AdamW step from the synchronised ``main_grad`` buffers (call after
        ``finalize_model_grads``); collective over the world, so every rank calls it.

        Returns:
            ``(stepped, grad_norm)``: whether the params changed, and the global norm of the unscaled grads before
            clipping (None when an fp16 overflow skipped the step before the norm was computed).
        """
        if not self.fsdp:  # buckets not synced yet (step() without finalize_model_grads): zero the missing grads
            for m in self.models:
                m.zero_missing_grads()
        grads = self._grads()
        scale = self.loss_scale
        if self.loss_scaler is not None and self._found_inf(grads, scale):
            self.loss_scaler.update(True)
            if self._copies is not None:
                self._copies.abandon()
            return False, None
        norm = self.grad_norm_squared(grads).sqrt() / scale
        # FusedAdamW divides every grad by grad_scale: the loss scale, and the clipping coefficient's inverse. A
        # non-finite norm sets found_inf, and the kernel then skips the step on every rank.
        found_inf = torch.isfinite(norm).logical_not().float()
        divisor = torch.full_like(norm, scale)
        if self.clip_grad > 0:
            divisor = divisor / torch.clamp(self.clip_grad / (norm + 1e-6), max=1.0)
        check = scale < 1.0  # below 1 a finite grad may overflow once divided: FusedAdamW checks them all
        if self._muon is not None and math.isfinite(norm.item()):  # one sync: skipped together with AdamW
            muon_pieces = {piece.param: piece for piece in self.pieces}
            self._muon.step(muon_pieces, divisor, self._muon_group["lr"], self._muon_group["weight_decay"])
        if self._copies is not None:
            self._copies.finish()  # the gradients not copied per bucket, then the host waits for all of them
            self._adam.step(grad_scale=divisor.to("cpu"), found_inf=found_inf.to("cpu"), check=check)
            self._copies.put_params()  # overlapped with the next forward; ZeRO-1's all-gather waits for them
            if self.distributed or self.fsdp:  # FSDP's all-gathers read the shards too
                self._copies.wait_params()
        else:
            # also rounds the masters into the params (set_rounded_copies)
            self._adam.step(grad_scale=divisor, found_inf=found_inf, check=check)
        if self.qk_clip_tau > 0 and math.isfinite(norm.item()):
            self._qk_clip()
        if self.distributed:
            for work in [w for m in self.models for w in m.start_param_sync()]:
                work.wait()
        norm_value = norm.item()
        stepped = math.isfinite(norm_value)
        if self.loss_scaler is not None:
            self.loss_scaler.update(not stepped)
        return stepped, norm_value

    def _qk_clip(self) -> None:
        """MuonClip on this rank's masters (the module docstring of ``megakernels.optim.qk_clip``): the maxima over
        the data- and context-parallel ranks, then each clipped head's rows scaled in the pieces this rank holds."""
        mods = self._clipped
        local = torch.cat([m.max_logits for m in mods]) if mods else torch.zeros(0, device=self.device)
        if local.numel() and state.is_initialized() and state.dp_cp_size() > 1:
            dist.all_reduce(local, op=dist.ReduceOp.MAX, group=state.dp_cp_group())
        pieces = {piece.param: piece for piece in self.pieces}
        at, clipped = 0, 0
        for m in mods:
            logits = local[at : at + m.local_heads]
            at += m.local_heads
            gamma = qk_clip.gammas(logits, self.qk_clip_tau)
            clipped += int((gamma < 1).sum())
            for p, scale in qk_clip.row_scales(m, gamma):
                piece = pieces.get(p)
                if piece is None:
                    continue
                qk_clip.scale_rows_(piece.main, scale, piece.lo, p.numel() // p.shape[0])
                if piece.main is not piece.flat:
                    piece.flat.copy_(piece.main)
        summary = torch.tensor(
            [float(local.max()) if local.numel() else float("-inf"), float(clipped)], device=self.device
        )
        if dist.is_initialized() and dist.get_world_size() > 1:  # the step's largest logit over every stage and rank
            best = summary[:1].clone()
            dist.all_reduce(best, op=dist.ReduceOp.MAX)
            dist.all_reduce(summary[1:], op=dist.ReduceOp.SUM)  # each head once per data/context-parallel replica
            summary[0] = best[0]
            summary[1] /= state.dp_cp_size() if state.is_initialized() else 1
        self.max_logit, self.clipped_heads = float(summary[0]), round(float(summary[1]))

    def wait_params(self) -> None:
        """With ``offload``: make the current stream wait until the updated params are on the device (the next
        forward does it per module by itself; call this before reading params otherwise, e.g. to checkpoint them).
        No host synchronisation; a no-op without offload."""
        if self._copies is not None:
            self._copies.wait_params()

    def zero_grad(self) -> None:
        """Start a new step's gradients: ``zero_grad_buffer()`` of every DDP wrapper (the buffers count as zero; a
        param's first gradient is copied in), else zero every ``main_grad``."""
        for m in self._clipped:  # the maxima of the step about to run
            m.max_logits.zero_()
        if self.models:
            for m in self.models:
                m.zero_grad_buffer()
        else:
            for piece in self.pieces:
                piece.grad.zero_()

    # ---- accounting and checkpoints ------------------------------------------------------------------------------

    def memory_bytes(self) -> dict[str, int]:
        """Bytes this rank holds, measured on the tensors (each storage once): ``params`` (model params / param
        buffers), ``grads`` (main_grad buffers) and ``optimizer`` (moments and masters not sharing the params'
        storage); with ``offload``, ``host`` (those in host memory, and the gradient copies), ``optimizer`` 0.
        Compare with ``memory_bytes_per_param`` and ``host_bytes_per_param``."""

        def nbytes(tensors, exclude=()):
            storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
            return sum(n for ptr, n in storages.items() if ptr not in exclude)

        flats = [piece.flat for piece in self.pieces]
        param_ptrs = {f.untyped_storage().data_ptr() for f in flats}
        moments = [s[k] for s in self._adam.state.values() for k in ("exp_avg", "exp_avg_sq") if k in s]
        moments += self._muon.momentum_tensors() if self._muon is not None else []
        state = nbytes(moments) + nbytes([piece.main for piece in self.pieces], exclude=param_ptrs)
        out = {
            "params": nbytes(flats)
            if not self.distributed
            else sum(b.untyped_storage().nbytes() for m in self.models for b in m.param_buffers),
            "grads": nbytes([piece.grad for piece in self.pieces])
            if not self.distributed
            else sum(b.untyped_storage().nbytes() for m in self.models for b in m.grad_buffers),
            "optimizer": 0 if self.offload else state,
        }
        if self.offload:  # in host memory: masters, moments and the gradient copies
            out["host"] = state + nbytes([piece.main.grad for piece in self.pieces])
        return out

    def state_names(self, p) -> tuple[str, ...]:
        """The per-parameter states ``param_state`` gives for ``p``: AdamW's two moments, or Muon's
        ``momentum_buffer``; and ``master`` for 16-bit params."""
        muon = self._muon is not None and any(e.param is p for e in self._muon.entries)
        names = ("momentum_buffer",) if muon else ("exp_avg", "exp_avg_sq")
        return names + (("master",) if p.dtype != torch.float32 else ())

    def param_state(self) -> tuple[dict[torch.Tensor, dict[str, torch.Tensor]], int]:
        """The optimizer state in the params' own shapes, for layout-independent checkpoints.

        Returns ``({param: {state: tensor}}, step)`` with the states of ``state_names``: fp32 tensors shaped like
        each param (this rank's TP shard), holding the values of the pieces this rank updates (a Muon momentum:
        of the matrices this rank owns) and zeros elsewhere; under ZeRO-1 and FSDP summing them over the
        data-parallel group completes them. ``step`` is the number of steps taken (the same for every piece).
        """
        out: dict[torch.Tensor, dict[str, torch.Tensor]] = {}
        step = self._muon.steps if self._muon is not None else 0

        def entry(p):
            if p not in out:
                out[p] = {k: torch.zeros(p.shape, dtype=torch.float32, device=p.device) for k in self.state_names(p)}
            return out[p]

        for piece in self.pieces:
            p = piece.param
            if self.fsdp and not fsdp.is_primary(p):  # an HSDP replica: its replica group's first holds the same
                continue
            st, mine = self._adam.state.get(piece.main), entry(p)
            if st:
                step = int(st["step"].item())
                mine["exp_avg"].view(-1)[piece.lo : piece.hi] = st["exp_avg"]
                mine["exp_avg_sq"].view(-1)[piece.lo : piece.hi] = st["exp_avg_sq"]
            if "master" in mine:
                mine["master"].view(-1)[piece.lo : piece.hi] = piece.main
        if self._muon is not None:
            for p, momentum in self._muon.param_state().items():
                if not (self.fsdp and not fsdp.is_primary(p)):
                    entry(p)["momentum_buffer"].copy_(momentum)
        return out, step

    def load_param_state(self, states: dict[torch.Tensor, dict[str, torch.Tensor]], step: int) -> None:
        """Restore ``param_state()`` (complete tensors, any rank's share): each piece takes its range, each Muon
        owner its momenta. With ``step == 0`` the moments stay uninitialised (as before a first step). Masters not
        given are taken from the params.

        Raises:
            KeyError: a param this rank updates is missing from ``states``.
        """
        muon = {id(e.param) for e in self._muon.entries} if self._muon is not None else set()
        for piece in self.pieces:
            st = states[piece.param]
            if "master" in st and piece.main is not piece.flat:
                piece.main.copy_(st["master"].reshape(-1)[piece.lo : piece.hi])
            elif piece.main is not piece.flat:
                piece.main.copy_(piece.flat)
            if id(piece.param) in muon:
                continue
            if step > 0:
                dev = piece.main.device if piece.main.device.type == "cuda" else torch.device("cpu")
                self._adam.state[piece.main] = {
                    "step": torch.tensor(float(step), dtype=torch.float32, device=dev),
                    "exp_avg": st["exp_avg"].reshape(-1)[piece.lo : piece.hi].to(piece.main).clone(),
                    "exp_avg_sq": st["exp_avg_sq"].reshape(-1)[piece.lo : piece.hi].to(piece.main).clone(),
                }
            else:
                self._adam.state.pop(piece.main, None)
        if self._muon is not None:
            owned = [e.param for e in self._muon.owned()]
            self._muon.load_param_state({p: states[p].get("momentum_buffer") for p in owned}, step)

    def state_dict(self) -> dict:
        """This rank's optimizer state: FusedAdamW's (moments, steps, hyper-parameters), the fp32 masters, the loss
        scaler, and the layout (piece sizes) it belongs to. Under ZeRO-1 it is this dp rank's shard only."""
        return {
            "adam": self._adam.state_dict(),
            "masters": [m.main for m in self._masters],
            "loss_scaler": self.loss_scaler.state_dict() if self.loss_scaler is not None else None,
            "layout": self._layout_key(),
            "muon": None
            if self._muon is None
            else {"momenta": self._muon.momentum_tensors(), "steps": self._muon.steps},
        }

    def _layout_key(self) -> dict:
        return {
            "distributed": self.distributed,
            "pieces": [(piece.lo, piece.hi) for piece in self.pieces],
            "optimizer": self.optimizer,
        }

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore ``state_dict()`` of an optimizer over the same model, precision and layout.

        Raises:
            ValueError: a different layout (distributed flag, piece sizes, optimizer) or number of masters.
        """
        if {"optimizer": "adamw", **state_dict["layout"]} != self._layout_key():
            raise ValueError(
                f"{type(self).__name__}.load_state_dict: the state was saved for another layout "
                f"(distributed, piece sizes) than this optimizer's; resharding is not supported here"
            )
        if len(state_dict["masters"]) != len(self._masters):
            raise ValueError(
                f"{type(self).__name__}.load_state_dict: {len(state_dict['masters'])} masters saved, "
                f"this optimizer has {len(self._masters)}"
            )
        self._adam.load_state_dict(state_dict["adam"])
        for master, saved in zip(self._masters, state_dict["masters"]):
            master.main.copy_(saved)
        if self._muon is not None:
            for momentum, saved in zip(self._muon.momentum_tensors(), state_dict["muon"]["momenta"]):
                momentum.copy_(saved)
            self._muon.steps = state_dict["muon"]["steps"]
        if self.loss_scaler is not None and state_dict["loss_scaler"] is not None:
            self.loss_scaler.load_state_dict(state_dict["loss_scaler"])
