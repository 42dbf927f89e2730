"""Fused rotary position embedding (RoPE, Su et al. 2021) of q and k in one pass, forward and backward.

Each head vector of q and k is cut into d/2 pairs and pair i of a token at position ``pos`` is rotated by the angle
``pos * theta^(-2i/d)``::

    (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)

``interleaved=False`` pairs ``(x[i], x[i + d/2])``: the half-rotated layout of GPT-NeoX and Llama, exactly
HuggingFace's ``q * cos + rotate_half(q) * sin``. ``interleaved=True`` pairs ``(x[2i], x[2i + 1])`` (GPT-J).

Angles (the contract every backend and :func:`rope_reference` share): ``inv_freq[i] = theta^(-2i/d)`` computed in
fp64 and rounded once to fp32; the angle is the fp32 product ``float(pos) * inv_freq[i]`` (as HF Llama computes
it, so positions are exact up to 2^24); its cos and sin are evaluated to ~1 ulp of fp32 (fp64 for fp64 data)
inside the kernel — no table in memory. Or pass ``cos_sin``, a cached fp32 table ``[max_positions, d/2, 2]`` of
(cos, sin) indexed by position (:func:`rope_cos_sin_table` builds the contract's one; any other, e.g. one taken
from a HuggingFace model, works too).

Backward is the inverse rotation of the gradients (the rotation is orthogonal), computed by the same kernel with
``-sin``; nothing but the positions is saved. The kernel reads q and k through their strides (q and k sliced out of
a fused QKV projection need no copy; only a non-unit last-dim stride is copied) and writes new contiguous tensors.
Math in fp32 (fp64 for fp64 data), outputs in the input dtype.
"""

from __future__ import annotations

import dataclasses
import math

import torch

import megakernels._lib  # noqa: F401  (registers torch.ops.megakernels.*)
from megakernels._backend import emulate_for
from megakernels.ops import _checks
from megakernels.ops._autograd import eager_autograd

OP = "fused_rope"


@torch.library.register_fake("megakernels::rope")
def _rope_fake(q, k, positions, cos_sin, theta, position_offset, interleaved, seq_dim, inverse, emulate):
    _checks.same_device(OP, "q", q, ("k", k), ("positions", positions), ("cos_sin", cos_sin))
    # The shape rules the kernel checks too, here for the fake (meta) path.
    if (
        q.dim() != 4
        or k.dim() != 4
        or q.shape[:2] != k.shape[:2]
        or q.shape[3] != k.shape[3]
        or q.shape[3] % 2
        or q.shape[3] < 2
    ):
        raise ValueError(
            f"{OP}: q {tuple(q.shape)} and k {tuple(k.shape)} must be 4-D with equal first two dims "
            "and an equal, even head_dim"
        )
    return torch.empty(q.shape, dtype=q.dtype, device=q.device), torch.empty(k.shape, dtype=k.dtype, device=k.device)


def _setup_context(ctx, inputs, output):
    _q, _k, positions, cos_sin, *rest = inputs
    ctx.save_for_backward(positions, cos_sin)
    ctx.rest = rest  # theta, position_offset, interleaved, seq_dim, inverse, emulate


def _backward(ctx, dq, dk):
    positions, cos_sin = ctx.saved_tensors
    theta, offset, interleaved, seq_dim, inverse, emulate = ctx.rest
    gq, gk = torch.ops.megakernels.rope(
        dq, dk, positions, cos_sin, theta, offset, interleaved, seq_dim, not inverse, emulate
    )
    return gq, gk, None, None, None, None, None, None, None, None


torch.library.register_autograd("megakernels::rope", _backward, setup_context=_setup_context)
_rope = eager_autograd("rope_eager", torch.ops.megakernels.rope.default, _setup_context, _backward)


def _check_table_rows(positions, cos_sin: torch.Tensor, offset: int, seq: int) -> None:
    """Every position indexes a row of the table: exactly on the CPU; on a GPU or in a compiled graph as an
    asynchronous device assert (no host synchronisation). The kernels never read outside the table either way."""
    rows = cos_sin.shape[0]
    if positions is None:
        if seq and not (offset >= 0 and offset + seq <= rows):
            raise ValueError(
                f"{OP}: positions [{offset}, {offset + seq}) (position_offset + range(seq_len)) fall "
                f"outside the cos_sin table's {rows} rows"
            )
        return
    if positions.numel() == 0 or positions.device.type == "meta":
        return
    if positions.device.type != "cpu" or torch.compiler.is_compiling():
        inside = ((positions + offset >= 0) & (positions + offset < rows)).all()
        torch._assert_async(inside, f"{OP}: positions + position_offset outside the cos_sin table's {rows} rows")
        return
    lo, hi = int(positions.min()) + offset, int(positions.max()) + offset
    if lo < 0 or hi >= rows:
        bad = lo if lo < 0 else hi
        raise ValueError(f"{OP}: positions + position_offset reaches {bad}, outside the cos_sin table's {rows} rows")


