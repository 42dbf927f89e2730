"""The causal LMs' fused loss (``fused_linear_ce``: ops.linear_cross_entropy) against the unfused path
(parallel_lm_logits + vocab_parallel_cross_entropy) on the same weights: per-token losses and every parameter's
gradient (and a last pipeline stage's input gradient) within 1e-5, for a GPT (tied output) and a Llama (untied,
grouped-query), in one process and in a world of 2 at tp 2 with and without sequence parallelism; and the
vision-language model's text loss in one process."""

from __future__ import annotations

import pytest
import torch

import megakernels.parallel as mp
from megakernels_models.models.config import ModelConfig
from megakernels_models.models.gpt.model import GPTModel
from megakernels_models.models.llama.model import LlamaModel
from tests.parallel.checks import Checks, assert_close

S, B = 16, 2
GPT = ModelConfig(
    "gpt", num_layers=2, hidden_size=32, num_heads=4, seq_length=S, vocab_size=261, dropout=0.0, attention_dropout=0.0
)
LLAMA = ModelConfig(
    "llama",
    num_layers=2,
    hidden_size=32,
    num_heads=4,
    num_kv_heads=2,
    seq_length=S,
    vocab_size=261,
    ffn_hidden_size=48,
    dropout=0.0,
    attention_dropout=0.0,
    rope_theta=500.0,
)
MODELS = {"gpt": (GPTModel, GPT), "llama": (LlamaModel, LLAMA)}


def _batch():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 261, (B, S), generator=g)
    labels = torch.randint(0, 261, (B, S), generator=g)
    labels[0, :3] = -100
    labels[1, -1] = 260  # the last real id; the padded rows past it never count
    return ids, labels


