"""The ops a row can name: how the peer's benchmark script calls each at the row's shape (``DRIVERS``), the
module each lives in, and the releases that first hold it."""

from __future__ import annotations

import importlib

from costmodel.peers.recorder import Ctx, call

# ---- the ops a row can name: how the peer's benchmark script calls it at the row's shape -----------------------


def _dtype(cfg: dict, default="torch.float32"):
    import torch

    return getattr(torch, str(cfg.get("dtype", default)).replace("torch.", ""))


def _fn(module: str, name: str):
    return getattr(importlib.import_module(module), name)


def _function_pass(rec, fn, mode, fwd_args: dict, grads, timed_grads: bool = False):
    """A Liger autograd function's forward and/or backward, recorded as ``mode`` asks; the backward's gradients
    (None in forward mode). ``grads(out)`` makes the output gradients: before the timed region (the benchmark's dy),
    or inside it with ``timed_grads`` (a loss's ``backward()`` filling its unit gradient)."""
    ctx = Ctx()
    with rec.recording(mode in ("forward", "full")):
        rec.call()
        out = call(fn.forward, ctx, **fwd_args)
        rec.ret()
    if mode == "forward":
        return
    with rec.recording(timed_grads):
        g = grads(out)
    with rec.recording(True):
        rec.call(backward=True)
        out = fn.backward(ctx, *g)
        rec.ret()
    return out


def _norm(kind):
    def drive(rec, mode, x, cfg):
        import torch

        m, n, dt = int(cfg["M"]), int(x), _dtype(cfg)
        X = torch.randn(m, n, device=rec.device, dtype=dt)
        W = torch.randn(n, device=rec.device, dtype=dt)
        eps = float(cfg.get("eps", 1e-6))
        if kind == "rms_norm":
            fn = _fn("liger_kernel.ops.rms_norm", "LigerRMSNormFunction")
            args = {"X": X, "W": W, "eps": eps}
        else:
            fn = _fn("liger_kernel.ops.layer_norm", "LigerLayerNormFunction")
            args = {"X": X, "W": W, "B": torch.randn(n, device=rec.device, dtype=dt), "eps": eps}
        _function_pass(rec, fn, mode, args, lambda y: (torch.randn_like(y),))

    return drive


def _cross_entropy(rec, mode, x, cfg):
    import torch

    rows, v = int(cfg["B"]) * int(cfg["T"]), int(x)
    X = torch.randn(rows, v, device=rec.device, dtype=_dtype(cfg))
    t = torch.randint(v, (rows,), device=rec.device)
    fn = _fn("liger_kernel.ops.cross_entropy", "LigerCrossEntropyFunction")
    args = {"_input": X, "target": t, "ignore_index": -100}

    def grads(out):
        loss = out[0] if isinstance(out, tuple) else out
        return (torch.ones_like(loss),) + ((None,) if isinstance(out, tuple) else ())

    _function_pass(rec, fn, mode, args, grads)
    if mode == "full":  # the benchmark's full pass sets no grad_to_none: the engine accumulates into X.grad
        with rec.recording(True):
            _ = X + X


def _rope(rec, mode, x, cfg):
    import torch

    hq, hk, dt = int(cfg["num_q_heads"]), int(cfg["num_kv_heads"]), _dtype(cfg)
    hidden = int(cfg.get("hidden_size", x))
    seq = int(cfg.get("seq_len", x))
    d = hidden // hq
    q = torch.randn(1, seq, hq, d, device=rec.device, dtype=dt).transpose(1, 2)
    k = torch.randn(1, seq, hk, d, device=rec.device, dtype=dt).transpose(1, 2)
    cos = torch.randn(1, seq, d, device=rec.device, dtype=dt)
    sin = torch.randn(1, seq, d, device=rec.device, dtype=dt)
    fn = _fn("liger_kernel.ops.rope", "LigerRopeFunction")
    args = {"q": q, "k": k, "cos": cos, "sin": sin, "position_ids": None, "unsqueeze_dim": 1}
    _function_pass(rec, fn, mode, args, lambda out: (torch.randn_like(out[0]), torch.randn_like(out[1])))


