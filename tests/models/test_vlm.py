"""The vision-language family (``--model vlm``) piece by piece, against independent references: a HuggingFace CLIP
vision tower converted into our encoder gives its features; the cross-attention block is softmax attention written
out in fp64; the contrastive loss is CLIP's written out per sample; the embedded shapes' captions say what the
pixels show; the image-text format round-trips and its preprocessing names bad files; the arguments name bad flags;
the 7B preset's dry run counts LLaVA-1.5-7B's parameters. (The loss curves over layouts are in test_layouts.py.)"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from megakernels.parallel.launch import single_process_world
from megakernels_models.arguments import ArgumentError, TrainArgs, validate
from megakernels_models.models.config import ModelConfig

TINY = dict(
    num_layers=2,
    hidden_size=32,
    num_heads=4,
    seq_length=16,
    dropout=0.0,
    attention_dropout=0.0,
    image_size=16,
    patch_size=8,
    vision_layers=1,
    vision_hidden_size=16,
    vision_heads=2,
)


def test_clip_vision_tower_converts_to_the_same_features(single_world):
    import transformers

    from megakernels_models.convert.clip import vision_fields, vision_state_dict
    from megakernels_models.models.vlm.vision import VisionEncoder

    torch.manual_seed(0)
    hc = transformers.CLIPVisionConfig(
        image_size=16,
        patch_size=4,
        hidden_size=32,
        num_attention_heads=4,
        num_hidden_layers=2,
        intermediate_size=64,
        hidden_act="gelu",
    )
    hf = transformers.CLIPVisionModel(hc).eval()
    with torch.no_grad():  # non-trivial norms and biases
        for name, p in hf.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    cfg = ModelConfig("vlm", **{**TINY, **vision_fields(hc)})
    ours = VisionEncoder(cfg, 0).eval()
    ours.load_state_dict(vision_state_dict(hf.state_dict(), cfg))
    pixels = torch.randn(3, 3, 16, 16)
    with torch.no_grad():
        ref = hf(pixel_values=pixels).last_hidden_state
        got = ours(pixels.permute(0, 2, 3, 1)).transpose(0, 1)  # channels last, [b, tokens, h]
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def test_clip_quick_gelu_is_refused():
    import transformers

    from megakernels_models.convert.clip import vision_fields
    from megakernels_models.convert.common import ConversionError

    with pytest.raises(ConversionError, match="quick_gelu"):
        vision_fields(transformers.CLIPVisionConfig(hidden_act="quick_gelu"))


def test_cross_attention_is_softmax_attention_over_the_context(single_world):
    from megakernels.parallel import ParallelCrossAttention

    torch.manual_seed(0)
    att = ParallelCrossAttention(32, 4, context_size=24, seed=3).double()
    with torch.no_grad():
        att.q.bias.normal_(), att.kv.bias.normal_(), att.proj.bias.normal_()
    x, ctx = torch.randn(5, 2, 32, dtype=torch.float64), torch.randn(7, 2, 24, dtype=torch.float64)
    got = att(x, ctx)
    q = (x @ att.q.weight.t() + att.q.bias).view(5, 2, 4, 8)
    k, v = (ctx @ att.kv.weight.t() + att.kv.bias).view(7, 2, 2, 4, 8).unbind(2)  # keys, then values
    scores = torch.einsum("qbhd,kbhd->bhqk", q, k) / math.sqrt(8)
    ref = torch.einsum("bhqk,kbhd->qbhd", scores.softmax(-1), v).reshape(5, 2, 32) @ att.proj.weight.t() + att.proj.bias
    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-10)


def test_contrastive_loss_is_clips_symmetric_cross_entropy():
    from megakernels_models.models.vlm.model import contrastive_loss

    torch.manual_seed(0)
    image, text = torch.randn(4, 3, 8, dtype=torch.float64), torch.randn(5, 3, 8, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.bool)
    got = contrastive_loss(image, text, mask, 0.1)
    img = [image[:, i].mean(0) / image[:, i].mean(0).norm() for i in range(3)]
    txt = [text[mask[i], i].mean(0) / text[mask[i], i].mean(0).norm() for i in range(3)]
    sim = torch.tensor([[float(img[i] @ txt[j]) / 0.1 for j in range(3)] for i in range(3)], dtype=torch.float64)
    ref = [0.5 * (-sim[i].log_softmax(0)[i] - sim[:, i].log_softmax(0)[i]) for i in range(3)]
    torch.testing.assert_close(got.double(), torch.stack(ref), rtol=1e-5, atol=1e-6)


def test_gated_cross_attention_starts_as_the_identity_then_reads_the_image(single_world):
    from megakernels_models.models.vlm.model import VLMModel

    cfg = ModelConfig("vlm", lm="llama", cross_attention_every=1, **TINY)
    model = VLMModel(cfg, 1).eval()
    ids = torch.randint(0, 256, (2, 16))
    a, b = (
        torch.randint(0, 256, (2, 16, 16, 3), dtype=torch.uint8),
        torch.randint(0, 256, (2, 16, 16, 3), dtype=torch.uint8),
    )
    with torch.no_grad():
        torch.testing.assert_close(model(a, ids), model(b, ids), rtol=0, atol=0)  # gates tanh(0) = 0
        for layer in model.cross.values():
            layer.attention_gate.fill_(1.0)
        assert (model(a, ids) - model(b, ids)).abs().max() > 1e-5


def test_freeze_groups_leave_only_the_projector_trainable():
    from megakernels_models.models.registry import task_for

    cfg = ModelConfig("vlm", cross_attention_every=1, **TINY)
    task = task_for(cfg)
    with single_process_world(parallel=True):
        names = [n for n, _ in task.build_chunk(0, device="meta").named_parameters()]
    trained = {n.split(".")[0] for n in names if not task.is_frozen(n, ["vision", "lm"])}
    assert trained == {"projector", "cross"}
    assert {n.split(".")[0] for n in names if task.is_frozen(n, ["vision"])} == {"vision"}


def test_shapes_captions_say_where_the_colours_are():
    from megakernels_models.data.shapes import COLOURS, shapes_sample

    for i in range(40):
        img, caption = shapes_sample(5, i, 32)
        words = caption.split()
        first, second = words[1], words[-2]
        relation = " ".join(words[3:-3])
        centre = {}
        for colour in (first, second):
            ys, xs = np.nonzero((img == np.array(COLOURS[colour], np.uint8)).all(-1))
            assert len(ys) > 10, (caption, colour)
            centre[colour] = (ys.mean(), xs.mean())
        (ya, xa), (yb, xb) = centre[first], centre[second]
        assert {"above": ya < yb, "below": ya > yb, "left of": xa < xb, "right of": xa > xb}[relation], caption


def test_image_text_format_round_trips(tmp_path):
    from megakernels_models.data.images import CaptionDataset, ImageTextIndexed, write_image_text

    rng = np.random.default_rng(0)
    samples = [(rng.integers(0, 256, (4, 6, 3), dtype=np.uint8), rng.integers(0, 261, n)) for n in (3, 0, 7)]
    assert write_image_text(str(tmp_path / "d"), samples, 261) == 3
    ds = ImageTextIndexed(str(tmp_path / "d"))
    for i, (img, cap) in enumerate(samples):
        got_img, got_cap = ds.sample(i)
        np.testing.assert_array_equal(got_img, img)
        np.testing.assert_array_equal(got_cap, cap)
    item = CaptionDataset(ds, 5, 0, eod=256, pad=257, documents=range(2, 3))[0]  # caption cut to fit
    np.testing.assert_array_equal(item["ids"], np.concatenate([[256], samples[2][1][:4]]))
    np.testing.assert_array_equal(item["labels"], np.concatenate([samples[2][1][:4], [256]]))
    short = CaptionDataset(ds, 5, 0, eod=256, pad=257, documents=range(0, 1))[0]
    np.testing.assert_array_equal(short["labels"], np.concatenate([samples[0][1], [256, -100]]))
    (tmp_path / "d.bin").write_bytes((tmp_path / "d.bin").read_bytes()[:-1])
    with pytest.raises(ValueError, match=r"d\.bin"):
        ImageTextIndexed(str(tmp_path / "d"))


def _folder(tmp_path, names=("a.png", "b.jpg")):
    from PIL import Image

    rng = np.random.default_rng(1)
    for name in names:
        Image.fromarray(rng.integers(0, 256, (20, 12, 3), dtype=np.uint8)).save(tmp_path / name)
    lines = [json.dumps({"image": n, "caption": f"picture {n}"}) for n in names]
    (tmp_path / "captions.jsonl").write_text("\n".join(lines) + "\n")


def test_preprocess_writes_decoded_resized_images(tmp_path):
    import PIL  # noqa: F401  (Pillow: the train extra, which the test set-up installs)

    from megakernels_models.cli import main
    from megakernels_models.data.images import ImageTextIndexed

    _folder(tmp_path)
    assert (
        main(
            [
                "preprocess",
                "--images",
                str(tmp_path),
                "--captions",
                str(tmp_path / "captions.jsonl"),
                "--image-size",
                "16",
                "--output-prefix",
                str(tmp_path / "out"),
            ]
        )
        == 0
    )
    ds = ImageTextIndexed(str(tmp_path / "out"))
    assert len(ds) == 2 and (ds.shapes == [16, 16, 3]).all()
    assert bytes(ds.sample(1)[1].astype(np.uint8)).decode() == "picture b.jpg"


@pytest.mark.parametrize(
    "damage, message", [("missing", r"b\.jpg does not exist"), ("corrupt", r"b\.jpg cannot be decoded")]
)
def test_preprocess_names_a_bad_image(tmp_path, capsys, damage, message):
    import PIL  # noqa: F401  (Pillow: the train extra, which the test set-up installs)

    from megakernels_models.cli import main

    _folder(tmp_path)
    if damage == "missing":
        (tmp_path / "b.jpg").unlink()
    else:
        (tmp_path / "b.jpg").write_bytes(b"\xff\xd8 not really a jpeg")
    assert (
        main(
            [
                "preprocess",
                "--images",
                str(tmp_path),
                "--captions",
                str(tmp_path / "captions.jsonl"),
                "--output-prefix",
                str(tmp_path / "out"),
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "captions.jsonl:2" in err and "b.jpg" in err, err
    with pytest.raises(ValueError, match=message):
        from megakernels_models.data.images import read_captioned_folder
        from megakernels_models.data.tokenizer import build_tokenizer

        list(read_captioned_folder(str(tmp_path), str(tmp_path / "captions.jsonl"), build_tokenizer("byte")))


def test_bad_vision_flags_are_named(tmp_path):
    with pytest.raises(ArgumentError, match="--image-size 30 is not divisible by --patch-size 8"):
        validate(TrainArgs(model="vlm", image_size=30, patch_size=8))
    with pytest.raises(ArgumentError, match="--sequence-parallel is not supported for --model vlm"):
        validate(TrainArgs(model="vlm", tp=2, nproc=2, sequence_parallel=True))
    with pytest.raises(ArgumentError, match="--image-size is for vision-language models"):
        validate(TrainArgs(model="gpt", image_size=32))
    from megakernels_models.data.images import write_image_text

    write_image_text(str(tmp_path / "d"), [(np.zeros((24, 24, 3), np.uint8), np.arange(5))] * 4, 261)
    with pytest.raises(ArgumentError, match=r"--data .*d: image 0 is 24x24x3 but the model takes 32x32x3"):
        validate(TrainArgs(model="vlm", data=str(tmp_path / "d")))
    with pytest.raises(ArgumentError, match="holds images and captions: train it with --model vlm"):
        validate(TrainArgs(model="gpt", data=str(tmp_path / "d")))


def test_vlm_7b_dry_run_counts_llava_parameters():
    from megakernels_models.planning.dryrun import report

    rep = report(
        TrainArgs(model="vlm", preset="vlm-7b", nproc=16, tp=8, micro_batch_size=1, global_batch_size=16, dry_run=True),
        out=lambda *_: None,
    )
    # Llama-2-7B 6.738e9 + CLIP ViT-L/14-336 without its post-norm 3.034e8 + a 1024 -> 4096 -> 4096 projector
    llama = 32 * (4 * 4096**2 + 3 * 4096 * 11008 + 2 * 4096) + 2 * 32000 * 4096 + 4096
    clip = (
        24 * (4 * 1024**2 + 4 * 1024 + 2 * 1024 * 4096 + 4096 + 1024 + 4 * 1024)
        + 577 * 1024
        + 1024
        + 3 * 14 * 14 * 1024
        + 1024
        + 2 * 1024
    )  # layers, positions, class token, patch (+ bias), pre-norm
    projector = 1024 * 4096 + 4096 + 4096 * 4096 + 4096
    assert rep["parameters"] == llama + clip + projector
    assert rep["image_tokens_per_sample"] == 577
    assert rep["flops_per_sample"] > 6 * (llama * (2048 + 577) + clip * 577)  # at least 6·N·tokens
    assert 0 < rep["memory_per_device_bytes"] < 141e9


def _tiny_run(precision: str) -> list[dict]:
    from megakernels_models.training.train import train

    return train(
        TrainArgs(
            model="vlm",
            preset="none",
            **{k: v for k, v in TINY.items() if k != "attention_dropout"},
            precision=precision,
            steps=4,
            micro_batch_size=4,
            global_batch_size=4,
            lr=5e-3,
            warmup_steps=1,
            eval_interval=0,
            progress=False,
        )
    )


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_16bit_training_follows_the_fp32_curve(world1, precision):
    """16-bit weights with fp32 master weights (fp16 with its dynamic loss scale): the loss falls, and each step's
    loss and (unscaled) gradient norm are the fp32 run's within 16-bit rounding."""
    ref, records = _tiny_run("fp32"), _tiny_run(precision)
    losses = [r["loss"] for r in records]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], losses
    torch.testing.assert_close(torch.tensor(losses), torch.tensor([r["loss"] for r in ref]), rtol=2e-3, atol=0)
    torch.testing.assert_close(
        torch.tensor([r["grad_norm"] for r in records]), torch.tensor([r["grad_norm"] for r in ref]), rtol=2e-2, atol=0
    )  # unscaled
    assert records[-1]["image_tokens_per_s"] > 0
    if precision == "fp16":
        assert records[-1]["loss_scale"] > 1 and not any(r["skipped"] for r in records)


