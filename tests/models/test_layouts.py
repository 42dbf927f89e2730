"""The trainer's central test (docs/parallelism.md): with the same seed, dropout 0 and fp32, the per-step losses of
every
(tp, cp, pp, dp) layout — with sequence parallelism, the distributed optimizer (and its CPU offload), recomputation,
interleaving and gradient accumulation on or off — equal the single process's within 1e-5 relative, for tiny GPT,
BERT and Llama (grouped-query attention with its key/value heads split over tp 2 and replicated over tp 4; context
parallelism by ring attention at cp 2 and 4, alone and with tp, pp, dp and ZeRO-1; a sliding window shorter than the
sequence, at tp 2, cp 2, both and tp 2 × pp 2, and with the torch attention core), Qwen (q/k/v biases, per-head q/k
RMSNorm and Llama 3.1's position scaling) at tp 2 × pp 2, and mixture-of-experts GPT, Llama and Qwen 3 (dropless
top-2 routing with the auxiliary losses on; experts split over ep 2 and 4, with dp, tp + SP, pp and ZeRO-1; Qwen's
unnormalised top-k at ep 2 and tp 2 × pp 2; checkpoints resharded across ep), sharded data parallelism by FSDP2
(fsdp 4 for every dense family and the vision-language model, fsdp 2 × tp 2, × pp 2, × cp 2, MoE at fsdp 4 × ep 2,
ZeRO-2, HSDP 2 × 2; checkpoints resharded fsdp 4 -> tp 2 × pp 2 -> fsdp 2 × tp 2 and to one process), FP8 training
(tensorwise GPT and blockwise Llama at tp 2 with SP and tp 2 × pp 2, their MoE forms at tp 2 × pp 2 × ep 2; 1e-4:
FP8_RTOL), the zero-bubble pipeline schedules (zb-h1 and zb-v for GPT and Llama at pp 2 and pp 4 — zb-v at pp 4
against an 8-layer single process —, BERT under zb-v, with full and selective recomputation, tp 2 × pp 2 with SP
for Llama and FP8 GPT, the MoE GPT at pp 2 × ep 2 under zb-v, tp 2 × pp 2 × dp 2 with SP and ZeRO-1 under zb-v;
zb-v checkpoints resumed under 1F1B and in one process, and 1F1B's under zb-v), and vision-language models (a ViT +
projector before a GPT, the image tokens a prefix; gated cross-attention in a Llama with the contrastive loss) at pp
2 (the encoder on the first stage), dp 2 with ZeRO-1, and tp 2 (the encoder, projector and cross-attention split)
alone and × dp 2 with ZeRO-1 and selective recomputation; their checkpoints saved at dp 2 with ZeRO-1 and at tp 2
resume in one process; gpt-oss (sinks, alternating windows, YaRN, the experts' biases and clamped SwiGLU) at ep 2 and
tp 2 × pp 2.

The single-process curves run in this process; each world size (2, 4, 8) is one spawned world that trains every
layout of that size in turn (initialise, 4 steps, destroy), so the suite pays each world's start-up once. The
cases of ``SLOW`` (more families at a layout whose features the fast cases already cover) run in worlds of their
own under the ``slow`` marker (``scripts/test.sh --all``).
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import shutil
import tempfile

import pytest
import torch

from megakernels.parallel.launch import single_process_world
from megakernels_models.arguments import TrainArgs
from tests.parallel.harness import run_world

# 4 steps: 3 updates after the first loss; a checkpoint saved at step SAVE_AT (2) is resumed for 2 steps, so the
# second one's loss depends on the optimizer state that was loaded.
STEPS = 4
SAVE_AT = 2
RTOL = 1e-5
BASE = TrainArgs(
    preset=None,
    num_layers=4,
    hidden_size=32,
    num_heads=4,
    seq_length=16,
    dropout=0.0,
    steps=STEPS,
    micro_batch_size=2,
    global_batch_size=8,
    lr=5e-3,
    min_lr=5e-4,
    warmup_steps=2,
    clip_grad=0.5,
    eval_interval=0,
    progress=False,
    corpus_bytes=1 << 18,
    seed=7,
    timeout=120,
)

MODELS = (
    "gpt",
    "bert",
    "llama",
    "llama-swa",
    "qwen",
    "gpt-moe",
    "llama-moe",
    "qwen-moe",
    "vlm",
    "vlm-x",
    "gpt-docs",
    "llama-sft",
    "gpt-fp8",
    "llama-fp8",
    "gpt-moe-fp8",
    "llama-moe-fp8",
    "gemma",
    "gpt-oss",
    "deepseek",
    "deepseek-mtp",
)
# The Llama of the suite: 4 query heads sharing 2 key/value heads, SwiGLU, RMSNorm, rotary positions, untied output.
LLAMA = dict(num_kv_heads=2, ffn_hidden_size=48, rope_theta=1000.0)
QWEN = dict(qkv_bias=True, qk_norm=True, rope_scaling="llama3", rope_scaling_factor=4.0, rope_original_max_positions=8)
MOE = dict(num_experts=4, moe_top_k=2, moe_ffn_hidden_size=16, moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001)
# Vision-language: a 1-layer ViT over 16×16 shapes (4 patches of 8) in front of the GPT, the image tokens a prefix
# (LLaVA); and with gated cross-attention after every second layer of the Llama and the contrastive loss (Flamingo).
FP8_TENSORWISE = dict(precision="fp8", fp8_base_precision="fp32", fp8_recipe="tensorwise")
FP8_BLOCKWISE = dict(precision="fp8", fp8_base_precision="fp32", fp8_recipe="blockwise")
GEMMA = dict(
    layer_types=("sliding_attention",) * 3 + ("full_attention",),
    sliding_window=5,
    local_rope_theta=100.0,
    query_pre_attn_scalar=6.0,
    final_logit_softcapping=3.0,
)
GPT_OSS = dict(
    layer_types=("sliding_attention", "full_attention") * 2,
    sliding_window=5,
    rope_scaling="yarn",
    rope_scaling_factor=4.0,
    rope_original_max_positions=8,
    rope_truncate=False,
    swiglu_limit=0.1,
    swiglu_alpha=1.702,
)
VLM = dict(image_size=16, patch_size=8, vision_layers=1, vision_hidden_size=16, vision_heads=2)
# DeepSeek-V3: latent attention (a query latent, d_qk 12 = 8 + 4 rotary, d_v 8), the first layer dense, then 4
# experts in 2 groups (1 eligible) with a shared expert, sigmoid scores scaled by 2.5 and the balancing bias
DEEPSEEK = dict(
    q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, num_experts=4,
    moe_top_k=2, moe_ffn_hidden_size=16, moe_shared_experts=1, moe_first_dense=1, moe_n_group=2, moe_topk_group=1,
    moe_routed_scaling=2.5, moe_bias_update_rate=0.01, ffn_hidden_size=48,
)  # fmt: skip
FAMILY = {
    "gpt": ("gpt", {}),
    "bert": ("bert", {}),
    "llama": ("llama", LLAMA),
    "llama-swa": ("llama", {**LLAMA, "sliding_window": 5}),  # Mistral's attention: 5 of 16 positions, over 2 chunks
    # Qwen: 2.5's biases on q/k/v and 3's per-head q/k RMSNorm together (each split over tp), with Llama 3.1's
    # position scaling (its original context shorter than the sequence, so every frequency band is in play)
    "qwen": ("qwen", {**LLAMA, **QWEN}),
    "gpt-moe": ("gpt", MOE),
    "llama-moe": ("llama", {**LLAMA, **MOE}),
    "qwen-moe": ("qwen", {**LLAMA, **MOE, "qk_norm": True, "moe_normalize": False}),  # Qwen 3 MoE, top-k unnormalised
    "vlm": ("vlm", VLM),
    "vlm-x": ("vlm", {**VLM, **LLAMA, "lm": "llama", "cross_attention_every": 2, "contrastive_coeff": 0.5}),
    # packed pre-training: short documents (EOD-separated, several per sample) with --document-masking
    "gpt-docs": ("gpt", {"document_masking": True}),
    # supervised fine-tuning on the example conversations, packed whole into samples of 128 tokens
    "llama-sft": ("llama", {**LLAMA, "sft": True, "seq_length": 128}),
    # FP8 (the rest in fp32, so that only FP8's rounding is compared): tensorwise GPT, blockwise Llama (its 1x128
    # tiles and 128x128 blocks straddle the tp shards of these small layers: reduced over TP)
    "gpt-fp8": ("gpt", FP8_TENSORWISE),
    "llama-fp8": ("llama", {**LLAMA, **FP8_BLOCKWISE}),
    "gpt-moe-fp8": ("gpt", {**MOE, **FP8_TENSORWISE}),
    "llama-moe-fp8": ("llama", {**LLAMA, **MOE, **FP8_BLOCKWISE}),
    # Gemma 3: three sliding layers (5 of 16 positions) and a full one, each with its rotary base, q/k norms,
    # sandwich norms, the sqrt(hidden) embedding scale, GeGLU, tied output, its attention scale and a logit cap
    "gemma": ("gemma", {**LLAMA, **GEMMA}),
    # gpt-oss: sliding and full layers alternating with sinks, YaRN, attention biases, and top-2 of 4 experts with
    # biases (the down bias replicated over tp), the softmax over the chosen logits and a clamp the activations reach
    "gpt-oss": ("gpt_oss", {**LLAMA, **MOE, **GPT_OSS}),
    "deepseek": ("deepseek", DEEPSEEK),
    # with a multi-token prediction module on the last stage (its copy of the embedding under pp, its layer MoE)
    "deepseek-mtp": ("deepseek", {**DEEPSEEK, "mtp_layers": 1}),
}
FP8_MODELS = ("gpt-fp8", "llama-fp8", "gpt-moe-fp8", "llama-moe-fp8")
# An fp32 sum in another order can move an element across an FP8 rounding boundary (an error of one FP8 ulp in one
# element of one GEMM operand): rare, and the curves of FP8 layouts agree to 1e-4 instead of 1e-5.
FP8_RTOL = 1e-4
PACKED = ("gpt-docs", "llama-sft")
DENSE, EXPERTS, VISION = ("gpt", "bert", "llama"), ("gpt-moe", "llama-moe"), ("vlm", "vlm-x")
SAVED = ("gpt", "bert", "llama", "gpt-moe", "llama-moe")  # the families of the resharding tests

# name: (nproc, changes); every layout is run for GPT, BERT and Llama unless ONLY names its models.
LAYOUTS = {
    "no-accumulation": (1, dict(micro_batch_size=8)),
    "torch-attention": (1, dict(attention="torch")),
    "tp2": (2, dict(tp=2)),
    "tp2-sp": (2, dict(tp=2, sequence_parallel=True)),
    "pp2": (2, dict(pp=2)),
    "pp2-gpipe": (2, dict(pp=2, schedule="gpipe")),
    "dp2": (2, dict()),
    "dp2-zero1": (2, dict(distributed_optimizer=True)),
    "offload": (1, dict(offload_optimizer=True)),
    "dp2-zero1-offload": (2, dict(distributed_optimizer=True, offload_optimizer=True)),
    "tp2-pp2": (4, dict(tp=2, pp=2)),
    "tp2-dp2-sp": (4, dict(tp=2, sequence_parallel=True)),
    "pp2-dp2": (4, dict(pp=2)),
    "pp2-vpp2-dp2": (4, dict(pp=2, vpp=2)),
    "pp4": (4, dict(pp=4, recompute="full")),
    "tp2-pp2-dp2": (8, dict(tp=2, pp=2)),
    "tp2-pp2-ep2": (8, dict(tp=2, pp=2, ep=2)),
    "tp2-pp2-dp2-sp-zero1-recompute": (
        8,
        dict(tp=2, pp=2, sequence_parallel=True, distributed_optimizer=True, recompute="selective"),
    ),
    "tp4-kv-replicated": (4, dict(tp=4)),
    "cp2": (2, dict(cp=2)),
    "cp4": (4, dict(cp=4)),
    "tp2-cp2-sp": (4, dict(tp=2, cp=2, sequence_parallel=True)),
    "pp2-cp2": (4, dict(pp=2, cp=2)),
    "cp2-dp2-zero1": (4, dict(cp=2, distributed_optimizer=True)),
    "tp2-cp2-pp2-recompute": (8, dict(tp=2, cp=2, pp=2, recompute="full")),
    "ep2": (2, dict(ep=2)),
    "ep4": (4, dict(ep=4, moe_a2a_chunks=2)),  # the all-to-all in two overlapped chunks
    "tp2-ep2-sp": (4, dict(tp=2, ep=2, sequence_parallel=True)),
    "pp2-ep2": (4, dict(pp=2, ep=2)),
    "ep2-dp4-zero1": (4, dict(ep=2, distributed_optimizer=True)),
    "cp2-ep2": (4, dict(cp=2, ep=2, moe_dispatcher="allgather")),
    "tp2-dp2-recompute": (4, dict(tp=2, recompute="selective", distributed_optimizer=True)),
    # FSDP2 (ZeRO-3) over the data-parallel ranks of the layout, ZeRO-2, and HSDP (shard over 2, replicate over 2)
    "fsdp4": (4, dict(fsdp=True)),
    "fsdp2-tp2": (4, dict(fsdp=True, tp=2)),
    "fsdp2-pp2": (4, dict(fsdp=True, pp=2)),
    "fsdp2-cp2": (4, dict(fsdp=True, cp=2)),
    "fsdp4-ep2": (4, dict(fsdp=True, ep=2)),
    "zero2": (4, dict(zero=2)),
    "hsdp2": (4, dict(fsdp=True, fsdp_degree=2)),
    "fsdp4-offload": (4, dict(fsdp=True, offload_optimizer=True)),  # each rank's shards stepped on the host
    # zero-bubble pipeline schedules (B and W split; zb-v's V: two chunks per rank, both ends on pipeline rank 0)
    "pp2-zb-h1": (2, dict(pp=2, schedule="zb-h1")),
    "pp2-zb-v": (2, dict(pp=2, schedule="zb-v")),
    "pp2-zb-h1-recompute": (2, dict(pp=2, schedule="zb-h1", recompute="full")),
    "pp2-zb-v-selective": (2, dict(pp=2, schedule="zb-v", recompute="selective")),
    # the V's tied-embedding sum with the offloaded optimizer, and its forward-only evaluation
    "pp2-zb-v-offload-eval": (2, dict(pp=2, schedule="zb-v", offload_optimizer=True, eval_interval=3, eval_steps=1)),
    "pp4-zb-h1": (4, dict(pp=4, schedule="zb-h1")),
    "pp4-zb-v": (4, dict(pp=4, schedule="zb-v", num_layers=8)),  # 8 stages: against the 8-layer single process
    "tp2-pp2-zb-h1-sp": (4, dict(tp=2, pp=2, schedule="zb-h1", sequence_parallel=True)),
    "pp2-ep2-zb-v": (4, dict(pp=2, ep=2, schedule="zb-v")),
    "tp2-pp2-dp2-zb-v": (
        8,
        dict(tp=2, pp=2, schedule="zb-v", sequence_parallel=True, distributed_optimizer=True),
    ),
}
ONLY = {
    "offload": ("gpt",),
    "dp2-zero1-offload": ("gpt",),
    "pp2-gpipe": ("gpt",),
    "pp4": ("gpt",),
    "tp2-dp2-sp": ("gpt",),
    "pp2-dp2": ("gpt",),
    "tp2-pp2": ("gpt", "bert", "llama-swa", "llama-moe", "qwen", "qwen-moe", "gemma", "gpt-oss", "deepseek-mtp")
    + PACKED
    + FP8_MODELS,
    "tp2-sp": DENSE + ("gpt-fp8", "llama-fp8"),
    "tp2-pp2-ep2": ("gpt-moe-fp8", "llama-moe-fp8"),
    "pp2-vpp2-dp2": ("gpt", "bert"),
    "tp2-pp2-dp2": ("bert",),
    "tp2-pp2-dp2-sp-zero1-recompute": ("gpt", "llama"),
    "tp4-kv-replicated": ("llama",),
    "cp4": ("gpt", "llama"),
    "pp2-cp2": ("gpt", "llama"),
    "cp2-dp2-zero1": ("llama",),
    "tp2-cp2-pp2-recompute": ("llama",),
    "ep2": EXPERTS + ("qwen-moe", "gpt-oss", "deepseek"),
    "ep4": EXPERTS,
    "tp2-ep2-sp": EXPERTS + ("deepseek-mtp",),
    "pp2-ep2": EXPERTS,
    "ep2-dp4-zero1": ("gpt-moe",),
    "cp2-ep2": ("llama-moe",),
    "tp2": DENSE + ("llama-swa", "vlm-x"),
    "cp2": ("gpt", "llama", "llama-swa", "gemma", "deepseek") + PACKED,
    "tp2-cp2-sp": ("gpt", "llama", "llama-swa"),
    "torch-attention": ("llama-swa",),
    "pp2": DENSE + VISION,
    "dp2-zero1": DENSE + ("vlm",),
    "tp2-dp2-recompute": ("vlm-x",),
    "fsdp4": DENSE + ("qwen", "vlm", "gpt-fp8", "llama-fp8"),  # tensorwise FP8 weights gathered in FP8
    "fsdp2-tp2": DENSE + ("qwen", "gpt-fp8"),
    "fsdp2-pp2": DENSE,
    "fsdp2-cp2": ("gpt", "llama"),
    "fsdp4-ep2": EXPERTS,
    "zero2": ("gpt", "llama"),
    "hsdp2": ("gpt",),
    "fsdp4-offload": ("gpt",),
    "pp2-zb-h1": ("gpt", "llama"),
    "pp2-zb-v": ("gpt", "llama", "bert"),
    "pp2-zb-h1-recompute": ("gpt",),
    "pp2-zb-v-selective": ("llama",),
    "pp2-zb-v-offload-eval": ("gpt",),
    "pp4-zb-h1": ("gpt", "llama"),
    "pp4-zb-v": ("gpt", "llama"),
    "tp2-pp2-zb-h1-sp": ("llama", "gpt-fp8"),
    "pp2-ep2-zb-v": ("gpt-moe",),
    "tp2-pp2-dp2-zb-v": ("gpt", "llama"),
}
# The slow set (``-m slow``, ``scripts/test.sh --all``): the same layout for more families where every feature it
# combines is already covered for those families by the fast cases (each layout keeps at least one family, each
# family its own TP/CP/PP/EP/FSDP cases). CI runs the rest; these run in worlds of their own.
SLOW = {
    "tp2": ("gpt", "bert", "llama-swa"),  # gpt: tp2-sp, tp2-dp2-sp; bert: tp2-sp, tp2-pp2-dp2; llama-swa: tp2-cp2-sp
    "tp2-sp": ("gpt", "llama"),  # tp2-dp2-sp; tp2-pp2-zb-h1-sp and the world of 8
    "pp2": ("gpt", "bert", "llama"),  # 1F1B at pp2-dp2 / pp4, tp2-pp2-dp2, pp2-cp2 (the vision models stay)
    "dp2": ("bert", "llama"),  # their data parallelism at dp2-zero1, cp2-dp2-zero1
    "dp2-zero1": ("llama",),  # ZeRO-1 at cp2-dp2-zero1 and in the world of 8
    "cp2": ("gpt", "llama"),  # gpt-docs at cp2; llama at cp4, pp2-cp2, cp2-dp2-zero1
    "ep2": ("gpt-moe", "llama-moe"),  # ep4, pp2-ep2, cp2-ep2, ...; qwen-moe's top-k stays
    "pp2-zb-h1": ("llama",),  # tp2-pp2-zb-h1-sp
    "pp2-zb-v": ("gpt", "llama"),  # pp2-zb-v-offload-eval, pp2-zb-v-selective, pp4-zb-v, tp2-pp2-dp2-zb-v
    "tp2-pp2": ("gpt", "bert", "llama-swa", "llama-moe", "gpt-docs", "gpt-fp8", "llama-moe-fp8", "gpt-moe-fp8"),
    "pp2-vpp2-dp2": ("bert",),  # interleaving kept for gpt; bert's pipeline at tp2-pp2-dp2 and pp2-zb-v
    "tp2-cp2-sp": ("gpt", "llama"),  # llama-swa: TP, CP, SP and the window together
    "cp4": ("gpt",),
    "fsdp4": ("llama", "qwen", "gpt-fp8"),  # llama: fsdp2-cp2, zero2; gpt-fp8 and qwen: fsdp2-tp2
    "fsdp2-tp2": ("gpt", "bert", "llama"),  # qwen and gpt-fp8 stay
    "fsdp2-pp2": ("bert", "llama"),
    "fsdp2-cp2": ("gpt",),
    "fsdp4-ep2": ("gpt-moe",),
    "zero2": ("gpt",),
    "tp2-ep2-sp": ("gpt-moe",),
    "pp2-ep2": ("llama-moe",),
    "pp2-cp2": ("gpt",),
    "pp4-zb-h1": ("llama",),
    "pp4-zb-v": ("gpt",),
    "tp2-pp2-dp2-sp-zero1-recompute": ("llama",),  # llama's tp x cp x pp with recomputation stays in the world of 8
    "tp2-pp2-dp2-zb-v": ("llama",),  # llama's zb-v at pp2 and pp4
}
# Single-process curves of other models than BASE's, and the layouts compared against them.
REFERENCES = {"layers8": dict(num_layers=8)}
REFERENCE_OF = {"pp4-zb-v": "layers8"}


def _args(model: str, changes: dict, nproc: int, root: str = "") -> TrainArgs:
    family, extra = FAMILY[model]
    args = dataclasses.replace(BASE, model=family, nproc=nproc, **extra, **changes)
    if model == "gpt-docs":
        args = dataclasses.replace(args, data=os.path.join(root or CKPT_DIR, "docs"))
    elif model == "llama-sft":
        tok = os.path.join(root or CKPT_DIR, "chat-tokenizer")
        args = dataclasses.replace(args, data=os.path.join(root or CKPT_DIR, "chat"), tokenizer=f"hf:{tok}")
    return args


def _packed_data(root: str = None) -> None:
    """The packed models' data under ``root`` (made once, in the parent process): ~400 short byte-level documents
    of 3 to 30 tokens with EOD, and the example conversations preprocessed with a small chat tokenizer."""
    import json

    from megakernels_models.data import chat
    from megakernels_models.data.preprocess import preprocess

    root = root or CKPT_DIR
    if os.path.exists(os.path.join(root, "chat.chat.json")):
        return
    g = torch.Generator().manual_seed(0)
    words = ["alpha", "beta", "gamma", "delta", "pack", "doc", "end", "x"]
    with open(os.path.join(root, "docs.jsonl"), "w") as f:
        for _ in range(400):
            n = int(torch.randint(1, 6, (1,), generator=g))
            text = " ".join(words[int(i)] for i in torch.randint(0, len(words), (n,), generator=g))
            f.write(json.dumps({"text": text}) + "\n")
    preprocess([os.path.join(root, "docs.jsonl")], os.path.join(root, "docs"), "byte", append_eod=True)
    example = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "data", "chat_small.jsonl")
    tok = os.path.join(root, "chat-tokenizer")
    chat.write_small_tokenizer(tok, chat.conversation_texts([example]), 300)
    chat.preprocess_chat([example], os.path.join(root, "chat"), tok)


def _cases(nproc: int, slow: bool | None = False) -> list[tuple[str, str]]:
    """The (model, layout) cases of world size ``nproc``: the fast set, the slow set (``slow=True``) or both
    (``None``)."""
    return [
        (model, name)
        for name, (n, _) in LAYOUTS.items()
        if n == nproc
        for model in ONLY.get(name, DENSE)
        if slow is None or (model in SLOW.get(name, ())) == slow
    ]


def _losses(records) -> list[float]:
    return [r["loss"] for r in records]


# Resharding: the (2, 2, 2) run with SP and ZeRO-1 saves (asynchronously) at step SAVE_AT; its checkpoint resumes at
# other layouts (here in the world of 8, and at (1, 1, 1) in this process); the steps after it must follow the
# single-process curve.
SAVE_LAYOUT = dict(
    tp=2,
    pp=2,
    sequence_parallel=True,
    distributed_optimizer=True,
    save_interval=SAVE_AT,
    keep_checkpoints=5,
    async_save=True,
)
RESHARD_TO = {"tp4-dp2": (8, dict(tp=4)), "pp4-dp2": (8, dict(pp=4)), "single": (1, dict())}
# Vision-language models are saved in the world of 2 (no sequence parallelism for them): the GPT one at dp 2 with
# ZeRO-1 (its optimizer state sharded), the cross-attention Llama at tp 2 (encoder, projector and cross-attention
# split); both resume in this process.
VISION_SAVE = {"vlm": dict(distributed_optimizer=True), "vlm-x": dict(tp=2)}
# MoE models are saved with their experts over ep 2 and resumed at ep 1 (tp4-dp2, single) and ep 2 (pp4-dp2).
EP_WHEN = {"saving": 2, "pp4-dp2": 2}


def _with_ep(model: str, where: str, changes: dict) -> dict:
    return dict(changes, ep=EP_WHEN[where]) if model in EXPERTS and where in EP_WHEN else changes


CKPT_DIR = tempfile.mkdtemp(prefix="megakernels-layouts-")
atexit.register(shutil.rmtree, CKPT_DIR, ignore_errors=True)


def _saved(model: str, root: str = CKPT_DIR) -> str:
    return os.path.join(root, model)


def _train_cases(rank: int, world_size: int, cases, root: str):
    from megakernels_models.training.train import train

    out = {}
    for model, name in cases:
        records = train(_args(model, LAYOUTS[name][1], world_size, root))
        if records is not None:
            out[(model, name)] = (_losses(records), [r["grad_norm"] for r in records])
            out[("memory", model, name)] = records[0]["memory_per_param_bytes"]
    return out


def _world(rank: int, world_size: int, cases, root: str):
    from megakernels_models.training.train import train

    out = _train_cases(rank, world_size, cases, root)
    if world_size == 2:
        _zero_bubble_checkpoints(root, world_size, out)
        for model, changes in VISION_SAVE.items():
            records = train(
                _args(
                    model,
                    dict(changes, save=_saved(model, root), save_interval=SAVE_AT, keep_checkpoints=5),
                    world_size,
                )
            )
            if records is not None:
                out[("saving", model)] = (_losses(records), [r["grad_norm"] for r in records])
    if world_size == 4:
        for model in FSDP_RESHARD:
            _fsdp_reshard(model, root, world_size, out)
    if world_size == 8:
        for model in SAVED:
            records = train(
                _args(model, _with_ep(model, "saving", dict(SAVE_LAYOUT, save=_saved(model, root))), world_size)
            )
            if records is not None:
                out[("saving", model)] = (_losses(records), [r["grad_norm"] for r in records])
            for target, (n, changes) in RESHARD_TO.items():
                if n == world_size:
                    records = train(
                        _args(
                            model, _with_ep(model, target, dict(changes, load=_resume_point(model, root))), world_size
                        )
                    )
                    if records is not None:
                        out[("reshard", model, target)] = (_losses(records), [r["grad_norm"] for r in records])
    return out


# zb-v checkpoints (its V: both ends of the model, and a tied embedding's two copies, on pipeline rank 0) in full-model
# coordinates: saved under zb-v at pp 2 (step SAVE_AT) and resumed under 1F1B at pp 2 and in one process; saved under
# 1F1B at pp 2 and resumed under zb-v.
ZB_SAVED = ("gpt", "llama")
ZB_CHAIN = (
    ("zb-v-saving", dict(pp=2, schedule="zb-v"), None),
    ("zb-v-to-1f1b", dict(pp=2), "zb-v-saving"),
    ("1f1b-saving", dict(pp=2), None),
    ("1f1b-to-zb-v", dict(pp=2, schedule="zb-v"), "1f1b-saving"),
)


def _zb_saved(model: str, name: str, root: str = CKPT_DIR) -> str:
    return os.path.join(root, f"{name}-{model}")


def _zero_bubble_checkpoints(root: str, world_size: int, out: dict) -> None:
    from megakernels_models.training.train import train

    for model in ZB_SAVED:
        for name, changes, source in ZB_CHAIN:
            if source is None:
                changes = dict(changes, save=_zb_saved(model, name, root), save_interval=SAVE_AT, keep_checkpoints=5)
            else:
                changes = dict(changes, load=os.path.join(_zb_saved(model, source, root), _step_dir(SAVE_AT)))
            records = train(_args(model, changes, world_size, root))
            if records is not None:
                out[("zb-chain", model, name)] = (_losses(records), [r["grad_norm"] for r in records])


# FSDP checkpoints reshard: saved at fsdp 4 (step 2), resumed at tp 2 × pp 2 and saved again (step 3), resumed at
# fsdp 2 × tp 2 with the optimizer offloaded — all in the world of 4 — and the fsdp 4 one also in one process.
FSDP_RESHARD = ("gpt", "llama-moe")
FSDP_CHAIN = (
    ("fsdp4", dict(fsdp=True), None, SAVE_AT),
    ("tp2-pp2", dict(tp=2, pp=2), "fsdp4", SAVE_AT + 1),
    ("fsdp2-tp2", dict(fsdp=True, tp=2, offload_optimizer=True), "tp2-pp2", None),
)


def _fsdp_reshard(model: str, root: str, world_size: int, out: dict) -> None:
    from megakernels_models.training.train import train

    for name, changes, source, save_at in FSDP_CHAIN:
        changes = dict(changes, **({"ep": 2} if model in EXPERTS and name == "fsdp4" else {}))
        if source is not None:
            prev = dict(FSDP_CHAIN_SAVES)[source]
            changes["load"] = os.path.join(root, f"fsdp-{model}-{source}", f"step-{prev:08d}")
        if save_at is not None:
            changes.update(save=os.path.join(root, f"fsdp-{model}-{name}"), save_interval=save_at, keep_checkpoints=5)
        records = train(_args(model, changes, world_size, root))
        if records is not None:
            out[("fsdp-chain", model, name)] = (_losses(records), [r["grad_norm"] for r in records])


FSDP_CHAIN_SAVES = [(name, at) for name, _, _, at in FSDP_CHAIN if at is not None]


def _step_dir(step: int) -> str:
    return f"step-{step:08d}"


def _resume_point(model: str, root: str = CKPT_DIR) -> str:
    return os.path.join(_saved(model, root), _step_dir(SAVE_AT))


def _single(cases):
    from megakernels_models.training.train import train

    with single_process_world():
        return {
            c: (
                (lambda r: (_losses(r), [x["grad_norm"] for x in r]))(
                    train(_args(c[0], LAYOUTS[c[1]][1] if c[1] in LAYOUTS else REFERENCES.get(c[1], {}), 1))
                )
            )
            for c in cases
        }


def _references() -> list[tuple[str, str]]:
    return list(dict.fromkeys((m, ref) for name, ref in REFERENCE_OF.items() for m in ONLY.get(name, DENSE)))


@pytest.fixture(scope="module")
def baseline():
    _packed_data()
    return _single([(m, "single") for m in MODELS] + _cases(1) + _references())


_WORLDS: dict[tuple[int, bool], object] = {}


def _world_results(n: int, slow: bool = False) -> dict:
    """The curves of every fast (or slow) layout of world size n (one spawned world, run on first use; a failure is
    kept). The fast world also runs the checkpoint chains."""
    if (n, slow) not in _WORLDS:
        _packed_data()
        try:
            cases = _cases(n, slow)
            world = _train_cases if slow else _world
            _WORLDS[n, slow] = run_world(n, world, cases, CKPT_DIR, timeout=600)[-1]  # the last rank logs
        except AssertionError as e:
            _WORLDS[n, slow] = e
    if isinstance(_WORLDS[n, slow], AssertionError):
        raise _WORLDS[n, slow]
    return _WORLDS[n, slow]


def test_single_process_loss_falls(baseline):
    for model in MODELS:
        losses, norms = baseline[(model, "single")]
        assert len(losses) == STEPS and losses[-1] < losses[0], (model, losses)
        assert all(n > 0 for n in norms)


def _assert_same_curve(got, ref, what):
    (losses, norms), (ref_losses, ref_norms) = got, ref
    fp8 = str(what[0] if isinstance(what, tuple) else what).split()[0] in FP8_MODELS
    torch.testing.assert_close(
        torch.tensor(losses, dtype=torch.float64),
        torch.tensor(ref_losses, dtype=torch.float64),
        rtol=FP8_RTOL if fp8 else RTOL,
        atol=0,
        msg=lambda m: f"{what} loss curve differs: {losses} vs {ref_losses}\n{m}",
    )
    torch.testing.assert_close(
        torch.tensor(norms, dtype=torch.float64),
        torch.tensor(ref_norms, dtype=torch.float64),
        rtol=1e-3 if fp8 else 1e-4,
        atol=0,
        msg=lambda m: f"{what} grad norms differ\n{m}",
    )


@pytest.mark.parametrize("case", _cases(1), ids=lambda c: f"{c[0]}-{c[1]}")
def test_single_process_variants_match(baseline, case):
    _assert_same_curve(baseline[case], baseline[(case[0], "single")], case)


@pytest.mark.parametrize("case", [c for n in (2, 4, 8) for c in _cases(n)], ids=lambda c: f"{c[0]}-{c[1]}")
def test_layout_matches_single_process(baseline, case):
    got = _world_results(LAYOUTS[case[1]][0])
    _assert_same_curve(got[case], baseline[(case[0], REFERENCE_OF.get(case[1], "single"))], case)


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for n in (2, 4, 8) for c in _cases(n, slow=True)], ids=lambda c: f"{c[0]}-{c[1]}")
def test_more_families_at_a_layout_match_single_process(baseline, case):
    got = _world_results(LAYOUTS[case[1]][0], slow=True)
    _assert_same_curve(got[case], baseline[(case[0], REFERENCE_OF.get(case[1], "single"))], case)


def test_the_fast_set_keeps_every_layout_and_family():
    """Moving cases to the slow set never drops a feature: every layout keeps a family in the fast set, every family
    of the distributed cases keeps a fast case, and SLOW names only cases that exist."""
    every = {c for n in (2, 4, 8) for c in _cases(n, slow=None)}
    fast = {c for n in (2, 4, 8) for c in _cases(n)}
    assert {(m, name) for name, models in SLOW.items() for m in models} <= every
    assert {name for _, name in fast} == {name for _, name in every}
    assert {m for m, _ in fast} == {m for m, _ in every}


def test_distributed_optimizer_shards_the_optimizer_state():
    """fp32: 4 bytes of weights + 4 of fp32 gradients + 8 of Adam moments per parameter; ZeRO-1 over dp 2 holds
    half the moments (buckets are padded to a multiple of dp, hence the tolerance)."""
    got = _world_results(2)
    plain, zero = got[("memory", "gpt", "dp2")], got[("memory", "gpt", "dp2-zero1")]
    assert plain == {"params": pytest.approx(4.0), "grads": pytest.approx(4.0), "optimizer": pytest.approx(8.0)}
    assert zero["optimizer"] == pytest.approx(4.0, rel=0.02) and zero["grads"] == pytest.approx(4.0, rel=0.02)
    offloaded = got[("memory", "gpt", "dp2-zero1-offload")]  # each rank's shard in host memory: 16 / dp
    assert offloaded["optimizer"] == 0 and offloaded["host"] == pytest.approx(8.0, rel=0.02)


def test_fsdp_offload_moves_the_sharded_optimizer_state_to_the_host():
    """fsdp 4 (fp32): each rank holds a quarter of the weights, gradients and moments (1 + 1 + 2 bytes per
    parameter; FSDP pads each dim-0 cut to equal sizes, hence the tolerance); offloaded, the moments leave the device
    and the host holds them, a master copy and a gradient copy of the shard (2 + 1 + 1)."""
    got = _world_results(4)
    sharded, offloaded = got[("memory", "gpt", "fsdp4")], got[("memory", "gpt", "fsdp4-offload")]
    quarter = pytest.approx(1.0, rel=0.05)
    assert sharded == {"params": quarter, "grads": quarter, "optimizer": pytest.approx(2.0, rel=0.05)}
    assert offloaded == {"params": quarter, "grads": quarter, "optimizer": 0, "host": pytest.approx(4.0, rel=0.05)}


@pytest.mark.parametrize("model", list(SAVED))
def test_saving_does_not_change_the_curve(baseline, model):
    got = _world_results(8)
    _assert_same_curve(got[("saving", model)], baseline[(model, "single")], f"{model} saving at (2,2,2)")


@pytest.mark.parametrize("target", list(RESHARD_TO))
@pytest.mark.parametrize("model", list(SAVED))
def test_a_checkpoint_resumes_at_another_layout(baseline, model, target):
    """Saved at (tp, pp, dp) = (2, 2, 2) with SP and ZeRO-1 at step SAVE_AT, loaded at another layout: the steps
    after it equal the single process's (1e-5 relative)."""
    if RESHARD_TO[target][0] == 1:
        from megakernels_models.training.train import train

        _world_results(8)  # the checkpoint
        with single_process_world():
            records = train(_args(model, dict(load=_resume_point(model)), 1))
        got = (_losses(records), [r["grad_norm"] for r in records])
    else:
        got = _world_results(8)[("reshard", model, target)]
    ref_losses, ref_norms = baseline[(model, "single")]
    assert len(got[0]) == STEPS - SAVE_AT
    _assert_same_curve(got, (ref_losses[SAVE_AT:], ref_norms[SAVE_AT:]), f"{model} resumed at {target}")


