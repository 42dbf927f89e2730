"""Data parallelism: gradients accumulated in contiguous fp32 buffers and averaged over the data-parallel group in
buckets, each bucket's collective launched as soon as backward has produced all of its gradients.

Layout. Every trainable parameter ``p`` gets ``p.main_grad``, a view (``p``'s shape) into one flat buffer per
(param dtype, grad dtype) pair, ``grad_dtype`` fp32 by default even for bf16/fp16 params (accumulating many
micro-batches in 16 bits loses the small contributions). Params are laid out in reverse registration order, roughly
the order backward produces their grads, and the buffer is cut into buckets of about ``bucket_size`` elements, each
padded to a multiple of the data-parallel size ``dp``. With ``reduce_scatter=True`` (ZeRO-1, for the distributed
optimizer) the params themselves are moved into a second flat buffer of the same layout in the param dtype, so the
updated shards can be all-gathered straight into them.

Backward. A post-accumulate-grad hook moves ``p.grad`` into ``p.main_grad`` and drops ``p.grad``: the first gradient a
param receives after ``zero_grad_buffer()`` is copied in (converted to the grad dtype), later ones (more
micro-batches, deferred weight gradients) are added. ``zero_grad_buffer()`` therefore writes nothing: the params that
received no gradient get their ``main_grad`` zeroed when their bucket's sync is launched, so from then on every
``main_grad`` holds exactly what zero-filling the buffer and adding every gradient would (the bucket padding is
never written and stays zero). Before its bucket is launched, the ``main_grad`` of a param that has not received a
gradient yet this step holds stale values (``zero_missing_grads()`` zeroes them on demand). While grad sync is
enabled, the hook that completes a bucket launches its collective asynchronously: the bucket is divided by ``dp``
first (pre-division keeps 16-bit buckets from overflowing; the sum of the divided grads is the mean), then summed
over the group, all-reduce, or with ``reduce_scatter=True`` reduce-scatter, after which dp rank ``r`` holds the mean
of the ``r``-th contiguous ``1/dp`` of every bucket (the rest of its buffer is stale). The collectives of the later
layers thus run while backward computes the earlier ones. ``finish_grad_sync()`` launches what is left (buckets whose
params got no grad in this backward, or all of them with ``overlap=False``) and waits for everything.

Every rank must run the same graph: collectives are issued in the order buckets complete, which must agree across
the data-parallel group (a parameter used on some ranks only can reorder them; unused on all ranks is fine).

Tied parameters across pipeline stages (the word embedding on the first stage and its copy on the last, marked
``shared_embedding``) each get a bucket of their own (``separate``), so the param sits at the same place of an
identical bucket on both stages; after the data-parallel sync the two copies' ``main_grad`` are summed over the
embedding group (``finalize_model_grads`` does it, with the sequence-parallel sums), which is right for either
collective: under reduce-scatter each rank sums the shard it owns with the same shard of the other stage.

A training step::

    ddp.zero_grad_buffer()
    for i, micro_batch in enumerate(micro_batches):
        with ddp.no_sync() if i < len(micro_batches) - 1 else contextlib.nullcontext():
            loss_fn(ddp(micro_batch)).backward()
    finalize_model_grads([ddp])              # finish_grad_sync + sequence-parallel and embedding sums
    optimizer.step()
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from megakernels.parallel import comm, state
from megakernels.parallel.comm import all_gather_single, reduce_scatter_single
from megakernels.parallel.params import info, is_expert_parallel, is_sequence_parallel, is_shared_embedding
from megakernels.validation import positive_int

_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class Bucket:
    """A contiguous range of a grad buffer whose collective is launched as one.

    Attributes:
        params: the parameters in it, in buffer order; ``offsets[i]`` is where ``params[i]`` starts, relative to
            the bucket's start.
        numel: elements, padded to a multiple of the data-parallel size.
        grad_data: the bucket's 1-D view of the grad buffer (grad dtype).
        param_data: the bucket's 1-D view of the param buffer (param dtype), or None without ``reduce_scatter``.
        shard_size: ``numel / dp``: data-parallel rank ``r`` owns elements ``[r · shard_size, (r+1) · shard_size)``.
    """

    def __init__(self, params, offsets, numel, grad_data, param_data, dp):
        self.params, self.offsets, self.numel = params, offsets, numel
        self.grad_data, self.param_data = grad_data, param_data
        self.shard_size = numel // dp
        self.ready: set[int] = set()
        self.written: set[int] = set()  # params whose main_grad holds this step's gradients (or was zeroed)
        self.pending: comm.Pending | None = None
        self.launched = self.reduced_hooks_ran = False

    def reset(self) -> None:
        self.ready.clear()
        self.written.clear()
        self.pending, self.launched, self.reduced_hooks_ran = None, False, False

    def zero_unwritten(self) -> None:
        """Zero the ``main_grad`` of the params that received no gradient since the last reset (the whole bucket in
        one fill when none did); afterwards every param of the bucket counts as written."""
        if len(self.written) == len(self.params):
            return
        if not self.written:
            self.grad_data.zero_()  # the padding is zero already: one fill instead of one per param
        else:
            for i, p in enumerate(self.params):
                if i not in self.written:
                    p.main_grad.zero_()
        self.written.update(range(len(self.params)))


class DistributedDataParallel(nn.Module):
    """Wraps ``module`` for data parallelism with fp32 gradient buffers and bucketed, overlapped gradient averaging.

    Args:
        module: the model (chunk); its trainable params must be dense, contiguous and on one device.
        group: the data-parallel process group; default ``megakernels.parallel.dp_cp_group()`` (the data- and
            context-parallel ranks, which hold different tokens of the same parameters' gradient). Without
            ``megakernels.parallel`` initialised and without a multi-rank default group: one rank, no collectives.
        bucket_size: elements per bucket (a bucket closes once it reaches this; default 40M).
        grad_dtype: dtype of ``main_grad`` (fp32, bf16, fp16), or None for each param's own dtype.
        overlap: launch each bucket's collective from the backward hooks as soon as it is complete; otherwise all
            are launched by ``finish_grad_sync()``.
        reduce_scatter: reduce-scatter instead of all-reduce (ZeRO-1); also moves the params into a flat buffer.
        separate: params for which it returns True get a bucket of their own (default: the tied embedding,
            ``params.is_shared_embedding``).
        include: the params this wrapper handles (default all); ``wrap_model`` gives a mixture-of-experts model
            two wrappers, one for the dense params and one, over the expert-data-parallel group, for the experts'.
        divisor: what the summed gradients are divided by (default the group's size: the mean). Experts' gradients
            are summed over fewer ranks than the dense ones but come from the same scaled losses, so their wrapper
            divides by the data-parallel size as well.

    Raises:
        ValueError: no trainable params, params on several devices, a non-contiguous param, a bad ``bucket_size``
            or ``grad_dtype``. RuntimeError: a multi-rank world with ``megakernels.parallel`` not initialised and
            no ``group``.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        group=None,
        bucket_size: int = 40_000_000,
        grad_dtype: torch.dtype | None = torch.float32,
        overlap: bool = True,
        reduce_scatter: bool = False,
        separate=is_shared_embedding,
        include=None,
        divisor: int | None = None,
    ) -> None:
        super().__init__()
        cls = type(self).__name__
        positive_int(bucket_size, "bucket_size", where=cls)
        if grad_dtype is not None and grad_dtype not in _GRAD_DTYPES:
            raise ValueError(f"{cls}: grad_dtype must be float32, bfloat16, float16 or None, got {grad_dtype}")
        self.module = module
        self.group, self.dp_size, self.dp_rank = self._resolve_group(group)
        self.divisor = self.dp_size if divisor is None else positive_int(divisor, "divisor", where=cls)
        self.overlap, self.reduce_scatter, self.bucket_size = bool(overlap), bool(reduce_scatter), bucket_size
        params = [p for p in module.parameters() if p.requires_grad and (include is None or include(p))]
        if not params:
            raise ValueError(f"{cls}: module has no parameters with requires_grad=True")
        devices = {p.device for p in params}
        if len(devices) > 1:
            raise ValueError(f"{cls}: params must be on one device, got {sorted(map(str, devices))}")
        for name, p in module.named_parameters():
            if p.requires_grad and not p.is_contiguous():
                raise ValueError(f"{cls}: parameter {name!r} is not contiguous")
        self.buckets: list[Bucket] = []
        self.grad_buffers: list[torch.Tensor] = []
        self.param_buffers: list[torch.Tensor] = []
        self._bucket_of: dict[nn.Parameter, tuple[Bucket, int]] = {}
        by_dtype: dict[tuple[torch.dtype, torch.dtype], list[nn.Parameter]] = {}
        for p in reversed(params):
            by_dtype.setdefault((p.dtype, grad_dtype or p.dtype), []).append(p)
        device = next(iter(devices))
        for (param_dtype, gdtype), group_params in by_dtype.items():
            self._build_buffer(group_params, param_dtype, gdtype, separate, device)
        self._sync_enabled = True
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in params]
        self._reduced_hooks: list = []

    @staticmethod
    def _resolve_group(group):
        if group is None:
            if state.is_initialized():
                group = state.dp_cp_group()
            elif dist.is_initialized() and dist.get_world_size() > 1:
                raise RuntimeError(
                    "DistributedDataParallel: megakernels.parallel is not initialised; call "
                    "megakernels.parallel.initialize(tp, pp) first or pass group="
                )
            else:
                return None, 1, 0
        return group, dist.get_world_size(group), dist.get_rank(group)

    def _layout(self, params, separate) -> list[list[nn.Parameter]]:
        """Params (backward order) grouped into buckets: close one at bucket_size, separate params alone."""
        buckets, current, size = [], [], 0
        for p in params:
            if separate(p):
                if current:
                    buckets.append(current)
                buckets.append([p])
                current, size = [], 0
                continue
            current.append(p)
            size += p.numel()
            if size >= self.bucket_size:
                buckets.append(current)
                current, size = [], 0
        if current:
            buckets.append(current)
        return buckets

    def _build_buffer(self, params, param_dtype, grad_dtype, separate, device) -> None:
        dp, layout = self.dp_size, self._layout(params, separate)
        sizes = [-(-max(sum(p.numel() for p in members), 1) // dp) * dp for members in layout]
        total = sum(sizes)
        grad = torch.zeros(total, dtype=grad_dtype, device=device)
        param = torch.zeros(total, dtype=param_dtype, device=device) if self.reduce_scatter else None
        self.grad_buffers.append(grad)
        if param is not None:
            self.param_buffers.append(param)
        start = 0
        for members, size in zip(layout, sizes):
            offsets, at = [], 0
            for p in members:
                offsets.append(at)
                lo, hi = start + at, start + at + p.numel()
                p.main_grad = grad[lo:hi].view(p.shape)
                if param is not None:
                    param[lo:hi].view(p.shape).copy_(p.detach())
                    p.data = param[lo:hi].view(p.shape)
                at += p.numel()
            end = start + size
            bucket = Bucket(
                members, offsets, size, grad[start:end], param[start:end] if param is not None else None, dp
            )
            self.buckets.append(bucket)
            for i, p in enumerate(members):
                self._bucket_of[p] = (bucket, i)
            start = end

    # ---- backward hooks and the collectives ---------------------------------------------------------------------

    def _on_grad(self, p: nn.Parameter) -> None:
        if p.grad is None:
            return
        bucket, i = self._bucket_of[p]
        if bucket.launched:
            raise RuntimeError(
                "DistributedDataParallel: a parameter received a gradient after its bucket's "
                "gradient sync was launched; call zero_grad_buffer() after each step and disable "
                "sync (no_sync()) for all but the last micro-batch"
            )
        if i in bucket.written:
            p.main_grad.add_(p.grad)
        else:  # the first gradient of the step: no zero fill, no read of the stale buffer (module docstring)
            p.main_grad.copy_(p.grad)
            bucket.written.add(i)
        p.grad = None
        if self._sync_enabled and self.overlap:
            bucket.ready.add(i)
            if len(bucket.ready) == len(bucket.params):
                self._launch(bucket)

    def register_grad_reduced_hook(self, hook) -> None:
        """Call ``hook(bucket)`` once per bucket and step as soon as the bucket's gradients are reduced (the optimizer
        offload copies them to the host then). On CUDA it runs when the collective is launched (from backward): the
        hook orders its own stream after it with ``bucket.pending.wait_stream()`` (``pending`` is None with one
        rank). On the CPU it runs once the collective completed (in ``finish_grad_sync``), or at launch with one
        rank."""
        self._reduced_hooks.append(hook)

    def _run_reduced_hooks(self, bucket: Bucket) -> None:
        if not bucket.reduced_hooks_ran:
            bucket.reduced_hooks_ran = True
            for hook in self._reduced_hooks:
                hook(bucket)

    def _launch(self, bucket: Bucket) -> None:
        bucket.launched = True
        bucket.zero_unwritten()
        if self.divisor != 1:
            bucket.grad_data.div_(self.divisor)
        if self.dp_size > 1:
            self._start_collective(bucket)
        if bucket.pending is None or bucket.grad_data.is_cuda:
            self._run_reduced_hooks(bucket)

    def _start_collective(self, bucket: Bucket) -> None:
        data = bucket.grad_data
        if self.reduce_scatter:
            shard = data[self.dp_rank * bucket.shard_size : (self.dp_rank + 1) * bucket.shard_size]
            comm.record("launch", "reduce_scatter")
            work = reduce_scatter_single(shard, data, group=self.group, async_op=True)
            bucket.pending = comm.Pending("reduce_scatter", work, shard)
        else:
            comm.record("launch", "all_reduce")
            work = dist.all_reduce(data, group=self.group, async_op=True)
            bucket.pending = comm.Pending("all_reduce", work, data)

    def finish_grad_sync(self) -> None:
        """Launch the collectives of buckets not launched yet (in bucket order) and wait for all of them; then every
        ``main_grad`` (or, with reduce-scatter, this rank's shard of every bucket) holds the mean over the group."""
        for bucket in self.buckets:
            if not bucket.launched:
                self._launch(bucket)
        for bucket in self.buckets:
            if bucket.pending is not None:
                bucket.pending.wait()
                bucket.pending = None
                self._run_reduced_hooks(bucket)

    def start_param_sync(self) -> list[comm.Pending]:
        """ZeRO-1: all-gather every bucket's param shards over the group (asynchronously); returns the pending
        collectives, whose ``wait()`` makes the params whole. Needs ``reduce_scatter=True``."""
        if not self.reduce_scatter:
            raise RuntimeError("DistributedDataParallel.start_param_sync: needs reduce_scatter=True")
        if self.dp_size == 1:
            return []
        pending = []
        for bucket in self.buckets:
            full, n = bucket.param_data, bucket.shard_size
            comm.record("launch", "all_gather")
            work = all_gather_single(
                full, full[self.dp_rank * n : (self.dp_rank + 1) * n], group=self.group, async_op=True
            )
            pending.append(comm.Pending("all_gather", work, full))
        return pending

    def zero_grad_buffer(self) -> None:
        """Start a new step (waiting for collectives still in flight): every ``main_grad`` counts as zero. The buffer
        is not filled: each param's first gradient is copied into its ``main_grad`` and the params without one are
        zeroed when their bucket is synced (module docstring), so the synced buffer is the same as after a fill.
        Reading ``main_grad`` before its bucket's sync: call ``zero_missing_grads()`` first."""
        for bucket in self.buckets:
            if bucket.pending is not None:
                bucket.pending.wait()
            bucket.reset()
        for p in self._bucket_of:
            p.grad = None

    def zero_missing_grads(self) -> None:
        """Zero the ``main_grad`` of every param that has received no gradient since ``zero_grad_buffer()`` (in
        buckets not launched yet; launching does it per bucket). Afterwards every ``main_grad`` holds the sum of the
        step's gradients so far, zero where none arrived; a no-op once ``finish_grad_sync()`` has run."""
        for bucket in self.buckets:
            if not bucket.launched:
                bucket.zero_unwritten()

    # ---- sync switch, forward, state -----------------------------------------------------------------------------

    def set_grad_sync(self, enabled: bool) -> None:
        """Enable or disable launching collectives from backward (disabled: grads only accumulate)."""
        self._sync_enabled = bool(enabled)

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside only accumulate into ``main_grad`` (for all but the last micro-batch)."""
        previous = self._sync_enabled
        self._sync_enabled = False
        try:
            yield
        finally:
            self._sync_enabled = previous

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def state_dict(self, *args, **kwargs):
        """The wrapped module's state dict (no ``module.`` prefix)."""
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        if assign and self.reduce_scatter:
            raise ValueError(
                "DistributedDataParallel.load_state_dict: assign=True would move params out of the "
                "param buffer that reduce_scatter=True relies on"
            )
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)


def wrap_model(module: nn.Module, **kwargs) -> list[DistributedDataParallel]:
    """The data-parallel wrappers of a model chunk: one over ``dp_cp_group()`` for its dense params and, when it has
    mixture-of-experts weights (``params.is_expert_parallel``), one over ``expert_dp_group()`` for those (their
    copies live on the ranks holding the same experts). ``kwargs`` go to both."""
    experts = [p for p in module.parameters() if p.requires_grad and is_expert_parallel(p)]
    if not experts:
        return [DistributedDataParallel(module, **kwargs)]
    group = state.expert_dp_group() if state.is_initialized() else None
    divisor = state.dp_cp_size() if state.is_initialized() else 1
    return [
        DistributedDataParallel(module, include=lambda p: not is_expert_parallel(p), **kwargs),
        DistributedDataParallel(module, group=group, include=is_expert_parallel, divisor=divisor, **kwargs),
    ]


def finalize_model_grads(models: list[DistributedDataParallel]) -> None:
    """After the last backward of a step: finish every model chunk's data-parallel sync, then sum over the TP group
    the ``main_grad`` of params marked sequence-parallel (each TP rank saw only its tokens), over their replica
    group that of blocks replicated within the TP group (each rank's copy got only its query heads' share), and
    over the embedding group that of the shared embedding (the tied word embedding of the first and last pipeline
    stage; under the V placement both are on pipeline rank 0, whose two copies are summed there).

    Under ``reduce_scatter`` the sums are right for the shard each rank owns, given the same bucket layout on every
    TP rank (TP shards of equal shapes, as the parallel layers make them) and on both embedding stages (the
    ``separate`` bucket).
    """
    for m in models:
        m.finish_grad_sync()
    params = list(dict.fromkeys(p for m in models for b in m.buckets for p in b.params))
    sum_partial_grads(params, lambda p: p.main_grad)


def sum_partial_grads(params, grad_of) -> None:
    """The sums of ``finalize_model_grads`` after the data-parallel reduction, on ``grad_of(p)`` of each param
    (``main_grad`` here; FSDP's sharded gradient in ``parallel.fsdp``, the same shard on every rank summed)."""
    if not state.is_initialized():
        return
    if state.tp_size() > 1:
        grads = [grad_of(p) for p in params if is_sequence_parallel(p)]
        _sum_over(grads, state.tp_group())
        replicated: dict[int, list[torch.Tensor]] = {}
        for p in params:
            if info(p).replicas > 1:
                replicated.setdefault(info(p).replicas, []).append(grad_of(p))
        for c, grads in sorted(replicated.items()):
            _sum_over(grads, state.tp_replica_group(c))
    shared = [grad_of(p) for p in params if is_shared_embedding(p)]
    if len(shared) > 1:  # the V placement (zb-v): both copies on this rank, in its two chunks
        total = torch.stack(shared).sum(0)
        for g in shared:
            g.copy_(total)
    if _tied_across_stages():
        _sum_over(shared, state.embedding_group())


def _tied_across_stages() -> bool:
    return state.embedding_group() is not None and len(state.embedding_ranks()) > 1


def _tied_on_this_rank() -> bool:
    """The V placement puts the first and the last stage, and both copies of a tied embedding, on pipeline rank 0."""
    return state.pipeline_placement() == "v" and state.pp_rank() == 0


def changed_after_sync(p) -> bool:
    """Whether ``finalize_model_grads`` still changes ``p.main_grad`` after the data-parallel sync: with tp > 1 a
    sequence-parallel or TP-replicated param, and the tied embedding shared by the first and last pipeline stage."""
    if not state.is_initialized():
        return False
    if state.tp_size() > 1 and (is_sequence_parallel(p) or info(p).replicas > 1):
        return True
    return is_shared_embedding(p) and (_tied_across_stages() or _tied_on_this_rank())


def _sum_over(grads: list[torch.Tensor], group) -> None:
    if not grads:
        return
    if len(grads) == 1:
        comm.all_reduce(grads[0], group)  # a view of the contiguous grad buffer: reduced in place
        return
    flat = torch._utils._flatten_dense_tensors(grads)
    comm.all_reduce(flat, group)
    for g, reduced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
        g.copy_(reduced)
