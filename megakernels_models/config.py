"""Model configurations: one dataclass for GPT and BERT, the presets, and what a configuration costs.

The presets include the Megatron-LM paper's sizes (Shoeybi et al. 2019, Table 1 for GPT-2 style models, §4 for
BERT) and tiny ones that train on a CPU in minutes. Sizes here are what the model *is*; how it is split over
devices (tp/pp/dp) belongs to the trainer's configuration.

FLOPs follow Narayanan et al. 2021 (§5.1), written per token and generalised to any FFN size: one layer's forward
is ``2·(4h² + 2hf)`` GEMM FLOPs for QKV, the output projection and the MLP, plus ``4sh`` for the attention scores
and the weighted sum (the full s×s square, as the paper counts it, causal or not); the LM head adds ``2hV``.
Backward costs twice the forward, so a training step is 3× the forward; full recomputation adds one more forward
of the layers (4×), selective recomputation one more attention core. With f = 4h this is the paper's
``72·l·h²·(1 + s/(6h) + V/(12·l·h))`` per token (``96 …`` with recomputation).
"""

from __future__ import annotations

import dataclasses

from megakernels.validation import positive_int

MODELS = ("gpt", "bert")
RECOMPUTE = ("none", "selective", "full")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A GPT or BERT Transformer (pre-norm, learned positions, GeLU MLP, word embedding tied to the output).

    Attributes:
        model: ``"gpt"`` (causal LM) or ``"bert"`` (bidirectional; masked LM + sentence-order prediction).
        num_layers, hidden_size, num_heads: l, h, a.
        seq_length: s, tokens per sample (also the number of learned positions).
        vocab_size: V, the tokenizer's real vocabulary (padded for GEMMs inside the model, never in the math).
        ffn_hidden_size: the MLP's inner size f (default 4h).
        dropout: hidden dropout (after the embeddings and on each residual branch).
        attention_dropout: on the attention probabilities.
        layernorm_eps: of every LayerNorm.
        init_std: std of the normal init (output projections use ``init_std / sqrt(2·l)``).
        num_token_types: BERT's segment embeddings (ignored by GPT).
        norm_position: ``"pre"`` (LayerNorm on each branch's input, a final LayerNorm; every preset) or ``"post"``
            (the original Transformer/BERT: LayerNorm after each residual sum and after the embeddings, no final
            one; for models converted from HuggingFace BERT).
        activation: the MLP's GeLU, ``"gelu_tanh"`` (GPT-2/Megatron) or ``"gelu"`` (erf, BERT).
    """

    model: str = "gpt"
    num_layers: int = 4
    hidden_size: int = 128
    num_heads: int = 4
    seq_length: int = 128
    vocab_size: int = 261
    ffn_hidden_size: int | None = None
    dropout: float = 0.1
    attention_dropout: float = 0.1
    layernorm_eps: float = 1e-5
    init_std: float = 0.02
    num_token_types: int = 2
    norm_position: str = "pre"
    activation: str = "gelu_tanh"

    def __post_init__(self):
        if self.norm_position not in ("pre", "post"):
            raise ValueError(f"ModelConfig: norm_position must be 'pre' or 'post', got {self.norm_position!r}")
        if self.activation not in ("gelu_tanh", "gelu"):
            raise ValueError(f"ModelConfig: activation must be 'gelu_tanh' or 'gelu', got {self.activation!r}")
        if self.model not in MODELS:
            raise ValueError(f"ModelConfig: model must be one of {MODELS}, got {self.model!r}")
        for name in ("num_layers", "hidden_size", "num_heads", "seq_length", "vocab_size", "num_token_types"):
            positive_int(getattr(self, name), name, where="ModelConfig")
        if self.ffn_hidden_size is None:
            object.__setattr__(self, "ffn_hidden_size", 4 * self.hidden_size)
        positive_int(self.ffn_hidden_size, "ffn_hidden_size", where="ModelConfig")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"ModelConfig: hidden_size={self.hidden_size} is not divisible by "
                             f"num_heads={self.num_heads}")
        for name in ("dropout", "attention_dropout"):
            v = getattr(self, name)
            if not 0.0 <= v < 1.0:
                raise ValueError(f"ModelConfig: {name} must be in [0, 1), got {v}")
        if not self.init_std > 0 or not self.layernorm_eps > 0:
            raise ValueError("ModelConfig: init_std and layernorm_eps must be > 0")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    # ---- cost model -------------------------------------------------------------------------------------------

    def forward_flops_per_token(self) -> dict[str, float]:
        """Forward FLOPs per token: ``{"layers_gemm", "attention", "head"}`` (all layers together)."""
        h, f, s, l, V = self.hidden_size, self.ffn_hidden_size, self.seq_length, self.num_layers, self.vocab_size
        gemm = 2.0 * (4 * h * h + 2 * h * f) * l
        attention = 4.0 * s * h * l
        head = 2.0 * h * V + (2.0 * h * h if self.model == "bert" else 0.0)  # BERT's MLM transform
        return {"layers_gemm": gemm, "attention": attention, "head": head}

    def flops_per_token(self, recompute: str = "none") -> float:
        """Training FLOPs per token (forward + backward = 3× forward, plus what recomputation repeats).

        ``recompute="none"`` gives the *model* FLOPs that MFU is measured against; ``"full"``/``"selective"``
        give the hardware FLOPs actually executed."""
        if recompute not in RECOMPUTE:
            raise ValueError(f"flops_per_token: recompute must be one of {RECOMPUTE}, got {recompute!r}")
        fw = self.forward_flops_per_token()
        total = 3.0 * sum(fw.values())
        if recompute == "full":
            total += fw["layers_gemm"] + fw["attention"]
        elif recompute == "selective":
            total += fw["attention"]
        return total

    def activation_bytes_per_layer(self, micro_batch_size: int, tp: int = 1, sequence_parallel: bool = False,
                                   recompute: str = "none", bytes_per_element: int = 2,
                                   flash_attention: bool = False) -> float:
        """Activation memory one layer keeps for backward, per micro-batch (Korthikanti et al. 2022, Table 2).

        ``s·b·h·(10 + 24/t + 5·a·s/(h·t))`` with tensor parallelism; ``s·b·h/t·(34 + 5·a·s/h)`` with sequence
        parallelism too; selective recomputation (or FlashAttention, which never stores the s×s scores) drops the
        ``5·a·s/h`` term; full recomputation keeps only the layer's input ``2·s·b·h`` (``/t`` with SP). The
        paper's constants assume 2-byte activations; ``bytes_per_element=4`` doubles them (fp32 training)."""
        s, b, h, a = self.seq_length, micro_batch_size, self.hidden_size, self.num_heads
        scale = bytes_per_element / 2.0
        if recompute == "full":
            return scale * 2.0 * s * b * h / (tp if sequence_parallel else 1)
        scores = 0.0 if (recompute == "selective" or flash_attention) else 5.0 * a * s / h
        if sequence_parallel:
            return scale * s * b * h / tp * (34.0 + scores)
        return scale * s * b * h * (10.0 + 24.0 / tp + scores / tp)


PRESETS: dict[str, ModelConfig] = {
    # Tiny models for the CPU (byte-level vocabulary).
    "gpt-tiny": ModelConfig("gpt", num_layers=4, hidden_size=256, num_heads=8, seq_length=256, vocab_size=261,
                            dropout=0.0, attention_dropout=0.0),
    "bert-tiny": ModelConfig("bert", num_layers=4, hidden_size=192, num_heads=6, seq_length=128, vocab_size=261,
                             dropout=0.0, attention_dropout=0.0),
    # Megatron-LM paper, GPT-2 vocabulary and context.
    "gpt-1.2b": ModelConfig("gpt", num_layers=40, hidden_size=1536, num_heads=16, seq_length=1024, vocab_size=50257),
    "gpt-2.5b": ModelConfig("gpt", num_layers=54, hidden_size=1920, num_heads=20, seq_length=1024, vocab_size=50257),
    "gpt-4.2b": ModelConfig("gpt", num_layers=64, hidden_size=2304, num_heads=24, seq_length=1024, vocab_size=50257),
    "gpt-8.3b": ModelConfig("gpt", num_layers=72, hidden_size=3072, num_heads=32, seq_length=1024, vocab_size=50257),
    # GPT-3 XL shape (the 1.3B single-GPU MFU benchmark).
    "gpt-1.3b": ModelConfig("gpt", num_layers=24, hidden_size=2048, num_heads=16, seq_length=2048, vocab_size=50257),
    # Megatron-LM paper BERT sizes, WordPiece vocabulary.
    "bert-336m": ModelConfig("bert", num_layers=24, hidden_size=1024, num_heads=16, seq_length=512, vocab_size=30522),
    "bert-1.3b": ModelConfig("bert", num_layers=24, hidden_size=2048, num_heads=32, seq_length=512, vocab_size=30522),
    "bert-3.9b": ModelConfig("bert", num_layers=48, hidden_size=2560, num_heads=40, seq_length=512, vocab_size=30522),
}


def preset(name: str, **overrides) -> ModelConfig:
    """The preset ``name`` with fields replaced by ``overrides`` (those that are not None).

    Raises:
        ValueError: an unknown name (listing the known ones).
    """
    if name not in PRESETS:
        raise ValueError(f"preset: unknown preset {name!r}; known: {', '.join(PRESETS)}")
    return PRESETS[name].replace(**{k: v for k, v in overrides.items() if v is not None})


def stage_layers(num_layers: int, pp: int, vpp: int = 1) -> list[list[range]]:
    """Which layers each pipeline rank holds: ``out[rank][chunk]`` is a range of layer indices.

    Virtual stage ``k = chunk·pp + rank`` holds layers ``[k·L/(pp·vpp), (k+1)·L/(pp·vpp))`` (Megatron's
    interleaved assignment; with vpp 1, contiguous blocks).

    Raises:
        ValueError: ``num_layers`` not divisible by ``pp·vpp``.
    """
    stages = pp * vpp
    if num_layers % stages:
        rule = f"pp·vpp = {pp}·{vpp} = {stages}" if vpp > 1 else f"pp = {pp}"
        raise ValueError(f"num_layers={num_layers} is not divisible by {rule} (each pipeline stage needs the same "
                         "number of layers)")
    per = num_layers // stages
    return [[range((c * pp + r) * per, (c * pp + r + 1) * per) for c in range(vpp)] for r in range(pp)]


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def human(n: float, unit: str = "") -> str:
    """``1.23e9`` -> ``"1.23 G"`` (with unit)."""
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {prefix}{unit}"
    return f"{n:.3g} {unit}".rstrip()


__all__ = ["ModelConfig", "PRESETS", "preset", "stage_layers", "MODELS", "RECOMPUTE", "human", "ceil_div"]