# A reduced vlm-tiny (a 2-layer 64-wide GPT, 16×16 images of two 8-pixel cells' shapes, 4 image tokens) whose captions
# are cut to 7 characters ("a red c"): the first colour, the one of the upper or left shape, is the caption's main
# image-dependent token. 150 steps take ~10 s on one core.
LEARNS = [
    "--model",
    "vlm",
    "--preset",
    "vlm-tiny",
    "--num-layers",
    "2",
    "--hidden-size",
    "64",
    "--seq-length",
    "8",
    "--image-size",
    "16",
    "--patch-size",
    "8",
    "--vision-hidden-size",
    "32",
    "--steps",
    "150",
    "--eval-interval",
    "0",
    "--no-progress",
]


def test_default_recipe_learns_to_read_the_image(tmp_path, capsys):
    """After a short run, captions of held-out images are predicted far better with the image than by the best
    text-only predictor or by the same model shown another sample's image: the model reads the pixels. (A model
    that ignores its image prefix scores the text-only level on the image-dependent tokens.)"""
    from megakernels_models.cli import main

    assert main(["train", *LEARNS, "--save", str(tmp_path / "ckpt")]) == 0
    capsys.readouterr()
    assert (
        main(
            [
                "eval",
                "--load",
                str(tmp_path / "ckpt"),
                "--task",
                "caption",
                "--samples",
                "256",
                "--baseline-captions",
                "2048",
            ]
        )
        == 0
    )
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    seen, blind, rolled = (res[k]["image_token_accuracy"] for k in ("model", "text_only", "mismatched_image"))
    assert res["image_tokens"] >= res["samples"], res  # at least the first colour of every caption
    assert seen > 0.6 and seen > max(blind, rolled) + 0.25, res
    assert res["model"]["exact_match"] > res["text_only"]["exact_match"] + 0.2, res