def _gated_mlp(function: str):
    """LLaMA's MLP with a peer's gated activation: gate and up projections, the activation, the down projection
    (the peer's benchmark times the whole module), and their backward as nn.Linear's autograd computes it."""

    def drive(rec, mode, x, cfg):
        import torch

        b = int(cfg.get("B", cfg.get("bsz", 1)))
        rows, h, f, dt = b * int(x), int(cfg["hidden_size"]), int(cfg["intermediate_size"]), _dtype(cfg)
        fn = _fn(f"liger_kernel.ops.{function[0]}", function[1])
        X = torch.randn(rows, h, device=rec.device, dtype=dt)
        Wg, Wu = torch.randn(f, h, device=rec.device, dtype=dt), torch.randn(f, h, device=rec.device, dtype=dt)
        Wd = torch.randn(h, f, device=rec.device, dtype=dt)
        ctx = Ctx()
        with rec.recording(mode in ("forward", "full")):
            g, u = X @ Wg.t(), X @ Wu.t()
            rec.call()
            a = call(fn.forward, ctx, a=g, b=u)
            rec.ret()
            y = a @ Wd.t()
        if mode == "forward":
            return
        with rec.recording(False):
            dy = torch.randn_like(y)
        with rec.recording(True):
            da = dy @ Wd
            _ = dy.t() @ a
            rec.call(backward=True)
            dg, du = fn.backward(ctx, da)[:2]
            rec.ret()
            dx = dg @ Wg
            dx = dx + du @ Wu
            _ = dg.t() @ X
            _ = du.t() @ X

    return drive


def _accumulate(rec, grad) -> None:
    """The autograd engine adding a fresh gradient into a leaf's ``.grad`` that a previous timed call left (the
    benchmarks that do not reset it): one elementwise pass of the gradient's size."""
    with rec.recording(True):
        _ = grad + grad


def _divergence(module: str, function: str, normalise: str, target: str):
    """A peer's loss between two distributions over the vocabulary (KL, JSD, TVD) as its benchmark times it:
    ``input = randn(B·T, V, requires_grad).<normalise>(-1)`` (fp32), ``target = randn(B·T, V).<target>(-1)``, the
    loss with its default reduction. Backward then runs through the normalisation's backward into the leaf, whose
    ``.grad`` accumulates over the timed calls (the benchmark's ``grad_to_none`` names the non-leaf input)."""

    def drive(rec, mode, x, cfg):
        import torch

        rows, v = int(cfg["B"]) * int(cfg["T"]), int(x)
        leaf = torch.randn(rows, v, device=rec.device)
        inp = getattr(torch, normalise)(leaf, -1)
        tgt = getattr(torch, target)(torch.randn(rows, v, device=rec.device), -1)
        fn = _fn(f"liger_kernel.ops.{module}", function)
        args = {  # the input and target names each version's forward uses; the benchmark's defaults
            "y_pred": inp,
            "_input": inp,
            "p": inp,
            "y_true": tgt,
            "target": tgt,
            "q": tgt,
            "shift_labels": None,
            "reduction": "batchmean",
            "log_target": False,
            "beta": 0.5,
            "ignore_index": -100,
        }
        grads = _function_pass(rec, fn, mode, args, lambda loss: (torch.ones_like(loss),), timed_grads=True)
        if grads is None:
            return
        aten = torch.ops.aten
        back = aten._log_softmax_backward_data if normalise == "log_softmax" else aten._softmax_backward_data
        with rec.recording(True):
            dleaf = back(grads[0], inp, -1, torch.float32)
        _accumulate(rec, dleaf)

    return drive


def _relu_squared(rec, mode, x, cfg):
    import torch

    X = torch.randn(int(cfg["M"]), int(x), device=rec.device, dtype=_dtype(cfg))
    fn = _fn("liger_kernel.ops.relu_squared", "LigerReLUSquaredFunction")
    _function_pass(rec, fn, mode, {"X": X, "x": X, "input": X}, lambda y: (torch.randn_like(y),))


