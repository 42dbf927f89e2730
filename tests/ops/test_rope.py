"""Specification of fused_rope on every backend: forward and backward against the fp64 plain-PyTorch reference,
both pair layouts, GQA, sequence-first and batch-first, explicit and offset positions (context-parallel chunks),
strided views of a packed QKV output, the cached table, HuggingFace Llama's and GPT-J's conventions written out
by hand, fp64 gradcheck and torch.library.opcheck."""

from __future__ import annotations

import math

import pytest
import torch

from megakernels.ops import fused_rope, rope_cos_sin_table, rope_reference
from tests.helpers import assert_close_to_reference, make

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def qk(shape_q, hk, dtype, device, seed=0):
    b, s, _, d = shape_q
    return make(shape_q, dtype, device, seed=seed), make((b, s, hk, d), dtype, device, seed=seed + 1)


def check(backend, q, k, dtype, **kw):
    """Outputs and gradients (w.r.t. q and k) against the fp64 reference."""
    dq, dk = make(q.shape, dtype, backend.device, seed=7), make(k.shape, dtype, backend.device, seed=8)

    def loss_of(fn):
        return lambda q, k: sum((o * g.to(o.dtype)).sum() for o, g in zip(fn(q, k, **kw), (dq, dk)))

    q1, k1 = q.detach().clone().requires_grad_(True), k.detach().clone().requires_grad_(True)
    out = fused_rope(q1, k1, **kw)
    torch.autograd.backward(out, (dq, dk))
    q2, k2 = q.detach().double().requires_grad_(True), k.detach().double().requires_grad_(True)
    ref = rope_reference(q2, k2, **kw)
    torch.autograd.backward(ref, (dq.double(), dk.double()))
    for name, a, e in (
        ("q_rot", out[0], ref[0]),
        ("k_rot", out[1], ref[1]),
        ("dq", q1.grad, q2.grad),
        ("dk", k1.grad, k2.grad),
    ):
        assert a.dtype == dtype and a.shape == e.shape, f"{name}: {a.dtype} {tuple(a.shape)}"
        assert_close_to_reference(a, e, dtype, name)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("d", [2, 6, 64, 128])
def test_forward_and_backward_match_fp64_reference(backend, dtype, interleaved, d):
    q, k = qk((2, 5, 4, d), 2, dtype, backend.device)
    check(backend, q, k, dtype, interleaved=interleaved, theta=10000.0)


@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
def test_sequence_first_layout_equals_batch_first(backend, interleaved):
    q, k = qk((3, 7, 4, 32), 1, torch.float32, backend.device)
    bsd = fused_rope(q, k, interleaved=interleaved)
    sbd = fused_rope(q.transpose(0, 1), k.transpose(0, 1), interleaved=interleaved, seq_dim=0)
    assert torch.equal(sbd[0].transpose(0, 1), bsd[0]) and torch.equal(sbd[1].transpose(0, 1), bsd[1])
    check(
        backend,
        q.transpose(0, 1).contiguous(),
        k.transpose(0, 1).contiguous(),
        torch.float32,
        interleaved=interleaved,
        seq_dim=0,
    )


def test_context_parallel_chunks_rotate_as_their_place_in_the_full_sequence(backend):
    # cp = 2, seq 16 in 4 chunks of 4: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2.
    q, k = qk((2, 16, 4, 16), 2, torch.float32, backend.device)
    full = fused_rope(q, k, theta=500000.0)
    for chunks in ([0, 3], [1, 2]):
        idx = torch.cat([torch.arange(c * 4, c * 4 + 4) for c in chunks])
        local = fused_rope(q[:, idx], k[:, idx], idx.to(backend.device), theta=500000.0)
        assert torch.equal(local[0], full[0][:, idx]) and torch.equal(local[1], full[1][:, idx])


def test_position_offset_shifts_every_position(backend):
    q, k = qk((1, 6, 2, 8), 2, torch.float32, backend.device)
    offset = fused_rope(q, k, position_offset=1000)
    explicit = fused_rope(q, k, torch.arange(1000, 1006, device=backend.device))
    assert torch.equal(offset[0], explicit[0]) and torch.equal(offset[1], explicit[1])
    both = fused_rope(q, k, torch.arange(6, device=backend.device).flip(0).to(torch.int32), position_offset=10)
    check(backend, q, k, torch.float32, positions=torch.arange(6).flip(0).to(backend.device), position_offset=10)
    assert torch.equal(both[0][:, 0], fused_rope(q, k, position_offset=15)[0][:, 0])


