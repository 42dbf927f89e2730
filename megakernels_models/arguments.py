"""The trainer's settings: one dataclass, each field declared once with its flag, help and group (``settings``), and
its validation.

Everything that can be wrong with a layout is reported here, in the parent process, before any rank starts: each
message names the flag and the rule it broke (``--tp 4 does not divide num_heads=6``).
"""

from __future__ import annotations

import dataclasses
import os
import re
import tempfile

import torch

from megakernels.nn.attention import ATTENTION_CORES
from megakernels.ops.fp8 import RECIPES
from megakernels.ops.post_training import GRPO_LOSSES, PREFERENCE_LOSSES
from megakernels.optim.lr_schedule import STYLES as LR_STYLES
from megakernels.optim.muon import LR_SCALES as MUON_LR_SCALES
from megakernels.optim.muon import SPLITS as MUON_SPLITS
from megakernels.parallel.muon import TP_MODES as MUON_TP_MODES
from megakernels.parallel.optimizer import OPTIMIZERS
from megakernels.parallel.pipeline.schedules import TRAINER_SCHEDULES, ZERO_BUBBLE
from megakernels.precisions import DTYPES, PRECISIONS
from megakernels.validation import finite_number, positive_int
from megakernels_models.models import registry
from megakernels_models.models.config import PRESETS, RECOMPUTE, ModelConfig, preset
from megakernels_models.planning.layout_rules import validate_layout
from megakernels_models.settings import ArgumentError, flag_of, setting
from megakernels_models.training.preemption import SIGNALS

FP8_RECIPES = tuple(RECIPES)
FP8_BASES = ("bf16", "fp32")
DEVICES = ("cpu", "cuda")
# --timeout's default: Megatron-LM's (--distributed-timeout-minutes 10), long enough for a large checkpoint's save or
# load and a first step's compilation, which report no progress while they run.
DEFAULT_TIMEOUT_S = 600.0
SIZES = ("num_layers", "hidden_size", "num_heads", "seq_length", "vocab_size", "ffn_hidden_size", "num_kv_heads")

MODEL, MOE, LAYOUT, OPTIM, DATA, POST, LOGS = (
    "model",
    "mixture of experts",
    "layout",
    "optimisation",
    "data",
    "post-training",
    "checkpoints, evaluation and logs",
)
MOE_FIELDS = (
    "num_experts",
    "moe_first_dense",
    "moe_score",
    "moe_n_group",
    "moe_topk_group",
    "moe_routed_scaling",
    "moe_expert_bias",
    "moe_seq_aux_loss",
    "moe_top_k",
    "moe_normalize",
    "moe_ffn_hidden_size",
    "moe_layer_freq",
    "moe_aux_loss_coeff",
    "moe_z_loss_coeff",
    "moe_capacity_factor",
    "moe_shared_experts",
)
ROPE_FIELDS = (
    "rope_scaling",
    "rope_scaling_factor",
    "rope_low_freq_factor",
    "rope_high_freq_factor",
    "rope_original_max_positions",
    "rope_beta_fast",
    "rope_beta_slow",
    "rope_mscale",
    "rope_mscale_all_dim",
    "rope_truncate",
)

# Per-layer attention (gpt-oss, Gemma 3): each layer's type, the sliding layers' rotary base, learnable sinks.
ATTENTION_FIELDS = ("layer_types", "local_rope_theta", "sinks")
MTP_FIELDS = ("mtp_layers", "mtp_loss_weight")
LAYER_TYPE_NAMES = {"sliding": "sliding_attention", "full": "full_attention"}


def layer_types_value(value):
    """``--layer-types``: a comma-separated string (or a list, from a configuration file) of ``sliding`` / ``full``
    (or transformers' ``sliding_attention`` / ``full_attention``), one a layer -> a tuple of transformers' names, or
    None. ``ModelConfig`` checks the names and the count."""
    if value is None:
        return None
    items = value.split(",") if isinstance(value, str) else list(value)
    return tuple(LAYER_TYPE_NAMES.get(str(t).strip(), str(t).strip()) for t in items)


# The flags only some families take (``FamilySpec.settings``): each is its family's config field of the same name.
FAMILY_SETTINGS = {
    f.name: spec for spec in registry.families() if spec.settings for f in dataclasses.fields(spec.settings)
}
# Every setting that describes the model itself: a resolved configuration folds them into its architecture.
ARCHITECTURE_SETTINGS = (
    "preset",
    "model",
    *SIZES,
    "rope_theta",
    *ROPE_FIELDS,
    "sliding_window",
    *ATTENTION_FIELDS,
    "dropout",
    *MOE_FIELDS,
    *MTP_FIELDS,
    *FAMILY_SETTINGS,
)
__all__ = ["TrainArgs", "validate", "ArgumentError"]


