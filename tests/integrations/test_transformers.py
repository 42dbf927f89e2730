"""megakernels.integrations.transformers: a patched model computes what the unpatched one computes (logits, loss,
every parameter gradient, greedy generation with the KV cache), through the fused ops, for each family, patched
in place or through its classes.

Tolerances: fp32 within 1e-5 (logits, loss) and 1e-4 relative + 1e-6 absolute (gradients). bf16 (documented in
docs/integrations.md): against the fp32 model, the relative L2 error of the patched bf16 model's logits and of each
gradient is at most twice the unpatched bf16 model's, plus 0.002.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import megakernels.integrations.transformers as mkt
from tests.integrations import hf_models as H

# The fused ops each family's patched forward + backward must reach.
ROUTER = ("moe_router_fwd", "moe_router_bwd")
EXPECTED_OPS = {
    "gpt2": {"norm_fwd", "bias_gelu_fwd", "flash_attn_fwd", "cross_entropy_stats"},
    "bert": {"norm_fwd", "bias_gelu_fwd", "flash_attn_fwd", "cross_entropy_stats"},
    "llama": {"norm_fwd", "swiglu_fwd", "flash_attn_fwd", "cross_entropy_stats"},
    "mistral": {"norm_fwd", "swiglu_fwd", "flash_attn_fwd", "cross_entropy_stats"},
    "mixtral": {"norm_fwd", "swiglu_fwd", "grouped_gemm", *ROUTER, "flash_attn_fwd", "cross_entropy_stats"},
    "qwen2": {"norm_fwd", "swiglu_fwd", "flash_attn_fwd", "cross_entropy_stats"},
    "qwen3": {"norm_fwd", "swiglu_fwd", "flash_attn_fwd", "cross_entropy_stats"},
    "qwen3_moe": {"norm_fwd", "swiglu_fwd", "grouped_gemm", *ROUTER, "flash_attn_fwd", "cross_entropy_stats"},
    "gemma3_text": {"norm_fwd", "swiglu_fwd", "flash_attn_fwd", "cross_entropy_stats"},  # GeGLU: the swiglu op
    "gpt_oss": {"norm_fwd", "swiglu_fwd", "grouped_gemm", *ROUTER, "flash_attn_fwd", "cross_entropy_stats"},
    "deepseek_v3": {"norm_fwd", "swiglu_fwd", "grouped_gemm", *ROUTER, "flash_attn_fwd", "cross_entropy_stats"},
    "deepseek_v2": {"norm_fwd", "swiglu_fwd", "grouped_gemm", *ROUTER, "flash_attn_fwd", "cross_entropy_stats"},
}


class MegakernelsOps(TorchDispatchMode):
    """Records the names of the ``megakernels::`` ops dispatched while active."""

    def __init__(self):
        super().__init__()
        self.names = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "megakernels":
            self.names.add(func._opname)
        return func(*args, **(kwargs or {}))


def patched_copy(model, mode: str, family: str):
    """``model``'s weights in a patched model: patched in place, or rebuilt under the family's class patch."""
    if mode == "in_place":
        twin = copy.deepcopy(model)
        mkt.apply(twin)
        return twin
    with mkt.patch_classes(family):
        twin = type(model)(copy.deepcopy(model.config))  # its own config: the patch records itself on the config
    twin.load_state_dict(model.state_dict())
    return twin


def step(model, ids, labels=None, **kwargs):
    """Loss and logits of one training forward on ``ids`` (labels: ``ids`` unless given), and every parameter's
    gradient."""
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids if labels is None else labels, **kwargs)
    out.loss.backward()
    return out.logits.detach(), out.loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("mode", ["in_place", "classes"])
@pytest.mark.parametrize("family", H.FAMILIES)
def test_patched_model_matches_unpatched_fp32(family, mode):
    ref = H.build(family)
    model = patched_copy(ref, mode, family)
    ids = H.batch()
    logits0, loss0, grads0 = step(ref, ids)
    with MegakernelsOps() as seen:
        logits1, loss1, grads1 = step(model, ids)
    assert EXPECTED_OPS[family] <= seen.names
    torch.testing.assert_close(logits1, logits0, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss1, loss0, rtol=1e-5, atol=1e-6)
    assert grads1.keys() == grads0.keys()
    for name, g in grads0.items():
        assert grads1[name] is not None, name
        torch.testing.assert_close(grads1[name], g, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")


ROUTED = ("mixtral", "qwen3_moe", "gpt_oss", "deepseek_v3", "deepseek_v2")


@pytest.mark.parametrize("family", ROUTED)
def test_patched_routers_route_as_the_classes_do(family):
    """Each MoE family's router alone, fp32, on tokens whose scores have no ties: the same logits, the same k experts
    per token with the same weights (in either order: the classes' top-k is unsorted in DeepSeek's), the gradients
    of a weighted sum of the weights and the logits equal; DeepSeek's correction bias moves the choice in both."""
    from megakernels.integrations.transformers._families import FAMILIES

    ref = H.build(family)
    name = next(iter(FAMILIES[family].routers))
    router = next(m for m in ref.modules() if type(m).__name__ == name)
    with torch.no_grad():
        router.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(1))
        if hasattr(router, "e_score_correction_bias"):
            router.e_score_correction_bias.uniform_(-0.5, 0.5, generator=torch.Generator().manual_seed(2))
    patched = copy.deepcopy(router)
    model = copy.deepcopy(ref)
    assert mkt.apply(model)["routers"] >= 1
    bound = next(m for m in model.modules() if type(m).__name__ == name).forward  # the patch's, on this copy
    patched.forward = functools.partial(bound.func, patched, **bound.keywords)
    for m in (router, patched):
        m.zero_grad(set_to_none=True)
    x = torch.randn(24, router.hidden_dim, generator=torch.Generator().manual_seed(3))
    dw = torch.randn(24, router.top_k, generator=torch.Generator().manual_seed(4))
    outs = []
    for m in (router, patched):
        xi = x.clone().requires_grad_(True)
        logits, weights, index = m(xi)
        index, order = index.sort(-1)
        weights = weights.gather(1, order)
        ((weights * dw).sum() + logits.square().sum() * 1e-2).backward()
        outs.append((logits.detach(), weights.detach(), index, xi.grad, m.weight.grad))
    (l0, w0, i0, gx0, gw0), (l1, w1, i1, gx1, gw1) = outs
    torch.testing.assert_close(l1, l0, rtol=0, atol=0)
    assert torch.equal(i1, i0)
    torch.testing.assert_close(w1, w0, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(gx1, gx0, rtol=1e-5, atol=1e-6)  # fp32 rounding: the fused backward's sums
    torch.testing.assert_close(gw1, gw0, rtol=1e-5, atol=1e-6)


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.float() - ref).norm() / ref.norm())


