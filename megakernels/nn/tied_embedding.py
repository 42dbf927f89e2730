"""A word-embedding table shared by the input lookup and the output layer, with the lookup's gradient added into
the output layer's weight gradient instead of into a dense table of its own.

With a tied table ``E`` ``[V, h]`` a language model reads rows of ``E`` for its input ids and multiplies its last
hidden states by ``Eᵀ`` for the logits. Autograd gives ``E`` two gradients and sums them: the output layer's
``dlogitsᵀ · h`` (dense, ``[V, h]``) and the lookup's, which is non-zero only in the rows of the ids seen — yet
``embedding_dense_backward`` zero-fills a whole ``[V, h]`` table for it and the engine then adds the two tables:
three passes over ``V · h`` elements to add a few thousand rows (a 128k x 4k table: 3 GiB of traffic in bf16).

:class:`TiedEmbedding` removes those passes. Its output layer (or ``ops.linear_cross_entropy`` over ``E``, through
:func:`dense_gradient_sent`) records, in each backward (autograd graph task), that a dense gradient of ``E`` is on
its way to ``E``'s accumulator; the lookup's backward then returns no gradient for
``E`` and keeps ``(ids, dout)`` instead, and a hook on ``E`` (it runs once per backward, on the sum of everything
that reached ``E``, before it is accumulated into ``E.grad``) adds those rows into that sum: each id's rows summed
in fp32 (fp64 for fp64 tables), then added once, so a row is rounded as often as in the unfolded sum. The sum is
updated in place when it is the output layer's own fresh gradient (nothing else holds it), otherwise on a copy.
A lookup of as many ids as the table has rows (a small vocabulary) keeps the dense gradient: folding its rows
would cost as much. Where the output layer's gradient is not there — a loss that never reaches the output layer,
a backward asking only for other inputs' gradients (``torch.autograd.grad``), a nested backward (reentrant
checkpointing) — the lookup returns its dense gradient as usual, and rows kept in a backward that never reached
``E`` are dropped by the next one. The same gradient either way, up to the order of fp32 sums.

Plain ``F.embedding`` / ``F.linear`` run instead (nothing changes) while compiling, under autocast, without
autograd (no grad mode, ``E`` not requiring grad), and for tensor subclasses (DTensor shards, ...). A
``create_graph`` backward does not fold (both backwards are differentiable ops then, as autograd's).
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from megakernels.ops import gemm

# id(table tensor) -> (weak reference to it, weak reference to its hooked TiedEmbedding); keyed by id because a
# tensor's == is elementwise (a WeakKeyDictionary compares keys with it)
_TABLES: dict[int, tuple] = {}


def dense_gradient_sent(weight: torch.Tensor, grad: torch.Tensor) -> None:
    """For an output layer's backward computed outside :class:`TiedEmbedding` (``ops.linear_cross_entropy``):
    ``grad`` (a fresh tensor that nothing else holds), the dense gradient it returns for ``weight``, will reach
    ``weight``'s accumulator in this backward; a tied table's lookups then fold their rows into it. A no-op for a
    weight no ``TiedEmbedding`` has hooked."""
    if torch.compiler.is_compiling():
        return
    entry = _TABLES.get(id(weight))
    if entry is not None and entry[0]() is weight:
        table = entry[1]()
        if table is not None:
            table._dense_sent(grad)


def _plain(weight: torch.Tensor) -> bool:
    """Run the unfolded ops: nothing to fold, or a context the fold does not cover."""
    return (
        not torch.is_grad_enabled()
        or not weight.requires_grad
        or type(weight) not in (torch.Tensor, torch.nn.Parameter)
        or torch.compiler.is_compiling()
        or torch.is_autocast_enabled(weight.device.type)
    )


class TiedEmbedding:
    """The lookup and the output layer of one tied table (module docstring).

    Args:
        weight: the table ``[V, h]``, a leaf tensor (the model's parameter); a hook is registered on it.

    ``lookup(ids, padding_idx=None)`` is ``F.embedding(ids, weight, padding_idx)``; ``logits(hidden)`` is
    ``F.linear(hidden, weight)``. Both read the table passed here; ``folds`` counts the backwards whose lookup
    gradient went into the output layer's.

    Raises:
        ValueError: ``weight`` is not a 2-D floating-point leaf tensor.
    """

    def __init__(self, weight: torch.Tensor):
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or not weight.is_floating_point():
            raise ValueError(
                "TiedEmbedding: weight must be a 2-D floating-point tensor [V, h], got "
                f"{tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__}"
            )
        if weight.grad_fn is not None:
            raise ValueError("TiedEmbedding: weight must be a leaf tensor (a parameter), not the result of an op")
        self.weight = weight
        self.folds = 0
        self._reset()

    def _reset(self) -> None:
        self._kept: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (graph task, ids, dout rows)
        self._dense_task = -1  # the graph task whose output layer sent E a dense gradient
        self._dense_grad = None  # a weak reference to that gradient
        self._hooked = None  # a weak reference to the tensor carrying the hook

    def __getstate__(self):  # a deep copy or pickle of a model: the table and the count, not the backward's state
        return {"weight": self.weight, "folds": self.folds}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._reset()

    def _ready(self) -> bool:
        """Fold in this forward's backward; registers the hook on ``weight`` first (also on a copied table's)."""
        if _plain(self.weight):
            return False
        if self._hooked is None or self._hooked() is not self.weight:
            this = weakref.ref(self)
            self.weight.register_hook(lambda grad: _fold_hook(this, grad))
            self._hooked = weakref.ref(self.weight)
            for key in [k for k, (w, t) in _TABLES.items() if w() is None or t() is None]:  # dead entries
                del _TABLES[key]
            _TABLES[id(self.weight)] = (self._hooked, this)
        return True

    def lookup(self, ids: torch.Tensor, padding_idx: int | None = None) -> torch.Tensor:
        if not self._ready():
            return F.embedding(ids, self.weight, padding_idx)
        rows = self.weight.shape[0]
        return _Lookup.apply(ids, self.weight, self, None if padding_idx is None else padding_idx % rows)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if not self._ready():
            return gemm.linear(hidden, self.weight)
        return _Head.apply(hidden, self.weight, self)

    # ---- the backward's bookkeeping -----------------------------------------------------------------------------

    def _dense_sent(self, grad: torch.Tensor) -> None:
        if torch.is_grad_enabled():  # a create_graph backward: no fold (the lookup returns its own gradient)
            return
        task = torch._C._current_graph_task_id()
        if task != self._dense_task:  # rows kept in an earlier backward that never reached E: drop them
            self._kept = [k for k in self._kept if k[0] == task]
        self._dense_task, self._dense_grad = task, weakref.ref(grad)

    def _keep(self, ids: torch.Tensor, dout: torch.Tensor, padding_idx: int | None) -> bool:
        """Keep the lookup's rows for the hook when this backward sends E a dense gradient; else False."""
        task = torch._C._current_graph_task_id()
        if task < 0 or task != self._dense_task or torch.is_grad_enabled():
            return False
        if ids.numel() >= self.weight.shape[0]:  # as many rows as the table: the dense gradient costs no more
            return False
        ids, rows = ids.reshape(-1), dout.reshape(-1, dout.shape[-1])
        if padding_idx is not None:  # the padding row gets no gradient from the lookup
            keep = ids != padding_idx  # (made non-negative by ``lookup``)
            ids, rows = ids[keep], rows[keep]
        self._kept.append((task, ids, rows))
        return True

    def _fold(self, grad: torch.Tensor) -> torch.Tensor | None:
        task = torch._C._current_graph_task_id()
        kept = [k for k in self._kept if k[0] == task]
        self._kept = []
        if not kept:
            return None
        ids = torch.cat([k[1] for k in kept]) if len(kept) > 1 else kept[0][1]
        rows = torch.cat([k[2] for k in kept]) if len(kept) > 1 else kept[0][2]
        acc_dtype = torch.float64 if grad.dtype == torch.float64 else torch.float32
        unique, where = torch.unique(ids, return_inverse=True)
        sums = torch.zeros(unique.numel(), grad.shape[1], dtype=acc_dtype, device=grad.device)
        sums.index_add_(0, where, rows.to(acc_dtype))
        own = self._dense_grad() if self._dense_grad is not None else None
        out = grad if own is grad else grad.clone()
        out.index_add_(0, unique, sums.to(grad.dtype))
        self.folds += 1
        return out


