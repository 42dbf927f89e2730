"""The post-training losses' gradient taken in the forward pass, chunk by chunk of whole sequences.

A loss of ``ops.post_training`` is a function of the labelled tokens' log-probabilities (and entropies) that adds up
over *units* — a preference pair, a sequence — once the batch-wide normalisers (token counts, the number of pairs)
are known from the mask. So a chunk made of whole units holds everything its share of the loss depends on: its
logits are computed once, the share and its derivative in each token's log-probability and entropy follow from
``[tokens]``-sized arithmetic (autograd on the small tensors: any formula), and the gradient in the chunk's logits is
written in closed form and sent through the two GEMMs of the backward at once — three GEMMs over the vocabulary a
token, as many as the full-logits loss takes, where a separate backward would compute the logits a second time.
The autograd backward then only scales the stored gradients by the loss's upstream gradient.

A *tail* is the loss's formula on a chunk: ``tail(logp, ent, idx, lseq, sel) -> (share, aux)`` with ``logp``/``ent``
the chunk's labelled tokens' ``[c]`` log-probabilities and entropies, ``idx`` their flat positions, ``lseq`` each
one's index into ``sel``, the chunk's sequences (global ids); ``share`` the chunk's scalar part of the loss (the parts
add up to the loss), ``aux`` detached figures: ``[k]`` tensors (concatenated over chunks, in unit order) or 0-d
tensors (summed). The same tail on all tokens at once (``sel`` every sequence) is the path that differentiates
through ``linear_logprobs`` instead: used under ``torch.compile``, on meta tensors, and where one unit's tokens are
more than ``MAX_UNIT_CHUNKS`` chunks (its logits would not fit a chunk's memory).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megakernels._backend import emulate_for
from megakernels.ops import gemm
from megakernels.ops.cross_entropy import combine_stats, grad_rows_into, stats_rows
from megakernels.ops.linear_cross_entropy import gather_rows, reduce_scatter_rows
from megakernels.ops.logprobs import linear_logprobs

MAX_UNIT_CHUNKS = 4
_PAD = -1e30  # logits of the padded vocabulary columns: no probability, finite products


def _merge(parts: list[dict]) -> dict:
    out = {}
    for key in parts[0]:
        vals = [p[key] for p in parts]
        out[key] = (torch.stack(vals).sum(0) if vals[0].dim() == 0 else torch.cat(vals)).detach()
    return out


def _layout(seq: torch.Tensor, mask: torch.Tensor, n: int):
    """The labelled tokens' flat positions grouped by sequence, and each sequence's token count (host ints)."""
    keep = mask & (seq >= 0)
    pos = keep.nonzero().view(-1)
    order = torch.sort(seq[pos], stable=True).indices
    pos = pos[order]
    counts = torch.bincount(seq[pos], minlength=n)[:n]
    return pos, counts.tolist()


def _chunks(units: list[list[int]], counts: list[int], chunk: int):
    """Whole units packed greedily in order into chunks of at most ``chunk`` tokens (a unit alone when larger)."""
    out, cur, size = [], [], 0
    for unit in units:
        u = sum(counts[s] for s in unit)
        if cur and size + u > chunk:
            out.append(cur)
            cur, size = [], 0
        cur.append(unit)
        size += u
    if cur:
        out.append(cur)
    return out


class _CrossEntropyChunk:
    """A chunk's logits through the cross-entropy kernels (``ops.cross_entropy``'s statistics and gradient, written
    over the logits): the targets' log-probabilities without entropies, in two passes over the vocabulary."""

    def __init__(self, logits, tgt, head, group, emulate):
        self.logits, self.tgt, self.head, self.emulate = logits, tgt, head, emulate
        if head["inv_temp"] != 1.0:
            logits.mul_(head["inv_temp"])
        self.n_valid = max(0, min(logits.shape[1], head["vocab"] - head["vocab_start"]))
        stats = stats_rows(logits, tgt, head["vocab_start"], self.n_valid, emulate, 0.0)
        nll, self.lse = combine_stats(stats, tgt, group, head["ignore_index"], 0.0, head["vocab"])
        self.logp, self.ent = -nll, torch.zeros_like(nll)

    def grad(self, dlp, den):
        """The gradient in the raw logits, over them."""
        head = self.head
        dloss = (-dlp * head["inv_temp"]).contiguous()
        grad_rows_into(
            self.logits, self.tgt, self.lse, dloss, head["vocab_start"], self.n_valid, head["ignore_index"], 1.0, 0.0,
            self.emulate, self.logits, 0.0,
        )  # fmt: skip
        return self.logits


