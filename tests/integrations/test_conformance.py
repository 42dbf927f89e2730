"""What transformers' own ModelTester and generation checks ask of a model, asked of class-patched models of every
family the integration patches (written here from the behaviour those checks test; the configs use SiLU where the
family has a gated MLP, Gemma 3 its tanh GeLU, so the SwiGLU, GeGLU and expert patches are live): attention weights
on request, the attention and experts implementations following the caller (set at load or afterwards), gradients
retained on hidden states and attention weights, left-padded generation, and forwards whose signatures are the
classes'. The reference is always the unpatched model with the same weights."""

from __future__ import annotations

import inspect
import json

import pytest
import torch

import megakernels.integrations.transformers as mkt
from tests.integrations import hf_models as H
from tests.integrations.test_transformers import MegakernelsOps

MOE = ("mixtral", "qwen3_moe", "gpt_oss", "deepseek_v3", "deepseek_v2")


def _patched_name(family: str) -> str:
    """The attention implementation a patched model of ``family`` reports when the caller chose none: transformers'
    default ``"sdpa"``, or ``"megakernels"`` where transformers' default is another (gpt-oss: ``"eager"``, as it has
    no SDPA path)."""
    return "sdpa" if mkt.FAMILIES[family].attention_default == "sdpa" else "megakernels"


def _pair(family: str, **options):
    """(unpatched, class-patched) models of ``family`` with the same weights, in evaluation mode."""
    ref = H.build(family).eval()
    with mkt.patch_classes(family, **options):
        model = type(ref)(H.config(family))
    model.load_state_dict(ref.state_dict())
    return ref, model.eval()


def _inputs(family: str, padded: bool = False):
    ids = H.batch(seed=3, batch=2, seq=8)
    mask = torch.ones_like(ids)
    if padded:
        mask[0, :3] = 0
    return {"input_ids": ids, "attention_mask": mask}


def _switching(ref, model, kind: str, op: str, cases) -> None:
    """``model.set_<kind>_implementation(impl)`` for each (impl, ours) of ``cases``: the config says ``impl``,
    megakernels' ``op`` runs exactly where ``ours``, and the logits are the unpatched model's."""
    kwargs = _inputs(model.config.model_type)
    with torch.no_grad():
        expected = ref(**kwargs).logits
        for impl, ours in cases:
            getattr(model, f"set_{kind}_implementation")(impl)
            assert getattr(model.config, f"_{kind}_implementation") == impl
            with MegakernelsOps() as seen:
                got = model(**kwargs).logits
            assert (op in seen.names) == ours, impl
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", H.FAMILIES)
def test_attention_weights_are_returned_on_request(family):
    """output_attentions=True: the patched model under its default implementation returns every layer's weights
    (the family's eager attention, as transformers' "eager"), equal to the unpatched eager model's; so does a model
    loaded with attn_implementation="eager" under the class patch (which it keeps)."""
    ref, model = _pair(family)
    ref.set_attn_implementation("eager")
    layers = H.config(family).num_hidden_layers
    for padded in (False, True):
        kwargs = _inputs(family, padded)
        with torch.no_grad():
            expected = ref(**kwargs, output_attentions=True)
            got = model(**kwargs, output_attentions=True)
        assert len(got.attentions) == layers and got.attentions[0].shape == expected.attentions[0].shape
        for a, b in zip(got.attentions, expected.attentions):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got.logits, expected.logits, rtol=1e-5, atol=1e-5)
    with mkt.patch_classes(family):
        eager = type(ref)._from_config(H.config(family), attn_implementation="eager")
    assert eager.config._attn_implementation == "eager"
    eager.load_state_dict(ref.state_dict())
    with torch.no_grad(), MegakernelsOps() as seen:
        out = eager.eval()(**_inputs(family), output_attentions=True)
    assert "flash_attn_fwd" not in seen.names and len(out.attentions) == layers


@pytest.mark.parametrize("family", H.FAMILIES)
def test_the_attention_implementation_can_be_set_dynamically(family):
    """set_attn_implementation after the patch: the config says what was set, the model computes it (eager runs no
    FlashAttention), an unknown name is refused as transformers refuses it, and back to "sdpa" (gpt-oss:
    "megakernels") the model runs megakernels' kernel again."""
    ref, model = _pair(family)
    name = _patched_name(family)
    _switching(ref, model, "attn", "flash_attn_fwd", (("eager", False), (name, True)))
    with pytest.raises(ValueError, match='Specified `attn_implementation="foo"` is not supported'):
        model.set_attn_implementation("foo")
    assert model.config._attn_implementation == name