@pytest.mark.parametrize("family", ["gpt2", "llama", "mixtral", "gemma3_text", "gpt_oss"])
def test_patched_bf16_is_as_accurate_as_unpatched_bf16(family):
    ref = H.build(family)
    plain = copy.deepcopy(ref).to(torch.bfloat16)
    model = copy.deepcopy(ref).to(torch.bfloat16)
    mkt.apply(model)
    ids = H.batch()
    logits, _, grads = step(ref, ids)
    logits_u, _, grads_u = step(plain, ids)
    logits_p, _, grads_p = step(model, ids)
    assert _rel(logits_p, logits) <= 2 * _rel(logits_u, logits) + 2e-3
    scale = max(g.norm() for g in grads.values())
    for name, g in grads.items():
        if g.norm() < 1e-6 * scale:  # the key biases: their gradient is zero (softmax ignores a per-row shift)
            continue
        assert _rel(grads_p[name], g) <= 2 * _rel(grads_u[name], g) + 2e-3, name


@pytest.mark.parametrize("family", H.FAMILIES)
def test_greedy_generation_with_kv_cache_gives_the_same_tokens(family):
    ref = H.build(family).eval()
    model = copy.deepcopy(ref)
    mkt.apply(model)
    prompt = H.batch(seed=1, batch=2, seq=5)
    kwargs = dict(max_new_tokens=10, do_sample=False, use_cache=True, pad_token_id=0)
    expected = ref.generate(prompt, **kwargs)
    with MegakernelsOps() as seen:
        got = model.generate(prompt, **kwargs)
    assert "flash_attn_fwd" in seen.names
    assert got.shape == (2, 15)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("family", ["llama", "mixtral", "qwen3_moe", "gemma3_text", "gpt_oss"])