def test_per_batch_positions(backend):
    q, k = qk((3, 5, 2, 16), 1, torch.float32, backend.device)
    pos = torch.tensor([[0, 1, 2, 3, 4], [7, 8, 9, 10, 11], [4, 3, 2, 1, 0]], device=backend.device)
    check(backend, q, k, torch.float32, positions=pos)
    out = fused_rope(q, k, pos)
    assert torch.equal(out[0][1:2], fused_rope(q[1:2], k[1:2], pos[1])[0])


@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
def test_views_of_a_packed_qkv_projection_are_read_in_place(backend, interleaved):
    b, s, hq, hk, d = 2, 5, 4, 2, 32
    qkv = make((b, s, (hq + 2 * hk) * d), torch.bfloat16, backend.device).view(b, s, hq + 2 * hk, d)
    q, k = qkv[:, :, :hq], qkv[:, :, hq : hq + hk]
    assert not q.is_contiguous() and not k.is_contiguous()
    out = fused_rope(q, k, interleaved=interleaved)
    ref = fused_rope(q.contiguous(), k.contiguous(), interleaved=interleaved)
    assert out[0].is_contiguous() and torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])
    check(backend, q, k, torch.bfloat16, interleaved=interleaved)


def test_a_non_unit_last_stride_is_copied_and_correct(backend):
    q = make((1, 4, 2, 32), torch.float32, backend.device)[..., ::2]  # head_dim 16, stride 2
    k = make((1, 4, 1, 16), torch.float32, backend.device)
    check(backend, q, k, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cached_table_matches_angles_computed_in_kernel(backend, dtype):
    q, k = qk((2, 9, 4, 64), 2, dtype, backend.device)
    table = rope_cos_sin_table(64, 64, theta=500000.0, device=backend.device)
    pos = torch.tensor([3, 60, 1, 0, 63, 17, 18, 40, 5], device=backend.device)
    with_table = fused_rope(q, k, pos, cos_sin=table)
    computed = fused_rope(q, k, pos, theta=500000.0)
    for a, c in zip(with_table, computed):
        assert_close_to_reference(a, c.double(), dtype, "table vs in-kernel angles")
    check(backend, q, k, dtype, positions=pos, cos_sin=table)


def test_long_context_positions_keep_fp32_accuracy(backend):
    # Angles up to ~1.3e5 rad: the range reduction must not lose digits (fp32 Cody-Waite would).
    q, k = qk((1, 4, 2, 128), 1, torch.float32, backend.device)
    pos = torch.tensor([0, 32767, 65536, 131071], device=backend.device)
    check(backend, q, k, torch.float32, positions=pos, theta=500000.0)


def _hf_rotate_half_fp64(x, pos, theta):
    """HuggingFace Llama written out: fp32 inv_freq and angles, ``x * cos + rotate_half(x) * sin`` in fp64."""
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    freqs = pos.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], -1).double()
    cos, sin = emb.cos()[None, :, None, :], emb.sin()[None, :, None, :]
    x = x.double()
    rotated = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1)
    return x * cos + rotated * sin


def test_half_layout_is_huggingface_llama_rotate_half(backend):
    q, k = qk((2, 12, 4, 64), 2, torch.float32, backend.device)
    pos = torch.arange(12) * 37
    out = fused_rope(q, k, pos.to(backend.device), theta=10000.0)
    # HF's inv_freq is fp32 pow, ours fp64 rounded once: they may differ by an ulp, i.e. pos * 1e-7 rad here.
    assert_close_to_reference(out[0], _hf_rotate_half_fp64(q.cpu(), pos, 10000.0), torch.float32, "q", factor=5)
    assert_close_to_reference(out[1], _hf_rotate_half_fp64(k.cpu(), pos, 10000.0), torch.float32, "k", factor=5)


def test_half_layout_with_transformers_own_cos_sin_is_exact_to_fp32(backend):
    from transformers.models.llama import modeling_llama as modeling

    q, k = qk((1, 10, 4, 32), 2, torch.float32, backend.device)
    pos = torch.arange(10)
    d = 32
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    freqs = pos.float()[:, None] * inv_freq
    table = torch.stack([freqs.cos(), freqs.sin()], -1)  # HF's own fp32 cos/sin as our table
    emb = torch.cat([freqs, freqs], -1)
    hq, hk = modeling.apply_rotary_pos_emb(
        q.cpu().transpose(1, 2), k.cpu().transpose(1, 2), emb.cos()[None], emb.sin()[None]
    )
    out = fused_rope(q, k, cos_sin=table.to(backend.device))
    assert_close_to_reference(out[0], hq.transpose(1, 2).double(), torch.float32, "q vs transformers")
    assert_close_to_reference(out[1], hk.transpose(1, 2).double(), torch.float32, "k vs transformers")


