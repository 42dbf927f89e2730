"""flash_attention against a materialising fp64 PyTorch reference, on the CPU path (backend cpu), the Triton
kernels under the interpreter (cuda_emu) and the GPU (cuda). Tolerances in flash-attn's style: the kernel's error
must be within 2x the error of PyTorch's own attention computed in the input's precision, plus a small atol."""

from __future__ import annotations

import math

import pytest
import torch

import megakernels
from megakernels.ops.attention import dropout_mask, flash_attention, flash_attention_reference

# (batch, sq, sk, heads, kv_heads, head_dim): the sequence lengths, sq != sk both ways, GQA and MQA.
CASES = [
    (1, 1, 1, 2, 2, 32),
    (2, 17, 17, 4, 2, 64),
    (1, 128, 128, 2, 2, 128),
    (1, 130, 257, 4, 1, 32),
    (1, 257, 130, 2, 2, 64),
    (1, 17, 128, 3, 3, 96),
    (1, 128, 17, 2, 1, 128),
]


def _dtypes(triton_backend):
    if triton_backend.name == "cuda":
        return (torch.float16, torch.bfloat16)
    if triton_backend.emulated:  # the interpreter's bf16 tl.dot is broken (docs/design.md §3)
        return (torch.float16, torch.float32)
    return (torch.float16, torch.bfloat16, torch.float32)


def _inputs(case, dtype, device, seed=0):
    b, sq, sk, h, hk, d = case
    g = torch.Generator().manual_seed(seed)
    q, k, v = (
        torch.randn(shape, generator=g).to(dtype=dtype, device=device)
        for shape in ((b, sq, h, d), (b, sk, hk, d), (b, sk, hk, d))
    )
    do = torch.randn((b, sq, h, d), generator=g).to(dtype=dtype, device=device)
    return q, k, v, do


def _run(fn, q, k, v, do):
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    out = fn(*leaves)
    out.backward(do)
    return [out.detach()] + [t.grad for t in leaves]


def _max_err(a, b):
    return (a.double().cpu() - b.double().cpu()).abs().max().item() if a.numel() else 0.0


def _assert_matches_fp64(q, k, v, do, causal):
    """Output and gradients of flash_attention against the fp64 reference: 1e-5 (fp32) or 4e-3 (16-bit) of the
    largest magnitude."""
    results = _run(lambda *t: flash_attention(*t, causal=causal), q, k, v, do)
    exact = _run(
        lambda *t: flash_attention_reference(*t, causal=causal)[0], q.double(), k.double(), v.double(), do.double()
    )
    for name, r, ex in zip(("out", "dq", "dk", "dv"), results, exact):
        tol = 1e-5 if q.dtype == torch.float32 else 4e-3
        assert _max_err(r, ex) < tol * max(1.0, ex.abs().max().item()), f"{name} (causal={causal})"


def _assert_flash_style(results, lowp, exact, dtype, names=("out", "dq", "dk", "dv")):
    for name, r, lp, ex in zip(names, results, lowp, exact):
        assert r.shape == ex.shape and r.dtype == dtype, f"{name}: {r.shape}/{r.dtype}"
        err, ref_err = _max_err(r, ex), _max_err(lp, ex)
        atol = (1e-5 if dtype == torch.float32 else 1e-3) * max(1.0, ex.abs().max().item())
        assert err <= 2 * ref_err + atol, f"{name}: error {err:.3g} > 2 x PyTorch's {ref_err:.3g} + {atol:.3g}"


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "b{}_sq{}_sk{}_h{}_hk{}_d{}".format(*c))
def test_matches_reference(triton_backend, case, causal):
    _assert_case_flash_style(triton_backend, case, causal)