def test_patched_model_compiles_as_one_graph(family):
    """fullgraph=True: the MoE dispatch has no data-dependent shape and no host read outside an op; forward and
    backward equal the unpatched eager model's."""
    ref = H.build(family)
    model = copy.deepcopy(ref)
    mkt.apply(model)
    ids = H.batch()
    torch._dynamo.reset()  # a fresh compile per family: another family's scale would make the next one's symbolic
    compiled = torch.compile(lambda i: model(input_ids=i, labels=i).loss, fullgraph=True, backend="aot_eager")
    loss = compiled(ids)
    loss.backward()
    expected = ref(input_ids=ids, labels=ids).loss
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    grads = dict(model.named_parameters())
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name].grad, p.grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen3", "qwen3_moe", "gpt_oss", "deepseek_v3", "deepseek_v2"])
def test_a_padding_free_packed_batch_runs_flash_attention_per_sequence(family):
    """DataCollatorWithFlattening's batches (sequences concatenated, position_ids restarting, -100 at each
    sequence's first label): no mask is made, FlashAttention keeps the sequences apart (Mistral's window inside
    each); logits, loss and gradients equal those of each sequence run alone through the unpatched model (the
    loss over the same labels)."""
    from transformers import DataCollatorWithFlattening
    from transformers.loss.loss_utils import ForCausalLMLoss

    ref = H.build(family)
    model = copy.deepcopy(ref)
    mkt.apply(model)
    seqs = [H.batch(seed=i, batch=1, seq=n)[0] for i, n in enumerate((5, 9, 4))]
    batch = DataCollatorWithFlattening()([{"input_ids": s.tolist()} for s in seqs])
    with MegakernelsOps() as seen:
        logits, loss, grads = step(
            model, batch["input_ids"], position_ids=batch["position_ids"], labels=batch["labels"]
        )
    assert "flash_attn_fwd" in seen.names
    ref.zero_grad(set_to_none=True)
    alone = torch.cat([ref(input_ids=s[None]).logits for s in seqs], 1)
    expected = ForCausalLMLoss(alone, batch["labels"], H.VOCAB)
    expected.backward()
    torch.testing.assert_close(logits, alone.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-5, atol=1e-6)
    for name, p in ref.named_parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)  # experts no token reached
        got = grads[name] if grads[name] is not None else torch.zeros_like(p)
        torch.testing.assert_close(got, g, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("mode", ["in_place", "classes"])
@pytest.mark.parametrize(
    "family", ["gpt2", "llama", "mistral", "qwen2", "qwen3", "gemma3_text", "gpt_oss", "deepseek_v3", "deepseek_v2"]
)
def test_the_fused_head_trains_like_the_unpatched_model_without_its_logits(family, mode):
    """fused_head=True: in training with labels the LM head and loss are one linear_cross_entropy (no logits made),
    loss and every gradient equal the unpatched model's (labels with -100 and num_items_in_batch too); reading
    the output's logits computes them then (the unpatched model's); in evaluation mode the logits are there as
    before."""
    ref = H.build(family)
    if mode == "in_place":
        model = copy.deepcopy(ref)
        assert mkt.apply(model, fused_head=True)["fused_head"]
    else:
        with mkt.patch_classes(family, fused_head=True):
            model = type(ref)(copy.deepcopy(ref.config))
        model.load_state_dict(ref.state_dict())
    ids = H.batch()
    labels = ids.clone()
    labels[0, :3] = -100
    for extra in ({}, {"num_items_in_batch": torch.tensor(13)}):
        model.zero_grad(set_to_none=True)
        with MegakernelsOps() as seen:
            out = model(input_ids=ids, labels=labels, **extra)
            out.loss.backward()
        assert "logits" not in out.keys() and "linear_cross_entropy_stats" in seen.names
        logits0, loss0, grads0 = step(ref, ids, labels, **extra)
        torch.testing.assert_close(out.loss.detach(), loss0, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(out.logits.detach(), logits0, rtol=1e-5, atol=1e-5)  # made now, on the read
        assert "logits" in out.keys()
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad, grads0[name], rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids, labels=labels).logits, ref.eval()(input_ids=ids).logits)