def fused_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor | None = None,
    *,
    theta: float = 10000.0,
    interleaved: bool = False,
    position_offset: int = 0,
    cos_sin: torch.Tensor | None = None,
    seq_dim: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary position embedding of q and k in one fused pass.

    Args:
        q: ``[batch, seq, heads_q, d]`` (``seq_dim=1``) or ``[seq, batch, heads_q, d]`` (``seq_dim=0``), d even;
            fp32/bf16/fp16/fp64; any strides on the first three dims (a view into a packed QKV output is read in
            place), a non-unit last-dim stride costs one copy.
        k: the same layout, dtype and device, ``heads_k`` heads (GQA: may differ from q's).
        positions: int64/int32 ``[seq]`` (or ``[batch, seq]``) absolute position of each token along the sequence
            dim, e.g. the two non-adjacent chunks a context-parallel rank holds; default ``arange(seq)``.
            ``position_offset`` (an int) is added to every position (generation, chunked prefill).
        theta: the RoPE base, a finite number > 0 (10000 for Llama 2, 500000 for Llama 3).
        interleaved: False for the half-rotated NeoX/Llama layout, True for GPT-J's.
        cos_sin: optional cached fp32 table ``[max_positions, d/2, 2]`` of (cos, sin), indexed by position
            (replaces theta). Not differentiated: pass a tensor that does not require grad.
        seq_dim: 1 for ``[batch, seq, ...]``, 0 for Megatron's sequence-first ``[seq, batch, ...]``.

    Returns:
        ``(q_rot, k_rot)``: new contiguous tensors of q's and k's shapes and dtype; differentiable w.r.t. q and k.

    Raises:
        TypeError: a non-tensor, a non-floating q/k, integer options that are not ints, a non-bool interleaved,
        a non-integer positions, a non-fp32 table. ValueError: a sparse tensor, mismatched devices (meta
        included), shapes or head dims, an odd head dim, seq_dim not 0/1, theta not > 0, positions of the wrong
        shape, a table of the wrong shape, positions outside the table, a table that requires grad.
    """
    _checks.tensor(OP, "q", q)
    _checks.tensor(OP, "k", k)
    _checks.tensor(OP, "positions", positions, optional=True)
    _checks.tensor(OP, "cos_sin", cos_sin, optional=True)
    _checks.same_device(OP, "q", q, ("k", k), ("positions", positions), ("cos_sin", cos_sin))
    seq_dim = _checks.integer(OP, "seq_dim", seq_dim)
    if seq_dim not in (0, 1):
        raise ValueError(
            f"{OP}: seq_dim must be 0 ([seq, batch, heads, d]) or 1 ([batch, seq, heads, d]), got {seq_dim}"
        )
    offset = _checks.integer(OP, "position_offset", position_offset)
    if not isinstance(interleaved, bool):
        raise TypeError(f"{OP}: interleaved must be a bool, got {interleaved!r}")
    if q.dim() != 4:
        raise ValueError(
            f"{OP}: q has shape {tuple(q.shape)}; expected 4 dims [batch, seq, heads, head_dim] "
            "(or [seq, batch, heads, head_dim] with seq_dim=0)"
        )
    if cos_sin is None:
        theta = _checks.real(OP, "theta", theta)
        if not theta > 0:
            raise ValueError(f"{OP}: theta must be a finite number > 0, got {theta}")
    else:
        if cos_sin.requires_grad and torch.is_grad_enabled():
            raise ValueError(f"{OP}: cos_sin requires grad, but the table is not differentiated; pass cos_sin.detach()")
        if cos_sin.dim() == 3:  # a wrong shape is reported by the kernel's checks
            _check_table_rows(positions, cos_sin, offset, q.shape[seq_dim])
        theta = 1.0
    return _rope(q, k, positions, cos_sin, float(theta), offset, interleaved, seq_dim, False, emulate_for(OP, q, "q"))


def rope_cos_sin_table(
    max_positions: int, head_dim: int, theta: float = 10000.0, device=None, scaling: RopeScaling | None = None
) -> torch.Tensor:
    """The contract's ``cos_sin`` table: fp32 ``[max_positions, head_dim/2, 2]``, (cos, sin) of the fp32 angle
    ``float(pos) * inv_freq[i]`` (``rope_inv_freq``: ``theta^(-2i/d)``, scaled by ``scaling``), evaluated in fp64
    and rounded once; with YaRN scaling both multiplied by ``scaling.attention_factor`` (in fp64, before the
    rounding). A scaled model's rotary embedding reads its angles from this table: the scaled inverse frequencies
    and YaRN's factor are the kernel's input through it."""
    angle = _angles(torch.arange(max_positions, device=device), head_dim, theta, scaling).double()
    gain = 1.0 if scaling is None else scaling.attention_factor
    return (torch.stack([angle.cos(), angle.sin()], -1) * gain).float()


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Position scaling of the rotary frequencies (long-context models).

    Attributes:
        kind: ``"linear"`` (every frequency divided by ``factor``: position interpolation), ``"llama3"``
            (Llama 3.1's: wavelengths shorter than ``original_max_positions / high_freq_factor`` kept, longer than
            ``original_max_positions / low_freq_factor`` divided by ``factor``, a linear blend of the two between)
            or ``"yarn"`` (YaRN, Peng et al. 2023, as gpt-oss and DeepSeek-V3 use it: the pairs that turn more than
            ``beta_fast`` times over ``original_max_positions`` kept, fewer than ``beta_slow`` times divided by
            ``factor``, a ramp linear in the pair index between; cos and sin multiplied by ``attention_factor``).
        factor, low_freq_factor, high_freq_factor, original_max_positions: as above (Llama 3.1: 8, 1, 4, 8192).
        beta_fast, beta_slow: YaRN's rotation counts bounding the ramp (32 and 1; ``beta_fast > beta_slow > 0``).
        mscale, mscale_all_dim: DeepSeek's form of YaRN's attention factor: with both set, ``attention_factor`` is
            ``(0.1 mscale ln(factor) + 1) / (0.1 mscale_all_dim ln(factor) + 1)``; otherwise
            ``0.1 ln(factor) + 1``. None, or a finite number > 0.
        truncate: round YaRN's ramp bounds out to whole pair indices (the paper's; gpt-oss sets False).

    Raises:
        ValueError: an unknown kind, ``factor < 1``, or a kind's parameters outside the rules above, named.
        TypeError: a non-bool ``truncate``.
    """

    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_positions: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    KINDS = ("linear", "llama3", "yarn")

    def __post_init__(self):
        if self.kind not in self.KINDS:
            raise ValueError(f"RopeScaling: kind must be one of {self.KINDS}, got {self.kind!r}")
        if not self.factor >= 1.0:
            raise ValueError(f"RopeScaling: factor must be >= 1, got {self.factor}")
        if self.kind == "llama3" and not (
            0 < self.low_freq_factor < self.high_freq_factor and self.original_max_positions >= 1
        ):
            raise ValueError(
                "RopeScaling: llama3 needs 0 < low_freq_factor < high_freq_factor and original_max_positions >= 1, "
                f"got {self.low_freq_factor}, {self.high_freq_factor}, {self.original_max_positions}"
            )
        if self.kind == "yarn":
            self._check_yarn()

    def _check_yarn(self):
        if not math.isfinite(self.factor):
            raise ValueError(f"RopeScaling: yarn needs a finite factor, got {self.factor}")
        if isinstance(self.original_max_positions, bool) or not isinstance(self.original_max_positions, int):
            raise TypeError(f"RopeScaling: original_max_positions must be an int, got {self.original_max_positions!r}")
        if self.original_max_positions < 1:
            raise ValueError(f"RopeScaling: original_max_positions must be >= 1, got {self.original_max_positions}")
        if not (0 < self.beta_slow < self.beta_fast < math.inf):
            raise ValueError(
                f"RopeScaling: yarn needs 0 < beta_slow < beta_fast (finite), got beta_fast={self.beta_fast}, "
                f"beta_slow={self.beta_slow}"
            )
        for name in ("mscale", "mscale_all_dim"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and 0 < value < math.inf):
                raise ValueError(f"RopeScaling: {name} must be None or a finite number > 0, got {value!r}")
        if not isinstance(self.truncate, bool):
            raise TypeError(f"RopeScaling: truncate must be a bool, got {self.truncate!r}")

    @property
    def attention_factor(self) -> float:
        """The factor multiplying the rotary cos and sin: YaRN's (see the class); 1.0 for the other kinds."""
        if self.kind != "yarn":
            return 1.0

        def mscale(m: float) -> float:
            return 0.1 * m * math.log(self.factor) + 1.0 if self.factor > 1 else 1.0

        if self.mscale is not None and self.mscale_all_dim is not None:
            return mscale(self.mscale) / mscale(self.mscale_all_dim)
        return mscale(1.0)

    def apply(self, inv_freq: torch.Tensor, theta: float | None = None) -> torch.Tensor:
        """The scaled inverse frequencies (fp64 ``[d/2]`` in, fp64 out); ``theta``, the rotary base, is needed by
        ``yarn`` (its ramp is placed by pair index). Raises ValueError for ``yarn`` without ``theta``."""
        if self.kind == "linear":
            return inv_freq / self.factor
        if self.kind == "yarn":
            if theta is None:
                raise ValueError("RopeScaling.apply: yarn needs theta, the rotary base")
            return self._yarn(inv_freq, float(theta))
        wavelength = 2.0 * math.pi / inv_freq
        short = self.original_max_positions / self.high_freq_factor  # shorter wavelengths are kept
        long = self.original_max_positions / self.low_freq_factor  # longer ones are divided by the factor
        blend = (self.original_max_positions / wavelength - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor
        )
        mixed = (1.0 - blend) * inv_freq / self.factor + blend * inv_freq
        return torch.where(wavelength < short, inv_freq, torch.where(wavelength > long, inv_freq / self.factor, mixed))

    def _yarn(self, inv_freq: torch.Tensor, theta: float) -> torch.Tensor:
        d = 2 * inv_freq.shape[-1]

        def pair_index(rotations: float) -> float:
            # The (fractional) pair index whose frequency turns `rotations` times over the original context.
            return d * math.log(self.original_max_positions / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low, high = pair_index(self.beta_fast), pair_index(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        # The bounds are clamped to [0, d - 1] (not d/2 - 1), and a zero-width ramp widened, as the YaRN reference
        # code does: the ramp then matches checkpoints' published frequencies exactly.
        low, high = max(low, 0), min(high, d - 1)
        if low == high:
            high += 0.001
        i = torch.arange(d // 2, dtype=inv_freq.dtype, device=inv_freq.device)
        keep = 1.0 - ((i - low) / (high - low)).clamp(0.0, 1.0)  # 1: pair kept, 0: divided by the factor
        return inv_freq / self.factor * (1.0 - keep) + inv_freq * keep


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None = None, device=None) -> torch.Tensor:
    """fp32 ``[head_dim/2]``: ``theta^(-2i/d)`` computed in fp64, scaled by ``scaling`` (fp64), rounded once.
    YaRN's ``scaling.attention_factor`` is not part of the frequencies: :func:`rope_cos_sin_table` applies it."""
    i = torch.arange(head_dim // 2, dtype=torch.float64, device=device)
    inv_freq = torch.exp2(-(2.0 * i / head_dim) * math.log2(theta))
    return (inv_freq if scaling is None else scaling.apply(inv_freq, theta)).float()


# ----------------------------------------------------------------------------------------------------------------
# Reference semantics in plain PyTorch (tests; documentation).


def _angles(pos: torch.Tensor, d: int, theta: float, scaling: RopeScaling | None = None) -> torch.Tensor:
    """fp32 angles ``[..., d/2]`` for integer positions ``[...]``: the kernels' exact arithmetic."""
    return pos.float()[..., None] * rope_inv_freq(d, theta, scaling, pos.device)


def rope_reference(
    q,
    k,
    positions=None,
    *,
    theta=10000.0,
    interleaved=False,
    position_offset=0,
    cos_sin=None,
    seq_dim=1,
    compute_dtype=torch.float64,
):
    """:func:`fused_rope` with plain PyTorch ops; returns ``(q_rot, k_rot)`` in ``compute_dtype`` (differentiable).

    The angles are computed as the contract says (fp32), their cos and sin and the rotation in ``compute_dtype``.
    """
    seq, d = q.shape[seq_dim], q.shape[-1]
    pos = torch.arange(seq, device=q.device) if positions is None else positions.to(torch.int64)
    pos = pos + position_offset
    if cos_sin is None:
        angle = _angles(pos, d, theta).to(compute_dtype)
        cos, sin = angle.cos(), angle.sin()
    else:
        table = cos_sin[pos].to(compute_dtype)  # [..., d/2, 2]
        cos, sin = table[..., 0], table[..., 1]
    # [seq, d/2] or [batch, seq, d/2] -> broadcastable against the [.., .., heads, d/2] halves.
    if cos.dim() == 2:
        shape = (1, seq, 1, d // 2) if seq_dim == 1 else (seq, 1, 1, d // 2)
        cos, sin = cos.reshape(shape), sin.reshape(shape)
    else:
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
        if seq_dim == 0:
            cos, sin = cos.transpose(0, 1), sin.transpose(0, 1)

    def rotate(x):
        x = x.to(compute_dtype)
        if interleaved:
            x1, x2 = x[..., 0::2], x[..., 1::2]
            return torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).flatten(-2)
        x1, x2 = x[..., : d // 2], x[..., d // 2 :]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)

    return rotate(q), rotate(k)