def _assert_case_flash_style(backend, case, causal):
    """``case`` in every dtype of the backend: against fp64, within twice PyTorch's own error in that dtype."""
    for dtype in _dtypes(backend):
        q, k, v, do = _inputs(case, dtype, backend.device)
        results = _run(lambda *t: flash_attention(*t, causal=causal), q, k, v, do)
        exact = _run(
            lambda *t: flash_attention_reference(*t, causal=causal)[0], q.double(), k.double(), v.double(), do.double()
        )
        # PyTorch's own attention in the input precision (fp32 softmax for 16-bit, as its SDPA math path).
        lowp = _run(
            lambda *t: flash_attention_reference(*t, causal=causal, compute_dtype=dtype)[0].to(dtype),
            q.cpu(),
            k.cpu(),
            v.cpu(),
            do.cpu(),
        )
        _assert_flash_style(results, lowp, exact, dtype)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_lse_matches_reference_and_is_minus_inf_for_rows_that_see_no_key(triton_backend, causal):
    case = (1, 40, 23, 2, 1, 32)  # causal with sq > sk: the first 17 queries see no key
    q, k, v, _ = _inputs(case, torch.float32 if triton_backend.name != "cuda" else torch.float16, triton_backend.device)
    out, lse = flash_attention(q, k, v, causal=causal, return_lse=True)
    ref_out, ref_lse = flash_attention_reference(q, k, v, causal=causal)
    assert lse.dtype == torch.float32 and lse.shape == (1, 2, 40)
    assert torch.equal(torch.isneginf(lse.cpu()), torch.isneginf(ref_lse.cpu()))
    assert torch.isneginf(lse).any().item() == causal
    finite = torch.isfinite(ref_lse.cpu())
    assert _max_err(lse.cpu()[finite], ref_lse.cpu()[finite]) < 1e-3
    if causal:
        assert (out[:, :17] == 0).all()


def test_gradcheck_cpu_fp64():
    g = torch.Generator().manual_seed(1)
    for causal in (False, True):
        q, k, v = (
            torch.randn(s, generator=g, dtype=torch.float64, requires_grad=True)
            for s in ((1, 5, 4, 8), (1, 7, 2, 8), (1, 7, 2, 8))
        )
        assert torch.autograd.gradcheck(lambda *t: flash_attention(*t, causal=causal), (q, k, v))


def test_cpu_path_at_seq_4096_matches_sdpa():
    g = torch.Generator().manual_seed(2)
    b, s, h, d = 1, 4096, 2, 64
    q, k, v = (torch.randn((b, s, h, d), generator=g) for _ in range(3))
    for causal in (False, True):
        with megakernels.backend("cpu"):
            out = flash_attention(q, k, v, causal=causal)
        ref = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2).double(), k.transpose(1, 2).double(), v.transpose(1, 2).double(), is_causal=causal
        )
        assert _max_err(out, ref.transpose(1, 2)) < 2e-5


def test_cpu_blocks_bound_the_score_memory():
    from megakernels.ops import _attention_cpu

    rows = _attention_cpu._rows_per_block(1, 2, 16384, 4)
    assert 16 <= rows < 16384 and rows * 2 * 16384 * 4 <= _attention_cpu._BLOCK_BYTES
    blocks = list(_attention_cpu._blocks(300, 300, 128, causal=True))
    assert blocks == [(0, 128, 0, 128), (128, 256, 0, 256), (256, 300, 0, 300)]  # causal blocks stop at the diagonal
    blocks = list(_attention_cpu._blocks(300, 300, 128, causal=True, window=100))  # and start at the window's edge
    assert blocks == [(0, 128, 0, 128), (128, 256, 29, 256), (256, 300, 157, 300)]


def test_noncontiguous_inputs(triton_backend):
    dtype = torch.float16 if triton_backend.name != "cpu" else torch.float32
    qkv = torch.randn(2, 33, 3, 4, 32).to(dtype=dtype, device=triton_backend.device)  # packed, as FlashSelfAttention
    q, k, v = qkv.unbind(2)
    out = flash_attention(q, k, v, causal=True)
    ref, _ = flash_attention_reference(q, k, v, causal=True)
    assert _max_err(out, ref) < (1e-5 if dtype == torch.float32 else 2e-3)


def test_strides_that_tma_cannot_address_take_the_pointer_path(triton_backend):
    """A head stride of 33 fp16 elements (66 bytes) is no multiple of 16 bytes: the forward loads through
    pointers instead of tensor descriptors, with the same result."""
    from megakernels.triton import flash_attention as fa

    dtype = torch.float16 if triton_backend.name != "cpu" else torch.float32
    g = torch.Generator().manual_seed(3)
    q, k, v, do = (
        torch.randn(1, 40, 4, 33, generator=g).to(dtype=dtype, device=triton_backend.device)[..., :32] for _ in range(4)
    )
    assert not fa.tma_eligible(q, k, v)
    _assert_matches_fp64(q, k, v, do, causal=True)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_deterministic_backward_matches_reference_and_repeats_bitwise(triton_backend, causal):
    case = (1, 130, 97, 4, 2, 64)
    dtype = torch.float32 if triton_backend.name != "cuda" else torch.float16
    q, k, v, do = _inputs(case, dtype, triton_backend.device)
    fn = lambda *t: flash_attention(*t, causal=causal, deterministic=True)  # noqa: E731
    first, second = _run(fn, q, k, v, do), _run(fn, q, k, v, do)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    exact = _run(
        lambda *t: flash_attention_reference(*t, causal=causal)[0], q.double(), k.double(), v.double(), do.double()
    )
    lowp = _run(
        lambda *t: flash_attention_reference(*t, causal=causal, compute_dtype=dtype)[0].to(dtype),
        q.cpu(),
        k.cpu(),
        v.cpu(),
        do.cpu(),
    )
    _assert_flash_style(first, lowp, exact, dtype)