def _llama4_rope(rec, mode, x, cfg):
    """Llama 4's complex-multiplication RoPE on ``q [1, s, hq, d]``, ``k [1, s, hk, d]`` with the complex
    ``freqs_cis [1, s, d/2]`` of transformers' Llama4TextRotaryEmbedding; backward as ``torch.autograd.grad`` of
    both outputs (nothing accumulates)."""
    import torch

    hq, hk, dt = int(cfg["num_q_heads"]), int(cfg["num_kv_heads"]), _dtype(cfg)
    hidden = int(cfg.get("hidden_size", x))
    seq = int(cfg.get("seq_len", x))
    d = hidden // hq
    q = torch.randn(1, seq, hq, d, device=rec.device, dtype=dt)
    k = torch.randn(1, seq, hk, d, device=rec.device, dtype=dt)
    freqs = torch.randn(1, seq, d // 2, device=rec.device, dtype=torch.complex64)
    fn = _fn("liger_kernel.ops.llama4_rope", "LigerLlama4RopeFunction")
    args = {"q": q, "k": k, "freqs_cis": freqs, "xq": q, "xk": k}
    _function_pass(rec, fn, mode, args, lambda out: (torch.randn_like(out[0]), torch.randn_like(out[1])))


def _megatron(kind: str):
    """Liger's Megatron-LM modules on Megatron's ``[S, B, ·]`` bf16 activations as their benchmarks time them:
    ``forward`` the module; ``backward`` forward + ``out.sum().backward()`` (the input's ``.grad`` reset each call,
    a weight's accumulating); ``full`` the same, RMSNorm's input ``.grad`` accumulating too."""

    def drive(rec, mode, x, cfg):
        import torch

        s, b, n = int(cfg["S"]), int(cfg["B"]), int(x)
        ctx = Ctx()
        if kind == "rms_norm":
            X = torch.randn(s, b, n, device=rec.device, dtype=torch.bfloat16)
            W = torch.randn(n, device=rec.device, dtype=torch.bfloat16)
            fn = _fn("liger_kernel.ops.rms_norm", "LigerRMSNormFunction")
            args = {"X": X, "W": W, "eps": 1e-6, "offset": 0.0, "casting_mode": "llama", "in_place": False}
            args["row_mode"] = None
        else:  # swiglu: fc1's output, gate and up concatenated on the last dimension
            X = torch.randn(s, b, 2 * n, device=rec.device, dtype=torch.bfloat16)
            fn = _fn("liger_kernel.ops.swiglu", "LigerFusedGateUpSiLUMulFunction")
            args = {"y": X, "in_place": False}
        with rec.recording(True):
            rec.call()
            out = call(fn.forward, ctx, **args)
            rec.ret()
            if mode == "forward":
                return
            _ = out.sum()
            # the sum's gradient, a stride-0 expansion of one scalar, made contiguous by the peer's backward: one
            # write pass of the output's size (recorded as the fill it amounts to)
            g = torch.ones_like(out)
            rec.call(backward=True)
            grads = fn.backward(ctx, g)
            rec.ret()
        if kind == "rms_norm":
            _accumulate(rec, grads[1])  # the weight's gradient, never reset by the benchmark
            if mode == "full":
                _accumulate(rec, grads[0])

    return drive


def _fused_add_rms_norm(rec, mode, x, cfg):
    """Residual add + RMSNorm (``LigerFusedAddRMSNorm``: an fp32 weight of ones, eps from the row) on ``x, r [M, N]``
    returning the normed rows and the new residual; backward with both gradients given; the inputs' ``.grad`` reset
    each call (``grad_to_none``), the weight's accumulating."""
    import torch

    m, n, dt = int(cfg["M"]), int(x), _dtype(cfg)
    X = torch.randn(m, n, device=rec.device, dtype=dt)
    R = torch.randn(m, n, device=rec.device, dtype=dt)
    W = torch.ones(n, device=rec.device)
    fn = _fn("liger_kernel.ops.fused_add_rms_norm", "LigerFusedAddRMSNormFunction")
    eps = float(cfg.get("eps", 1e-6))
    args = {"X": X, "R": R, "W": W, "eps": eps, "offset": 0.0, "casting_mode": "llama", "in_place": False}
    grads = _function_pass(rec, fn, mode, args, lambda out: (torch.randn_like(out[0]), torch.randn_like(out[1])))
    if grads is not None:
        _accumulate(rec, grads[2])


def _neighborhood_attention(rec, mode, x, cfg):
    """``LigerFusedNeighborhoodAttention`` as its benchmark times it: q/k/v projections (``nn.Linear``, biases per
    the row), the fused neighborhood attention over ``[batch, heads, seq, head_dim]``, the output projection; backward
    through all of it with the input's ``.grad`` reset each call and the projections' weight and bias gradients
    accumulating."""
    import torch
    import torch.nn.functional as F

    b, s, h, dt = int(cfg["batch_size"]), int(x), int(cfg["hidden_size"]), _dtype(cfg)
    heads = int(cfg["num_heads"])
    d = h // heads
    bias = bool(cfg.get("bias", True))
    X = torch.randn(b, s, h, device=rec.device, dtype=dt)
    W = [torch.randn(h, h, device=rec.device, dtype=dt) for _ in range(4)]
    B = [torch.randn(h, device=rec.device, dtype=dt) if bias else None for _ in range(4)]
    fn = _fn("liger_kernel.ops.fused_neighborhood_attention", "LigerFusedNeighborhoodAttentionFunction")
    args = {"kernel_size": int(cfg.get("kernel_size", 7)), "dilation": int(cfg.get("dilation", 1)), "scale": d**-0.5}
    ctx = Ctx()

    def heads_of(t):
        return t.view(b, s, heads, d).transpose(1, 2)

    with rec.recording(mode in ("forward", "full")):
        q, k, v = (heads_of(F.linear(X, W[i], B[i])) for i in range(3))
        rec.call()
        att = call(fn.forward, ctx, query=q, key=k, value=v, **args)
        rec.ret()
        a = att.transpose(1, 2).contiguous().view(b, s, h)
        y = F.linear(a, W[3], B[3])
    if mode == "forward":
        return
    with rec.recording(False):
        dy = torch.randn_like(y)
    with rec.recording(True):
        rows = dy.reshape(b * s, h)
        da = rows @ W[3]
        grads = [rows.t() @ a.reshape(b * s, h)]  # out_proj's weight gradient
        if bias:
            grads.append(rows.sum(0))
        datt = da.view(b, s, heads, d).transpose(1, 2)
        rec.call(backward=True)
        dq, dk, dv = fn.backward(ctx, datt)[:3]
        rec.ret()
        dx = None
        for i, g in enumerate((dq, dk, dv)):
            g = g.transpose(1, 2).reshape(b * s, h)
            part = g @ W[i]
            dx = part if dx is None else dx + part
            grads.append(g.t() @ X.reshape(b * s, h))
            if bias:
                grads.append(g.sum(0))
    for g in grads:  # the module's parameters are not in grad_to_none: their gradients accumulate
        _accumulate(rec, g)


def _loss_pass(rec, fn, mode, fwd_args: dict, leaves: list, reset: list):
    """A peer's fused linear + loss autograd function (the loss and its gradients made in the forward; the backward
    scales the saved gradients unless the loss gradient is 1, which the benchmark's ``y.backward()`` gives) as its
    benchmark times it: ``forward`` the call; ``backward`` ``y.backward(retain_graph=True)`` of a forward made
    before; ``full`` the two. ``leaves``: the positions among the backward's returned gradients of the leaves
    autograd accumulates into (``.grad`` of the inputs and parameters that require it), of which ``reset`` the
    benchmark's ``grad_to_none`` clears before each call (a fresh ``.grad`` then costs no add)."""
    import torch

    ctx = Ctx()
    with rec.recording(mode in ("forward", "full")), torch.no_grad():
        rec.call()
        out = call(fn.forward, ctx, **fwd_args)
        rec.ret()
    if mode == "forward":
        return
    loss = out[0] if isinstance(out, tuple) else out
    with rec.recording(True):
        g = torch.ones_like(loss)  # the engine's seed gradient of a scalar loss
        rec.answers.append(False)  # the backward's "grad_output != 1" test reads False
        rec.call(backward=True)
        grads = fn.backward(ctx, g, *([None] * (len(out) - 1) if isinstance(out, tuple) else []))
        rec.ret()
    for i in leaves:
        if grads[i] is not None and (mode == "full" or i not in reset):
            _accumulate(rec, grads[i])


def _fused_linear_jsd(rec, mode, x, cfg):
    """``LigerFusedLinearJSD`` as its benchmark times it: student and teacher LM heads ``[V, H]`` (no bias) on
    ``student_input, teacher_input [BT, H]`` (``torch.rand``, the student's requiring grad), no labels. The forward
    chunks BT by ``cdiv(V, H)`` (per chunk: both logit GEMMs, their log-softmax, the JSD kernel writing its
    gradient in place, the softmax backward, the student's input and weight gradient GEMMs); the backward skips its
    rescale at a unit loss gradient. ``full`` = forward + ``y.backward()``: the student input's and the student
    weight's ``.grad`` accumulate (nothing is reset)."""
    import torch

    bt, h, v, dt = int(x), int(cfg["H"]), int(cfg["V"]), _dtype(cfg)
    xs = torch.rand(bt, h, device=rec.device, dtype=dt)
    xt = torch.rand(bt, h, device=rec.device, dtype=dt)
    ws = torch.rand(v, h, device=rec.device, dtype=dt).requires_grad_(True)
    wt = torch.rand(v, h, device=rec.device, dtype=dt).requires_grad_(True)
    fn = _fn("liger_kernel.ops.fused_linear_jsd", "LigerFusedLinearJSDFunction")
    args = {
        "student_input": xs,
        "student_weight": ws,
        "teacher_input": xt,
        "teacher_weight": wt,
        "shift_labels": None,
        "jsd_beta": 0.5,
        "ignore_index": -100,
        "temperature": 1.0,
    }
    _loss_pass(rec, fn, mode, args, leaves=[0, 1], reset=[0, 1])


# Where the chunked losses make their tensors: their chunk function runs ``torch.func.grad_and_value``, whose autograd
# graph asks the device for a stream, which for a fake CUDA tensor reaches the CUDA runtime; they launch no Triton
# kernel, so their fake tensors are meta ones (the same ATen ops, recorded and priced alike)
_AUTOGRAD_DEVICE = "meta"


def _distill_jsd_loss(rec, mode, x, cfg):
    """The chunked distillation JSD loss (``chunked_loss.jsd_loss.LigerFusedLinearJSDFunction``) as its benchmark
    times it: student head ``[V, H/2]`` on ``[BT, H/2]`` (requiring grad), teacher head ``[V, H]`` on ``[BT, H]``,
    biases per the row, random labels; hard and soft loss weights from the row. The forward runs the release's
    chunk function per chunk of 1024 rows (both logit GEMMs, the losses and, through ``torch.func.grad_and_value``,
    the student's gradients, accumulated). The chunk function is ``torch.compile``d in the release: the recorder's
    ``torch.compile`` records each call as a compiled region (``Recorder.compiled``), priced as Inductor runs it
    (``price_compiled``). ``full`` = forward + ``y.backward()``: the student input's and weight's ``.grad``
    accumulate."""
    import torch

    dev = _AUTOGRAD_DEVICE
    bt, h, v, dt = int(x), int(cfg["H"]), int(cfg["V"]), _dtype(cfg)
    bias = bool(cfg.get("bias", False))
    xs = torch.rand(bt, h // 2, device=dev, dtype=dt)
    xt = torch.rand(bt, h, device=dev, dtype=dt)
    ws = torch.randn(v, h // 2, device=dev, dtype=dt).requires_grad_(True)
    wt = torch.randn(v, h, device=dev, dtype=dt).requires_grad_(True)
    bs = torch.randn(v, device=dev, dtype=dt).requires_grad_(True) if bias else None
    bt_ = torch.randn(v, device=dev, dtype=dt).requires_grad_(True) if bias else None
    target = torch.randint(0, v, (bt,), device=dev)
    fn = _fn("liger_kernel.chunked_loss.jsd_loss", "LigerFusedLinearJSDFunction")
    args = {
        "student_input": xs,
        "student_weight": ws,
        "teacher_input": xt,
        "teacher_weight": wt,
        "true_labels": target,
        "student_bias": bs,
        "teacher_bias": bt_,
        "weight_hard_loss": float(cfg.get("weight_hard_loss", 0.5)),
        "weight_soft_loss": float(cfg.get("weight_soft_loss", 0.5)),
        "beta": 0.5,
        "ignore_index": int(cfg.get("ignore_index", -100)),
        "temperature": 1.0,
        "compiled": True,
    }
    # the backward returns (input, weight, teacher input, teacher weight, labels, student bias, ...)
    _loss_pass(rec, fn, mode, args, leaves=[0, 1, 5], reset=[0])


def _kto_loss(rec, mode, x, cfg):
    """The chunked KTO loss (``LigerFusedLinearKTOFunction``) as its benchmark times it: policy head ``[V, H]``
    (bias per the row) and reference head (no bias) on ``[B, T, H]`` inputs that do not require grad, labels with
    ``ignore_index`` tokens, boolean preference labels, a precomputed KL; one chunk a sequence (the release's
    chunk size 1), each: the policy and reference logit GEMMs, the per-token log-probabilities and the loss, and
    through ``torch.func.grad_and_value`` the policy's gradients, accumulated. The chunk function is
    ``torch.compile``d in the release: each call is recorded as a compiled region and priced as Inductor runs it
    (``price_compiled``). ``full`` = forward + ``y.backward()``: the head's weight and bias ``.grad`` accumulate."""
    import torch

    dev = _AUTOGRAD_DEVICE
    b, t, h, v, dt = int(x), int(cfg["T"]), int(cfg["H"]), int(cfg["V"]), _dtype(cfg)
    bias = bool(cfg.get("bias", False))
    inp = torch.randn(b, t, h, device=dev, dtype=dt)
    ref = torch.randn(b, t, h, device=dev, dtype=dt)
    w = torch.randn(v, h, device=dev, dtype=dt).requires_grad_(True)
    wr = torch.randn(v, h, device=dev, dtype=dt).requires_grad_(True)
    bw = torch.randn(v, device=dev, dtype=dt).requires_grad_(True) if bias else None
    target = torch.randint(v, (b, t), device=dev)
    labels = torch.randint(2, (b,), device=dev).bool()
    kl = torch.randn(1, device=dev, dtype=dt)
    fn = _fn("liger_kernel.chunked_loss.kto_loss", "LigerFusedLinearKTOFunction")
    args = {
        "_input": inp,
        "weight": w,
        "target": target,
        "preference_labels": labels,
        "bias": bw,
        "ref_input": ref,
        "ref_weight": wr,
        "ref_bias": None,
        "kl": kl,
        "ignore_index": int(cfg.get("ignore_index", -100)),
        "beta": float(cfg.get("beta", 0.1)),
        "compiled": True,
        "use_ref_model": True,
    }
    # the backward returns (input, weight, target, preference labels, bias, ...)
    _loss_pass(rec, fn, mode, args, leaves=[1, 4], reset=[])


MOE_WARMUP_TOKENS = 8192  # the benchmark's autotune warm-up: its model profile's token count (Qwen3-MoE-30B)
MOE_WARMUP_EXPERTS = 8  # in the expert sweep, the first warm-up (fewest experts) is the one that tunes
MOE_WEIGHT_SCALE = 0.02  # the benchmark's weights: ``randn(..., requires_grad=True) * 0.02``


def _moe_routing(t: int, e: int, k: int, block_m: int) -> tuple[list[int], int]:
    """The routing the benchmark's random top-k makes, simulated on the host: ``topk(randn(t, e), k)`` (seed 42,
    the CPU generator; the distribution, not the benchmark's draws) -> (each expert's first row in the sorted
    token list, E + 1 entries; the M-tiles of ``block_m`` rows the experts' rows take)."""
    import torch
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        g = torch.Generator().manual_seed(42)
        idx = torch.topk(torch.randn(t, e, generator=g), k, dim=-1).indices
        counts = torch.bincount(idx.flatten(), minlength=e).tolist()
    starts = [0]
    for c in counts:
        starts.append(starts[-1] + c)
    return starts, sum(-(-c // block_m) for c in counts)


def _fused_moe(rec, mode, x, cfg):
    """``LigerFusedMoEFunction`` as its benchmark times it: bf16 ``x [T, H]`` (a leaf), gate-up ``[E, 2I, H]`` and
    down ``[E, H, I]`` weights, int32 top-k indices and their softmax weights (a leaf); T or E is the swept ``x``.
    Forward: the three routing kernels, one ``.item()`` (the M-tile count), the gate-up GEMM with SwiGLU, the down
    GEMM, the weighted token gather; backward (with a random ``dO``, drawn inside the timed call in ``full``): the
    down-projection backward, dW2, dX expanded, the gather-sum, dW1, and then the autograd engine's own work on the
    weights' gradients. The weights are made as ``randn(..., requires_grad=True) * MOE_WEIGHT_SCALE``: what the
    function receives is the product, whose ``MulBackward0`` scales each weight gradient (a pass reading it and
    writing a new one) into the ``randn`` leaf, whose ``.grad`` the benchmark never clears (its ``grad_to_none``
    names the products, which keep none), so ``AccumulateGrad`` adds it in place on every timed call (``+=``: two
    reads and a write). ``x.grad`` and the routing weights' ``.grad`` are cleared each call (the engine keeps the
    fresh gradient, no pass). The GEMM and gather kernels are autotuned (``autotune``) on the key (H, I): the benchmark
    tunes once, in a warm-up pass at ``MOE_WARMUP_TOKENS`` tokens (and ``MOE_WARMUP_EXPERTS`` experts in the
    expert sweep) before any timed call, so the driver runs that warm-up (unrecorded) first. The per-expert token
    counts that set the M-tile count and the dW kernels' loop trips come from ``_moe_routing``: each dW program's
    trips are those of its expert, so a dW launch is priced by the sum of its programs' work and no shorter than
    its busiest program (``analyse_triton``)."""
    import torch

    sweep = cfg.get("sweep_dim", "T")
    if sweep not in ("T", "E"):
        raise ValueError(f"fused_moe: sweep_dim {sweep!r} is neither 'T' nor 'E'")
    t = int(x) if sweep == "T" else int(cfg["T"])
    e = int(x) if sweep == "E" else int(cfg["E"])
    h, i, k, dt = int(cfg["H"]), int(cfg["intermediate_dim"]), int(cfg["K"]), _dtype(cfg)
    mod = importlib.import_module("liger_kernel.ops.fused_moe")
    fn, block_m = mod.LigerFusedMoEFunction, mod.BLOCK_M_TOKEN

    def inputs(t, e):
        xx = torch.randn(t, h, device=rec.device, dtype=dt)
        gup = torch.randn(e, 2 * i, h, device=rec.device, dtype=dt)
        dn = torch.randn(e, h, i, device=rec.device, dtype=dt)
        idx = torch.randint(e, (t, k), device=rec.device, dtype=torch.int32)
        wts = torch.randn(t, k, device=rec.device, dtype=dt)
        return xx, gup, dn, idx, wts

    def region(t, e, record_forward: bool, backward: bool, record_backward: bool):
        starts, tiles = _moe_routing(t, e, k, block_m)
        rec.contents = {"expert_start_ptr": starts}
        with rec.recording(False):
            xx, gup, dn, idx, wts = inputs(t, e)
        ctx = Ctx()
        rec.answers.append(tiles)  # the forward's one read-back: the M-tile count
        with rec.recording(record_forward):
            rec.call()
            out = call(fn.forward, ctx, x=xx, gate_up_proj=gup, down_proj=dn, top_k_index=idx, top_k_weights=wts)
            rec.ret()
        if not backward:
            return
        with rec.recording(record_backward and record_forward):  # full: ``y.backward(torch.randn_like(y))``
            do = torch.randn_like(out)
        with rec.recording(record_backward):
            rec.call(backward=True)
            grads = fn.backward(ctx, do)
            rec.ret()
            for g in (grads[2], grads[1]):  # the engine reaches the down weight's node first
                scaled = g * MOE_WEIGHT_SCALE  # MulBackward0
                _ = scaled + scaled  # AccumulateGrad: the leaf's ``.grad += scaled``

    region(MOE_WARMUP_TOKENS, MOE_WARMUP_EXPERTS if sweep == "E" else e, False, True, False)
    region(t, e, mode in ("forward", "full"), mode in ("backward", "full"), True)
    rec.contents = {}


DRIVERS = {
    "rms_norm": _norm("rms_norm"),
    "layer_norm": _norm("layer_norm"),
    "cross_entropy": _cross_entropy,
    "rope": _rope,
    "swiglu": _gated_mlp(("swiglu", "LigerSiLUMulFunction")),
    "geglu": _gated_mlp(("geglu", "LigerGELUMulFunction")),
    "kl_div": _divergence("kl_div", "LigerKLDivLossFunction", "log_softmax", "softmax"),
    "jsd": _divergence("jsd", "LigerJSDFunction", "log_softmax", "log_softmax"),
    "tvd": _divergence("tvd", "LigerTVDLossFunction", "softmax", "softmax"),
    "relu_squared": _relu_squared,
    "llama4_rope": _llama4_rope,
    "megatron_rms_norm": _megatron("rms_norm"),
    "megatron_swiglu": _megatron("swiglu"),
    "fused_add_rms_norm": _fused_add_rms_norm,
    "fused_neighborhood_attention": _neighborhood_attention,
    "fused_linear_jsd": _fused_linear_jsd,
    "distill_jsd_loss": _distill_jsd_loss,
    "kto_loss": _kto_loss,
    "fused_moe": _fused_moe,
}
# The provider name of the peer's kernels in a kernel's rows where it is not "liger" (other providers of those rows
# are its own variants or the eager reference)
PROVIDERS = {"fused_add_rms_norm": "liger_fused_add_rms_norm"}


def peer_provider(r: dict) -> str:
    return PROVIDERS.get(r["kernel_name"], "liger")


# The module each driver imports (under liger_kernel/), to find a release that has it: a row's liger_version is
# what the benchmark machine had installed, which lags the source the row was measured with when the kernel was
# newer than that release (``resolve_version``).
MODULES = {
    "rms_norm": "ops/rms_norm.py",
    "layer_norm": "ops/layer_norm.py",
    "cross_entropy": "ops/cross_entropy.py",
    "rope": "ops/rope.py",
    "swiglu": "ops/swiglu.py",
    "geglu": "ops/geglu.py",
    "kl_div": "ops/kl_div.py",
    "jsd": "ops/jsd.py",
    "tvd": "ops/tvd.py",
    "relu_squared": "ops/relu_squared.py",
    "llama4_rope": "ops/llama4_rope.py",
    "megatron_rms_norm": "megatron/rms_norm.py",
    "megatron_swiglu": "megatron/swiglu.py",
    "fused_add_rms_norm": "ops/fused_add_rms_norm.py",
    "fused_neighborhood_attention": "ops/fused_neighborhood_attention.py",
    "fused_linear_jsd": "ops/fused_linear_jsd.py",
    "distill_jsd_loss": "chunked_loss/jsd_loss.py",
    "kto_loss": "chunked_loss/kto_loss.py",
    "fused_moe": "ops/fused_moe.py",
}
# The first release of liger-kernel whose wheel holds each module a row may name before it existed (read from the
# registry's wheels): layer_norm and kl_div 0.3.0, jsd 0.4.0, fused_neighborhood_attention 0.6.0, llama4_rope 0.6.2,
# relu_squared 0.8.0, the Megatron RMSNorm 0.8.1 and SwiGLU (its fused gate-up kernel) 0.8.2, the fused linear JSD
# 0.4.0, the fused MoE 0.8.0.
FIRST_RELEASE = {
    "ops/fused_linear_jsd.py": "0.4.0",
    "ops/fused_moe.py": "0.8.0",
    "ops/layer_norm.py": "0.3.0",
    "ops/kl_div.py": "0.3.0",
    "ops/jsd.py": "0.4.0",
    "ops/llama4_rope.py": "0.6.2",
    "ops/relu_squared.py": "0.8.0",
    "megatron/rms_norm.py": "0.8.1",
    "megatron/swiglu.py": "0.8.2",
    "ops/fused_neighborhood_attention.py": "0.6.0",
}
# Kernels whose rows ran source that the first release holding the module does not match, with the first release
# that does (read from the repository's history): the distillation JSD rows ran the chunk function on chunks of 1024
# rows, which 0.5.3-0.5.4 changed to one row a chunk and 0.5.5 restored; the KTO rows ran the unpaired-preference
# base after its masked-sum rewrite, first released in 0.5.5. The TVD and fused add + RMSNorm rows name 0.7.0 but were
# committed together with a rewrite of their kernel (Liger-Kernel PR #1127: the gradient's scale inside the forward
# kernel; PR #1187: the backward's register pressure), which 0.8.0 first released: the commit that wrote a row ran
# the source of that commit (costmodel/peers/provenance.py compares the two for every row group).
SOURCE_RELEASE = {"distill_jsd_loss": "0.5.5", "kto_loss": "0.5.5", "tvd": "0.8.0", "fused_add_rms_norm": "0.8.0"}
# Drivers a row cannot have, with the reason: what the benchmark times is outside the model.
NOT_DRIVEN = {
    "megatron_cross_entropy": "its benchmark times a loop of calls through torch.distributed's vocabulary-parallel "
    "collectives without do_bench's L2 flush (a harness the model does not describe)",
}