@dataclasses.dataclass
class _Settings:
    """The settings every family takes (``TrainArgs`` adds the families' own)."""

    # model
    model: str | None = setting(
        None, f"model family (default: the preset's, else {registry.DEFAULT})", MODEL, choices=registry.names
    )
    preset: str | None = setting(
        None,
        "a preset model (default: the family's tiny one, e.g. gpt-tiny, unless "
        "--num-layers, --hidden-size, --num-heads and --seq-length are all given); 'none' "
        "to give every size with the flags below",
        MODEL,
        metavar="NAME",
    )
    num_layers: int | None = setting(None, "overrides the preset", MODEL)
    hidden_size: int | None = setting(None, "overrides the preset", MODEL)
    num_heads: int | None = setting(None, "overrides the preset", MODEL)
    seq_length: int | None = setting(None, "overrides the preset", MODEL)
    vocab_size: int | None = setting(None, "overrides the preset (default: the tokenizer's)", MODEL)
    ffn_hidden_size: int | None = setting(None, "overrides the preset (default: 4 × hidden)", MODEL)
    num_kv_heads: int | None = setting(
        None, "key/value heads, grouped-query attention (default: the preset's, or --num-heads)", MODEL
    )
    rope_theta: float | None = setting(None, "rotary embedding base (default: the preset's)", MODEL)
    rope_scaling: str | None = setting(
        None,
        "rotary position scaling for contexts past the trained one: linear (every frequency / factor), llama3 "
        "(Llama 3.1+: low frequencies / factor, high ones kept, a blend between) or yarn (NTK-by-parts between the "
        "beta corrections, cos/sin scaled by its attention factor); none: off (default: the preset's)",
        MODEL,
        choices=("linear", "llama3", "yarn", "none"),
    )
    rope_scaling_factor: float | None = setting(None, "the position scaling's factor (default: the preset's)", MODEL)
    rope_low_freq_factor: float | None = setting(
        None, "llama3 scaling: wavelengths past original / this are scaled (default: the preset's, 1)", MODEL
    )
    rope_high_freq_factor: float | None = setting(
        None, "llama3 scaling: wavelengths below original / this are kept (default: the preset's, 4)", MODEL
    )
    rope_original_max_positions: int | None = setting(
        None, "llama3 scaling: the context the model was trained at (default: the preset's, 8192)", MODEL
    )
    rope_beta_fast: float | None = setting(None, "yarn scaling: the fast correction (default: the preset's, 32)", MODEL)
    rope_beta_slow: float | None = setting(None, "yarn scaling: the slow correction (default: the preset's, 1)", MODEL)
    rope_mscale: float | None = setting(
        None, "yarn scaling: DeepSeek's mscale (with --rope-mscale-all-dim) (default: the preset's, none)", MODEL
    )
    rope_mscale_all_dim: float | None = setting(
        None, "yarn scaling: DeepSeek's mscale_all_dim (default: the preset's, none)", MODEL
    )
    rope_truncate: bool | None = setting(
        None, "yarn scaling: round the correction range to whole dims (default: the preset's, yes)", MODEL
    )
    sliding_window: int | None = setting(
        None,
        "sliding-window attention: each token attends the last N positions, its own included (Mistral); 0: every "
        "position (default: the preset's)",
        MODEL,
        metavar="N",
    )
    layer_types: str | None = setting(
        None,
        "each layer's attention, comma-separated, one a layer: sliding (the --sliding-window) or full "
        "(transformers' sliding_attention / full_attention also read) (default: the preset's)",
        MODEL,
        type=str,
        metavar="TYPES",
    )
    local_rope_theta: float | None = setting(
        None,
        "the rotary base of the sliding layers (with --layer-types) (default: the preset's, else --rope-theta)",
        MODEL,
    )
    sinks: bool | None = setting(
        None, "a learnable sink logit per attention head in every softmax (gpt-oss) (default: the preset's)", MODEL
    )
    mtp_layers: int | None = setting(
        None,
        "multi-token prediction (DeepSeek-V3): N modules on the last stage, module k predicting the token k+1 after "
        "the next (default: the preset's, else 0)",
        MODEL,
    )
    mtp_loss_weight: float | None = setting(
        None, "the multi-token prediction loss's weight in the gradient (default: the preset's, else 0.1)", MODEL
    )
    num_experts: int | None = setting(
        None, "experts per mixture-of-experts layer (default: the preset's; 0: dense)", MOE
    )
    moe_top_k: int | None = setting(None, "experts per token (default: the preset's)", MOE)
    moe_normalize: bool | None = setting(
        None,
        "renormalise the top-k router weights to sum to 1 (Mixtral) or not (Qwen 3 MoE) (default: the preset's)",
        MOE,
    )
    moe_ffn_hidden_size: int | None = setting(None, "each expert's MLP size (default: the preset's)", MOE)
    moe_layer_freq: int | None = setting(None, "every N-th layer is a MoE layer (default: the preset's)", MOE)
    moe_aux_loss_coeff: float | None = setting(None, "load-balancing loss coefficient (default: the preset's)", MOE)
    moe_z_loss_coeff: float | None = setting(None, "router z-loss coefficient (default: the preset's)", MOE)
    moe_capacity_factor: float | None = setting(
        None, "expert capacity as a factor of the even share; over-capacity tokens are dropped (default: dropless)", MOE
    )
    moe_shared_experts: int | None = setting(
        None, "shared experts every token goes through (default: the preset's)", MOE
    )
    moe_first_dense: int | None = setting(
        None, "the first N layers stay dense (DeepSeek's first_k_dense_replace) (default: the preset's)", MOE
    )
    moe_score: str | None = setting(
        None, "router scores: softmax, or sigmoid (DeepSeek-V3) (default: the preset's)", MOE,
        choices=("softmax", "sigmoid"),
    )  # fmt: skip
    moe_n_group: int | None = setting(None, "group-limited routing: expert groups (default: the preset's)", MOE)
    moe_topk_group: int | None = setting(
        None, "group-limited routing: groups eligible per token (default: the preset's)", MOE
    )
    moe_routed_scaling: float | None = setting(
        None, "factor on the routed experts' weights (routed_scaling_factor) (default: the preset's)", MOE
    )
    moe_expert_bias: bool | None = setting(
        None,
        "auxiliary-loss-free balancing: a per-expert selection bias moved after each step (default: the preset's)",
        MOE,
    )  # fmt: skip
    moe_seq_aux_loss: bool | None = setting(
        None,
        "the load-balancing loss per sequence, averaged over the micro-batch (DeepSeek-V3's sequence-wise loss, "
        "weighted by --moe-aux-loss-coeff) (default: the preset's)",
        MOE,
    )  # fmt: skip
    moe_bias_update_rate: float = setting(
        0.001, "the balancing bias's step: bias += rate * sign(mean load - load) after each optimizer step", MOE
    )
    moe_dispatcher: str = setting(
        "alltoall",
        "how tokens reach their experts' ranks: all-to-all, all-gather (small --ep) or a registered backend",
        MOE,
        choices=lambda: _dispatchers().names(),
    )
    moe_fp8_dispatch: bool = setting(
        False,
        "send the dispatched token rows as FP8 (e4m3, a scale a row): about half the bytes of bf16 (--moe-dispatcher "
        "alltoall)",
        MOE,
    )
    moe_a2a_chunks: int = setting(
        1, "split the expert-parallel exchange in N chunks overlapped with the experts' compute (dropless)", MOE
    )
    dropout: float | None = setting(None, "hidden and attention dropout (default: the preset's)", MODEL)
    attention: str = setting(
        "flash",
        "attention core: FlashAttention or PyTorch's SDPA (the baseline)",
        MODEL,
        choices=lambda: tuple(ATTENTION_CORES),
    )
    fused_linear_ce: bool | None = setting(
        None,
        "causal LMs: the LM head and its cross-entropy fused over token chunks, the [tokens, vocab] logits never "
        "held (one more LM-head GEMM); --no-fused-linear-ce: the logits, then the vocab-parallel cross-entropy "
        "(default: fused when a micro-batch's fp32 logits on a rank exceed one chunk, 256 MiB)",
        MODEL,
    )
    # layout
    tp: int = setting(1, "tensor-parallel size", LAYOUT)
    cp: int = setting(1, "context-parallel size: each sequence split over cp ranks, ring attention", LAYOUT)
    ep: int = setting(1, "expert-parallel size: MoE experts split over groups of ep data-parallel ranks", LAYOUT)
    pp: int = setting(1, "pipeline-parallel size", LAYOUT)
    vpp: int | None = setting(None, "virtual stages per pipeline rank (interleaved 1F1B)", LAYOUT)
    dp: int | None = setting(None, "data-parallel size (default: world / (tp·pp))", LAYOUT)
    nproc: int = setting(
        1,
        "local CPU processes to spawn (gloo); on GPUs launch with torchrun instead (with "
        "--dry-run: the world size to plan for)",
        LAYOUT,
    )
    device: str = setting("cpu", "where to train", LAYOUT, choices=DEVICES)
    sequence_parallel: bool = setting(
        False, "shard LayerNorm/dropout activations over the sequence (with --tp)", LAYOUT
    )
    schedule: str = setting(
        "1f1b",
        "pipeline schedule (--vpp selects interleaved 1F1B); zb-h1, zb-v: zero-bubble (Qi et al. 2023), backward "
        "split into input- and weight-gradient passes, the latter run where a rank would idle; zb-v puts two model "
        "chunks on every rank in a V (needs --pp > 1, leave --vpp out)",
        LAYOUT,
        choices=TRAINER_SCHEDULES,
    )
    tp_across_nodes: bool = setting(
        False,
        "under torchrun, run a --tp whose groups span nodes (one that does not divide the ranks per node); refused "
        "without it: every layer's all-reduces would cross the network",
        LAYOUT,
    )
    # optimisation
    micro_batch_size: int = setting(8, "samples per micro-batch", OPTIM)
    global_batch_size: int = setting(16, "samples per optimizer step, over all data-parallel ranks", OPTIM)
    steps: int = setting(300, "optimizer steps in total (a resumed run continues up to it)", OPTIM)
    lr: float = setting(2e-3, "peak learning rate", OPTIM)
    min_lr: float = setting(2e-4, "learning rate at the end of the decay", OPTIM)
    warmup_steps: int | None = setting(None, "linear warmup steps (default: a tenth of --steps)", OPTIM)
    lr_decay_style: str = setting(
        "cosine", "decay after warmup (wsd: warmup, stable, then a linear decay)", OPTIM, choices=LR_STYLES
    )
    lr_decay_steps: int | None = setting(None, "the step at which the decay reaches --min-lr (default: --steps)", OPTIM)
    lr_wsd_decay_steps: int | None = setting(
        None, "length of wsd's final decay (default: a tenth of the steps after warmup)", OPTIM
    )
    adam_beta1: float = setting(0.9, "AdamW beta1", OPTIM)
    adam_beta2: float = setting(0.95, "AdamW beta2", OPTIM)
    adam_eps: float = setting(1e-8, "AdamW epsilon", OPTIM)
    weight_decay: float = setting(0.1, "AdamW weight decay", OPTIM)
    no_weight_decay: str = setting(
        "",
        "comma list of parameter-name parts that get no weight decay, besides biases "
        "and norms (which never do), e.g. embedding",
        OPTIM,
        metavar="NAMES",
    )
    freeze: str = setting(
        "",
        "comma list of parameter-name parts that are not trained (e.g. embedding; for a vlm "
        "also the groups vision, projector, lm, cross); incremental checkpoints reference their "
        "saved bytes instead of rewriting them",
        OPTIM,
        metavar="NAMES",
    )
    clip_grad: float = setting(1.0, "global gradient-norm clipping (0 = off)", OPTIM)
    seed: int = setting(1234, "defines the weights, the data order and dropout", OPTIM)
    precision: str = setting(
        "fp32",
        "training precision (16-bit with fp32 master weights; fp8: the transformer blocks' linear layers and "
        "experts in FP8, the rest in --fp8-base-precision)",
        OPTIM,
        choices=PRECISIONS,
    )
    fp8_recipe: str = setting(
        "tensorwise",
        "--precision fp8's scaling: tensorwise (one scale a tensor from its amax; e5m2 gradients) or blockwise "
        "(1x128 tiles and 128x128 weight blocks, e4m3, fp32 promotion every 128 of K: DeepSeek-V3)",
        OPTIM,
        choices=FP8_RECIPES,
    )
    fp8_base_precision: str = setting(
        "bf16",
        "--precision fp8: the precision of parameters and of what FP8 does not cover (embeddings, LM head, "
        "attention, norms); fp32 isolates FP8's own rounding (comparing layouts)",
        OPTIM,
        choices=FP8_BASES,
    )
    recompute: str = setting("none", "activation recomputation", OPTIM, choices=RECOMPUTE)
    distributed_optimizer: bool = setting(False, "ZeRO-1: shard optimizer state over data-parallel ranks", OPTIM)
    fsdp: bool = setting(
        False,
        "ZeRO-3 by PyTorch's FSDP2: parameters, gradients and optimizer state sharded over the data-parallel ranks "
        "(each layer's parameters all-gathered for its forward and again for its backward)",
        OPTIM,
    )
    zero: int = setting(
        0,
        "ZeRO stage: 1 = --distributed-optimizer, 2 = FSDP2 keeping each layer's gathered parameters from its "
        "forward to its backward, 3 = --fsdp (0: plain data parallelism)",
        OPTIM,
        choices=(0, 1, 2, 3),
    )
    fsdp_degree: int | None = setting(
        None,
        "with --fsdp / --zero 2: shard over this many data-parallel ranks and replicate across the rest (HSDP; "
        "default: all of them)",
        OPTIM,
        type=int,
    )
    fsdp_reduce_dtype: str = setting(
        "fp32", "with --fsdp / --zero 2: the dtype of the gradient reduce-scatter", OPTIM, choices=("fp32", "bf16")
    )
    offload_optimizer: bool = setting(
        False,
        "fp32 masters and Adam moments in host memory, stepped by the C++ CPU "
        "AdamW (each ZeRO-1 rank offloads its shard; with --fsdp / --zero 2 each rank its FSDP shard)",
        OPTIM,
    )
    # Muon (megakernels.optim.muon; in the trainer megakernels.parallel.muon): the hidden matrices' optimizer
    optimizer: str = setting(
        "adamw",
        "adamw, or muon: Newton-Schulz-orthogonalised momentum for the hidden matrices (AdamW for embeddings, "
        "output layer, routers, norms and biases), both at --lr and --weight-decay",
        OPTIM,
        choices=OPTIMIZERS,
    )
    muon_momentum: float = setting(0.95, "Muon's momentum", OPTIM)
    muon_nesterov: bool = setting(True, "Muon without the Nesterov look-ahead", OPTIM, flag="--no-muon-nesterov")
    muon_ns_steps: int = setting(5, "Newton-Schulz iterations per Muon step", OPTIM)
    muon_lr_scale: str = setting(
        "match_rms_adamw",
        "Muon's update scale per matrix [m, n]: match_rms_adamw 0.2*sqrt(max(m, n)) (Moonlight: AdamW's update "
        "RMS, so AdamW's --lr carries over), original sqrt(max(1, m/n)), spectral_unclamped sqrt(m/n)",
        OPTIM,
        choices=MUON_LR_SCALES,
    )
    muon_split: str = setting(
        "projection",
        "fused QKV and gate/up weights orthogonalised per projection, per head, or as one matrix (none)",
        OPTIM,
        choices=MUON_SPLITS,
    )
    muon_tp_mode: str = setting(
        "exact",
        "a tensor-parallel matrix gathered to one rank and orthogonalised whole (exact), or each rank's shard on "
        "its own (shard: an approximation, no gather)",
        OPTIM,
        choices=MUON_TP_MODES,
    )
    muon_clip_tau: float = setting(
        0.0,
        "MuonClip (Kimi K2's qk-clip; any --optimizer): after each step, heads whose largest attention logit of "
        "the step exceeded this get their query/key projections scaled down to it (0: off; Kimi K2 used 100)",
        OPTIM,
        metavar="TAU",
    )
    muon_ns_dtype: str = setting(
        "auto",
        "Newton-Schulz arithmetic: auto (bf16 on CUDA, fp32 on the CPU), bf16 or fp32",
        OPTIM,
        choices=("auto", "bf16", "fp32"),
    )
    # data
    data: str | None = setting(None, "PREFIX[,WEIGHT,PREFIX...] (default: the Python standard library's sources)", DATA)
    tokenizer: str = setting("byte", "byte | hf:PATH | spm:PATH", DATA)
    split: str = setting("949,50,1", "train,valid,test weights over documents", DATA)
    corpus_bytes: int = setting(8 << 20, "cap of the embedded corpus in bytes", DATA)
    document_masking: bool = setting(
        False,
        "packed pre-training: positions restart and attention stops at each document's end (EOD), and an EOD "
        "token predicts nothing (the three flags below together)",
        DATA,
    )
    reset_position_ids: bool = setting(False, "positions restart after each EOD token (Megatron-LM's name)", DATA)
    reset_attention_mask: bool = setting(False, "attention stays within each document (Megatron-LM's name)", DATA)
    eod_mask_loss: bool = setting(False, "an EOD token predicts nothing: no loss there (Megatron-LM's name)", DATA)
    sft: bool = setting(
        False,
        "supervised fine-tuning on --data made by 'megakernels preprocess --chat': conversations packed whole, "
        "loss on the assistant's tokens only",
        DATA,
    )
    sft_packing: bool = setting(
        True,
        "--sft: pack several conversations a sample (best fit); --no-sft-packing: one a sample, padded",
        DATA,
        flag="--no-sft-packing",
    )
    # post-training: preference optimisation (DPO) and reinforcement learning (GRPO)
    dpo: bool = setting(
        False,
        "direct preference optimisation on --data made by 'megakernels preprocess --preference': the policy "
        "against a frozen reference (--dpo-ref, default the policy's initial weights)",
        POST,
    )
    dpo_beta: float = setting(0.1, "--dpo: β, the strength of the pull towards the reference", POST)
    dpo_loss: str = setting("sigmoid", "--dpo: the loss of each pair's reward margin", POST, choices=PREFERENCE_LOSSES)
    dpo_label_smoothing: float = setting(
        0.0,
        "--dpo --dpo-loss sigmoid: the assumed share ε of flipped preferences (conservative DPO), in [0, 0.5)",
        POST,
    )
    dpo_ref: str | None = setting(
        None,
        "--dpo: the reference model, a megakernels checkpoint directory or a HuggingFace model directory "
        "(default: the weights the run starts from: --load-hf's, --load's, or the seed's)",
        POST,
        metavar="DIR",
    )
    precompute_ref: bool = setting(
        False,
        "--dpo: the reference's log-probabilities computed once over the data before training, and the "
        "reference freed (default: computed in each step, the reference kept)",
        POST,
    )
    grpo: bool = setting(
        False,
        'group-relative policy optimisation: prompts from --data FILE.jsonl ({"prompt": TEXT, ...}), '
        "--grpo-group-size completions of each sampled with the KV cache, scored by --reward; "
        "--global-batch-size counts completions",
        POST,
    )
    reward: str | None = setting(
        None,
        "--grpo: the reward, MODULE:FUNCTION called as TRL calls one: f(prompts=[...], completions=[...], "
        "completion_ids=[...], **the prompts' other fields) -> one float a completion",
        POST,
        metavar="MODULE:FUNCTION",
    )
    grpo_group_size: int = setting(8, "--grpo: completions sampled per prompt (its advantages' group)", POST)
    grpo_beta: float = setting(
        0.0, "--grpo: weight of the KL to the reference (the initial policy, kept frozen when > 0)", POST
    )
    grpo_loss: str = setting("grpo", "--grpo: the loss's aggregation (TRL's loss_type)", POST, choices=GRPO_LOSSES)
    grpo_epsilon: float = setting(0.2, "--grpo: the ratio's clipping range below 1 (TRL's epsilon)", POST)
    grpo_epsilon_high: float | None = setting(
        None,
        "--grpo: the clipping range above 1 (default --grpo-epsilon; DAPO uses 0.28); cispo: the ratio's cap "
        "(TRL's epsilon_high: 5 recommended there)",
        POST,
    )
    max_completion_tokens: int = setting(32, "--grpo: tokens sampled per completion at most", POST)
    temperature: float = setting(1.0, "--grpo: the sampling temperature (the log-probabilities use it too)", POST)
    # checkpoints, evaluation, logs
    save: str | None = setting(None, "save checkpoints here (atomic, DCP)", LOGS, metavar="DIR")
    save_interval: int | None = setting(None, "steps between checkpoints (default: only at the end)", LOGS)
    keep_checkpoints: int = setting(3, "how many of the latest checkpoints are kept", LOGS)
    load: str | None = setting(
        None,
        "resume from DIR's latest checkpoint (any layout); a missing or empty DIR starts "
        "from scratch, so --save DIR --load DIR serves every (re)launch",
        LOGS,
        metavar="DIR",
    )
    load_hf: str | None = setting(
        None,
        "fine-tune the HuggingFace model in DIR: converted into --save's directory as its step-0 checkpoint (a "
        "temporary one without --save) and loaded from there (its architecture and tokenizer unless given; a "
        "relaunch resumes --save's latest checkpoint)",
        LOGS,
        metavar="DIR",
    )
    async_save: bool = setting(
        False,
        "write checkpoints in the background (staged to host memory at the step, written while training goes on)",
        LOGS,
    )
    max_save_failures: int = setting(
        3,
        "stop the run (exit 1) after N checkpoint saves in a row failed (a full "
        "disk: each failed save is reported and cleaned up, the next one tries again); "
        "0: never stop for it",
        LOGS,
    )
    exit_signal: str = setting(
        "SIGTERM",
        "on this signal every rank finishes its step, saves (with --save) and exits 0 (SIGUSR1: Slurm's --signal); "
        "Ctrl-C (SIGINT) does the same whatever this is, and a second Ctrl-C ends the run at once without saving",
        LOGS,
        choices=SIGNALS,
    )
    exit_interval: int | None = setting(None, "stop (saving) after every N-th step", LOGS)
    exit_duration_mins: float | None = setting(
        None, "stop (saving) after the first step ending M minutes into the run", LOGS, metavar="M"
    )
    eval_interval: int = setting(100, "steps between validations (0 = never)", LOGS)
    eval_steps: int = setting(4, "global batches per validation", LOGS)
    log_jsonl: str | None = setting(None, "append one JSON object per step to FILE", LOGS, metavar="FILE")
    tensorboard: str | None = setting(None, "write TensorBoard events to DIR", LOGS, metavar="DIR")
    progress: bool = setting(True, "no progress bar", LOGS, flag="--no-progress")
    peak_tflops: float | None = setting(
        None, "device peak TFLOP/s for MFU (default: a GPU table, or measured on the CPU)", LOGS
    )
    timeout: float = setting(
        DEFAULT_TIMEOUT_S,
        "seconds a rank may go without progress (a step phase, a collective, a save, a checkpoint load) before the "
        "job is ended, naming the rank that stopped responding: a hung or stopped rank ends the job after about "
        f"this long (default: {DEFAULT_TIMEOUT_S:.0f} s, {DEFAULT_TIMEOUT_S / 60:.0f} minutes, as Megatron-LM's "
        "--distributed-timeout-minutes)",
        LOGS,
    )
    gpus_per_node: int = setting(8, "GPUs per node, for --dry-run's and megakernels plan's layout checks", LAYOUT)
    gpu: str = setting(
        "h200", "the GPU --dry-run checks memory against", LAYOUT, choices=("h200", "h100", "a100", "v100")
    )
    dry_run: bool = setting(
        False, "validate and report parameters, FLOPs and memory per device, without training", LOGS
    )
    memory_check: bool = setting(
        True,
        "train even when the model's estimated memory (--dry-run's) is more than "
        "this machine has free (the device's memory; on the CPU what the processes may "
        "use)",
        LAYOUT,
        flag="--no-memory-check",
    )
    architecture: dict | None = setting(
        None, "ModelConfig fields defining the model (from a --config file)", MODEL, cli=False
    )
    config_file: str | None = setting(
        None, "the --config file the settings came from (errors name it)", MODEL, cli=False
    )
    config_settings: dict | None = setting(None, "the values that file gave", MODEL, cli=False)
    step_timers: bool = setting(
        False, "per-phase step times and peak memory (megakernels bench --e2e)", LOGS, cli=False
    )