def test_the_fused_head_is_refused_where_the_model_has_none():
    families = "deepseek_v2, deepseek_v3, gemma3_text, gpt2, gpt_oss, llama, mistral, qwen2, qwen3"
    expected = rf"fused_head is for the causal LMs of {families}; got a"
    with pytest.raises(ValueError, match=expected):
        mkt.apply(H.build("mixtral"), fused_head=True)


def test_padded_batch_falls_back_to_sdpa_with_the_same_logits():
    ref = H.build("llama")
    model = copy.deepcopy(ref)
    mkt.apply(model)
    ids = H.batch()
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left padding: transformers builds a mask, which FlashAttention does not take
    expected = ref(input_ids=ids, attention_mask=mask).logits
    with MegakernelsOps() as seen:
        got = model(input_ids=ids, attention_mask=mask).logits
    assert "flash_attn_fwd" not in seen.names
    torch.testing.assert_close(got[:, 4:], expected[:, 4:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], expected[1], rtol=1e-5, atol=1e-5)


def test_causal_lm_loss_matches_transformers_with_ignored_tokens_and_num_items_in_batch():
    from transformers.loss.loss_utils import ForCausalLMLoss

    from megakernels.integrations.transformers._forwards import causal_lm_loss

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 7, 50, generator=g, dtype=torch.float64).float().requires_grad_()
    labels = torch.randint(0, 50, (3, 7), generator=g)
    labels[0, 2:5] = -100
    for n_items in (None, 11, torch.tensor(11)):
        expected = ForCausalLMLoss(logits, labels, 50, num_items_in_batch=n_items)
        got = causal_lm_loss(logits, labels, 50, num_items_in_batch=n_items)
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
        (ge,) = torch.autograd.grad(expected, logits)
        (gg,) = torch.autograd.grad(got, logits)
        torch.testing.assert_close(gg, ge, rtol=1e-5, atol=1e-7)


def test_bf16_logits_reach_the_loss_without_an_fp32_copy():
    from megakernels.integrations.transformers._forwards import causal_lm_loss

    logits = torch.randn(2, 5, 40).to(torch.bfloat16)
    labels = torch.randint(0, 40, (2, 5))
    with MegakernelsOps() as seen, torch.no_grad():
        causal_lm_loss(logits, labels, 40)
    assert "cross_entropy_stats" in seen.names  # the fused op reads the bf16 logits


def test_patch_leaves_parameters_and_state_dict_names_unchanged():
    ref = H.build("mixtral")
    model = copy.deepcopy(ref)
    mkt.apply(model)
    assert list(model.state_dict()) == list(ref.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), ref.state_dict().values()))
    ref.load_state_dict(model.state_dict())  # and each loads into the other