@pytest.mark.parametrize("family", H.FAMILIES)
def test_gradients_are_retained_on_hidden_states_and_attention_weights(family):
    """Hidden states and attention weights requested from a training forward keep their gradients (retain_grad),
    equal to the unpatched eager model's."""
    ref, model = _pair(family)
    ref.set_attn_implementation("eager")
    grads = []
    for m in (ref, model):
        out = m.train()(**_inputs(family), output_hidden_states=True, output_attentions=True)
        hidden, attention = out.hidden_states[1], out.attentions[0]
        hidden.retain_grad()
        attention.retain_grad()
        out.logits[:, -1].sum().backward(retain_graph=True)
        grads.append((hidden.grad, attention.grad))
    (h0, a0), (h1, a1) = grads
    assert h1 is not None and a1 is not None and h0.abs().sum() > 0 and a0.abs().sum() > 0
    torch.testing.assert_close(h1, h0, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(a1, a0, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("family", H.FAMILIES)
def test_loading_dispatches_to_the_requested_attention(family, tmp_path):
    """Under the class patch, from_pretrained without a choice runs transformers' default name ("sdpa"; gpt-oss,
    whose default is "eager": "megakernels") on megakernels' kernel; with attn_implementation="eager" or "sdpa"
    (where the family has it) the model keeps what was asked (no FlashAttention), down to every attention module's
    config. The saved config says nothing of the patch."""
    ref = H.build(family)
    ref.save_pretrained(tmp_path)
    kwargs = _inputs(family)
    with torch.no_grad():
        expected = ref.eval()(**kwargs).logits
    name = _patched_name(family)
    for asked, flash in ((None, True), ("eager", False)) + ((("sdpa", False),) if name == "sdpa" else ()):
        with mkt.patch_classes(family):
            model = type(ref).from_pretrained(tmp_path, **({} if asked is None else {"attn_implementation": asked}))
        assert model.config._attn_implementation == (asked or name)
        for m in model.modules():
            if type(m).__name__.endswith("Attention") and hasattr(m, "config"):
                assert m.config._attn_implementation == (asked or name)
        with torch.no_grad(), MegakernelsOps() as seen:
            got = model.eval()(**kwargs).logits
        assert ("flash_attn_fwd" in seen.names) == flash, asked
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    model.save_pretrained(tmp_path / "again")
    saved = json.loads((tmp_path / "again" / "config.json").read_text())
    assert json.loads((tmp_path / "config.json").read_text()).keys() == saved.keys()
    assert not [k for k in saved if "megakernels" in k or "attn_implementation" in k]


@pytest.mark.parametrize("family", MOE)
def test_eager_batched_and_grouped_experts_agree(family):
    """The experts follow set_experts_implementation and the experts_implementation argument: megakernels' grouped
    GEMM under the default ("grouped_mm"), transformers' eager and batched_mm loops as set, the same outputs."""
    ref, model = _pair(family)
    _switching(ref, model, "experts", "grouped_gemm", (("grouped_mm", True), ("eager", False), ("batched_mm", False)))
    kwargs = _inputs(family)
    with torch.no_grad():
        expected = ref(**kwargs).logits
    for asked, ours in (("eager", False), ("megakernels", True)):
        with mkt.patch_classes(family):
            chosen = type(ref)._from_config(H.config(family), experts_implementation=asked)
        assert chosen.config._experts_implementation == asked
        chosen.load_state_dict(ref.state_dict())
        with torch.no_grad(), MegakernelsOps() as seen:
            torch.testing.assert_close(chosen.eval()(**kwargs).logits, expected, rtol=1e-5, atol=1e-5)
        assert ("grouped_gemm" in seen.names) == ours, asked


@pytest.mark.parametrize("family", H.FAMILIES)
def test_left_padded_generation_matches_the_unpatched_model(family):
    """Greedy generation from a left-padded batch (transformers builds position ids from the mask, which needs the
    forward's real signature): the same tokens and scores; with the fused head too where the family has one."""
    options = [{}] + ([{"fused_head": True}] if mkt.FAMILIES[family].fused_head else [])
    kwargs = _inputs(family, padded=True)
    kwargs["input_ids"][0, :3] = 0  # the padding id
    gen = dict(max_new_tokens=5, do_sample=False, pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    for opts in options:
        ref, model = _pair(family, **opts)
        expected = ref.generate(**kwargs, **gen)
        got = model.generate(**kwargs, **gen)
        assert torch.equal(got.sequences, expected.sequences), opts
        for a, b in zip(got.scores, expected.scores):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_gpt2_generation_takes_token_type_ids_with_the_fused_head():
    ref, model = _pair("gpt2", fused_head=True)
    kwargs = _inputs("gpt2")
    types = torch.ones_like(kwargs["input_ids"])
    gen = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    expected = ref.generate(**kwargs, token_type_ids=types, **gen)
    assert torch.equal(model.generate(**kwargs, token_type_ids=types, **gen), expected)


@pytest.mark.parametrize("family", H.FAMILIES)
def test_patched_forwards_have_their_classes_signatures(family):
    """What inspects a forward (generate, TRL, PEFT) sees the class's parameters, the model's and every module's."""
    options = {"fused_head": True} if mkt.FAMILIES[family].fused_head else {}
    _, model = _pair(family, **options)
    bound = [m for m in model.modules() if getattr(m.__dict__.get("forward"), "megakernels", False)]
    assert len(bound) > 3 and (not options or model in bound)
    for m in bound:
        expected = inspect.signature(type(m).forward)
        expected = expected.replace(parameters=list(expected.parameters.values())[1:])
        assert inspect.signature(m.forward) == expected, type(m).__name__


@pytest.mark.parametrize("family", H.FAMILIES)
def test_a_model_can_be_built_on_the_meta_device_under_the_class_patch(family):
    """transformers builds models on the meta device (to load big checkpoints; its tests do too): under the class
    patch, fused head included, the model built there has the same forwards bound as one built on the CPU."""
    options = {"fused_head": True} if mkt.FAMILIES[family].fused_head else {}

    def bound(model):
        return [n for n, m in model.named_modules() if getattr(m.__dict__.get("forward"), "megakernels", False)]

    with mkt.patch_classes(family, **options):
        with torch.device("meta"):
            model = H.model_class(family)(H.config(family))
        on_cpu = H.model_class(family)(H.config(family))
    assert all(p.device.type == "meta" for p in model.parameters())
    assert bound(model) == bound(on_cpu) and bound(model)
