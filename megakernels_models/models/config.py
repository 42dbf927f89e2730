"""Model configurations: one dataclass for the GPT, BERT and Llama families, the presets, and what a configuration
costs.

The presets include the Megatron-LM paper's sizes (Shoeybi et al. 2019, Table 1 for GPT-2 style models, §4 for
BERT), the Llama 2 / Llama 3 shapes, and tiny ones that train on a CPU in minutes. Sizes here are what the model
*is*; how it is split over devices (tp/cp/pp/dp) belongs to the trainer's configuration.

FLOPs follow Narayanan et al. 2021 (§5.1), written per token for any attention and MLP shape: one layer's forward is
``2·h·(q + 2·kv) + 2·q·h`` for the Q/K/V and output projections (``q = heads·head_dim``, ``kv = kv_heads·head_dim``;
``4h²`` with full multi-head attention), ``2·h·f`` per MLP matrix (two for GeLU, three for SwiGLU), plus ``4·s·q``
for the attention scores and the weighted sum (the full s×s square, as the paper counts it, causal or not); the LM
head adds ``2hV``. Backward costs twice the forward, so a training step is 3× the forward; full recomputation adds
one more forward of the layers (4×), selective recomputation one more attention core. With f = 4h and full MHA
this is the paper's ``72·l·h²·(1 + s/(6h) + V/(12·l·h))`` per token (``96 …`` with recomputation).
"""

from __future__ import annotations

import dataclasses

from megakernels.validation import positive_int