class _SoftmaxChunk:
    """A chunk's log-distribution and probabilities in fp32 (two ``[c, V_local]`` buffers), for the losses that read
    the entropies: ``d/d logits = dlp (onehot − p) − den p (log q + H)``, over the temperature."""

    def __init__(self, logits, tgt, head, group, comm):
        self.head = head
        x = logits.float()
        if head["inv_temp"] != 1.0:
            x.mul_(head["inv_temp"])
        v_local = x.shape[1]
        self.width = width = max(0, min(v_local, head["vocab"] - head["vocab_start"]))
        if width < v_local:
            x[:, width:] = _PAD
        m = x.max(-1).values
        if comm:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        x.sub_(m[:, None])
        p = x.exp()
        total = p.sum(-1)
        if comm:
            dist.all_reduce(total, group=group)
        x.sub_(total.log()[:, None])
        p.div_(total[:, None])
        local = tgt - head["vocab_start"]
        self.inside = (local >= 0) & (local < width)
        self.col = local.clamp(0, max(width - 1, 0))
        logp = torch.where(self.inside, x.gather(1, self.col[:, None])[:, 0], torch.zeros((), device=x.device))
        both = torch.stack([logp, -(p * x).sum(-1)])
        if comm:
            dist.all_reduce(both, group=group)
        self.logp, self.ent = both[0], both[1]
        self.logq, self.p, self.dtype = x, p, logits.dtype

    def grad(self, dlp, den):
        g, p = self.logq, self.p
        g.add_(self.ent[:, None]).mul_(-den[:, None]).sub_(dlp[:, None]).mul_(p)
        self.p = None
        if self.width < g.shape[1]:
            g[:, self.width :] = 0.0
        rows = torch.arange(g.shape[0], device=g.device)
        g.index_put_((rows, self.col), torch.where(self.inside, dlp, torch.zeros((), device=g.device)), accumulate=True)
        if self.head["inv_temp"] != 1.0:
            g.mul_(self.head["inv_temp"])
        return g.to(self.dtype)


class _GradInForward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, plan):
        loss, grads = plan.run(hidden, weight, bias)
        ctx.grads = grads
        return loss

    @staticmethod
    def backward(ctx, g):
        dx, dw, db = ctx.grads
        ctx.grads = None
        return (None if dx is None else dx * g, None if dw is None else dw * g, None if db is None else db * g, None)


