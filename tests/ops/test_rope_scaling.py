"""YaRN rotary scaling (``RopeScaling(kind="yarn")``) against transformers' own ``ROPE_INIT_FUNCTIONS["yarn"]``:
its inverse frequencies and attention factor on gpt-oss-, DeepSeek-V3- and paper-default-like configurations, the
q and k a scaled ``RotaryEmbedding`` rotates against transformers' ``apply_rotary_pos_emb`` with its own cos/sin,
and bad parameters refused by name (in ``RopeScaling`` and in ``ModelConfig``)."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama import modeling_llama

from megakernels.nn import RotaryEmbedding
from megakernels.ops import RopeScaling, rope_cos_sin_table, rope_inv_freq
from megakernels_models.models.config import ModelConfig
from tests.helpers import assert_close_to_reference, make

# (theta, head_dim, transformers' rope_parameters): gpt-oss's (truncate False), DeepSeek-V3's (mscale ratio 1),
# the paper's defaults with truncation, an mscale ratio other than 1, and a small head whose ramp bounds clamp.
CONFIGS = {
    "gpt-oss": (
        150000.0,
        64,
        dict(factor=32.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0, truncate=False),
    ),
    "deepseek-v3": (
        10000.0,
        64,
        dict(
            factor=40.0,
            original_max_position_embeddings=4096,
            beta_fast=32.0,
            beta_slow=1.0,
            mscale=1.0,
            mscale_all_dim=1.0,
        ),
    ),
    "paper-defaults": (10000.0, 128, dict(factor=8.0, original_max_position_embeddings=8192)),
    "mscale-ratio": (
        10000.0,
        64,
        dict(factor=16.0, original_max_position_embeddings=2048, mscale=1.0, mscale_all_dim=0.707),
    ),
    "clamped-head": (10000.0, 8, dict(factor=4.0, original_max_position_embeddings=64, beta_fast=64.0, beta_slow=2.0)),
}


def _hf(theta: float, head_dim: int, params: dict) -> tuple[torch.Tensor, float]:
    """transformers' YaRN inverse frequencies (fp32) and attention factor for these parameters."""
    cfg = PretrainedConfig()
    cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim = 8 * head_dim, 8, head_dim
    cfg.max_position_embeddings = int(params["factor"] * params["original_max_position_embeddings"])
    cfg.rope_parameters = {"rope_type": "yarn", "rope_theta": theta, **params}
    return ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")


def _ours(params: dict) -> RopeScaling:
    return RopeScaling(
        "yarn",
        params["factor"],
        original_max_positions=params["original_max_position_embeddings"],
        beta_fast=params.get("beta_fast", 32.0),
        beta_slow=params.get("beta_slow", 1.0),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        truncate=params.get("truncate", True),
    )


@pytest.mark.parametrize("name", CONFIGS)
def test_yarn_frequencies_and_attention_factor_are_transformers(name):
    theta, head_dim, params = CONFIGS[name]
    inv_freq, factor = _hf(theta, head_dim, params)
    scaling = _ours(params)
    assert scaling.attention_factor == pytest.approx(factor, rel=1e-15, abs=0.0)
    # transformers computes in fp32, we in fp64 rounded once: at most an ulp or two apart.
    torch.testing.assert_close(rope_inv_freq(head_dim, theta, scaling), inv_freq, rtol=3e-7, atol=0.0)
    # The ramp did something: some pairs kept, some interpolated by the factor.
    plain = rope_inv_freq(head_dim, theta)
    ours = rope_inv_freq(head_dim, theta, scaling)
    assert (ours == plain).any() and torch.allclose(ours[-1], plain[-1] / params["factor"], rtol=1e-6)


def test_attention_factor_forms():
    assert RopeScaling("yarn", 32.0).attention_factor == pytest.approx(0.1 * math.log(32.0) + 1.0)
    ratio = RopeScaling("yarn", 40.0, mscale=1.0, mscale_all_dim=0.5).attention_factor
    assert ratio == pytest.approx((0.1 * math.log(40.0) + 1.0) / (0.05 * math.log(40.0) + 1.0))
    assert RopeScaling("yarn", 1.0).attention_factor == 1.0
    assert RopeScaling("llama3", 8.0).attention_factor == RopeScaling("linear", 4.0).attention_factor == 1.0