MODELS = ("gpt", "bert", "llama", "vlm")
LANGUAGE_MODELS = ("gpt", "llama")  # what a vision-language model's language model may be
RECOMPUTE = ("none", "selective", "full")
NORMS = ("layernorm", "rmsnorm")
POSITIONS = ("learned", "rope")
ACTIVATIONS = ("gelu_tanh", "gelu", "swiglu")
# What each family is unless a field says otherwise (fields left None take these).
FAMILY_DEFAULTS = {
    "gpt": dict(norm="layernorm", position_embedding="learned", activation="gelu_tanh", bias=True, tie_embeddings=True),
    "bert": dict(
        norm="layernorm", position_embedding="learned", activation="gelu_tanh", bias=True, tie_embeddings=True
    ),
    "llama": dict(norm="rmsnorm", position_embedding="rope", activation="swiglu", bias=False, tie_embeddings=False),
}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A Transformer of the GPT (causal LM), BERT (masked LM + sentence order) or Llama (causal LM) family.

    Attributes:
        model: ``"gpt"``, ``"bert"`` or ``"llama"``; the architecture fields below that are None take the family's
            values (``FAMILY_DEFAULTS``): GPT/BERT pre-norm LayerNorm, learned positions, tanh-GeLU MLP with
            biases, tied output embedding; Llama RMSNorm, rotary positions, SwiGLU MLP without biases, untied.
        num_layers, hidden_size, num_heads: l, h, a.
        num_kv_heads: key/value heads (grouped-query attention; default ``num_heads``: multi-head).
        seq_length: s, tokens per sample (also the number of learned positions).
        vocab_size: V, the tokenizer's real vocabulary (padded for GEMMs inside the model, never in the math).
        ffn_hidden_size: the MLP's inner size f (default 4h).
        dropout: hidden dropout (after the embeddings and on each residual branch).
        attention_dropout: on the attention probabilities.
        layernorm_eps: of every LayerNorm / RMSNorm.
        init_std: std of the normal init (output projections use ``init_std / sqrt(2·l)``).
        num_token_types: BERT's segment embeddings (ignored otherwise).
        norm_position: ``"pre"`` (a norm on each branch's input, a final norm; every preset) or ``"post"``
            (the original Transformer/BERT: a norm after each residual sum and after the embeddings, no final
            one; for models converted from HuggingFace BERT).
        norm: ``"layernorm"`` or ``"rmsnorm"``.
        position_embedding: ``"learned"`` (a table of ``seq_length`` positions) or ``"rope"`` (rotary, applied to
            queries and keys).
        rope_theta: the rotary base (10000 in Llama 2, 500000 in Llama 3).
        rope_interleaved: rotate pairs ``(2i, 2i+1)`` (GPT-J, Meta's original Llama weights) instead of
            ``(i, i + d/2)`` (GPT-NeoX, HuggingFace's Llama).
        activation: the MLP: ``"gelu_tanh"`` (GPT-2/Megatron), ``"gelu"`` (erf, BERT) or ``"swiglu"``
            (``silu(x W_gate) * (x W_up)``, Llama).
        bias: biases in the linear layers.
        tie_embeddings: the output layer is the word embedding's table.
        num_experts: experts of each mixture-of-experts layer (0: every MLP is dense).
        moe_top_k: experts per token.
        moe_ffn_hidden_size: each expert's MLP size (default ``ffn_hidden_size``).
        moe_layer_freq: layer ``i`` is a MoE layer when ``i % moe_layer_freq == 0`` (1: every layer).
        moe_normalize: renormalise the top-k router weights (Mixtral) or not (Switch/GShard).
        moe_aux_loss_coeff, moe_z_loss_coeff: load-balancing and router z-loss coefficients.
        moe_capacity_factor: capacity per expert as a factor of the even share (None: dropless).
        moe_shared_experts: dense experts every token of a MoE layer also goes through.
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
    activation: str | None = None
    num_kv_heads: int | None = None
    norm: str | None = None
    position_embedding: str | None = None
    rope_theta: float = 10000.0
    rope_interleaved: bool = False
    bias: bool | None = None
    tie_embeddings: bool | None = None
    num_experts: int = 0
    moe_top_k: int = 2
    moe_ffn_hidden_size: int | None = None
    moe_layer_freq: int = 1
    moe_normalize: bool = True
    moe_aux_loss_coeff: float = 0.01
    moe_z_loss_coeff: float = 0.0
    moe_capacity_factor: float | None = None
    moe_shared_experts: int = 0
    lm: str | None = None
    image_size: int = 32
    patch_size: int = 8
    image_channels: int = 3
    vision_layers: int = 2
    vision_hidden_size: int = 64
    vision_heads: int = 4
    vision_ffn_hidden_size: int | None = None
    vision_activation: str = "gelu_tanh"
    vision_class_token: bool = False
    vision_pre_norm: bool = False
    vision_final_norm: bool = True
    projector_hidden_size: int | None = None
    cross_attention_every: int = 0
    contrastive_coeff: float = 0.0
    contrastive_temperature: float = 0.07

    def __post_init__(self):
        if self.model not in MODELS:
            raise ValueError(f"ModelConfig: model must be one of {MODELS}, got {self.model!r}")
        if self.model == "vlm":
            _check_vision(self)
        for name, value in FAMILY_DEFAULTS[self.lm if self.model == "vlm" else self.model].items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)
        for name, allowed in (
            ("norm_position", ("pre", "post")),
            ("activation", ACTIVATIONS),
            ("norm", NORMS),
            ("position_embedding", POSITIONS),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(f"ModelConfig: {name} must be one of {allowed}, got {getattr(self, name)!r}")
        for name in ("num_layers", "hidden_size", "num_heads", "seq_length", "vocab_size", "num_token_types"):
            positive_int(getattr(self, name), name, where="ModelConfig")
        if self.ffn_hidden_size is None:
            object.__setattr__(self, "ffn_hidden_size", 4 * self.hidden_size)
        positive_int(self.ffn_hidden_size, "ffn_hidden_size", where="ModelConfig")
        if self.num_kv_heads is None:
            object.__setattr__(self, "num_kv_heads", self.num_heads)
        positive_int(self.num_kv_heads, "num_kv_heads", where="ModelConfig")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig: num_heads={self.num_heads} is not a multiple of "
                f"num_kv_heads={self.num_kv_heads} (each key/value head serves a group of query heads)"
            )
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"ModelConfig: hidden_size={self.hidden_size} is not divisible by num_heads={self.num_heads}"
            )
        if self.position_embedding == "rope":
            if self.head_dim % 2:
                raise ValueError(f"ModelConfig: rotary embeddings need an even head_dim, got {self.head_dim}")
            if not self.rope_theta > 1:
                raise ValueError(f"ModelConfig: rope_theta must be > 1, got {self.rope_theta}")
        if self.model == "bert" and (self.position_embedding != "learned" or self.activation == "swiglu"):
            raise ValueError("ModelConfig: the BERT family has learned positions and a GeLU MLP")
        if self.num_experts:
            positive_int(self.num_experts, "num_experts", where="ModelConfig")
            if self.model == "bert":
                raise ValueError("ModelConfig: mixture-of-experts layers are for the GPT and Llama families")
            if not 1 <= self.moe_top_k <= self.num_experts:
                raise ValueError(
                    f"ModelConfig: moe_top_k={self.moe_top_k} must be in 1..num_experts={self.num_experts}"
                )
            positive_int(self.moe_layer_freq, "moe_layer_freq", where="ModelConfig")
            if self.moe_ffn_hidden_size is None:
                object.__setattr__(self, "moe_ffn_hidden_size", self.ffn_hidden_size)
            positive_int(self.moe_ffn_hidden_size, "moe_ffn_hidden_size", where="ModelConfig")
            if self.moe_capacity_factor is not None and not self.moe_capacity_factor > 0:
                raise ValueError(
                    f"ModelConfig: moe_capacity_factor must be > 0 or None (dropless), got {self.moe_capacity_factor}"
                )
            for name in ("moe_aux_loss_coeff", "moe_z_loss_coeff"):
                if not getattr(self, name) >= 0:
                    raise ValueError(f"ModelConfig: {name} must be >= 0, got {getattr(self, name)}")
        for name in ("dropout", "attention_dropout"):
            v = getattr(self, name)
            if not 0.0 <= v < 1.0:
                raise ValueError(f"ModelConfig: {name} must be in [0, 1), got {v}")
        if not self.init_std > 0 or not self.layernorm_eps > 0:
            raise ValueError("ModelConfig: init_std and layernorm_eps must be > 0")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    # ---- vision-language models (model="vlm", vlm.py) ---------------------------------------------------------

    @property
    def num_patches(self) -> int:
        """Patches per image (``(image_size / patch_size)²``; 0 for a text-only model)."""
        return (self.image_size // self.patch_size) ** 2 if self.model == "vlm" else 0

    @property
    def num_image_tokens(self) -> int:
        """Image tokens the vision encoder gives per image: the patches, plus a class token when it has one."""
        return self.num_patches + (self.vision_class_token and self.model == "vlm")

    @property
    def tokens_per_sample(self) -> int:
        """Positions of the hidden state a pipeline stage sends on: the image tokens (first) and the text tokens of
        a vision-language model; ``seq_length`` otherwise."""
        return self.seq_length + self.num_image_tokens

    def layout_shapes(self):
        """The shapes the parallel layout's rules check (``megakernels.parallel.layout.ModelShapes``)."""
        from megakernels.parallel.layout import ModelShapes

        widths, no_cp, no_sp = (), None, None
        if self.model == "bert":
            no_cp = (
                ": context parallelism is for causal language models (GPT, Llama); BERT's padding masks are "
                "not split over the ring"
            )
        if self.model == "vlm":
            v = self.vision_config()
            widths = (
                ("vision_heads", v.num_heads),
                ("vision_hidden_size", v.hidden_size),
                ("vision ffn_hidden_size", v.ffn_hidden_size),
                ("projector_hidden_size", self.projector_hidden_size),
            )
            no_sp = "is not supported for --model vlm (the image tokens are not split over ranks)"
            no_cp = " " + no_sp
        return ModelShapes(
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            ffn_hidden_size=self.ffn_hidden_size,
            num_layers=self.num_layers,
            seq_length=self.seq_length,
            num_experts=self.num_experts or 0,
            attention_dropout=self.attention_dropout,
            tp_widths=widths,
            context_parallel=no_cp,
            sequence_parallel=no_sp,
        )

    def vision_config(self) -> ModelConfig:
        """The vision encoder's Transformer as a bidirectional (BERT-family) configuration: its layers are the
        same ``TransformerLayer`` every family stacks."""
        return ModelConfig(
            "bert",
            num_layers=self.vision_layers,
            hidden_size=self.vision_hidden_size,
            num_heads=self.vision_heads,
            seq_length=self.num_image_tokens,
            vocab_size=1,
            ffn_hidden_size=self.vision_ffn_hidden_size,
            activation=self.vision_activation,
            dropout=self.dropout,
            attention_dropout=self.attention_dropout,
            layernorm_eps=self.layernorm_eps,
            init_std=self.init_std,
        )

    def language_config(self) -> ModelConfig:
        """A vision-language model's language model alone (the GPT or Llama it is built on); ``self`` otherwise."""
        if self.model != "vlm":
            return self
        return dataclasses.replace(self, model=self.lm, lm=None)

    def has_cross_attention_after(self, layer: int) -> bool:
        """Whether a gated cross-attention layer follows language layer ``layer`` (every ``cross_attention_every``
        layers; never with 0, where the image tokens are the sequence's prefix)."""
        n = self.cross_attention_every
        return self.model == "vlm" and n > 0 and (layer + 1) % n == 0

    def replace(self, **changes) -> ModelConfig:
        """A copy with ``changes``. Sizes derived from others follow them unless given: an MLP of 4h follows a new
        hidden size, multi-head attention (as many key/value heads as heads) a new head count, experts as wide as
        the dense MLP a new MLP width."""
        c = dict(changes)
        if "hidden_size" in c and "ffn_hidden_size" not in c and self.ffn_hidden_size == 4 * self.hidden_size:
            c["ffn_hidden_size"] = 4 * c["hidden_size"]
        if "num_heads" in c and "num_kv_heads" not in c and self.num_kv_heads == self.num_heads:
            c["num_kv_heads"] = c["num_heads"]
        if (
            "hidden_size" in c
            and "projector_hidden_size" not in c
            and self.model == "vlm"
            and self.projector_hidden_size == self.hidden_size
        ):
            c["projector_hidden_size"] = c["hidden_size"]
        if (
            "ffn_hidden_size" in c
            and "moe_ffn_hidden_size" not in c
            and self.num_experts
            and self.moe_ffn_hidden_size == self.ffn_hidden_size
        ):
            c["moe_ffn_hidden_size"] = c["ffn_hidden_size"]
        return dataclasses.replace(self, **c)

    # ---- cost model -------------------------------------------------------------------------------------------

    @property
    def kv_size(self) -> int:
        """Width of the key (and of the value) projection: ``num_kv_heads · head_dim``."""
        return self.num_kv_heads * self.head_dim

    def is_moe_layer(self, i: int) -> bool:
        """Whether layer ``i`` is a mixture-of-experts layer."""
        return self.num_experts > 0 and i % self.moe_layer_freq == 0

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_layers))

    @property
    def mlp_matrices(self) -> int:
        """Weight matrices of the MLP: three with SwiGLU (gate, up, down), else two."""
        return 3 if self.activation == "swiglu" else 2

    def forward_flops_per_token(self) -> dict[str, float]:
        """Forward FLOPs per token: ``{"layers_gemm", "attention", "head"}`` (all layers together)."""
        h, f, s, l, V = self.hidden_size, self.ffn_hidden_size, self.seq_length, self.num_layers, self.vocab_size
        moe = self.num_moe_layers
        # a MoE layer's MLP: the router, top_k experts and the shared experts per token (the active parameters)
        moe_mlp = (
            (
                h * self.num_experts
                + (self.moe_top_k + self.moe_shared_experts) * self.mlp_matrices * h * (self.moe_ffn_hidden_size or f)
            )
            if moe
            else 0
        )
        gemm = 2.0 * ((h * (h + 2 * self.kv_size) + h * h) * l + self.mlp_matrices * h * f * (l - moe) + moe_mlp * moe)
        attention = 4.0 * s * h * l
        head = 2.0 * h * V + (2.0 * h * h if self.model == "bert" else 0.0)  # BERT's MLM transform
        return {"layers_gemm": gemm, "attention": attention, "head": head}

    def flops_per_token(self, recompute: str = "none") -> float:
        """Training FLOPs per token (forward + backward = 3× forward, plus what recomputation repeats); for a
        vision-language model per *text* token (its FLOPs per sample over ``seq_length``).

        ``recompute="none"`` gives the *model* FLOPs that MFU is measured against; ``"full"``/``"selective"``
        give the hardware FLOPs actually executed."""
        if recompute not in RECOMPUTE:
            raise ValueError(f"flops_per_token: recompute must be one of {RECOMPUTE}, got {recompute!r}")
        if self.model == "vlm":
            from megakernels_models.models.vlm.costs import vlm_flops_per_sample

            return vlm_flops_per_sample(self, recompute) / self.seq_length
        return training_flops(self.forward_flops_per_token(), recompute)

    def activation_bytes_per_layer(
        self,
        micro_batch_size: int,
        tp: int = 1,
        sequence_parallel: bool = False,
        recompute: str = "none",
        bytes_per_element: int = 2,
        flash_attention: bool = False,
        cp: int = 1,
    ) -> float:
        """Activation memory one layer keeps for backward, per micro-batch (Korthikanti et al. 2022, §4.1,
        generalised to grouped-query attention, any MLP width and SwiGLU).

        In 2-byte elements per token: attention keeps its input (2h), Q (2h), K and V (2·2·kv), the input of the
        output projection (2h) and, with dropout, its mask (h); the MLP its input (2h), the activation's input
        (2f, 4f for SwiGLU's gate and up) and output (2f) and a dropout mask (h); the two norms their inputs (4h).
        A mixture-of-experts MLP keeps each token ``top_k`` times (its expert rows, 2h each, and their MLPs) plus
        the shared experts' (averaged over the layers, for models whose MoE layers are every n-th).
        The attention scores add ``5·a·s`` (softmax output, dropout mask and output) unless FlashAttention or
        selective recomputation avoid storing them. Tensor parallelism divides all but the norms' and branches'
        inputs and the residual dropout masks (``10h`` of GPT's ``34h``); sequence parallelism divides those too.
        Full recomputation keeps only the layer's input ``2·s·b·h`` (``/t`` with SP). With f = 4h, full MHA and
        dropout this is the paper's ``s·b·h·(10 + 24/t + 5·a·s/(h·t))`` (``s·b·h/t·(34 + 5·a·s/h)`` with SP).
        Context parallelism gives each rank ``s/cp`` tokens (its attention runs as ring attention, never storing
        scores). ``bytes_per_element=4`` doubles everything (fp32 training)."""
        s, b, h, a = self.seq_length // cp, micro_batch_size, self.hidden_size, self.num_heads
        f, kv = self.ffn_hidden_size, self.kv_size
        scale = bytes_per_element / 2.0
        if recompute == "full":
            return scale * 2.0 * s * b * h / (tp if sequence_parallel else 1)
        mask = 1.0 if self.dropout > 0 else 0.0
        mlp = lambda width: (4.0 if self.activation == "swiglu" else 2.0) * width + 2.0 * width  # noqa: E731
        inside = mlp(f)
        if self.num_experts:  # a MoE layer keeps each token k times (its rows for the experts) plus the shared MLPs
            moe = self.moe_top_k * (2.0 * h + mlp(self.moe_ffn_hidden_size)) + self.moe_shared_experts * mlp(
                self.moe_ffn_hidden_size
            )
            share = self.num_moe_layers / self.num_layers
            inside = (1 - share) * inside + share * moe
        replicated = (2.0 + mask) * h + (2.0 + mask) * h + 4.0 * h  # branch inputs + residual masks, norms
        split = (2.0 * h + 4.0 * kv + 2.0 * h) + inside  # Q, K, V, projection input; the MLP's inside
        scores = 0.0 if (recompute == "selective" or flash_attention or cp > 1) else 5.0 * a * s
        if sequence_parallel:
            return scale * s * b * (replicated + split + scores) / tp
        return scale * s * b * (replicated + (split + scores) / tp)