def _run(name, fused, last_stage=False, **kwargs):
    """(per-token loss, {param: grad}, the stage input's grad or None) of one model built with ``fused``."""
    cls, cfg = MODELS[name]
    ids, labels = _batch()
    if last_stage:  # a last pipeline stage: layer 1 only, its input the previous stage's hidden state
        model = cls(cfg, seed=5, layers=range(1, 2), pre_process=False, fused_linear_ce=fused, **kwargs)
        h = torch.randn(S, B, cfg.hidden_size, generator=torch.Generator().manual_seed(4))
        if kwargs.get("sequence_parallel"):  # this rank's sequence shard
            r, tp = mp.tp_rank(), mp.tp_size()
            h = h[r * S // tp : (r + 1) * S // tp]
        hidden = h.clone().requires_grad_(True)
        loss = model(hidden=hidden, labels=labels)
    else:
        model = cls(cfg, seed=5, fused_linear_ce=fused, **kwargs)
        hidden = None
        loss = model(ids=ids, labels=labels)
    loss.backward(torch.rand(loss.shape, generator=torch.Generator().manual_seed(6)))
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return loss.detach(), grads, None if hidden is None else hidden.grad


def _assert_same(name, what, **kwargs):
    loss, grads, dh = _run(name, True, **kwargs)
    ref_loss, ref_grads, ref_dh = _run(name, False, **kwargs)
    assert loss.shape == (S, B)
    assert_close(loss, ref_loss, f"{what}: loss", rtol=1e-5)
    assert grads.keys() == ref_grads.keys()
    for n in grads:
        assert_close(grads[n], ref_grads[n], f"{what}: grad of {n}", rtol=1e-5)
    if dh is not None:
        assert_close(dh, ref_dh, f"{what}: input grad", rtol=1e-5)


@pytest.mark.parametrize("last_stage", [False, True])
@pytest.mark.parametrize("name", list(MODELS))
def test_fused_equals_unfused_in_one_process(single_world, name, last_stage):
    _assert_same(name, f"{name} last_stage={last_stage}", last_stage=last_stage)


@pytest.mark.parametrize("lm", ["gpt", "llama"])
def test_vision_language_text_loss_fused_equals_unfused(single_world, lm):
    from megakernels_models.models.vlm.model import VLMModel

    cfg = ModelConfig(
        "vlm", lm=lm, num_layers=2, hidden_size=32, num_heads=4, seq_length=S, dropout=0.0, attention_dropout=0.0,
        image_size=16, patch_size=8, vision_layers=1, vision_hidden_size=16, vision_heads=2,
    )  # fmt: skip
    g = torch.Generator().manual_seed(8)
    images = torch.randint(0, 256, (B, 16, 16, 3), dtype=torch.uint8, generator=g)
    ids, labels = _batch()
    ids, labels = ids.clamp(max=cfg.vocab_size - 1), labels.clamp(max=cfg.vocab_size - 1)
    out = []
    for fused in (True, False):
        model = VLMModel(cfg, 3, fused_linear_ce=fused)
        loss = model(images, ids, labels)
        loss.backward(torch.rand(loss.shape, generator=torch.Generator().manual_seed(6)))
        out.append((loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (loss, grads), (ref_loss, ref_grads) = out
    assert_close(loss, ref_loss, f"vlm {lm}: loss", rtol=1e-5)
    assert grads.keys() == ref_grads.keys() and grads
    for n in grads:
        assert_close(grads[n], ref_grads[n], f"vlm {lm}: grad of {n}", rtol=1e-5)


def test_the_flag_chooses_the_path(single_world, monkeypatch):
    from megakernels_models.models.gpt import model as gpt_model

    calls = []
    real = gpt_model.linear_cross_entropy
    monkeypatch.setattr(gpt_model, "linear_cross_entropy", lambda *a, **k: calls.append(1) or real(*a, **k))
    _run("gpt", True)
    _run("gpt", False)
    assert calls == [1]


CHECKS = Checks()


@CHECKS.add("tp2")
def _(rank, world):
    for name in MODELS:
        for sp in (False, True):
            for last_stage in (False, True):
                mp.initialize(2)
                try:
                    what = f"{name} tp2 sp={sp} last_stage={last_stage}"
                    _assert_same(name, what, last_stage=last_stage, sequence_parallel=sp)
                finally:
                    mp.destroy()


def _world(rank, world_size):
    return CHECKS.run(rank, world_size)


world = CHECKS.fixture(2, _world)


@pytest.mark.parametrize("name", CHECKS.names())
def test_fused_equals_unfused_at_tp2(world, name):
    CHECKS.assert_passed(world, name)


def test_the_trainer_fuses_the_head_where_the_logits_outgrow_a_chunk():
    """Default: fused when a micro-batch's fp32 logits on a rank are more than one chunk (256 MiB): Llama 3 8B at
    8k tokens, but not the tiny CPU models (one chunk: the fused head would only add a GEMM); tp and cp divide the
    logits; --fused-linear-ce / --no-fused-linear-ce decide."""
    from megakernels_models.arguments import validate
    from megakernels_models.cli import parse_train_args

    def fused(flags):
        args = parse_train_args(flags)
        return args.fused_head(args.model_config())

    assert not fused([]) and not fused(["--model", "llama"])
    assert fused(["--preset", "llama3-8b", "--micro-batch-size", "1"])  # 8192 x 128256 x 4 B = 4 GiB
    assert not fused(["--preset", "llama3-8b", "--micro-batch-size", "1", "--seq-length", "512", "--tp", "2"])
    assert fused(["--fused-linear-ce"]) and not fused(["--preset", "llama3-8b", "--no-fused-linear-ce"])
    args = parse_train_args(["--preset", "llama3-8b", "--dry-run", "--nproc", "8", "--tp", "8"])
    from megakernels_models.planning import costs

    assert costs.Layout.of(args, validate(args, check_memory=False)).fused_linear_ce


def test_the_memory_estimate_counts_a_chunk_of_logits_not_all():
    from megakernels.parallel.embedding import pad_vocab_size
    from megakernels_models.planning import costs

    cfg = LLAMA.replace(seq_length=4096, vocab_size=128256, hidden_size=64, ffn_hidden_size=128)
    meta = costs.MetaModel(cfg)
    act = {
        fused: costs.memory(meta, costs.Layout(micro_batch_size=2, precision="bf16", fused_linear_ce=fused))[
            "breakdown"
        ]["activations"]
        for fused in (True, False)
    }
    v = pad_vocab_size(128256, 1)
    # unfused: 8192 tokens of fp32 logits; fused: 512 tokens of bf16 ones, dW's fp32 sum and a bf16 chunk product
    assert act[False] - act[True] == 8192 * v * 4 - (512 * v * 2 + v * 64 * 6)
    bert = costs.MetaModel(GPT.replace(model="bert"))
    same = [costs.memory(bert, costs.Layout(fused_linear_ce=f))["total"] for f in (True, False)]
    assert same[0] == same[1]  # BERT's head is not fused