class _Plan:
    def __init__(self, target, pos, counts, groups, tail, head, need, entropy, emulate):
        self.target, self.pos, self.counts, self.groups, self.tail, self.head = target, pos, counts, groups, tail, head
        self.entropy, self.emulate = entropy, emulate
        self.need_h, self.need_w, self.need_b = need
        self.aux: dict = {}

    def run(self, hidden, weight, bias):
        head, group = self.head, self.head["group"]
        comm = group is not None and dist.get_world_size(group) > 1
        sp = head["sequence_parallel"] and comm
        full = gather_rows(hidden, group) if sp else hidden
        x = full.reshape(-1, full.shape[-1])
        tflat = self.target.reshape(-1)
        want = self.need_h or self.need_w or self.need_b
        dx = torch.zeros_like(x) if self.need_h else None
        # dW: fp32 weights accumulate in place (addmm); 16-bit ones in an fp32 sum of the chunks' 16-bit products
        direct = weight.dtype == torch.float32
        dw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if self.need_w else None
        part = None
        db = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if self.need_b else None
        starts = [0]
        for c in self.counts:
            starts.append(starts[-1] + c)
        loss = torch.zeros((), dtype=torch.float32, device=x.device)
        parts = []
        for units in self.groups:
            sel = [s for unit in units for s in unit]
            idx = torch.cat([self.pos[starts[s] : starts[s + 1]] for s in sel])
            k = torch.tensor([self.counts[s] for s in sel], device=x.device)
            lseq = torch.repeat_interleave(torch.arange(len(sel), device=x.device), k)
            h = x[idx]
            logits = gemm.linear_nograd(h, weight, bias)
            tgt = tflat[idx].long()
            if self.entropy:
                chunk = _SoftmaxChunk(logits, tgt, head, group, comm)
            else:
                chunk = _CrossEntropyChunk(logits, tgt, head, group, self.emulate)
            del logits
            with torch.enable_grad():
                lp, en = chunk.logp.detach().requires_grad_(want), chunk.ent.detach().requires_grad_(want)
                share, aux = self.tail(lp, en, idx, lseq, torch.tensor(sel, device=x.device, dtype=torch.long))
                if want:
                    dlp, den = torch.autograd.grad(share, [lp, en], allow_unused=True)
            loss = loss + share.detach().float()
            parts.append(aux)
            if not want:
                continue
            dlp = torch.zeros_like(lp) if dlp is None else dlp.float()
            den = torch.zeros_like(en) if den is None else den.float()
            g = chunk.grad(dlp, den)
            del chunk
            if self.need_h:
                dx[idx] = gemm.mm(g, weight)
            if self.need_w:
                if direct:
                    dw.addmm_(g.t(), h)
                else:
                    part = torch.mm(g.t(), h, out=part)
                    dw.add_(part)
            if self.need_b:
                db.add_(g.sum(0, dtype=torch.float32))
            del g
        self.aux = _merge(parts) if parts else {}
        if dx is not None:
            if sp:
                dx = reduce_scatter_rows(dx.view(full.shape), group)
            elif comm:
                dist.all_reduce(dx, group=group)
            dx = dx.view(hidden.shape)
        grads = (dx, None if dw is None else dw.to(weight.dtype), None if db is None else db.to(weight.dtype))
        return loss, grads


def run_loss(op: str, hidden, weight, target, seq, n, mask, units, tail, head: dict, *, entropy: bool):
    """The loss ``Σ tail(chunk)`` over chunks of whole ``units`` (lists of sequence ids; every sequence with labelled
    tokens in exactly one), and its ``aux`` merged; differentiable w.r.t. ``hidden``, ``weight`` and ``head["bias"]``.

    ``head``: ``ignore_index, group, sequence_parallel, vocab, vocab_start, chunk, inv_temp, bias`` (checked by the
    caller). ``entropy``: the tail reads the entropies (the fallback path computes them only then)."""
    bias = head["bias"]
    pos, counts = (None, None)
    fallback = torch.compiler.is_compiling() or hidden.device.type == "meta"
    if not fallback:
        pos, counts = _layout(seq, mask, n)
        largest = max((sum(counts[s] for s in u) for u in units), default=0)
        fallback = largest > MAX_UNIT_CHUNKS * head["chunk"]
    if fallback:
        out = linear_logprobs(
            hidden, weight, target, ignore_index=head["ignore_index"], group=head["group"], vocab_size=head["vocab"],
            chunk_tokens=head["chunk"], bias=bias, sequence_parallel=head["sequence_parallel"],
            temperature=1.0 / head["inv_temp"], entropy=entropy,
        )  # fmt: skip
        logp, ent = out if entropy else (out, torch.zeros_like(out))
        keep = (mask & (seq >= 0)).nonzero().view(-1)
        lseq = seq[keep]
        share, aux = tail(logp.reshape(-1)[keep], ent.reshape(-1)[keep], keep, lseq, torch.arange(n, device=seq.device))
        return share, {k: v.detach() for k, v in aux.items()}
    grad = torch.is_grad_enabled()
    need = (
        grad and hidden.requires_grad,
        grad and weight.requires_grad,
        grad and bias is not None and bias.requires_grad,
    )
    emulate = emulate_for(op, hidden, "hidden")
    plan = _Plan(target, pos, counts, _chunks(units, counts, head["chunk"]), tail, head, need, entropy, emulate)
    loss = _GradInForward.apply(hidden, weight.contiguous(), None if bias is None else bias.contiguous(), plan)
    return loss, plan.aux