@dataclasses.dataclass
class TrainArgs(*(spec.settings for spec in registry.families() if spec.settings), _Settings):
    """All of ``megakernels train``'s settings (docs/training.md): every family's (``_Settings``) and each family's
    own (``FamilySpec.settings``); the defaults are the embedded default run."""

    # ---- derived ------------------------------------------------------------------------------------------------

    def preset_name(self) -> str | None:
        """The preset in use: ``--preset`` (None for ``none``), else the family's tiny preset unless every size is
        given."""
        if self.preset == "none" or (self.architecture and self.preset is None):
            return None
        if self.preset is not None:
            return self.preset
        if all(getattr(self, k) is not None for k in SIZES[:4]):
            return None
        return registry.family(self.model or registry.DEFAULT).tiny_preset

    def family_name(self) -> str:
        """The model's family: the preset's, the architecture's, ``--model``'s or the default."""
        name = self.preset_name()
        if name is not None and name in PRESETS:
            return PRESETS[name].model
        if self.architecture:
            return self.architecture.get("model", registry.DEFAULT)
        return self.model or registry.DEFAULT

    def fused_head(self, cfg: ModelConfig) -> bool:
        """Whether causal LMs compute the loss with ``ops.linear_cross_entropy``: ``--fused-linear-ce`` /
        ``--no-fused-linear-ce``, else when a micro-batch's fp32 logits on one rank are more than one of its chunks
        (below that the fused head saves no memory and costs one more LM-head GEMM)."""
        if self.fused_linear_ce is not None:
            return self.fused_linear_ce
        from megakernels.ops.linear_cross_entropy import CHUNK_LOGITS_BYTES

        tokens = self.micro_batch_size * cfg.seq_length // max(1, self.cp)  # the text tokens (a VLM's too)
        return 4 * tokens * -(-cfg.vocab_size // max(1, self.tp)) > CHUNK_LOGITS_BYTES

    def _check_family_settings(self) -> None:
        """A flag of another family's (``--image-size`` for a GPT) is an error naming the family it is for."""
        mine = self.family_name()
        for name, spec in FAMILY_SETTINGS.items():
            if getattr(self, name) is not None and spec.name != mine:
                raise ArgumentError(f"{_flag(name)} is for {spec.title}s (--model {spec.name})")

    def model_config(self) -> ModelConfig:
        """The model: the preset (if any) with the explicitly given sizes replacing its fields (``--sliding-window
        0`` removes the preset's window, ``--rope-scaling none`` its position scaling)."""
        cfg = self._model_config()
        if self.sliding_window == 0 and cfg.sliding_window is not None:
            cfg = cfg.replace(sliding_window=None)
        if self.rope_scaling == "none" and cfg.rope_scaling is not None:
            cfg = cfg.replace(rope_scaling=None)
        return cfg

    def _model_config(self) -> ModelConfig:
        sizes = {k: getattr(self, k) for k in SIZES}
        if self.sliding_window:
            sizes["sliding_window"] = self.sliding_window
        for name in ("rope_theta",) + ROPE_FIELDS + ATTENTION_FIELDS + MOE_FIELDS + MTP_FIELDS + tuple(FAMILY_SETTINGS):
            if getattr(self, name) is not None:
                sizes[name] = getattr(self, name)
        if self.layer_types is not None:
            sizes["layer_types"] = layer_types_value(self.layer_types)
        if self.rope_scaling == "none":
            sizes["rope_scaling"] = None  # model_config removes the preset's
        drop = {} if self.dropout is None else {"dropout": self.dropout, "attention_dropout": self.dropout}
        if sizes["vocab_size"] is None and self.tokenizer != "byte":  # the model's vocabulary is the tokenizer's
            from megakernels_models.data.tokenizer import build_tokenizer

            try:
                sizes["vocab_size"] = build_tokenizer(self.tokenizer).vocab_size
            except (OSError, ValueError):
                pass  # validate_data_args reports the tokenizer's problem, naming the flag
        overrides = {k: v for k, v in {**sizes, **drop}.items() if v is not None}
        name = self.preset_name()
        if name is not None and self.model is not None and name in PRESETS and self.model != PRESETS[name].model:
            raise ArgumentError(f"--model {self.model} contradicts --preset {name} (a {PRESETS[name].model} model)")
        if self.architecture and self.model is not None and self.model != self.family_name():
            raise ArgumentError(f"--model {self.model} contradicts the architecture (a {self.family_name()} model)")
        self._check_family_settings()
        if name is not None:
            cfg = preset(name, **sizes, **drop)
            if self.architecture:
                self._check_architecture_agrees(name, cfg, overrides)
            return cfg
        if self.architecture:
            return self._architecture_config(overrides)
        missing = [f"--{k.replace('_', '-')}" for k in SIZES[:4] if sizes[k] is None]
        if missing:
            raise ArgumentError(f"without --preset, give {', '.join(missing)}")
        sizes = {k: v for k, v in sizes.items() if v is not None}
        sizes.setdefault("vocab_size", 261)
        return ModelConfig(self.model or registry.DEFAULT, **sizes, **drop)

    def _architecture_source(self) -> str:
        return f"--config {self.config_file}: architecture" if self.config_file else "architecture"

    def _architecture_config(self, overrides: dict) -> ModelConfig:
        """The ``architecture`` fields with the size settings given (``overrides``) replacing them."""
        try:
            return ModelConfig(**self.architecture).replace(**overrides)
        except ValueError as e:
            raise ArgumentError(f"{self._architecture_source()}: {e}") from None

    def _check_architecture_agrees(self, name: str, cfg: ModelConfig, overrides: dict) -> None:
        """A preset (giving ``cfg``) and an architecture together: one of them would be ignored, so every field the
        architecture gives must come out as the preset's (after the size settings replace both; see config_file's
        precedence).

        Raises:
            ArgumentError: listing the fields that differ, with both values.
        """
        mine = self._architecture_config(overrides)
        conflicts = [
            f"{k}={getattr(mine, k)!r} (the preset's {getattr(cfg, k)!r})"
            for k in self.architecture
            if getattr(mine, k) != getattr(cfg, k)
        ]
        if conflicts:
            by = "the same file's preset" if (self.config_settings or {}).get("preset") == self.preset else "--preset"
            raise ArgumentError(
                f"{self._architecture_source()} differs from {by} {name} in {', '.join(conflicts)}: "
                "give one of them (--preset none trains the architecture; without the "
                "architecture the preset is trained)"
            )

    def world_size(self) -> int:
        """Ranks: torchrun's ``WORLD_SIZE`` under torchrun, else ``--nproc``."""
        return int(os.environ["WORLD_SIZE"]) if "WORLD_SIZE" in os.environ else self.nproc

    def restart_count(self) -> int:
        """How many times torchrun's elastic agent restarted the workers (``TORCHELASTIC_RESTART_COUNT``; 0 on the
        first attempt and outside torchrun). A restart may come with a different world size."""
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)

    def frozen_parts(self) -> tuple[str, ...]:
        """``--freeze``'s name parts (``Task.is_frozen``), empty ones dropped."""
        return tuple(n.strip() for n in self.freeze.split(",") if n.strip())

    def data_parallel_size(self) -> int:
        from megakernels_models.planning.layout_rules import layout_of

        return layout_of(self).dp

    def num_microbatches(self) -> int:
        return self.global_batch_size // (self.micro_batch_size * self.data_parallel_size())

    def pipeline_chunks(self) -> int:
        """Model chunks per pipeline rank: 2 for ``--schedule zb-v`` (its V), else ``--vpp`` (1 without)."""
        return 2 if self.schedule == "zb-v" else (self.vpp or 1)

    def pipeline_placement(self) -> str:
        """Where the chunks sit (``megakernels.parallel.pipeline.schedules``): ``"v"`` for zb-v, else
        ``"interleaved"``."""
        return "v" if self.schedule == "zb-v" else "interleaved"

    def zero_stage(self) -> int:
        """0 (plain data parallelism), 1 (``--distributed-optimizer``), 2 or 3 (FSDP2: ``--zero 2``, ``--fsdp``)."""
        if self.fsdp:
            return 3
        return self.zero or (1 if self.distributed_optimizer else 0)

    def base_precision(self) -> str:
        """The precision of the parameters and of every op FP8 does not cover (``precision`` unless it is fp8)."""
        return self.fp8_base_precision if self.precision == "fp8" else self.precision

    def param_dtype(self) -> torch.dtype:
        return DTYPES[self.base_precision()]


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _naming_the_file(args, message: str) -> str:
    """``message`` (an error of ``arguments.validate``, naming flags) with the settings among those flags that came
    from ``args``'s ``--config`` file named, so the user knows where to fix them; unchanged otherwise."""
    given = args.config_settings or {}
    if not args.config_file or "--config" in message:
        return message
    flags = set(re.findall(r"--[a-z][a-z0-9-]*", message))
    # the file's value still in args (identity: the same object, also for nan), not one a flag replaced
    names = [
        f.name
        for f in dataclasses.fields(TrainArgs)
        if f.name in given
        and flag_of(f) in flags
        and (getattr(args, f.name) is given[f.name] or getattr(args, f.name) == given[f.name])
    ]
    return f"{message} ({', '.join(names)}: from --config {args.config_file})" if names else message