@pytest.mark.parametrize("model", FSDP_RESHARD)
def test_fsdp_checkpoints_reshard(baseline, model):
    """fsdp 4 (saved at step 2) -> tp 2 × pp 2 (saved at 3) -> fsdp 2 × tp 2 (optimizer offloaded), and fsdp 4 ->
    one process: every leg follows the single process's curve from where it started (1e-5 relative)."""
    from megakernels_models.training.train import train

    got = _world_results(4)
    ref = baseline[(model, "single")]
    starts = {name: 0 if source is None else dict(FSDP_CHAIN_SAVES)[source] for name, _, source, _ in FSDP_CHAIN}
    for name, start in starts.items():
        losses, norms = got[("fsdp-chain", model, name)]
        assert len(losses) == STEPS - start, (name, losses)
        _assert_same_curve((losses, norms), (ref[0][start:], ref[1][start:]), f"{model} FSDP chain at {name}")
    with single_process_world():
        point = os.path.join(CKPT_DIR, f"fsdp-{model}-fsdp4", _step_dir(SAVE_AT))
        records = train(_args(model, dict(load=point), 1))
    _assert_same_curve(
        (_losses(records), [r["grad_norm"] for r in records]),
        (ref[0][SAVE_AT:], ref[1][SAVE_AT:]),
        f"{model} fsdp 4 -> one",
    )


