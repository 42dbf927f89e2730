"""DeepSeek-V3 (``deepseek_v3``) and DeepSeek-V2 (``deepseek_v2``) under the integration: latent attention (the
query/key head dim apart from the value's, the module's own scaling) through FlashAttention, the dense first
layer's MLP and the shared experts through SwiGLU, the routed experts through grouped GEMMs, the router through
``moe_router``; with and without the query latent, group-limited routing, V2's softmax routing. The reference is
the unpatched transformers model with the same weights; fp32 tolerances as tests/integrations/test_transformers.py's."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import megakernels.integrations.transformers as mkt
from tests.integrations import hf_models as H
from tests.integrations.test_transformers import MegakernelsOps, step

SHAPES = {
    "query-latent": ("deepseek_v3", {}),
    "direct-query": ("deepseek_v3", {"q_lora_rank": None}),
    "v2-softmax-routing": ("deepseek_v2", {}),  # DeepSeek-V2: the same modules, V2's router and rotary dims
}


def _spread(model):
    """The norms' weights and the router's correction biases away from their constant start, so that each
    matters (a norm weight of ones hides whether it is applied; a zero bias, whether routing adds it)."""
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.05)
    return model


@pytest.mark.parametrize("shape", list(SHAPES))
def test_patched_deepseek_v3_trains_like_the_unpatched_model(shape):
    """Three SGD steps: logits, loss and every parameter's gradient at each step, and the parameters after, equal
    the unpatched model's; the patch reaches every kind of module the family has."""
    family, overrides = SHAPES[shape]
    ref = _spread(H.build(family, **overrides))
    model = copy.deepcopy(ref)
    done = mkt.apply(model)
    latent = ref.config.q_lora_rank is not None
    # per layer: the two layer norms, the key/value latent's (and the query latent's); the final norm
    assert done["norms"] == 2 * (3 + latent) + 1
    assert done["mlp"] == 2 and done["experts"] == 1 and done["attention"] and done["loss"]  # dense MLP, shared
    assert not done["declined"]
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (ref, model)]
    for i in range(3):
        ids = H.batch(seed=i)
        logits0, loss0, grads0 = step(ref, ids)
        with MegakernelsOps() as seen:
            logits1, loss1, grads1 = step(model, ids)
        assert {"norm_fwd", "swiglu_fwd", "grouped_gemm", "moe_router_fwd", "flash_attn_fwd"} <= seen.names
        assert "cross_entropy_stats" in seen.names
        torch.testing.assert_close(logits1, logits0, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(loss1, loss0, rtol=1e-5, atol=1e-6)
        for name, g in grads0.items():
            g = torch.zeros_like(dict(ref.named_parameters())[name]) if g is None else g  # experts no token reached
            got = grads1[name] if grads1[name] is not None else torch.zeros_like(g)
            torch.testing.assert_close(got, g, rtol=1e-4, atol=1e-6, msg=lambda m: f"step {i}, {name}: {m}")
        for opt in opts:
            opt.step()
    for (name, p0), p1 in zip(ref.named_parameters(), model.parameters()):
        torch.testing.assert_close(p1, p0, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_latent_attention_passes_the_value_head_dim_and_the_modules_scaling():
    """The attention entry gets a value head dim apart from the query's and the module's ``scaling`` (here set
    away from ``1 / sqrt(d_qk)``): FlashAttention runs with both, and the logits are the unpatched model's under
    the same scaling."""
    ref = H.build("deepseek_v3").eval()
    for layer in ref.model.layers:
        layer.self_attn.scaling = 0.7
    model = copy.deepcopy(ref)
    mkt.apply(model)
    seen = []
    fwd = torch.ops.megakernels.flash_attn_fwd.default

    class Spy(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is fwd:
                seen.append((args[0].shape[-1], args[2].shape[-1], args[4]))
            return func(*args, **(kwargs or {}))

    ids = H.batch()
    with torch.no_grad(), Spy():
        got = model(input_ids=ids).logits
    c = ref.config
    assert seen and all(s[:2] == (c.qk_nope_head_dim + c.qk_rope_head_dim, c.v_head_dim) for s in seen)
    assert all(s[2] == pytest.approx(0.7) for s in seen)
    with torch.no_grad():
        expected = ref(input_ids=ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_patch_deepseek_v3_patches_every_model_built_inside():
    assert "deepseek_v3" in mkt.supported_model_types()
    ref = H.build("deepseek_v3")
    with mkt.patch_deepseek_v3(fused_head=True):
        model = type(ref)(copy.deepcopy(ref.config))
    model.load_state_dict(ref.state_dict())
    assert getattr(model.forward, "megakernels", False)  # the fused head
    assert getattr(model.model.layers[1].mlp.shared_experts.forward, "megakernels", False)
    ids = H.batch()
    model.zero_grad(set_to_none=True)
    with MegakernelsOps() as seen:
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
    assert "linear_cross_entropy_stats" in seen.names and "grouped_gemm" in seen.names
    _, loss0, grads0 = step(ref, ids)
    torch.testing.assert_close(out.loss.detach(), loss0, rtol=1e-5, atol=1e-6)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads0[name], rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