# --timeout's bounds in seconds: below one second the first rendezvous cannot finish (1e-9 ended in a
# DistNetworkError traceback); past a year torch's timedelta arithmetic overflows.
TIMEOUT_RANGE = (1.0, 365 * 86400.0)


def _check_local_ranks(a: TrainArgs) -> None:
    """``--nproc`` spawns that many processes on this machine: at most ``launch.MAX_LOCAL_RANKS`` (a dry run only
    plans for the world, and under torchrun ``--nproc`` starts nothing)."""
    from megakernels.parallel.launch import MAX_LOCAL_RANKS

    if a.nproc > MAX_LOCAL_RANKS and not a.dry_run and "WORLD_SIZE" not in os.environ:
        raise ArgumentError(
            f"--nproc {a.nproc} is more than the {MAX_LOCAL_RANKS} local processes megakernels train spawns on "
            "one machine: launch a larger world with torchrun on several nodes (--dry-run --nproc N plans any size)"
        )


def _writable_dir(flag: str, path: str) -> None:
    """Create directory ``path`` (and its parents) as the run would, and write a file in it.

    Raises:
        ArgumentError: ``path`` cannot be created or written (the reason and the path named).
    """
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        raise ArgumentError(f"{flag} {path!r} cannot be written: {e.strerror or e} ({e.filename or path})") from None


