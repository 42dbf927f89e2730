"""Packed sequences in the causal language models: a sample holding several documents, with their ids and
per-document positions, computes for each document exactly what the model computes on that document alone
(attention stops at the document's end, positions restart), for learned and rotary positions (GPT, Llama, Qwen 3
with its q/k norms and position scaling); the task's loss counts the labelled tokens of the global batch only."""

from __future__ import annotations

import pytest
import torch

from megakernels_models.models.config import ModelConfig
from megakernels_models.models.gpt.model import GPTModel
from megakernels_models.models.llama.model import LlamaModel
from megakernels_models.models.qwen.model import QwenModel

BASE = dict(
    num_layers=2, hidden_size=32, num_heads=4, seq_length=16, vocab_size=261, dropout=0.0, attention_dropout=0.0
)
MODELS = {
    "gpt": (GPTModel, ModelConfig("gpt", **BASE)),
    "llama": (LlamaModel, ModelConfig("llama", **BASE, num_kv_heads=2, ffn_hidden_size=48)),
    "qwen": (
        QwenModel,
        ModelConfig(
            "qwen",
            **BASE,
            num_kv_heads=2,
            ffn_hidden_size=48,
            qk_norm=True,
            qkv_bias=True,
            rope_scaling="llama3",
            rope_scaling_factor=4.0,
            rope_original_max_positions=8,
        ),
    ),
}
LENGTHS = (5, 7, 4)  # three documents in a sample of 16


def _packed_sample(seed: int, lengths=LENGTHS):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 261, (1, sum(lengths)), generator=g)
    labels = torch.randint(0, 261, (1, sum(lengths)), generator=g)
    doc_ids = torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(lengths)])[None]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    return ids, labels, doc_ids, positions


@pytest.mark.parametrize("attention", ["torch", "flash"])
@pytest.mark.parametrize("family", list(MODELS))
def test_each_packed_document_computes_what_it_computes_alone(single_world, family, attention):
    cls, cfg = MODELS[family]
    model = cls(cfg, seed=3, attention=attention).eval()
    ids, labels, doc_ids, positions = _packed_sample(0)
    with torch.no_grad():
        packed = model(ids, labels=labels, documents=(doc_ids, positions))[:, 0]  # [s] per-token loss
        alone = torch.cat(
            [
                model(ids[:, a : a + n], labels=labels[:, a : a + n])[:, 0]
                for a, n in zip(torch.tensor((0,) + LENGTHS).cumsum(0).tolist(), LENGTHS)
            ]
        )
        plain = model(ids, labels=labels)[:, 0]
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(plain[LENGTHS[0] :], alone[LENGTHS[0] :], atol=1e-3)  # the packing mattered


@pytest.mark.parametrize("family", ["llama"])
def test_packed_gradients_equal_the_documents_alone(single_world, family):
    """The gradient of the packed sample's summed loss is the sum of the documents' own gradients."""
    cls, cfg = MODELS[family]
    model = cls(cfg, seed=3, attention="torch")
    ids, labels, doc_ids, positions = _packed_sample(1)
    model(ids, labels=labels, documents=(doc_ids, positions)).sum().backward()
    packed = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    start = 0
    for n in LENGTHS:
        model(ids[:, start : start + n], labels=labels[:, start : start + n]).sum().backward()
        start += n
    for name, p in model.named_parameters():
        torch.testing.assert_close(packed[name], p.grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_packed_and_unpacked_sft_give_the_same_loss_and_gradients(single_world, tmp_path):
    """The example conversations through a Llama: the loss of packed samples (several conversations each, attention
    and positions per conversation, assistant targets only, normalised by the labelled tokens) and its gradients
    equal those of the same conversations one per sample."""
    import os

    from megakernels_models.data import chat
    from megakernels_models.data.sft import SFTDataset

    example = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "data", "chat_small.jsonl")
    tok = str(tmp_path / "tok")
    chat.write_small_tokenizer(tok, chat.conversation_texts([example]), 300)
    chat.preprocess_chat([example], str(tmp_path / "chat"), tok)
    data = chat.ChatIndexed(str(tmp_path / "chat"))
    cfg = MODELS["llama"][1].replace(seq_length=96, vocab_size=300)
    packed = SFTDataset(data, 96, seed=1, pad=0, documents=range(0, 12), packed=True)
    single = SFTDataset(data, 96, seed=1, pad=0, documents=range(0, 12), packed=False)
    samples = [packed[i] for i in range(len(packed))]
    assert max(len(packed.conversations(i)) for i in range(len(packed))) > 1  # the packing put several together
    alone = [single.conversation_sample(c) for i in range(len(packed)) for c in packed.conversations(i)]

    def loss_and_grads(batch_samples):
        model = LlamaModel(cfg, seed=5, attention="flash")
        ids, labels, docs, pos = (
            torch.stack([torch.as_tensor(s[k]) for s in batch_samples])
            for k in ("ids", "labels", "documents", "positions")
        )
        per_token = model(ids, labels=labels, documents=(docs, pos))
        loss = per_token.sum() / (labels != -100).sum()
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters()}

    loss_p, grads_p = loss_and_grads(samples)
    loss_u, grads_u = loss_and_grads(alone)
    torch.testing.assert_close(loss_p, loss_u, rtol=1e-5, atol=1e-6)
    for name, g in grads_u.items():
        torch.testing.assert_close(grads_p[name], g, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