@pytest.mark.parametrize("model", ZB_SAVED)
def test_zero_bubble_checkpoints_load_at_other_layouts(baseline, model):
    """Saved under zb-v at pp 2 (step SAVE_AT), resumed under 1F1B at pp 2 and in one process; saved under 1F1B at pp 2,
    resumed under zb-v: every leg follows the single process's curve from where it started (1e-5 relative)."""
    from megakernels_models.training.train import train

    got = _world_results(2)
    ref = baseline[(model, "single")]
    for name, _, source in ZB_CHAIN:
        start = 0 if source is None else SAVE_AT
        losses, norms = got[("zb-chain", model, name)]
        assert len(losses) == STEPS - start, (name, losses)
        _assert_same_curve((losses, norms), (ref[0][start:], ref[1][start:]), f"{model} {name}")
    with single_process_world():
        records = train(_args(model, dict(load=os.path.join(_zb_saved(model, "zb-v-saving"), _step_dir(SAVE_AT))), 1))
    _assert_same_curve(
        (_losses(records), [r["grad_norm"] for r in records]),
        (ref[0][SAVE_AT:], ref[1][SAVE_AT:]),
        f"{model} zb-v -> one",
    )


@pytest.mark.parametrize("model", list(VISION_SAVE))
def test_a_vision_language_checkpoint_resumes_at_another_layout(baseline, model):
    """Saved in the world of 2 at step SAVE_AT (VISION_SAVE), loaded in one process: the steps after it equal the
    single process's (1e-5 relative), as does the saving run."""
    from megakernels_models.training.train import train

    saving = _world_results(2)[("saving", model)]
    _assert_same_curve(saving, baseline[(model, "single")], f"{model} saving at {VISION_SAVE[model]}")
    with single_process_world():
        records = train(_args(model, dict(load=_resume_point(model)), 1))
    ref_losses, ref_norms = baseline[(model, "single")]
    assert len(records) == STEPS - SAVE_AT
    _assert_same_curve(
        (_losses(records), [r["grad_norm"] for r in records]),
        (ref_losses[SAVE_AT:], ref_norms[SAVE_AT:]),
        f"{model} saved at {VISION_SAVE[model]}, resumed in one process",
    )