PRESETS: dict[str, ModelConfig] = {
    # Tiny models for the CPU (byte-level vocabulary).
    "gpt-tiny": ModelConfig(
        "gpt",
        num_layers=4,
        hidden_size=256,
        num_heads=8,
        seq_length=256,
        vocab_size=261,
        dropout=0.0,
        attention_dropout=0.0,
    ),
    "bert-tiny": ModelConfig(
        "bert",
        num_layers=4,
        hidden_size=192,
        num_heads=6,
        seq_length=128,
        vocab_size=261,
        dropout=0.0,
        attention_dropout=0.0,
    ),
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
    # Llama: a tiny one for the CPU; Llama 3.2 1B, Llama 3 8B and Llama 2 7B shapes.
    "llama-tiny": ModelConfig(
        "llama",
        num_layers=4,
        hidden_size=256,
        num_heads=8,
        num_kv_heads=2,
        seq_length=256,
        vocab_size=261,
        ffn_hidden_size=704,
        dropout=0.0,
        attention_dropout=0.0,
        layernorm_eps=1e-5,
        rope_theta=10000.0,
    ),
    "llama3-1b": ModelConfig(
        "llama",
        num_layers=16,
        hidden_size=2048,
        num_heads=32,
        num_kv_heads=8,
        seq_length=8192,
        vocab_size=128256,
        ffn_hidden_size=8192,
        dropout=0.0,
        attention_dropout=0.0,
        layernorm_eps=1e-5,
        rope_theta=500000.0,
        tie_embeddings=True,
    ),
    "llama3-8b": ModelConfig(
        "llama",
        num_layers=32,
        hidden_size=4096,
        num_heads=32,
        num_kv_heads=8,
        seq_length=8192,
        vocab_size=128256,
        ffn_hidden_size=14336,
        dropout=0.0,
        attention_dropout=0.0,
        layernorm_eps=1e-5,
        rope_theta=500000.0,
    ),
    # Mixture of experts: tiny ones for the CPU, and Mixtral 8x7B (46.7B parameters, 12.9B active per token).
    "gpt-moe-tiny": ModelConfig(
        "gpt",
        num_layers=4,
        hidden_size=256,
        num_heads=8,
        seq_length=256,
        vocab_size=261,
        dropout=0.0,
        attention_dropout=0.0,
        num_experts=4,
        moe_top_k=2,
        moe_ffn_hidden_size=512,
        moe_normalize=False,
    ),
    "llama-moe-tiny": ModelConfig(
        "llama",
        num_layers=4,
        hidden_size=256,
        num_heads=8,
        num_kv_heads=2,
        seq_length=256,
        vocab_size=261,
        ffn_hidden_size=704,
        dropout=0.0,
        attention_dropout=0.0,
        num_experts=4,
        moe_top_k=2,
        moe_ffn_hidden_size=352,
    ),
    "mixtral-8x7b": ModelConfig(
        "llama",
        num_layers=32,
        hidden_size=4096,
        num_heads=32,
        num_kv_heads=8,
        seq_length=32768,
        vocab_size=32000,
        ffn_hidden_size=14336,
        dropout=0.0,
        attention_dropout=0.0,
        layernorm_eps=1e-5,
        rope_theta=1e6,
        num_experts=8,
        moe_top_k=2,
        moe_aux_loss_coeff=0.02,
    ),
    "llama2-7b": ModelConfig(
        "llama",
        num_layers=32,
        hidden_size=4096,
        num_heads=32,
        seq_length=4096,
        vocab_size=32000,
        ffn_hidden_size=11008,
        dropout=0.0,
        attention_dropout=0.0,
        layernorm_eps=1e-5,
        rope_theta=10000.0,
    ),
}