def _writable_file(flag: str, path: str) -> None:
    """Open ``path`` for appending as the run's log would (creating it and its directory).

    Raises:
        ArgumentError: ``path`` is a directory, or cannot be created or appended to (the reason named).
    """
    if os.path.isdir(path):
        raise ArgumentError(f"{flag} {path!r} is a directory, not a file")
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "a", encoding="utf-8"):
            pass
    except OSError as e:
        raise ArgumentError(f"{flag} {path!r} cannot be written: {e.strerror or e} ({e.filename or path})") from None


def check_output_paths(a: TrainArgs) -> None:
    """What the run will write can be written, before any process starts: ``--log-jsonl`` (a dry run's report
    too) is opened for appending, ``--save`` and ``--tensorboard`` directories are created and written to (the run
    creates them anyway). A failure later in the run stays a warning (``TrainLogger``) or a failed save
    (``--max-save-failures``). Skipped inside a process that already holds a ``torch.distributed`` world: its
    caller validated before making it.

    Raises:
        ArgumentError: a path that cannot be created or written, naming the flag, the path and the reason.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return
    if a.log_jsonl:
        _writable_file("--log-jsonl", a.log_jsonl)
    if a.dry_run:
        return
    for flag, path in (("--save", a.save), ("--tensorboard", a.tensorboard)):
        if path:
            _writable_dir(flag, path)


PACKING_SETTINGS = ("document_masking", "reset_position_ids", "reset_attention_mask", "eod_mask_loss", "sft")


def _check_sharding(a: TrainArgs) -> None:
    """The ZeRO stages' flags agree: --fsdp is stage 3, --distributed-optimizer stage 1 (FSDP's stages shard the
    optimizer state already)."""
    if a.fsdp and a.zero not in (0, 3):
        raise ArgumentError(f"--fsdp is ZeRO stage 3, but --zero {a.zero} asks for stage {a.zero}: give one of them")
    if a.distributed_optimizer and a.zero_stage() != 1:
        raise ArgumentError(
            f"--distributed-optimizer is ZeRO-1; with --fsdp or --zero {a.zero_stage()} FSDP shards the optimizer "
            "state already: leave it out"
        )
    if a.fsdp_degree is not None and a.zero_stage() < 2:
        raise ArgumentError(f"--fsdp-degree {a.fsdp_degree} needs --fsdp or --zero 2")


def _check_muon(a: TrainArgs, cfg: ModelConfig) -> None:
    """Muon's settings: a momentum in [0, 1), at least one Newton-Schulz step, the device optimizer; MuonClip's tau
    >= 0, on whole sequences (no context parallelism) of a model without per-head q/k norms."""
    tau = finite_number(a.muon_clip_tau, "--muon-clip-tau", error=ArgumentError)
    if tau < 0:
        raise ArgumentError(f"--muon-clip-tau must be >= 0 (0: off), got {tau}")
    if tau > 0 and a.cp > 1:
        raise ArgumentError(
            f"--muon-clip-tau measures each head's logits over whole sequences; --cp {a.cp} splits them over a ring"
        )
    if tau > 0 and getattr(cfg, "qk_norm", False):
        raise ArgumentError(
            "--muon-clip-tau scales the query/key projections, which a per-head q/k RMSNorm (qk_norm) undoes"
        )
    if a.optimizer != "muon":
        return
    if not 0.0 <= finite_number(a.muon_momentum, "--muon-momentum", error=ArgumentError) < 1.0:
        raise ArgumentError(f"--muon-momentum must be in [0, 1), got {a.muon_momentum}")
    positive_int(a.muon_ns_steps, "--muon-ns-steps", error=ArgumentError)
    if a.offload_optimizer:
        raise ArgumentError(
            "--offload-optimizer steps AdamW on the host; --optimizer muon runs on the device: leave one out"
        )


def _check_schedule(a: TrainArgs) -> None:
    """The zero-bubble schedules: zb-h1 runs one chunk per rank; both defer weight gradients past their backward,
    which FSDP (--fsdp / --zero 2) does not allow (zb-v's own rules, pp and chunks, are the layout's)."""
    if a.schedule not in ZERO_BUBBLE:
        return
    if a.schedule == "zb-h1" and (a.vpp or 1) > 1:
        raise ArgumentError(
            f"--schedule zb-h1 runs one model chunk per pipeline rank; --vpp {a.vpp} interleaves chunks (1F1B): "
            "leave --vpp out, or use --schedule zb-v for two chunks per rank"
        )
    if a.zero_stage() >= 2:
        flag = "--fsdp" if a.fsdp else f"--zero {a.zero}"
        raise ArgumentError(
            f"--schedule {a.schedule} computes weight gradients in later passes than their backward; {flag} "
            "(FSDP) reduce-scatters each module's gradients and reshards its parameters when its backward ends, "
            "before those passes: use --distributed-optimizer (ZeRO-1) or --schedule 1f1b"
        )


def _check_packing(a: TrainArgs, cfg: ModelConfig) -> None:
    """Packed sequences (--document-masking, the Megatron-LM flags, --sft) are for causal language models, and
    --sft reads a chat dataset."""
    if not a.sft_packing and not a.sft:
        raise ArgumentError("--no-sft-packing is for --sft")
    given = [_flag(n) for n in PACKING_SETTINGS if getattr(a, n)]
    if not given:
        return

    def packs(spec) -> bool:  # a causal LM trained on token documents
        return spec.causal and spec.data == "tokens"

    if not packs(registry.family(cfg.model)):
        lms = registry.titles(packs)
        raise ArgumentError(f"{given[0]} is for causal language models ({lms}), not --model {cfg.model}")
    if a.sft and a.data is None:
        raise ArgumentError("--sft needs --data PREFIX, made by 'megakernels preprocess --chat FILE.jsonl'")
    if a.sft and len(given) > 1:
        raise ArgumentError(f"--sft keeps each conversation's positions and attention apart already; drop {given[0]}")


DPO_OPTIONS = ("dpo_beta", "dpo_loss", "dpo_label_smoothing", "dpo_ref", "precompute_ref")
GRPO_OPTIONS = (
    "reward", "grpo_group_size", "grpo_beta", "grpo_loss", "grpo_epsilon", "grpo_epsilon_high",
    "max_completion_tokens", "temperature",
)  # fmt: skip


def _check_grpo(a: TrainArgs, cfg: ModelConfig) -> None:
    """--grpo: a text-generating causal language model whole on each rank (tp and dp only), a reward that imports,
    groups that split the global batch over the data-parallel ranks, and valid sampling and loss settings."""
    defaults = {f.name: f.default for f in dataclasses.fields(_Settings)}
    if not a.grpo:
        given = [_flag(n) for n in GRPO_OPTIONS if getattr(a, n) != defaults[n]]
        if given:
            raise ArgumentError(f"{given[0]} is for --grpo")
        return
    spec = registry.family(cfg.model)
    if not spec.text_generation:
        lms = registry.titles(lambda f: f.text_generation)
        raise ArgumentError(f"--grpo samples text: it is for causal language models ({lms}), not --model {cfg.model}")
    other = [_flag(n) for n in (*PACKING_SETTINGS, "dpo") if getattr(a, n)]
    if other:
        raise ArgumentError(f"--grpo is its own objective: drop {other[0]}")
    for name, bad in (
        ("pp", a.pp > 1),
        ("cp", a.cp > 1),
        ("ep", a.ep > 1),
        ("vpp", (a.vpp or 1) > 1),
    ):
        if bad:
            raise ArgumentError(
                f"--grpo samples with the whole model on each rank (tensor and data parallelism only): "
                f"{_flag(name)} {getattr(a, name)} is not supported"
            )
    if a.sequence_parallel:
        raise ArgumentError("--grpo decodes one token at a time, which --sequence-parallel cannot split: drop it")
    if a.zero_stage() >= 2:
        raise ArgumentError("--grpo: FSDP (--fsdp / --zero 2) is not supported; use --distributed-optimizer (ZeRO-1)")
    if a.reward is None:
        raise ArgumentError("--grpo needs --reward MODULE:FUNCTION (the function that scores each completion)")
    from megakernels_models.training.grpo import load_reward

    try:
        load_reward(a.reward)
    except ValueError as e:
        raise ArgumentError(str(e)) from None
    if a.grpo_loss not in GRPO_LOSSES:
        raise ArgumentError(f"--grpo-loss must be one of {', '.join(GRPO_LOSSES)}, got {a.grpo_loss!r}")
    positive_int(a.grpo_group_size, "--grpo-group-size", minimum=2, error=ArgumentError)
    positive_int(a.max_completion_tokens, "--max-completion-tokens", error=ArgumentError)
    per_rank = a.global_batch_size // a.data_parallel_size()
    if per_rank % a.grpo_group_size:
        raise ArgumentError(
            f"--grpo-group-size {a.grpo_group_size} must divide each data-parallel rank's "
            f"{per_rank} completions (--global-batch-size {a.global_batch_size} over dp {a.data_parallel_size()})"
        )
    finite_number(a.grpo_beta, "--grpo-beta", error=ArgumentError)
    if a.grpo_beta > 0 and a.load is not None:
        from megakernels_models.training.checkpoint import find_latest, read_meta

        latest = find_latest(a.load)
        if latest is not None and (read_meta(latest).get("train_config") or {}).get("grpo"):
            raise ArgumentError(
                f"--grpo --grpo-beta {a.grpo_beta} --load {a.load}: its latest checkpoint "
                f"{os.path.basename(latest)} was written by a --grpo run, so it is not the reference (the initial "
                "policy): a resumed run with a KL term is not supported (resume with --grpo-beta 0)"
            )
    for name in ("grpo_epsilon", "grpo_epsilon_high", "temperature"):
        value = getattr(a, name)
        if value is not None and not finite_number(value, _flag(name), minimum=None, error=ArgumentError) > 0:
            raise ArgumentError(f"{_flag(name)} must be > 0, got {value}")


def _check_mtp(a: TrainArgs, cfg: ModelConfig) -> None:
    if not cfg.mtp_layers:
        return
    spec = registry.family(cfg.model)
    if not spec.text_generation or cfg.num_image_tokens:
        lms = registry.titles(lambda f: f.text_generation)
        raise ArgumentError(f"--mtp-layers is for causal language models ({lms}), not --model {cfg.model}")
    if a.cp > 1:
        raise ArgumentError(
            "--mtp-layers reads the tokens ahead of each position, which --cp splits over ranks: use --cp 1"
        )
    for name in ("dpo", "grpo"):
        if getattr(a, name):
            raise ArgumentError(f"--mtp-layers is a pre-training objective: drop it for {_flag(name)}")


def _check_dispatch(a: TrainArgs, cfg: ModelConfig) -> None:
    if a.moe_dispatcher not in _dispatchers().names():
        raise ArgumentError(
            f"--moe-dispatcher must be one of {', '.join(_dispatchers().names())}, got {a.moe_dispatcher!r}"
        )
    dropless_only = a.moe_a2a_chunks > 1 or a.moe_dispatcher == "allgather"
    if cfg.num_experts and a.ep > 1 and dropless_only and cfg.moe_capacity_factor is not None:
        what = f"--moe-a2a-chunks {a.moe_a2a_chunks}" if a.moe_a2a_chunks > 1 else "--moe-dispatcher allgather"
        raise ArgumentError(f"{what} is dropless: it cannot take --moe-capacity-factor under --ep > 1")
    if a.moe_fp8_dispatch and a.moe_dispatcher != "alltoall":
        raise ArgumentError(
            f"--moe-fp8-dispatch is the alltoall dispatcher's, not --moe-dispatcher {a.moe_dispatcher}'s"
        )


def _dispatchers():
    from megakernels.parallel.moe import dispatcher

    return dispatcher


def _check_post_training(a: TrainArgs, cfg: ModelConfig) -> None:
    """--dpo: a causal language model on preference data, with valid β, loss and smoothing, a reference that is
    known (a run resumed from its own checkpoint needs --dpo-ref), and no other objective; its options need it."""
    defaults = {f.name: f.default for f in dataclasses.fields(_Settings)}
    if not a.dpo:
        given = [_flag(n) for n in DPO_OPTIONS if getattr(a, n) != defaults[n]]
        if given:
            raise ArgumentError(f"{given[0]} is for --dpo")
        return
    spec = registry.family(cfg.model)
    if not (spec.causal and spec.data == "tokens"):
        lms = registry.titles(lambda f: f.causal and f.data == "tokens")
        raise ArgumentError(f"--dpo is for causal language models ({lms}), not --model {cfg.model}")
    other = [_flag(n) for n in PACKING_SETTINGS if getattr(a, n)]
    if other:
        raise ArgumentError(f"--dpo trains on preference pairs, each sequence apart already; drop {other[0]}")
    if not a.sft_packing:
        raise ArgumentError("--no-sft-packing is for --sft (--dpo packs whole pairs)")
    if a.dpo_loss not in PREFERENCE_LOSSES:
        raise ArgumentError(f"--dpo-loss must be one of {', '.join(PREFERENCE_LOSSES)}, got {a.dpo_loss!r}")
    if not finite_number(a.dpo_beta, "--dpo-beta", minimum=None, error=ArgumentError) > 0:
        raise ArgumentError(f"--dpo-beta must be > 0, got {a.dpo_beta}")
    if not 0.0 <= finite_number(a.dpo_label_smoothing, "--dpo-label-smoothing", error=ArgumentError) < 0.5:
        raise ArgumentError(f"--dpo-label-smoothing must be in [0, 0.5), got {a.dpo_label_smoothing}")
    if a.dpo_label_smoothing and a.dpo_loss != "sigmoid":
        raise ArgumentError(f"--dpo-label-smoothing is for --dpo-loss sigmoid, not {a.dpo_loss}")
    if a.dpo_ref is not None:
        from megakernels_models.training.checkpoint import CheckpointError, find_latest

        hf = os.path.isfile(os.path.join(a.dpo_ref, "config.json"))
        try:
            found = os.path.isdir(a.dpo_ref) and (hf or find_latest(a.dpo_ref) is not None)
        except CheckpointError as e:
            raise ArgumentError(f"--dpo-ref {a.dpo_ref}: {e}") from None
        if not found:
            raise ArgumentError(
                f"--dpo-ref {a.dpo_ref}: neither a megakernels checkpoint directory nor a HuggingFace model directory "
                "(config.json)"
            )
    elif a.load is not None and not a.load_hf:
        from megakernels_models.training.checkpoint import find_latest, read_meta

        latest = find_latest(a.load)
        if latest is not None and (read_meta(latest).get("train_config") or {}).get("dpo"):
            raise ArgumentError(
                f"--dpo --load {a.load}: its latest checkpoint {os.path.basename(latest)} was written by a --dpo run, "
                "so it is not the reference: give --dpo-ref DIR (the weights the run started from)"
            )


def validate(a: TrainArgs, *, check_memory: bool = True, check_outputs: bool = True) -> ModelConfig:
    """Check every argument and their combinations; return the model configuration. Fills in the defaults that
    depend on other settings (``warmup_steps``). With ``check_memory`` (and ``--memory-check``, not for
    ``--dry-run``), a model whose estimated memory is more than this machine has is refused
    (``memory_limits.check``). With ``check_outputs``, what the run will write must be writable
    (``check_output_paths``: it creates the directories and the log file the run would create).

    Raises:
        ArgumentError: the first broken rule, naming the flag(s); when a setting it names came from a ``--config``
            file, the message says so (``--steps must be a positive int, got -1 (steps: from --config job.yaml)``).
    """
    try:
        cfg = _validate(a)
        if check_memory and a.memory_check and not a.dry_run:
            from megakernels_models.training.memory_limits import check

            check(a, cfg)
        if check_outputs:
            check_output_paths(a)
        return cfg
    except ArgumentError as e:
        raise ArgumentError(_naming_the_file(a, str(e))) from None


def _validate(a: TrainArgs) -> ModelConfig:
    if a.model is not None and a.model not in registry.names():
        raise ArgumentError(f"--model must be one of {', '.join(registry.names())}, got {a.model!r}")
    if a.preset not in (None, "none") and a.preset not in PRESETS:
        raise ArgumentError(f"--preset {a.preset!r} is unknown; known presets: {', '.join(PRESETS)}")
    for name in (
        "tp",
        "cp",
        "ep",
        "pp",
        "nproc",
        "micro_batch_size",
        "global_batch_size",
        "steps",
        "eval_steps",
        "keep_checkpoints",
        "moe_a2a_chunks",
    ):
        positive_int(getattr(a, name), _flag(name), error=ArgumentError)
    for name in ("vpp", "dp", "save_interval"):
        positive_int(getattr(a, name), _flag(name), allow_none=True, error=ArgumentError)
    positive_int(a.eval_interval, "--eval-interval", minimum=0, error=ArgumentError)
    positive_int(a.sliding_window, "--sliding-window", minimum=0, allow_none=True, error=ArgumentError)
    positive_int(a.max_save_failures, "--max-save-failures", minimum=0, error=ArgumentError)
    positive_int(a.seed, "--seed", minimum=0, error=ArgumentError)
    _check_local_ranks(a)
    positive_int(a.rope_original_max_positions, "--rope-original-max-positions", allow_none=True, error=ArgumentError)
    for spec in registry.families():
        if hasattr(spec.settings, "check"):
            spec.settings.check(a)
    try:
        cfg = a.model_config()
    except ValueError as e:
        raise ArgumentError(str(e)) from None
    for name, choices in (
        ("precision", PRECISIONS),
        ("fp8_recipe", FP8_RECIPES),
        ("fp8_base_precision", FP8_BASES),
        ("recompute", RECOMPUTE),
        ("attention", tuple(ATTENTION_CORES)),
        ("schedule", TRAINER_SCHEDULES),
        ("device", DEVICES),
    ):
        if getattr(a, name) not in choices:
            raise ArgumentError(f"{_flag(name)} must be one of {', '.join(choices)}, got {getattr(a, name)!r}")
    under_torchrun = "WORLD_SIZE" in os.environ
    if a.device == "cuda" and a.nproc > 1 and not under_torchrun and not a.dry_run:
        raise ArgumentError(
            f"--nproc {a.nproc} spawns CPU processes (gloo); with --device cuda launch one process "
            f"per GPU with torchrun --nproc-per-node {a.nproc} (NCCL) and leave --nproc out"
        )
    if a.device == "cuda" and not torch.cuda.is_available() and not a.dry_run:
        raise ArgumentError("--device cuda: no CUDA device is available")
    _check_sharding(a)
    _check_schedule(a)
    _check_muon(a, cfg)
    validate_layout(a, cfg)
    _check_packing(a, cfg)
    _check_post_training(a, cfg)
    _check_grpo(a, cfg)
    _check_dispatch(a, cfg)
    _check_mtp(a, cfg)
    for name in ("lr", "min_lr", "weight_decay", "clip_grad", "adam_eps", "moe_bias_update_rate"):
        finite_number(getattr(a, name), _flag(name), error=ArgumentError)
    if a.moe_bias_update_rate < 0:
        raise ArgumentError(f"--moe-bias-update-rate must be >= 0, got {a.moe_bias_update_rate}")
    for name in ("adam_beta1", "adam_beta2"):
        if not 0.0 <= finite_number(getattr(a, name), _flag(name), error=ArgumentError) < 1.0:
            raise ArgumentError(f"{_flag(name)} must be in [0, 1), got {getattr(a, name)}")
    if a.lr_decay_style not in LR_STYLES:
        raise ArgumentError(f"--lr-decay-style must be one of {', '.join(LR_STYLES)}, got {a.lr_decay_style!r}")
    positive_int(a.lr_decay_steps, "--lr-decay-steps", allow_none=True, error=ArgumentError)
    positive_int(a.lr_wsd_decay_steps, "--lr-wsd-decay-steps", allow_none=True, error=ArgumentError)
    if a.min_lr > a.lr:
        raise ArgumentError(f"--min-lr {a.min_lr} is larger than --lr {a.lr}")
    if a.warmup_steps is None:
        a.warmup_steps = a.steps // 10
    positive_int(a.warmup_steps, "--warmup-steps", minimum=0, error=ArgumentError)
    decay_steps = a.lr_decay_steps or a.steps
    if a.warmup_steps > decay_steps:
        raise ArgumentError(
            f"--warmup-steps {a.warmup_steps} is more than --lr-decay-steps {decay_steps}"
            if a.lr_decay_steps
            else f"--warmup-steps {a.warmup_steps} is more than --steps {a.steps}"
        )
    if (
        a.lr_decay_style == "wsd"
        and a.lr_wsd_decay_steps is not None
        and a.lr_wsd_decay_steps > decay_steps - a.warmup_steps
    ):
        raise ArgumentError(
            f"--lr-wsd-decay-steps {a.lr_wsd_decay_steps} is more than the {decay_steps - a.warmup_steps}"
            " steps after warmup"
        )
    if a.save_interval is not None and a.save is None:
        raise ArgumentError("--save-interval needs --save DIR")
    for flag, path in (("--save", a.save), ("--tensorboard", a.tensorboard)):
        if path is not None and os.path.exists(path) and not os.path.isdir(path):
            raise ArgumentError(f"{flag} {path!r} exists and is not a directory")
    if a.load is not None:
        from megakernels_models.training.checkpoint import CheckpointError, find_latest

        try:
            find_latest(a.load)  # missing or empty: a first launch, which starts from scratch
        except CheckpointError as e:
            raise ArgumentError(str(e)) from None
    if a.async_save and a.save is None:
        raise ArgumentError("--async-save needs --save DIR")
    if a.exit_signal not in SIGNALS:
        raise ArgumentError(f"--exit-signal must be one of {', '.join(SIGNALS)}, got {a.exit_signal!r}")
    positive_int(a.exit_interval, "--exit-interval", allow_none=True, error=ArgumentError)
    if (
        a.exit_duration_mins is not None
        and not finite_number(a.exit_duration_mins, "--exit-duration-mins", error=ArgumentError) > 0
    ):
        raise ArgumentError(f"--exit-duration-mins must be > 0, got {a.exit_duration_mins}")
    from megakernels_models.data.build import validate_data_args

    validate_data_args(a, cfg)
    lo, hi = TIMEOUT_RANGE
    if not lo <= finite_number(a.timeout, "--timeout", minimum=None, error=ArgumentError) <= hi:
        raise ArgumentError(
            f"--timeout must be at least {lo:g} s and at most {hi:.0f} s (a year): how long a "
            f"collective waits for a peer, got {a.timeout:g}"
        )
    if a.peak_tflops is not None and not a.peak_tflops > 0:
        raise ArgumentError(f"--peak-tflops must be > 0, got {a.peak_tflops}")
    return cfg
