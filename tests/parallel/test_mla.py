"""Multi-head latent attention (megakernels.parallel.mla) against transformers' DeepseekV3Attention on random tiny
configurations (with and without the query latent, interleaved rotary dims or not, the flash and torch cores):
output and gradients; then split over two TP ranks, with and without sequence parallelism, against the single
process."""

from __future__ import annotations

import pytest
import torch
import transformers  # noqa: F401  (the test extra)
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

import megakernels.parallel as mp
from megakernels.nn import RotaryEmbedding
from megakernels.parallel.launch import single_process_world
from megakernels.parallel.mla import ParallelMultiLatentAttention
from tests.parallel.checks import Checks, assert_close, block, randn

H, HEADS, S, B = 32, 4, 10, 2
SHAPES = dict(kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6)
CHECKS = Checks()


def _hf(q_lora_rank, interleave, seed=0):
    cfg = transformers.DeepseekV3Config(
        hidden_size=H, num_attention_heads=HEADS, num_key_value_heads=HEADS, q_lora_rank=q_lora_rank,
        rope_interleave=interleave, max_position_embeddings=64, attention_bias=False, rms_norm_eps=1e-6,
        **SHAPES,
    )  # fmt: skip
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    attn = hf.DeepseekV3Attention(cfg, 0)
    with torch.no_grad():
        for p in attn.parameters():
            p.normal_(0.0, 0.2)
    return cfg, attn


def _ours(attn, q_lora_rank, interleave, core="flash", sequence_parallel=False):
    """Ours with the HF module's weights (this rank's heads)."""
    ours = ParallelMultiLatentAttention(
        H, HEADS, q_lora_rank=q_lora_rank, rotary=RotaryEmbedding(SHAPES["qk_rope_head_dim"]),
        rope_interleave=interleave, core=core, sequence_parallel=sequence_parallel, **SHAPES,
    )  # fmt: skip
    tp, r = mp.tp_size(), mp.tp_rank()
    with torch.no_grad():
        if q_lora_rank is None:
            ours.q.weight.copy_(block(attn.q_proj.weight, 0, r, tp))
        else:
            ours.q_a.copy_(attn.q_a_proj.weight)
            ours.q_a_norm.weight.copy_(attn.q_a_layernorm.weight)
            ours.q_b.weight.copy_(block(attn.q_b_proj.weight, 0, r, tp))
        ours.kv_a.copy_(attn.kv_a_proj_with_mqa.weight)
        ours.kv_a_norm.weight.copy_(attn.kv_a_layernorm.weight)
        ours.kv_b.weight.copy_(block(attn.kv_b_proj.weight, 0, r, tp))
        ours.proj.weight.copy_(block(attn.o_proj.weight, 1, r, tp))
    return ours


def _reference(cfg, attn, x):
    """transformers' output ``[s, b, h]`` for sequence-first ``x``, causal."""
    xb = x.transpose(0, 1)
    pos = torch.arange(S)[None].expand(B, S)
    cos_sin = hf.DeepseekV3RotaryEmbedding(cfg)(xb, pos)
    mask = torch.full((S, S), float("-inf")).triu(1)[None, None]
    return attn(xb, cos_sin, mask)[0].transpose(0, 1)


@pytest.mark.parametrize("q_lora_rank, interleave, core", [(16, True, "flash"), (None, False, "flash"),
                                                            (16, False, "torch")])  # fmt: skip
def test_mla_matches_transformers(q_lora_rank, interleave, core):
    cfg, attn = _hf(q_lora_rank, interleave)
    with single_process_world(parallel=True):
        ours = _ours(attn, q_lora_rank, interleave, core)
        x = randn(S, B, H, seed=1).requires_grad_(True)
        xr = x.detach().clone().requires_grad_(True)
        dy = randn(S, B, H, seed=2)
        out = ours(x)
        ref = _reference(cfg, attn, xr)
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
        out.backward(dy)
        ref.backward(dy)
    torch.testing.assert_close(x.grad, xr.grad, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(ours.kv_a.grad, attn.kv_a_proj_with_mqa.weight.grad, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(ours.kv_b.weight.grad, attn.kv_b_proj.weight.grad, atol=2e-5, rtol=1e-4)
    if q_lora_rank is not None:
        torch.testing.assert_close(ours.q_a_norm.weight.grad, attn.q_a_layernorm.weight.grad, atol=2e-5, rtol=1e-4)


def test_bad_shapes_are_named():
    with single_process_world(parallel=True):
        with pytest.raises(ValueError, match="qk_rope_head_dim must be even"):
            ParallelMultiLatentAttention(H, HEADS, q_lora_rank=None, **{**SHAPES, "qk_rope_head_dim": 5})
        with pytest.raises(ValueError, match="kv_lora_rank must be a positive int"):
            ParallelMultiLatentAttention(H, HEADS, q_lora_rank=None, **{**SHAPES, "kv_lora_rank": 0})


@CHECKS.add("mla_split_over_tp_with_and_without_sp_matches_the_single_process")
def _(rank, world):
    cfg, attn = _hf(16, True)
    x = randn(S, B, H, seed=1)
    dy = randn(S, B, H, seed=2)
    xr = x.clone().requires_grad_(True)
    ref = _reference(cfg, attn, xr)
    ref.backward(dy)
    for sp in (False, True):
        mp.initialize(2)
        r = mp.tp_rank()
        ours = _ours(attn, 16, True, sequence_parallel=sp)
        xin = (block(x, 0, r, 2) if sp else x).clone().requires_grad_(True)
        out = ours(xin)
        out.backward(block(dy, 0, r, 2) if sp else dy)
        mp.allreduce_sequence_parallel_grads(ours)
        what = f"tp2 sp={sp}"
        assert_close(out, block(ref, 0, r, 2) if sp else ref, f"{what}: output", rtol=1e-4)
        want = block(xr.grad, 0, r, 2) if sp else xr.grad
        assert_close(xin.grad, want, f"{what}: input grad", rtol=1e-4)
        kv_a = attn.kv_a_proj_with_mqa.weight.grad
        assert_close(ours.kv_a.grad, kv_a, f"{what}: kv_a grad (replicated)", rtol=1e-4)
        assert_close(ours.q_a_norm.weight.grad, attn.q_a_layernorm.weight.grad, f"{what}: q_a norm grad",
                     rtol=1e-4)  # fmt: skip
        assert_close(ours.kv_b.weight.grad, block(attn.kv_b_proj.weight.grad, 0, r, 2), f"{what}: kv_b grad",
                     rtol=1e-4)  # fmt: skip
        mp.destroy()


def _world(rank, world_size):
    return CHECKS.run(rank, world_size)


world = CHECKS.fixture(2, _world)


@pytest.mark.parametrize("name", CHECKS.names())
def test_mla_parallel(world, name):
    CHECKS.assert_passed(world, name)