def test_apply_reports_what_it_patched():
    done = mkt.apply(H.build("llama"), attention=False, loss=False)
    assert done == {
        "norms": 5,
        "mlp": 2,
        "routers": 0,
        "experts": 0,
        "linears": 7 * 2 + 1,  # every nn.Linear: q, k, v, o, gate, up, down of both layers, and the LM head
        "attention": False,
        "loss": False,
        "fused_head": False,
        "tied_embeddings": False,  # its LM head has a table of its own
        "declined": [],
    }
    done = mkt.apply(H.build("mixtral"))
    assert done["experts"] == 2 and done["routers"] == 2  # one expert bank and its router a layer


class AtenOps(TorchDispatchMode):
    """Counts the aten ops dispatched while active."""

    def __init__(self):
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._opname
        self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ["gpt2", "llama", "gemma3_text"])
def test_a_tied_table_gets_the_lookup_rows_added_into_the_heads_gradient(family, dtype):
    """GPT-2 ties its word embedding to the LM head; Llama does with ``tie_word_embeddings`` (and has a padding
    row, which the lookup gives no gradient); Gemma 3 does by default, its lookup scaled by sqrt(hidden). The
    patched model computes the table's gradient without the dense embedding backward or the engine's add of two
    tables, equal to the unpatched model's to fp32 rounding (bf16: as accurate against the fp32 model)."""
    ref = H.build(family)
    if family == "llama":
        ref.config.tie_word_embeddings = True
        ref.tie_weights()
    table = ref.get_input_embeddings().weight
    assert ref.get_output_embeddings().weight is table
    plain = copy.deepcopy(ref).to(dtype)
    model = copy.deepcopy(ref).to(dtype)
    assert mkt.apply(model)["tied_embeddings"]
    ids = H.batch()
    ids[0, :3] = 0  # the padding id (Llama's padding_idx; an ordinary token for GPT-2)
    name = next(n for n, p in ref.named_parameters() if p is table)
    _, _, grads = step(ref, ids)
    with AtenOps() as unpatched:
        _, _, grads_u = step(plain, ids)
    with AtenOps() as seen:
        _, _, grads_p = step(model, ids)
    # the word table's dense embedding backward is gone (GPT-2's position table keeps its own)
    dense = "embedding_dense_backward"
    assert seen.counts.get(dense, 0) == unpatched.counts[dense] - 1
    assert model.get_input_embeddings().forward.keywords["table"].folds == 1
    if dtype == torch.float32:
        atol = 1e-6 if family == "gemma3_text" else 1e-7  # Gemma's rows come scaled by sqrt(32) into the fp32 sums
        for n, g in grads_u.items():
            torch.testing.assert_close(grads_p[n], g, rtol=1e-5, atol=atol, msg=lambda m: f"{n}: {m}")
    else:
        assert _rel(grads_p[name], grads[name]) <= 2 * _rel(grads_u[name], grads[name]) + 2e-3
    # a second backward without zeroing accumulates as the unpatched model does
    second = {}
    for key, m in (("ref", ref), ("plain", plain), ("model", model)):
        m(input_ids=ids, labels=ids).loss.backward()
        second[key] = dict(m.named_parameters())[name].grad
    assert model.get_input_embeddings().forward.keywords["table"].folds == 2
    if dtype == torch.float32:
        torch.testing.assert_close(second["model"], second["plain"], rtol=1e-5, atol=atol)
    else:
        assert _rel(second["model"], second["ref"]) <= 2 * _rel(second["plain"], second["ref"]) + 2e-3


def test_the_tied_table_folds_into_the_fused_heads_gradient():
    """A tied Llama with the fused head: linear_cross_entropy's weight gradient takes the lookup's rows (no dense
    embedding backward), and every gradient is the unpatched model's."""
    ref = H.build("llama")
    ref.config.tie_word_embeddings = True
    ref.tie_weights()
    model = copy.deepcopy(ref)
    done = mkt.apply(model, fused_head=True)
    assert done["fused_head"] and done["tied_embeddings"]
    ids = H.batch()
    with AtenOps() as seen:
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
    assert "logits" not in out.keys() and "embedding_dense_backward" not in seen.counts
    assert model.get_input_embeddings().forward.keywords["table"].folds == 1
    _, loss0, grads0 = step(ref, ids)
    torch.testing.assert_close(out.loss.detach(), loss0, rtol=1e-5, atol=1e-6)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads0[name], rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_the_tied_table_is_left_alone_when_asked_and_without_autograd():
    assert not mkt.apply(H.build("gpt2"), tied_embeddings=False)["tied_embeddings"]
    model = H.build("gpt2")
    mkt.apply(model)
    assert model.get_input_embeddings().forward.megakernels
    with AtenOps() as seen:  # generation (no autograd) runs the plain lookup
        with torch.no_grad():
            model(input_ids=H.batch())
    assert "embedding" in seen.counts


