"""Multi-token prediction (DeepSeek-V3; ``ModelConfig.mtp_layers``): each depth against a plain-PyTorch reference
(shifted inputs and labels written out position by position, documents included), the task's loss and gradient,
the FLOPs, the flags' checks, HF conversion in DeepSeek's checkpoint layout, and training on the embedded data.
The layouts (pipeline, tensor and sequence parallelism) are in tests/models/test_layouts.py (``deepseek-mtp``)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from megakernels.nn import DocumentMask
from megakernels_models.models.config import PRESETS
from megakernels_models.models.deepseek.model import DeepseekModel
from megakernels_models.models.tasks import CausalLMTask

S, B = 24, 2


def _cfg(**kw):
    return dataclasses.replace(PRESETS["deepseek-tiny"], seq_length=S, mtp_layers=2, **kw)


def _batch():
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 261, (B, S), generator=g)
    docs = torch.tensor([[0] * 10 + [1] * 9 + [2] * 5, [0] * S])
    labels = torch.cat([ids[:, 1:], torch.full((B, 1), -100)], 1)
    labels[docs != torch.cat([docs[:, 1:], torch.full((B, 1), -1)], 1)] = -100  # each document's last token
    labels[1, :4] = -100  # a prompt
    return ids, labels, docs


def _rms(x, w, eps):
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.double()


def _reference(model, cfg, ids, labels, docs, h):
    """Each depth's per-token loss ``[s, b]`` in fp64 from the modules' weights; ``h`` the main layers' output
    before the final norm ``[s, b, h]``. Only each depth's transformer layer is the model's own module."""
    emb, head = model.embedding.word.weight.double(), model.output_weight.double()
    out, prev = [], h.double()
    for k, m in enumerate(model.mtp, start=1):
        ahead = torch.zeros_like(ids)
        target = torch.full_like(labels, -100)
        for b in range(B):
            for i in range(S):
                if i + k < S and docs[b, i + k] == docs[b, i]:
                    ahead[b, i] = ids[b, i + k]
                    target[b, i] = labels[b, i + k]
        e = emb[ahead.t()]
        x = torch.cat([_rms(e, m.enorm.weight, cfg.layernorm_eps), _rms(prev, m.hnorm.weight, cfg.layernorm_eps)], -1)
        x = x @ m.eh_proj.weight.double().t()
        y = m.layer(x.float(), DocumentMask(docs), None).double()
        logits = _rms(y, m.norm.weight, cfg.layernorm_eps) @ head.t()
        loss = F.cross_entropy(
            logits[..., : cfg.vocab_size].reshape(-1, cfg.vocab_size), target.t().reshape(-1), reduction="none"
        )
        out.append(loss.view(S, B))
        prev = y
    return out


def test_each_depth_equals_the_reference_and_the_task_weighs_it(single_world):
    cfg = _cfg()
    torch.manual_seed(0)
    model = DeepseekModel(cfg, seed=3)
    ids, labels, docs = _batch()
    inputs = {}
    main, depths = model(ids, labels, documents=(docs, None), mtp=True)
    model.encode(ids, documents=(docs, None), mtp_inputs=inputs)
    ref = _reference(model, cfg, ids, labels, docs, inputs["hidden"].detach())
    assert len(depths) == 2
    for got, want in zip(depths, ref):
        torch.testing.assert_close(got.double(), want, rtol=2e-5, atol=2e-5)
        assert (got[-2:] == 0).all()  # no label past the end of the sequence

    # the task: the value is the main loss, the gradient that of main + λ · mean over depths
    task = CausalLMTask(cfg, DeepseekModel)
    assert task.metric_names == ("mtp_loss",)
    batch = {"ids": ids, "labels": labels, "documents": docs}
    n = torch.tensor(float((labels != -100).sum()))
    loss = task.forward(model, batch, None, {"tokens": n})
    torch.testing.assert_close(loss.detach(), main.detach().sum() / n)
    mtp = torch.stack([d.detach().sum() for d in depths]).mean() / n
    torch.testing.assert_close(task.take_metrics(), mtp.reshape(1))
    assert task.take_metrics() is None
    grads = torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)
    main, depths = model(ids, labels, documents=(docs, None), mtp=True)
    want = main.sum() / n + cfg.mtp_loss_weight * torch.stack([d.sum() for d in depths]).mean() / n
    wants = torch.autograd.grad(want, list(model.parameters()), allow_unused=True)
    names = [name for name, _ in model.named_parameters()]
    for name, g, w in zip(names, grads, wants):
        if w is None:
            assert g is None, name
            continue
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-7, msg=name)
    assert any(name.startswith("mtp.1.") for name, w in zip(names, wants) if w is not None and w.abs().sum() > 0)


def test_without_labels_or_mtp_the_main_head_alone(single_world):
    cfg = _cfg()
    model = DeepseekModel(cfg, seed=3).eval()
    ids, labels, _ = _batch()
    plain = DeepseekModel(dataclasses.replace(cfg, mtp_layers=0), seed=3).eval()
    with torch.no_grad():
        torch.testing.assert_close(model(ids), plain(ids))  # generation: the main head's logits
        torch.testing.assert_close(model(ids, labels), plain(ids, labels))


def test_mtp_flops_add_a_projection_a_layer_and_a_head_per_depth():
    cfg = _cfg()
    base = dataclasses.replace(cfg, mtp_layers=0).forward_flops_per_token()
    deeper = dataclasses.replace(cfg, mtp_layers=0, num_layers=cfg.num_layers + 2).forward_flops_per_token()
    got = cfg.forward_flops_per_token()
    h = cfg.hidden_size
    assert got["layers_gemm"] == deeper["layers_gemm"] + 2 * 2.0 * (2 * h * h)
    assert got["attention"] == deeper["attention"]
    assert got["head"] == 3 * base["head"]


def test_the_flags_and_their_refusals():
    from megakernels_models.arguments import TrainArgs, validate
    from megakernels_models.settings import ArgumentError

    base = dict(preset="deepseek-tiny", seq_length=32, steps=1, micro_batch_size=1, global_batch_size=1)
    cfg = validate(TrainArgs(**base, mtp_layers=2, mtp_loss_weight=0.3), check_memory=False, check_outputs=False)
    assert (cfg.mtp_layers, cfg.mtp_loss_weight) == (2, 0.3)
    with pytest.raises(ArgumentError, match="--mtp-layers.*--cp"):
        validate(TrainArgs(**base, mtp_layers=1, cp=2, nproc=2), check_memory=False, check_outputs=False)
    with pytest.raises(ArgumentError, match="--mtp-layers is for causal language models"):
        validate(
            TrainArgs(preset="bert-tiny", steps=1, micro_batch_size=1, global_batch_size=1, mtp_layers=1),
            check_memory=False,
            check_outputs=False,
        )
    with pytest.raises((ArgumentError, ValueError), match="mtp_layers"):
        validate(TrainArgs(**base, mtp_layers=-1), check_memory=False, check_outputs=False)
    with pytest.raises((ArgumentError, ValueError), match="mtp_loss_weight"):
        validate(TrainArgs(**base, mtp_layers=1, mtp_loss_weight=-1.0), check_memory=False, check_outputs=False)


def test_deepseek_with_mtp_trains_and_exports_in_deepseeks_layout(world1, tmp_path):
    """``megakernels train --model deepseek --mtp-layers 1`` on the embedded data: the loss and ``mtp_loss`` fall;
    its checkpoint exports with the module as the layer after the last (DeepSeek's names, with copies of the
    embedding and the head), transformers reads the main model from it, and it comes back bit-exact; a checkpoint
    transformers saves (its config still says one MTP layer, its weights without it) imports without the module."""
    import transformers
    from safetensors import safe_open

    import megakernels.parallel as mpu
    from megakernels_models import convert
    from megakernels_models.arguments import TrainArgs
    from megakernels_models.training import checkpoint
    from megakernels_models.training.train import train

    args = TrainArgs(
        preset="deepseek-tiny", seq_length=64, steps=6, micro_batch_size=4, global_batch_size=8, eval_interval=0,
        progress=False, corpus_bytes=1 << 18, seed=3, lr=3e-3, mtp_layers=1, save=str(tmp_path / "run"),
        save_interval=6,
    )  # fmt: skip
    recs = train(args)
    assert recs[-1]["loss"] < recs[0]["loss"] - 0.3
    assert recs[-1]["mtp_loss"] < recs[0]["mtp_loss"] - 0.3
    assert {"moe_expert_bias_norm", "max_expert_load"} <= set(recs[0])

    mk = checkpoint.read_latest(str(tmp_path / "run"))
    meta, first = convert.read_checkpoint(mk)
    cfg = convert.ModelConfig.from_dict(meta["config"])
    mpu.initialize(1, 1)  # the trainer ended its layout
    try:
        model = DeepseekModel(cfg, seed=0).eval()
        checkpoint.load(mk, [model], None, cfg)
        convert.megakernels_to_hf(mk, str(tmp_path / "hf"))
        keys = set()
        for f in (tmp_path / "hf").glob("*.safetensors"):
            with safe_open(str(f), "pt") as st:
                keys |= set(st.keys())
        extra = f"model.layers.{cfg.num_layers}."
        names = ("enorm", "hnorm", "eh_proj", "shared_head.norm", "shared_head.head", "embed_tokens")
        names += ("self_attn.kv_b_proj", "mlp.gate.e_score_correction_bias")
        for name in names:
            assert any(k.startswith(extra + name) for k in keys), name
        hf = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager").eval()
        assert hf.config.num_mtp_layers == 1
        ids = torch.randint(0, cfg.vocab_size, (2, 16))
        with torch.no_grad():
            ours = model(ids).transpose(0, 1)[..., : cfg.vocab_size]
            torch.testing.assert_close(ours, hf(ids).logits, rtol=1e-4, atol=1e-4)
        convert.hf_to_megakernels(str(tmp_path / "hf"), str(tmp_path / "back"))
        meta, back = convert.read_checkpoint(str(tmp_path / "back"))
        assert meta["config"]["mtp_layers"] == 1 and any(k.startswith("mtp.0.") for k in back)
        assert first.keys() == back.keys() and all(torch.equal(first[k], back[k]) for k in first)

        hf.save_pretrained(tmp_path / "saved", safe_serialization=True)
        convert.hf_to_megakernels(str(tmp_path / "saved"), str(tmp_path / "plain"))
        meta, plain = convert.read_checkpoint(str(tmp_path / "plain"))
        assert meta["config"]["mtp_layers"] == 0 and not any(k.startswith("mtp.") for k in plain)
    finally:
        mpu.destroy()