# ---------------------------------------------------------------------------------------------------------------
# Dropout


def test_dropout_matches_reference_with_the_documented_mask(triton_backend):
    p = 0.3
    case = (2, 37, 45, 4, 2, 32)
    for causal in (False, True):
        dtype = torch.float32 if triton_backend.name != "cuda" else torch.float16
        q, k, v, do = _inputs(case, dtype, triton_backend.device)
        gen = torch.Generator(device=triton_backend.device).manual_seed(7)
        seed = int(
            torch.randint(
                0,
                2**62,
                (),
                dtype=torch.int64,
                device=triton_backend.device,
                generator=torch.Generator(device=triton_backend.device).manual_seed(7),
            )
        )
        keep = dropout_mask(seed, 2, 4, 37, 45, p, device=triton_backend.device)
        results = _run(lambda *t: flash_attention(*t, causal=causal, dropout_p=p, generator=gen), q, k, v, do)
        exact = _run(
            lambda *t: flash_attention_reference(*t, causal=causal, keep=keep, dropout_p=p)[0],
            q.double(),
            k.double(),
            v.double(),
            do.double(),
        )
        for name, r, ex in zip(("out", "dq", "dk", "dv"), results, exact):
            tol = (2e-5 if dtype == torch.float32 else 4e-3) * max(1.0, ex.abs().max().item())
            assert _max_err(r, ex) <= tol, f"{name} (causal={causal})"


def test_dropout_is_reproducible_and_seed_dependent(triton_backend):
    q, k, v, _ = _inputs(
        (1, 20, 20, 2, 2, 32), torch.float32 if triton_backend.name != "cuda" else torch.float16, triton_backend.device
    )
    runs = []
    for seed in (1, 1, 2):
        torch.manual_seed(seed)
        runs.append(flash_attention(q, k, v, dropout_p=0.5))
    assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], runs[2])


def test_dropout_mask_statistics():
    for p in (0.1, 0.5):
        keep = dropout_mask(12345, 2, 4, 256, 512, p)
        n = keep.numel()
        frac = keep.double().mean().item()
        assert abs(frac - (1 - p)) < 5 * math.sqrt(p * (1 - p) / n)
        # No structure along rows, columns or heads: each slice keeps about 1 - p.
        for dim in (1, 2, 3):
            per_slice = keep.double().mean(dim=[i for i in range(4) if i != dim])
            m = n / keep.shape[dim]
            assert (per_slice - (1 - p)).abs().max().item() < 6 * math.sqrt(p * (1 - p) / m)
        # Neighbours are independent: P(keep[j] and keep[j+1]) = (1-p)^2.
        both = (keep[..., 1:] & keep[..., :-1]).double().mean().item()
        assert abs(both - (1 - p) ** 2) < 0.01
    assert not torch.equal(dropout_mask(1, 1, 1, 64, 64, 0.5), dropout_mask(2, 1, 1, 64, 64, 0.5))


