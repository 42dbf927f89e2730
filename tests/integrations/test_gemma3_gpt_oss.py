"""What the Gemma 3 (``gemma3_text``) and gpt-oss patches do beyond the checks every family gets in
test_transformers.py: Gemma's attention-logit soft-capping, which FlashAttention does not compute, is left to
transformers (and reported), its final-logit soft cap goes into the fused loss, gpt-oss's sinks and expert banks
are read without being changed, and the masks and heads those models need in other cases stay transformers'. The
reference is always the unpatched model with the same weights (fp32: logits within 1e-5, gradients within 1e-4
relative + 1e-6 absolute)."""

from __future__ import annotations

import copy
import warnings

import torch

import megakernels.integrations.transformers as mkt
from tests.integrations import hf_models as H
from tests.integrations.test_transformers import MegakernelsOps, step


def _built(family: str, **overrides):
    """``H.build(family)``'s weights in a model of its config with ``overrides``."""
    model = H.model_class(family)(H.config(family, **overrides))
    model.load_state_dict(H.build(family).state_dict())
    return model


def _close_grads(got: dict, expected: dict) -> None:
    assert got.keys() == expected.keys()
    for name, g in expected.items():
        torch.testing.assert_close(got[name], g, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_gemma3_attention_logit_softcapping_keeps_transformers_attention_and_says_so():
    ref = _built("gemma3_text", attn_logit_softcapping=50.0)
    model = copy.deepcopy(ref)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        done = mkt.apply(model)
    assert not done["attention"] and done["mlp"] == 2
    assert done["declined"] == ["attention (attn_logit_softcapping=50.0: FlashAttention has no logit soft-capping)"]
    assert any("attn_logit_softcapping" in str(w.message) for w in caught)
    ids = H.batch()
    logits0, loss0, grads0 = step(ref, ids)
    with MegakernelsOps() as seen:
        logits1, loss1, grads1 = step(model, ids)
    assert "flash_attn_fwd" not in seen.names and "norm_fwd" in seen.names
    torch.testing.assert_close(logits1, logits0, rtol=1e-5, atol=1e-5)
    _close_grads(grads1, grads0)


def test_gemma3_final_logit_softcapping_is_applied_by_the_fused_head_and_the_fused_loss():
    """final_logit_softcapping (binding: logits capped at 0.5 from about 1): the fused head caps inside
    linear_cross_entropy and caps the logits it makes on a read; without the fused head the class's forward caps
    and the fused cross-entropy takes the capped logits. Loss, logits and every gradient are transformers'."""
    ref = _built("gemma3_text", final_logit_softcapping=0.5)
    ids = H.batch()
    logits0, loss0, grads0 = step(ref, ids)
    assert logits0.abs().max() < 0.5
    for fused_head, op in ((True, "linear_cross_entropy_stats"), (False, "cross_entropy_stats")):
        model = copy.deepcopy(ref)
        assert mkt.apply(model, fused_head=fused_head)["fused_head"] == fused_head
        with MegakernelsOps() as seen:
            logits1, loss1, grads1 = step(model, ids)
        assert op in seen.names
        torch.testing.assert_close(logits1, logits0, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(loss1, loss0, rtol=1e-5, atol=1e-6)
        _close_grads(grads1, grads0)


def test_gemma3_bidirectional_attention_keeps_its_mask_for_restarting_positions():
    """use_bidirectional_attention (EmbeddingGemma): the model's own mask functions make the mask, so positions that
    restart are not taken for a packed batch; the logits are the unpatched model's."""
    ref = _built("gemma3_text", use_bidirectional_attention=True)
    model = copy.deepcopy(ref)
    mkt.apply(model)
    ids = H.batch(batch=1)
    positions = torch.cat([torch.arange(5), torch.arange(7)])[None]
    for kwargs in ({}, {"position_ids": positions}):
        with torch.no_grad():
            torch.testing.assert_close(
                model(input_ids=ids, **kwargs).logits, ref(input_ids=ids, **kwargs).logits, rtol=1e-5, atol=1e-5
            )


def test_gemma3_multimodal_model_under_the_text_class_patch_keeps_its_image_blocks():
    """Gemma3ForConditionalGeneration shares the text model's base class: under patch_classes("gemma3_text") its
    language model is patched (the outer model, of another model type, is left alone) and the mask with the
    images' bidirectional blocks is made and used, so the logits equal the unpatched model's."""
    import transformers as tf

    config = tf.Gemma3Config(
        text_config=H.config("gemma3_text").to_dict(),
        vision_config=dict(
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=28,
            patch_size=14,
        ),
        mm_tokens_per_image=4,
        image_token_index=90,
        boi_token_index=91,
        eoi_token_index=92,
    )
    torch.manual_seed(0)
    ref = tf.Gemma3ForConditionalGeneration(copy.deepcopy(config)).eval()
    with mkt.patch_classes("gemma3_text"):
        model = tf.Gemma3ForConditionalGeneration(copy.deepcopy(config)).eval()
    model.load_state_dict(ref.state_dict())
    assert model.model.language_model.norm.forward.megakernels
    ids = H.batch(batch=1)
    ids[0, 3], ids[0, 4:8], ids[0, 8] = 91, 90, 92  # begin-of-image, the four image tokens, end-of-image
    inputs = dict(input_ids=ids, token_type_ids=(ids == 90).long(), pixel_values=torch.randn(1, 3, 28, 28))
    with torch.no_grad():
        expected = ref(**inputs).logits
        with MegakernelsOps() as seen:
            got = model(**inputs).logits
    assert "norm_fwd" in seen.names and "swiglu_fwd" in seen.names
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_gpt_oss_sinks_get_their_gradient_and_the_expert_banks_stay_as_they_are():
    ref = H.build("gpt_oss")
    model = copy.deepcopy(ref)
    mkt.apply(model)
    before = {n: (p.data_ptr(), p.detach().clone()) for n, p in model.named_parameters()}
    ids = H.batch()
    _, _, grads0 = step(ref, ids)
    _, _, grads1 = step(model, ids)
    for layer in range(2):
        name = f"model.layers.{layer}.self_attn.sinks"
        assert grads0[name].abs().min() > 0
        torch.testing.assert_close(grads1[name], grads0[name], rtol=1e-4, atol=1e-7)
    for n, p in model.named_parameters():  # the interleaved gate/up columns are reordered per call, not stored
        assert p.data_ptr() == before[n][0] and torch.equal(p.detach(), before[n][1]), n


def test_gpt_oss_runs_its_eager_attention_with_the_sinks_where_a_mask_is_needed():
    """A left-padded batch needs a mask, which FlashAttention does not take; SDPA has no sinks, so the family's eager
    attention runs: the same logits as the unpatched model on the tokens that are not padding."""
    ref = H.build("gpt_oss")
    model = copy.deepcopy(ref)
    mkt.apply(model)
    assert model.config._attn_implementation == "megakernels"  # transformers' default for gpt-oss is "eager"
    ids = H.batch()
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    with torch.no_grad():
        expected = ref(input_ids=ids, attention_mask=mask).logits
        with MegakernelsOps() as seen:
            got = model(input_ids=ids, attention_mask=mask).logits
    assert "flash_attn_fwd" not in seen.names and "grouped_gemm" in seen.names
    torch.testing.assert_close(got[:, 4:], expected[:, 4:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], expected[1], rtol=1e-5, atol=1e-5)


def test_gpt_oss_keeps_an_attention_implementation_the_caller_chose():
    with mkt.patch_classes("gpt_oss"):
        eager = H.model_class("gpt_oss")._from_config(H.config("gpt_oss"), attn_implementation="eager")
        default = H.model_class("gpt_oss")(H.config("gpt_oss"))
    assert eager.config._attn_implementation == "eager"
    assert default.config._attn_implementation == "megakernels"
    ids = H.batch()
    default.load_state_dict(eager.state_dict())
    with torch.no_grad(), MegakernelsOps() as seen:
        expected = eager.eval()(input_ids=ids).logits
    assert "flash_attn_fwd" not in seen.names
    with torch.no_grad():
        torch.testing.assert_close(default.eval()(input_ids=ids).logits, expected, rtol=1e-5, atol=1e-5)


def test_gpt_oss_router_logits_run_the_class_forward_with_its_auxiliary_loss():
    """fused_head=True: a call that asks for router logits gets the class's forward, whose loss adds the router's
    load-balancing loss; it equals the unpatched model's."""
    ref = H.build("gpt_oss")
    model = copy.deepcopy(ref)
    assert mkt.apply(model, fused_head=True)["fused_head"]
    ids = H.batch()
    logits0, loss0, grads0 = step(ref, ids, output_router_logits=True)
    with MegakernelsOps() as seen:
        logits1, loss1, grads1 = step(model, ids, output_router_logits=True)
    assert "linear_cross_entropy_stats" not in seen.names
    plain = ref(input_ids=ids, labels=ids).loss
    assert not torch.allclose(loss0, plain)  # the auxiliary loss counts
    torch.testing.assert_close(loss1, loss0, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(logits1, logits0, rtol=1e-5, atol=1e-5)
    _close_grads(grads1, grads0)


def test_gemma3_rms_norm_takes_any_weight_dtype_and_keeps_the_input_dtype_as_gemmas():
    """Gemma's RMSNorm returns the input's dtype whatever its weight's (the product in fp32): the fused forward
    does so too, against Gemma's own forward (fp32 weight under bf16 input, bf16 weight under fp32 input); a fp64
    input runs Gemma's forward (which computes it in fp32)."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    from megakernels.integrations.transformers._forwards import offset_rms_norm_forward

    torch.manual_seed(0)
    for weight, x_dtype, tol in ((torch.float32, torch.bfloat16, 1e-2), (torch.bfloat16, torch.float32, 1e-6)):
        norm = Gemma3RMSNorm(32).to(weight)
        with torch.no_grad():
            norm.weight.normal_(0.0, 0.5)
        x = torch.randn(3, 5, 32).to(x_dtype)
        with MegakernelsOps() as seen:
            got = offset_rms_norm_forward(norm, x)
        expected = norm(x)
        assert "norm_fwd" in seen.names and got.dtype == expected.dtype == x_dtype
        torch.testing.assert_close(got.float(), expected.float(), rtol=tol, atol=tol)
    x = torch.randn(4, 32, dtype=torch.float64)
    with MegakernelsOps() as seen:
        got = offset_rms_norm_forward(norm, x)
    assert not seen.names and torch.equal(got, norm(x))


def test_gpt_oss_norms_kept_in_fp32_in_a_fp16_model_stay_fused(tmp_path):
    """transformers keeps gpt-oss's norms in fp32 when it loads the model in fp16 (_keep_in_fp32_modules); their
    forward returns fp16 whatever the weight's dtype, so the fused norm serves them: the loaded patched model runs
    it on every norm, and its logits are as accurate against the fp32 model as the unpatched fp16 model's."""
    ref = H.build("gpt_oss")
    ref.save_pretrained(tmp_path)
    plain = H.model_class("gpt_oss").from_pretrained(tmp_path, dtype=torch.float16)
    with mkt.patch_classes("gpt_oss"):
        model = H.model_class("gpt_oss").from_pretrained(tmp_path, dtype=torch.float16)
    assert model.model.norm.weight.dtype == torch.float32 and model.model.embed_tokens.weight.dtype == torch.float16
    ids = H.batch()
    calls = []
    for m in model.modules():
        if type(m).__name__ == "GptOssRMSNorm":
            m.register_forward_hook(lambda mod, args, out: calls.append(out.dtype))
    with torch.no_grad():
        expected = ref(input_ids=ids).logits
        unpatched = plain(input_ids=ids).logits.float()
        with MegakernelsOps() as seen:
            got = model(input_ids=ids).logits.float()
    assert "norm_fwd" in seen.names and calls == [torch.float16] * 5
    rel = float((got - expected).norm() / expected.norm())
    assert rel <= 2 * float((unpatched - expected).norm() / expected.norm()) + 2e-3


def test_gpt_oss_experts_are_fused_whatever_the_configs_activation_says():
    """gpt-oss's experts compute their clamped SwiGLU, not ``hidden_act``: a config naming another activation
    still gets the fused experts, equal to the unpatched model's."""
    ref = _built("gpt_oss", hidden_act="gelu")
    model = copy.deepcopy(ref)
    assert mkt.apply(model)["experts"] == 2
    ids = H.batch()
    with torch.no_grad(), MegakernelsOps() as seen:
        got = model(input_ids=ids).logits
    assert "grouped_gemm" in seen.names
    with torch.no_grad():
        torch.testing.assert_close(got, ref(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