def test_dry_run_counts_no_gradients_or_optimizer_state_for_frozen_parameters():
    """LLaVA's first stage (only the projector trained): the frozen encoder and language model hold their bf16
    weights, but gradients (4 bytes) and optimizer state (12) only for the projector's share of a device."""
    from megakernels_models.planning.dryrun import report

    def run(freeze):
        return report(
            TrainArgs(
                model="vlm",
                preset="vlm-7b",
                nproc=16,
                tp=8,
                micro_batch_size=1,
                global_batch_size=16,
                precision="bf16",
                freeze=freeze,
                dry_run=True,
            ),
            out=lambda *_: None,
        )

    full, stage1 = run(""), run("vision,lm")
    # fc1 column-parallel (weight and bias split over tp = 8), fc2 row-parallel (weight split, bias replicated)
    projector = (1024 * 4096 + 4096) // 8 + 4096 * 4096 // 8 + 4096
    assert stage1["trained_parameters_per_device"] == projector and "trained_parameters_per_device" not in full
    b, f = stage1["memory_breakdown_bytes"], full["memory_breakdown_bytes"]
    assert b["weights"] == f["weights"] == 2 * full["parameters_per_device"]
    assert (b["grads"], b["optimizer"]) == (4 * projector, 12 * projector)
    assert (f["grads"], f["optimizer"]) == (4 * full["parameters_per_device"], 12 * full["parameters_per_device"])
    assert stage1["layout"]["frozen"] == ["vision", "lm"]