def test_dropout_mask_is_the_same_in_triton():
    """The Triton hash (run by a kernel under the interpreter or on a GPU) equals the PyTorch one."""
    from megakernels.triton import interpreting
    from megakernels.triton._common import dropout_threshold, split_seed
    from tests.triton.kernels import dropout_mask_kernel

    device = "cpu" if interpreting() else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("Triton compiled for a GPU but there is no GPU")
    seed = (0xDEADBEEF << 20) | 12345
    out = torch.empty((24, 64), dtype=torch.int8, device=device)
    lo, hi = split_seed(seed)
    dropout_mask_kernel[(24,)](out, lo, hi, dropout_threshold(0.25), SK=64)
    assert torch.equal(out.cpu().bool(), dropout_mask(seed, 1, 1, 24, 64, 0.25)[0, 0])


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_queries_whose_batches_are_not_packed_take_the_4d_descriptor(triton_backend, causal):
    """Queries sliced out of a longer sequence (batch stride != sq x row stride) cannot be viewed as [b * sq, h * d]
    rows: the forward loads them through the 4-D descriptor, with the same result as the packed layout."""
    from megakernels.triton import flash_attention as fa

    dtype = torch.float16 if triton_backend.name != "cpu" else torch.float32
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 48, 2, 32, generator=g).to(dtype=dtype, device=triton_backend.device)[:, :40]
    k, v, do = (torch.randn(2, 40, 2, 32, generator=g).to(dtype=dtype, device=triton_backend.device) for _ in range(3))
    assert fa._rows_descriptor(q, 32) is None and fa._rows_descriptor(q.contiguous(), 32) is not None
    _assert_matches_fp64(q, k, v, do, causal)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_backward_with_64_row_query_blocks_matches_reference(triton_backend, causal, monkeypatch):
    """The backward adds dQ as dS K when a query block has 64 rows or more (a wgmma's M), and as (K^T dS^T)^T below
    that (the interpreter's default 32-row blocks): the 64-row form against the fp64 reference."""
    from megakernels.triton import flash_attention as fa

    if not triton_backend.emulated:
        pytest.skip("sets the config of the Triton interpreter (cuda_emu); a GPU or the CPU path picks its own")
    monkeypatch.setattr(fa, "INTERPRETER_CONFIG", (64, 32, 4, 1))
    _assert_case_flash_style(triton_backend, (2, 130, 97, 4, 2, 64), causal)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("config", [(32, 32, 4, 1), (64, 32, 4, 1)], ids=["dq_t", "dq"])
def test_backward_adds_dq_with_atomics_where_no_descriptor_can(triton_backend, causal, config, monkeypatch):
    """dQ tiles go through a tensor descriptor (a TMA reduce) on Hopper and under the interpreter; where no
    descriptor can address the buffers (or before Hopper) the backward adds them with fp32 atomics, in both forms
    (K^T dS^T below 64 query rows, dS K from 64): against the fp64 reference."""
    from megakernels.triton import flash_attention as fa

    if not triton_backend.emulated:
        pytest.skip("sets the config of the Triton interpreter (cuda_emu); a GPU or the CPU path picks its own")
    monkeypatch.setattr(fa, "INTERPRETER_CONFIG", config)
    monkeypatch.setattr(fa, "tma_eligible", lambda *tensors: False)
    _assert_case_flash_style(triton_backend, (2, 130, 97, 4, 2, 64), causal)


@pytest.mark.parametrize("tma", [True, False], ids=["descriptor", "atomics"])
@pytest.mark.parametrize("d", [256, 200])
def test_d256_backward_adds_dq_in_two_column_halves(triton_backend, tma, d, monkeypatch):
    """At head dim 256 (200 pads to 256) with 64-row query blocks the backward adds dS K in two column halves
    (DQ_CHUNKS: a whole 64 x 256 fp32 tile spilled on sm_90), through a descriptor half as wide or with atomics
    masked to the head dim: against the fp64 reference, causal and not."""
    from megakernels.triton import flash_attention as fa

    if not triton_backend.emulated:
        pytest.skip("sets the config of the Triton interpreter (cuda_emu); a GPU or the CPU path picks its own")
    monkeypatch.setattr(fa, "INTERPRETER_CONFIG", (64, 32, 4, 1))
    if not tma:
        monkeypatch.setattr(fa, "tma_eligible", lambda *tensors: False)
    launches = fa.backward_launches(
        *[torch.empty(1, 70, 2, d, device="meta", dtype=torch.bfloat16)] * 5,
        torch.empty(1, 2, 70, device="meta"),
        torch.empty(2, 1, 2, 70, device="meta"),
        torch.empty(1, 70, 2, d, device="meta"),
        *[torch.empty(1, 70, 2, d, device="meta", dtype=torch.bfloat16)] * 2,
        torch.empty(1, 2, 70, device="meta"),
        False,
        d**-0.5,
        0.0,
        (64, 32, 4, 1),
        False,
        arch=90,
    )
    assert next(ln for ln in launches if ln.name == "fa_bwd_kernel").kwargs["DQ_CHUNKS"] == 2
    for causal in (False, True):
        _assert_case_flash_style(triton_backend, (1, 70, 65, 2, 1, d), causal)