def _check_vision(c: ModelConfig) -> None:
    """The vision-language fields' rules (``model="vlm"``); fills the language model's default (GPT)."""
    if c.lm is None:
        object.__setattr__(c, "lm", "gpt")
    if c.lm not in LANGUAGE_MODELS:
        raise ValueError(
            f"ModelConfig: lm (the language model of a vlm) must be one of {LANGUAGE_MODELS}, got {c.lm!r}"
        )
    for name in ("image_size", "patch_size", "image_channels", "vision_layers", "vision_hidden_size", "vision_heads"):
        positive_int(getattr(c, name), name, where="ModelConfig")
    if c.image_size % c.patch_size:
        raise ValueError(f"ModelConfig: image_size={c.image_size} is not divisible by patch_size={c.patch_size}")
    if c.vision_hidden_size % c.vision_heads:
        raise ValueError(
            f"ModelConfig: vision_hidden_size={c.vision_hidden_size} is not divisible by vision_heads={c.vision_heads}"
        )
    if c.vision_activation not in ("gelu", "gelu_tanh"):
        raise ValueError(f"ModelConfig: vision_activation must be 'gelu' or 'gelu_tanh', got {c.vision_activation!r}")
    if c.projector_hidden_size is None:
        object.__setattr__(c, "projector_hidden_size", c.hidden_size)
    positive_int(c.projector_hidden_size, "projector_hidden_size", where="ModelConfig")
    positive_int(c.cross_attention_every, "cross_attention_every", minimum=0, where="ModelConfig")
    if c.num_experts:
        raise ValueError("ModelConfig: a vision-language model's language model is dense (num_experts=0)")
    if not c.contrastive_coeff >= 0 or not c.contrastive_temperature > 0:
        raise ValueError("ModelConfig: contrastive_coeff must be >= 0 and contrastive_temperature > 0")