def test_convert_puts_a_clip_vision_tower_in_front_of_a_language_model(single_world, tmp_path, capsys):
    """``convert hf-to-megakernels --input GPT2 --vision CLIP``: a vision-language checkpoint whose encoder gives
    CLIP's features, whose language model is the plain conversion's, and whose projector is the one ``--seed``
    initialises; a directory that is not CLIP is refused by name."""
    import transformers

    from megakernels_models import convert
    from megakernels_models.cli import main
    from megakernels_models.models.vlm.model import VLMModel
    from megakernels_models.models.vlm.vision import Projector
    from megakernels_models.training import checkpoint

    torch.manual_seed(0)
    gpt2 = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=300, n_positions=24)
    transformers.GPT2LMHeadModel(gpt2).save_pretrained(tmp_path / "gpt2", safe_serialization=True)
    clip = transformers.CLIPVisionModel(
        transformers.CLIPVisionConfig(
            image_size=16,
            patch_size=4,
            hidden_size=32,
            num_attention_heads=4,
            num_hidden_layers=2,
            intermediate_size=64,
            hidden_act="gelu",
        )
    ).eval()
    clip.save_pretrained(tmp_path / "clip", safe_serialization=True)
    assert (
        main(
            [
                "convert",
                "hf-to-megakernels",
                "--input",
                str(tmp_path / "gpt2"),
                "--vision",
                str(tmp_path / "clip"),
                "--output",
                str(tmp_path / "vlm"),
                "--seed",
                "5",
            ]
        )
        == 0
    )
    assert (
        main(["convert", "hf-to-megakernels", "--input", str(tmp_path / "gpt2"), "--output", str(tmp_path / "lm")]) == 0
    )

    meta, tensors = convert.read_checkpoint(str(tmp_path / "vlm"))
    cfg = ModelConfig.from_dict(meta["config"])
    assert (cfg.model, cfg.lm, cfg.num_image_tokens, cfg.hidden_size) == ("vlm", "gpt", 17, 32)
    _, lm = convert.read_checkpoint(str(tmp_path / "lm"))
    assert set(lm) == {k for k in tensors if not k.startswith(("vision.", "projector."))}
    for name, t in lm.items():
        torch.testing.assert_close(tensors[name], t, rtol=0, atol=0, msg=name)

    model = VLMModel(cfg, seed=0).eval()
    checkpoint.load(checkpoint.read_latest(str(tmp_path / "vlm")), [model], None, cfg)
    pixels = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        torch.testing.assert_close(
            model.vision(pixels.permute(0, 2, 3, 1)).transpose(0, 1),
            clip(pixel_values=pixels).last_hidden_state,
            rtol=1e-4,
            atol=1e-4,
        )
    for name, t in Projector(cfg, 5).state_dict().items():
        torch.testing.assert_close(model.projector.state_dict()[name], t, rtol=0, atol=0, msg=name)

    capsys.readouterr()
    assert (
        main(
            [
                "convert",
                "hf-to-megakernels",
                "--input",
                str(tmp_path / "gpt2"),
                "--vision",
                str(tmp_path / "gpt2"),
                "--output",
                str(tmp_path / "bad"),
            ]
        )
        == 2
    )
    assert "--vision" in capsys.readouterr().err