def _fold_hook(table_ref, grad):
    table = table_ref()
    return None if table is None else table._fold(grad)


class _Lookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids, weight, table, padding_idx):
        ctx.save_for_backward(ids)
        ctx.table, ctx.padding_idx, ctx.rows = table, padding_idx, weight.shape[0]  # padding_idx >= 0 or None
        return F.embedding(ids, weight, padding_idx)

    @staticmethod
    def backward(ctx, dout):
        (ids,) = ctx.saved_tensors
        if ctx.table._keep(ids, dout, ctx.padding_idx):
            return None, None, None, None
        pad = -1 if ctx.padding_idx is None else ctx.padding_idx
        return None, torch.ops.aten.embedding_dense_backward(dout, ids, ctx.rows, pad, False), None, None


class _Head(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, table):
        ctx.save_for_backward(hidden, weight)
        ctx.table = table
        return gemm.linear_nograd(hidden, weight)

    @staticmethod
    def backward(ctx, dlogits):
        hidden, weight = ctx.saved_tensors
        g = dlogits.reshape(-1, dlogits.shape[-1])
        dhidden = dweight = None
        if ctx.needs_input_grad[0]:
            dhidden = gemm.mm(g, weight).view(hidden.shape)
        if ctx.needs_input_grad[1]:
            dweight = gemm.mm(g.t(), hidden.reshape(-1, hidden.shape[-1]))
            ctx.table._dense_sent(dweight)
        return dhidden, dweight, None