_VLM_TINY = dict(
    image_size=32,
    patch_size=8,
    vision_layers=2,
    vision_hidden_size=64,
    vision_heads=4,
    num_layers=4,
    hidden_size=128,
    num_heads=4,
    seq_length=48,
    vocab_size=261,
    dropout=0.0,
    attention_dropout=0.0,
)
PRESETS.update(
    {
        # Vision-language, for the CPU: a 2-layer 64-wide ViT over 32×32 images and a 4-layer GPT; vlm-tiny reads
        # 16-pixel
        # patches (a 2×2 grid, one per cell of the embedded shapes) and trains with the contrastive loss beside the
        # captions' (with 8-pixel patches, or without it, its default run of 300 steps did not learn to read the shapes:
        # benchmarks/results/2026-12-01-cpu-vlm-caption.md). The same encoder at 8-pixel patches (16 image tokens) with
        # Flamingo-style gated cross-attention every second layer over a tiny Llama.
        "vlm-tiny": ModelConfig("vlm", lm="gpt", **{**_VLM_TINY, "patch_size": 16}, contrastive_coeff=0.5),
        "vlm-llama-tiny": ModelConfig("vlm", lm="llama", **{**_VLM_TINY, "num_kv_heads": 2}, cross_attention_every=2),
        # LLaVA-1.5 shape: a ViT-L/14 (CLIP) encoder at 336 px (576 patches) and a Llama-2-7B.
        "vlm-7b": ModelConfig(
            "vlm",
            lm="llama",
            image_size=336,
            patch_size=14,
            vision_layers=24,
            vision_hidden_size=1024,
            vision_heads=16,
            vision_ffn_hidden_size=4096,
            vision_activation="gelu",
            vision_class_token=True,
            vision_pre_norm=True,
            vision_final_norm=False,
            projector_hidden_size=4096,
            num_layers=32,
            hidden_size=4096,
            num_heads=32,
            seq_length=2048,
            vocab_size=32000,
            ffn_hidden_size=11008,
            dropout=0.0,
            attention_dropout=0.0,
            layernorm_eps=1e-5,
        ),
    }
)