def test_frozen_parameters_leave_the_data_parallel_reduction_and_the_offloaded_optimizer():
    """By hand: the gradient all-reduce of a step moves 4 bytes per *trained* parameter of a device over the ring
    (2(n-1)/n of them), behind the last micro-batch's backward (what it hides behind costs OVERLAP_SM_SHARE of
    itself); the offloaded optimizer steps only those. LLaVA's first stage at dp 16 (tp 2, two micro-batches: the
    reduction is exposed)."""
    from megakernels_models.planning import costs

    def predict(freeze, offload=False):
        args = TrainArgs(
            model="vlm",
            preset="vlm-7b",
            nproc=32,
            tp=2,
            micro_batch_size=1,
            global_batch_size=32,
            precision="bf16",
            freeze=freeze,
            offload_optimizer=offload,
            dry_run=True,
        )
        meta, layout = costs.MetaModel(validate(args)), costs.Layout.of(args)
        return costs.memory(meta, layout)["trained_parameters_per_device"], costs.predict(
            meta, layout, costs.DEVICES["h200"], 8
        )

    device = costs.DEVICES["h200"]
    for freeze in ("", "vision,lm"):
        trained, got = predict(freeze)
        # 16 replicas over 4 nodes, 4 of them a node (tp 2): a ring per adapter, 4 × 50 GB/s (costs.dp_gbps)
        ring = 2 * 15 / 16 * 4 * trained / (4 * device.inter_gbps * 1e9) + device.latency_s
        window = got["compute_s"] / 2 * 2 / 3
        hidden = min(ring, window)
        assert got["dp_s"] == pytest.approx(ring - hidden + costs.OVERLAP_SM_SHARE * hidden)
    full, stage1 = predict("")[1], predict("vision,lm")[1]
    assert full["dp_s"] > 0 and stage1["dp_s"] < full["dp_s"] / 10
    trained, offloaded = predict("vision,lm", offload=True)
    assert offloaded["host_adam_s"] == pytest.approx(trained * costs.HOST_ADAMW_NS_PER_PARAM * 1e-9)