@pytest.mark.parametrize("name", ["gpt-oss", "deepseek-v3", "mscale-ratio"])
def test_scaled_rotary_embedding_is_transformers_apply_rotary_pos_emb(backend, name):
    theta, d, params = CONFIGS[name]
    inv_freq, factor = _hf(theta, d, params)
    pos = torch.arange(24) * 97  # past the original context of every configuration here
    freqs = pos.double()[:, None] * inv_freq.double()
    emb = torch.cat([freqs, freqs], -1)
    q, k = (
        make((2, 24, 4, d), torch.float32, backend.device, seed=0),
        make((2, 24, 2, d), torch.float32, backend.device, seed=1),
    )
    hq, hk = modeling_llama.apply_rotary_pos_emb(
        q.cpu().double().transpose(1, 2),
        k.cpu().double().transpose(1, 2),
        (emb.cos() * factor)[None],
        (emb.sin() * factor)[None],
    )
    rope = RotaryEmbedding(d, theta, max_positions=int(pos.max()) + 1, device=backend.device, scaling=_ours(params))
    out = rope(q, k, pos.to(backend.device))
    # The kernel's angle is the fp32 product pos * inv_freq (the contract; transformers' own is fp32 too), ~1e-4 rad
    # from the fp64 one at these positions: a few fp32 tolerances on values up to ~5.
    assert_close_to_reference(out[0], hq.transpose(1, 2), torch.float32, "q vs transformers", factor=4)
    assert_close_to_reference(out[1], hk.transpose(1, 2), torch.float32, "k vs transformers", factor=4)


def test_table_carries_the_attention_factor_on_cos_and_sin():
    scaling = RopeScaling("yarn", 32.0, original_max_positions=4096, truncate=False)
    table = rope_cos_sin_table(64, 64, 150000.0, scaling=scaling).double()
    assert_close_to_reference(
        table.pow(2).sum(-1),
        torch.full((64, 32), scaling.attention_factor**2, dtype=torch.float64),
        torch.float32,
        "|(cos, sin)|^2",
    )


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(beta_fast=1.0, beta_slow=1.0), ValueError, "beta_slow < beta_fast"),
        (dict(beta_slow=0.0), ValueError, "0 < beta_slow"),
        (dict(beta_fast=math.inf), ValueError, "beta_fast"),
        (dict(mscale=0.0), ValueError, "mscale must be"),
        (dict(mscale_all_dim=float("nan")), ValueError, "mscale_all_dim must be"),
        (dict(truncate=1), TypeError, "truncate must be a bool"),
        (dict(original_max_positions=0), ValueError, "original_max_positions must be >= 1"),
        (dict(original_max_positions=4096.0), TypeError, "original_max_positions must be an int"),
        (dict(factor=math.inf), ValueError, "finite factor"),
        (dict(factor=0.5), ValueError, "factor must be >= 1"),
    ],
)
def test_bad_yarn_parameters_are_refused_by_name(kwargs, error, match):
    args = dict(factor=32.0, original_max_positions=4096) | kwargs
    with pytest.raises(error, match=match):
        RopeScaling("yarn", **args)


def test_yarn_apply_needs_theta():
    with pytest.raises(ValueError, match="yarn needs theta"):
        RopeScaling("yarn", 4.0).apply(torch.ones(4, dtype=torch.float64))


YARN = dict(
    num_layers=2,
    hidden_size=64,
    num_heads=4,
    rope_scaling="yarn",
    rope_scaling_factor=32.0,
    rope_original_max_positions=4096,
)


def test_model_config_builds_the_yarn_spec():
    cfg = ModelConfig(
        "llama", **YARN, rope_beta_fast=16.0, rope_mscale=1.0, rope_mscale_all_dim=0.5, rope_truncate=False
    )
    assert cfg.rope_scaling_spec() == RopeScaling(
        "yarn", 32.0, original_max_positions=4096, beta_fast=16.0, mscale=1.0, mscale_all_dim=0.5, truncate=False
    )


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(rope_beta_fast=0.5), ValueError, r"0 < rope_beta_slow < rope_beta_fast"),
        (dict(rope_beta_slow=-1.0), ValueError, r"rope_beta_slow=-1.0"),
        (dict(rope_mscale=-1.0), ValueError, r"ModelConfig: rope_mscale must be"),
        (dict(rope_mscale_all_dim=0.0), ValueError, r"ModelConfig: rope_mscale_all_dim must be"),
        (dict(rope_truncate="no"), TypeError, r"ModelConfig: rope_truncate must be a bool"),
        (dict(rope_scaling_factor=0.5), ValueError, r"ModelConfig: rope_scaling_factor must be >= 1"),
        (dict(rope_scaling="yarn2"), ValueError, r"ModelConfig: rope_scaling must be one of"),
    ],
)
def test_model_config_refuses_bad_yarn_fields_by_name(kwargs, error, match):
    with pytest.raises(error, match=match):
        ModelConfig("llama", **(YARN | kwargs))
