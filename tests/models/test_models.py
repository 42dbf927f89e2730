"""GPT and BERT against plain-PyTorch models written out here (same weights, fp64), in one process; weights that
depend on the seed and the layer, never on which layers a pipeline stage builds; recomputation that changes
nothing; presets and the cost model against the papers' numbers."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from megakernels.parallel.params import is_shared_embedding, is_shared_embedding_duplicate
from megakernels_models.models.bert.model import BertModel
from megakernels_models.models.config import PRESETS, ModelConfig, preset, stage_layers
from megakernels_models.models.gpt.model import GPTModel

GPT = ModelConfig(
    "gpt", num_layers=2, hidden_size=32, num_heads=4, seq_length=16, vocab_size=261, dropout=0.0, attention_dropout=0.0
)
BERT = GPT.replace(model="bert")


def _layer_reference(x, p, prefix, causal, mask=None):
    """One pre-norm layer in plain PyTorch; x [b, s, h]; QKV rows ordered (head, {q,k,v}, head_dim)."""
    b, s, h = x.shape
    n = GPT.num_heads
    ln = lambda y, name: F.layer_norm(y, (h,), p[f"{prefix}.{name}.weight"], p[f"{prefix}.{name}.bias"])  # noqa
    y = ln(x, "input_norm")
    qkv = F.linear(y, p[f"{prefix}.attention.qkv.weight"], p[f"{prefix}.attention.qkv.bias"])
    q, k, v = qkv.view(b, s, n, 3, h // n).permute(3, 0, 2, 1, 4)
    scores = q @ k.transpose(-1, -2) / math.sqrt(h // n)
    if causal:
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    if mask is not None:
        scores = scores.masked_fill(mask[:, None, None, :], float("-inf"))
    ctx = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, h)
    x = x + F.linear(ctx, p[f"{prefix}.attention.proj.weight"], p[f"{prefix}.attention.proj.bias"])
    y = ln(x, "post_attention_norm")
    y = F.gelu(F.linear(y, p[f"{prefix}.mlp.fc1.weight"], p[f"{prefix}.mlp.fc1.bias"]), approximate="tanh")
    return x + F.linear(y, p[f"{prefix}.mlp.fc2.weight"], p[f"{prefix}.mlp.fc2.bias"])


def _params(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().double() for k, v in model.named_parameters()}


def _gpt_reference(p, ids, labels, cfg):
    V, h = cfg.vocab_size, cfg.hidden_size
    x = p["embedding.word.weight"][ids] + p["embedding.position.weight"][: ids.shape[1]]
    for i in range(cfg.num_layers):
        x = _layer_reference(x, p, f"layers.{i}", True)
    x = F.layer_norm(x, (h,), p["final_norm.weight"], p["final_norm.bias"])
    logits = x @ p["embedding.word.weight"][:V].t()
    return F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1), reduction="none").view(labels.shape)


def test_gpt_loss_and_grads_match_plain_pytorch(single_world):
    torch.manual_seed(0)
    model = GPTModel(GPT, seed=7)
    ids = torch.randint(0, 261, (3, GPT.seq_length))
    labels = torch.randint(0, 261, (3, GPT.seq_length))
    loss = model(ids, labels=labels)  # [s, b]
    p = {k: v.requires_grad_(True) for k, v in _params(model).items()}
    ref = _gpt_reference(p, ids, labels, GPT)
    torch.testing.assert_close(loss.t().double(), ref, rtol=1e-5, atol=1e-5)
    loss.sum().backward()
    ref.sum().backward()
    # the tied word table: the lookup's rows went into the LM head's weight gradient (nn.TiedEmbedding)
    assert model.embedding.word.tied.folds == 1
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad.double(), p[name].grad, rtol=1e-4, atol=1e-5, msg=name)


def test_gpt_padded_vocab_rows_are_zero_and_unused(single_world):
    """The vocabulary is padded to 384 rows for GEMM shapes; the padding starts at zero and, whatever it holds,
    never changes the loss (its logits are excluded from the softmax)."""
    model = GPTModel(GPT, seed=7)
    w = model.embedding.word.weight
    assert w.shape[0] == 384 and torch.all(w[261:] == 0)
    ids = torch.randint(0, 261, (2, GPT.seq_length))
    assert model(ids).shape[-1] == 384
    before = model(ids, labels=ids)
    with torch.no_grad():
        w[261:] = 50.0  # logits of the padded columns become huge
    torch.testing.assert_close(model(ids, labels=ids), before, rtol=0, atol=0)


def test_bert_losses_match_plain_pytorch(single_world):
    torch.manual_seed(0)
    model = BertModel(BERT, seed=3)
    b, s, h, V = 2, BERT.seq_length, BERT.hidden_size, BERT.vocab_size
    ids = torch.randint(0, 256, (b, s))
    types = (torch.arange(s) >= s // 2).long().expand(b, s)
    pad = torch.zeros(b, s, dtype=torch.bool)
    pad[1, -5:] = True
    mlm_labels = torch.where(torch.rand(b, s) < 0.3, ids, -100)
    mlm_labels[:, 0] = ids[:, 0]
    sop = torch.tensor([0, 1])
    mlm, sop_loss = model(ids, types, pad, mlm_labels, sop)
    p = _params(model)
    x = p["embedding.word.weight"][ids] + p["embedding.position.weight"][:s] + p["embedding.token_type.weight"][types]
    for i in range(BERT.num_layers):
        x = _layer_reference(x, p, f"layers.{i}", False, pad)
    x = F.layer_norm(x, (h,), p["final_norm.weight"], p["final_norm.bias"])
    y = F.gelu(F.linear(x, p["mlm_dense.weight"], p["mlm_dense.bias"]))
    y = F.layer_norm(y, (h,), p["mlm_norm.weight"], p["mlm_norm.bias"])
    logits = y @ p["embedding.word.weight"][:V].t() + p["mlm_bias"][:V]
    ref_mlm = F.cross_entropy(logits.reshape(-1, V), mlm_labels.reshape(-1), reduction="none").view(b, s)
    pooled = torch.tanh(F.linear(x[:, 0], p["pooler.weight"], p["pooler.bias"]))
    ref_sop = F.cross_entropy(F.linear(pooled, p["sop_head.weight"], p["sop_head.bias"]), sop, reduction="none")
    torch.testing.assert_close(mlm.t().double(), ref_mlm, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sop_loss.double(), ref_sop, rtol=1e-5, atol=1e-5)
    assert torch.all(mlm.t()[mlm_labels == -100] == 0)


@pytest.mark.parametrize("cls,cfg", [(GPTModel, GPT.replace(num_layers=4)), (BertModel, BERT.replace(num_layers=4))])
def test_a_stage_builds_the_same_weights_as_the_whole_model(single_world, cls, cfg):
    whole = dict(cls(cfg, seed=11).named_parameters())
    torch.manual_seed(123)  # the default generator must not matter
    middle = cls(cfg, seed=11, layers=range(2, 4), pre_process=False, post_process=True)
    for name, p in middle.named_parameters():
        if name.startswith("layers."):
            i = int(name.split(".")[1])
            ref = whole[name.replace(f"layers.{i}.", f"layers.{i + 2}.", 1)]
        elif name.startswith("output_embedding."):
            ref = whole[name.replace("output_embedding.", "embedding.word.")]
            assert is_shared_embedding(p) and is_shared_embedding_duplicate(p)
        else:
            ref = whole[name]
        torch.testing.assert_close(p, ref, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_recompute_gives_the_same_gradients_with_dropout(single_world, recompute):
    import megakernels.parallel as mpu

    cfg = GPT.replace(dropout=0.2, attention_dropout=0.2)
    ids = torch.randint(0, 261, (2, cfg.seq_length))
    grads = []
    for mode in ("none", recompute):
        mpu.model_parallel_seed(5)
        model = GPTModel(cfg, seed=1, recompute=mode, attention="torch")
        model(ids, labels=ids).sum().backward()
        grads.append({k: v.grad for k, v in model.named_parameters()})
    for k in grads[0]:
        torch.testing.assert_close(grads[1][k], grads[0][k], rtol=0, atol=0, msg=k)


def test_flash_and_torch_attention_agree(single_world):
    ids = torch.randint(0, 261, (2, GPT.seq_length))
    a = GPTModel(GPT, seed=1, attention="flash")(ids, labels=ids)
    b = GPTModel(GPT, seed=1, attention="torch")(ids, labels=ids)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_bf16_model_follows_the_fp32_model(single_world):
    """The same weights in bf16: fp32 per-token losses within bf16 rounding of the fp32 model's, and gradients
    pointing the same way (cosine > 0.99 per tensor)."""
    torch.manual_seed(0)
    ids, labels = torch.randint(0, 261, (2, GPT.seq_length)), torch.randint(0, 261, (2, GPT.seq_length))
    ref, half = GPTModel(GPT, seed=1), GPTModel(GPT, seed=1).to(torch.bfloat16)
    ref_loss, loss = ref(ids, labels=labels), half(ids, labels=labels)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, ref_loss, rtol=3e-2, atol=3e-2)
    ref_loss.mean().backward()
    loss.mean().backward()
    for (name, p), r in zip(half.named_parameters(), ref.parameters()):
        cos = F.cosine_similarity(p.grad.float().flatten(), r.grad.flatten(), dim=0)
        assert cos > 0.99, (name, cos)


@pytest.mark.parametrize(
    "name,billions",
    [
        ("gpt-1.2b", 1.2),
        ("gpt-2.5b", 2.5),
        ("gpt-4.2b", 4.2),
        ("gpt-8.3b", 8.3),
        ("bert-336m", 0.336),
        ("bert-1.3b", 1.3),
        ("bert-3.9b", 3.9),
        ("gpt-1.3b", 1.3),
    ],
)
def test_paper_presets_have_the_papers_sizes_on_the_meta_device(single_world, name, billions):
    cfg = PRESETS[name]
    cls = GPTModel if cfg.model == "gpt" else BertModel
    model = cls(cfg, seed=0, device="meta")
    n = sum(p.numel() for p in model.parameters())
    assert abs(n / 1e9 - billions) / billions < 0.04, n
    # 12·l·h² + 13·l·h for the layers (weights + biases + norms), embeddings, final norm
    h, l = cfg.hidden_size, cfg.num_layers
    layers = l * (12 * h * h + 13 * h)
    assert sum(p.numel() for k, p in model.named_parameters() if k.startswith("layers.")) == layers


def test_flops_per_token_is_the_papers_formula():
    cfg = preset("gpt-8.3b")
    l, h, s, V = cfg.num_layers, cfg.hidden_size, cfg.seq_length, cfg.vocab_size
    paper = 72 * l * h * h * (1 + s / (6 * h) + V / (12 * l * h))
    assert cfg.flops_per_token("none") == pytest.approx(paper, rel=1e-12)
    paper_recompute = 96 * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))
    assert cfg.flops_per_token("full") == pytest.approx(paper_recompute, rel=1e-12)


def test_activation_memory_is_korthikanti_table_2():
    cfg = preset("gpt-8.3b")
    s, b, h, a, t = cfg.seq_length, 4, cfg.hidden_size, cfg.num_heads, 8
    assert cfg.activation_bytes_per_layer(b) == s * b * h * (34 + 5 * a * s / h)
    assert cfg.activation_bytes_per_layer(b, t) == pytest.approx(s * b * h * (10 + 24 / t + 5 * a * s / (h * t)))
    assert cfg.activation_bytes_per_layer(b, t, True) == pytest.approx(s * b * h / t * (34 + 5 * a * s / h))
    assert cfg.activation_bytes_per_layer(b, t, True, "selective") == pytest.approx(s * b * h / t * 34)
    assert cfg.activation_bytes_per_layer(b, t, True, "full") == pytest.approx(2 * s * b * h / t)


def test_stage_layers_interleaves_virtual_stages():
    assert stage_layers(8, 2, 2) == [[range(0, 2), range(4, 6)], [range(2, 4), range(6, 8)]]
    with pytest.raises(ValueError, match="not divisible by pp·vpp"):
        stage_layers(6, 2, 2)


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="hidden_size=30 is not divisible by num_heads=4"):
        GPT.replace(hidden_size=30)
    with pytest.raises(ValueError, match="unknown preset 'gpt-9b'"):
        preset("gpt-9b")