def test_interleaved_layout_is_gpt_j_rotate_every_two(backend):
    q, k = qk((1, 6, 2, 16), 1, torch.float32, backend.device)
    out = fused_rope(q, k, interleaved=True)
    x = q.cpu().double()
    ang = (torch.arange(6).float()[:, None] * (10000.0 ** (-torch.arange(0, 16, 2).double() / 16)).float()).double()
    sin, cos = ang.sin().repeat_interleave(2, -1)[None, :, None], ang.cos().repeat_interleave(2, -1)[None, :, None]
    every_two = torch.stack([-x[..., 1::2], x[..., ::2]], -1).flatten(-2)
    assert_close_to_reference(out[0], x * cos + every_two * sin, torch.float32, "GPT-J")


def test_gradcheck_fp64(backend):
    q, k = qk((2, 3, 2, 6), 1, torch.float64, backend.device)
    for t in (q, k):
        t.requires_grad_(True)
    pos = torch.tensor([4, 0, 9], device=backend.device)
    assert torch.autograd.gradcheck(lambda q, k: fused_rope(q, k, pos, interleaved=True), (q, k))
    assert torch.autograd.gradcheck(lambda q, k: fused_rope(q, k, seq_dim=0, position_offset=3), (q, k))


def test_backward_is_the_inverse_rotation(backend):
    q, k = qk((1, 5, 2, 8), 2, torch.float32, backend.device)
    q_rot, k_rot = fused_rope(q, k)
    back = torch.ops.megakernels.rope(q_rot, k_rot, None, None, 10000.0, 0, False, 1, True, backend.emulated)
    assert_close_to_reference(back[0], q.double(), torch.float32, "inverse(rotate(q))")
    assert_close_to_reference(back[1], k.double(), torch.float32, "inverse(rotate(k))")


def test_empty_inputs_give_empty_outputs(backend):
    q, k = qk((0, 3, 2, 8), 1, torch.float32, backend.device)
    out = fused_rope(q.requires_grad_(True), k.requires_grad_(True))
    assert out[0].shape == (0, 3, 2, 8) and out[1].shape == (0, 3, 1, 8)
    q, k = qk((2, 3, 2, 8), 0, torch.float32, backend.device)  # no k heads
    out = fused_rope(q, k)
    assert out[1].shape == (2, 3, 0, 8)
    assert_close_to_reference(out[0], rope_reference(q, k)[0], torch.float32, "q with an empty k")


def test_cpu_result_independent_of_thread_count():
    q, k = qk((2, 64, 8, 64), 2, torch.bfloat16, "cpu")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = fused_rope(q, k, theta=500000.0)
        torch.set_num_threads(max(2, threads))
        many = fused_rope(q, k, theta=500000.0)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one[0], many[0]) and torch.equal(one[1], many[1])


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(),
        dict(positions="1d", interleaved=True),
        dict(positions="2d", seq_dim=0, position_offset=2),
        dict(cos_sin=True),
    ],
    ids=["default", "positions-interleaved", "per-batch-seq-first", "table"],
)
def test_opcheck(kwargs):
    q, k = qk((2, 4, 2, 8), 1, torch.float32, "cpu")
    q.requires_grad_(True)
    k.requires_grad_(True)
    pos = {"1d": torch.tensor([3, 1, 2, 0]), "2d": torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7]])}.get(
        kwargs.get("positions")
    )
    table = rope_cos_sin_table(8, 8) if kwargs.get("cos_sin") else None
    args = (
        q,
        k,
        pos,
        table,
        10000.0,
        kwargs.get("position_offset", 0),
        kwargs.get("interleaved", False),
        kwargs.get("seq_dim", 1),
        False,
        False,
    )
    torch.library.opcheck(torch.ops.megakernels.rope.default, args)


def test_rope_reference_matches_the_math_written_out():
    # The reference itself against an independent loop over pairs (fp64 angles are near the fp32 ones here).
    q, k = qk((1, 3, 1, 4), 1, torch.float64, "cpu")
    out, _ = rope_reference(q, k, theta=100.0)
    for s in range(3):
        for i in range(2):
            a = float(torch.tensor(s, dtype=torch.float32) * torch.tensor(100.0 ** (-2 * i / 4), dtype=torch.float32))
            x1, x2 = q[0, s, 0, i].item(), q[0, s, 0, i + 2].item()
            assert math.isclose(out[0, s, 0, i].item(), x1 * math.cos(a) - x2 * math.sin(a), abs_tol=1e-6)
            assert math.isclose(out[0, s, 0, i + 2].item(), x2 * math.cos(a) + x1 * math.sin(a), abs_tol=1e-6)