def preset(name: str, **overrides) -> ModelConfig:
    """The preset ``name`` with fields replaced by ``overrides`` (those that are not None). Sizes the preset derives
    follow their source unless given: an MLP of 4h follows a new hidden size, and multi-head attention (as many
    key/value heads as heads) a new head count.

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
        raise ValueError(
            f"num_layers={num_layers} is not divisible by {rule} (each pipeline stage needs the same number of layers)"
        )
    per = num_layers // stages
    return [[range((c * pp + r) * per, (c * pp + r + 1) * per) for c in range(vpp)] for r in range(pp)]


def training_flops(forward: dict[str, float], recompute: str) -> float:
    """Training FLOPs from forward FLOPs ``{"layers_gemm", "attention", "head"}``: 3× the forward (backward is
    twice it), plus the layers again with full recomputation or the attention cores again with selective."""
    total = 3.0 * sum(forward.values())
    if recompute == "full":
        total += forward["layers_gemm"] + forward["attention"]
    elif recompute == "selective":
        total += forward["attention"]
    return total


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def human(n: float, unit: str = "") -> str:
    """``1.23e9`` -> ``"1.23 G"`` (with unit)."""
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {prefix}{unit}"
    return f"{n:.3g} {unit}".rstrip()


__all__ = ["ModelConfig", "PRESETS", "preset", "stage_layers", "MODELS", "RECOMPUTE", "human", "ceil_div"]