def test_unselected_parts_keep_transformers_forwards():
    model = H.build("llama")
    mkt.apply(model, norms=False, mlp=True, attention=False, loss=False)
    with MegakernelsOps() as seen:
        step(model, H.batch())
    assert seen.names == {"swiglu_fwd", "swiglu_bwd"}


def test_class_patch_reverts():
    from transformers.models.llama import modeling_llama

    hooked = ("__init__", "post_init", "from_pretrained", "_from_config")
    before = {name: modeling_llama.LlamaPreTrainedModel.__dict__.get(name) for name in hooked}
    with mkt.patch_llama() as patch:
        assert patch.active
        assert "forward" in H.build("llama").model.norm.__dict__
    assert not patch.active
    assert {name: modeling_llama.LlamaPreTrainedModel.__dict__.get(name) for name in hooked} == before
    model = H.build("llama")
    assert "forward" not in model.model.norm.__dict__
    with MegakernelsOps() as seen:
        model(input_ids=H.batch())
    assert not seen.names  # attention included: the model built after the revert is transformers' own


def test_class_patch_twice_is_refused():
    with mkt.patch_gpt2():
        with pytest.raises(ValueError, match="'gpt2' classes are patched already"):
            mkt.patch_gpt2()


def test_class_patched_from_pretrained_is_patched(tmp_path):
    """Loaded under the class patch, a model keeps the fused forwards post_init bound: transformers' default
    kernelization with the `kernels` hub (which unbinds them from the layers it maps) is off unless asked for."""
    ref = H.build("mistral")
    ref.save_pretrained(tmp_path)
    with mkt.patch_mistral():
        model = type(ref).from_pretrained(tmp_path)
    assert model.config._attn_implementation == "sdpa"  # transformers' default, its calls on megakernels' kernel
    ids = H.batch()
    with MegakernelsOps() as seen:
        got = model(input_ids=ids).logits
    assert EXPECTED_OPS["mistral"] - {"cross_entropy_stats"} <= seen.names
    torch.testing.assert_close(got, ref(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


def test_attn_implementation_megakernels_is_registered():
    import transformers

    mkt.register()
    model = transformers.AutoModelForCausalLM.from_config(H.config("gpt2"), attn_implementation="megakernels")
    with MegakernelsOps() as seen:
        model(input_ids=H.batch())
    assert "flash_attn_fwd" in seen.names


def test_unknown_model_type_is_refused_naming_it():
    import transformers

    config = transformers.GPTNeoXConfig(
        num_hidden_layers=1, hidden_size=32, num_attention_heads=4, intermediate_size=64, vocab_size=64
    )
    model = transformers.GPTNeoXForCausalLM(config)
    with pytest.raises(ValueError, match="model type 'gpt_neox' is not supported"):
        mkt.apply(model)
    with pytest.raises(ValueError, match="model type 'gpt_neox' is not supported"):
        mkt.patch_classes("gpt_neox")


def test_every_family_is_documented_tested_and_has_its_class_patch():
    """Each model type the integration knows is in docs/integrations.md's table, in ``apply``'s list, among the
    tiny models every per-family test runs, and has a ``patch_*`` helper (exported) that patches its classes."""
    from pathlib import Path

    page = (Path(__file__).resolve().parents[2] / "docs" / "integrations.md").read_text(encoding="utf-8")
    rows = [line for line in page.splitlines() if line.startswith("| `")]
    helpers = {name for name in mkt.__all__ if name.startswith("patch_") and name != "patch_classes"}
    assert set(mkt.supported_model_types()) == set(H.FAMILIES)
    for family in mkt.supported_model_types():
        assert any(f"`{family}`" in row.split("|")[1] for row in rows), family
        assert family in mkt.apply.__doc__, family
    for name in helpers:
        assert f"`{name}`" in page, name
        with getattr(mkt, name)() as patch:
            assert patch.model_type in mkt.FAMILIES and name.startswith(f"patch_{patch.model_type.split('_text')[0]}")
    assert len(helpers) == len(mkt.FAMILIES)


def test_a_module_that_is_not_a_transformers_model_is_refused():
    with pytest.raises(TypeError, match="model must be a transformers PreTrainedModel, got Linear"):
        mkt.apply(torch.nn.Linear(2, 2))


def test_transformers_older_than_the_minimum_is_refused(monkeypatch):
    import transformers

    monkeypatch.setattr(transformers, "__version__", "4.45.0")
    with pytest.raises(ImportError, match=r"transformers 4.45.0 is installed; megakernels needs >= 5.0.0"):
        mkt.apply(H.build("gpt2"))


@pytest.mark.parametrize("reentrant", [True, False])
def test_the_tied_table_folds_under_gradient_checkpointing(reentrant):
    """transformers' gradient checkpointing recomputes the blocks in the backward (reentrant: in a nested backward of
    its own); the lookup and the head stay outside, and the table's gradient is the unpatched model's."""
    ref = H.build("gpt2")
    ref.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model = copy.deepcopy(ref)
    mkt.apply(model)
    _, _, grads = step(ref, H.batch())
    _, _, grads_p = step(model, H.batch())
    assert model.get_input_embeddings().forward.keywords["table"].folds == 1
    for n, g in grads.items():
        torch.testing.assert_close(grads_p[n], g, rtol=1e-4, atol=1e-6, msg=lambda m: f"{n}: {m}")


def test_gpt2s_double_heads_model_keeps_its_own_forward():
    """The fused head replaces the forward of causal LMs only: GPT-2's double-heads model (an LM head beside a
    multiple-choice head) is refused, not stripped of its second head."""
    import transformers

    config = H.build("gpt2").config
    model = transformers.GPT2DoubleHeadsModel(config)
    with pytest.raises(ValueError, match="fused_head is for the causal LMs"):
        mkt.apply(model, fused_head=True)
    with mkt.patch_classes("gpt2", fused_head=True):
        model = transformers.GPT2DoubleHeadsModel(config)
    assert not getattr(model.forward, "megakernels", False)


@pytest.mark.parametrize("family", ["gpt2", "bert", "llama"])
def test_a_hooked_or_parametrized_linear_is_called_not_read(family):
    """A fused MLP reads its linears' weights only while they are plain: a forward hook on one (which a read would
    skip) or a parametrization of its weight (another class) makes the MLP run transformers' forward, after the
    patch too; the outputs are the unpatched model's with the same hook / parametrization."""
    import torch.nn.utils.parametrize as parametrize

    def first(model, name):
        return next(m for n, m in model.named_modules() if n.endswith(name))

    read = {"gpt2": "h.0.mlp.c_fc", "bert": "layer.0.intermediate.dense", "llama": "layers.0.mlp.up_proj"}[family]

    class Scale(torch.nn.Module):
        def forward(self, w):
            return 2 * w

    for change in ("hook", "parametrization"):
        ref = H.build(family)
        model = copy.deepcopy(ref)
        mkt.apply(model)  # the change comes after the patch
        for m in (ref, model):
            if change == "hook":
                first(m, read).register_forward_hook(lambda mod, args, out: out * 3)
            else:
                parametrize.register_parametrization(first(m, read), "weight", Scale())
        ids = H.batch()
        torch.testing.assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
