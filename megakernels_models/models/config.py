"""Model configurations: ``ModelConfig``, the fields every family shares (a Transformer's sizes and architecture
options, mixture-of-experts layers for the decoders), the presets, and what a configuration costs.

Each family (``models/<family>/``) subclasses it with its own fields, defaults and rules and registers the subclass
(``registry.FamilySpec``); ``ModelConfig(model=NAME, ...)`` builds the registered family's class, so a configuration
read back from a checkpoint or a file is always its family's. The presets are the families' (the Megatron-LM paper's
sizes, the Llama 2 / Llama 3 shapes, Mixtral, LLaVA, and tiny ones that train on a CPU in minutes). Sizes here are
what the model *is*; how it is split over devices (tp/cp/pp/dp) belongs to the trainer's configuration.

FLOPs follow Narayanan et al. 2021 (§5.1), written per token for any attention and MLP shape: one layer's forward is
``2·h·(q + 2·kv) + 2·q·h`` for the Q/K/V and output projections (``q = heads·head_dim``, ``kv = kv_heads·head_dim``;
``4h²`` with full multi-head attention), ``2·h·f`` per MLP matrix (two for GeLU, three for SwiGLU), plus ``4·s·q``
for the attention scores and the weighted sum (the full s×s square, as the paper counts it, causal or not; with a
sliding window of w keys, ``4·min(w, s)·q``: each query's keys are at most the window, however long the sequence,
so a windowed layer costs its band; with ``layer_types`` each layer its own); the LM head adds ``2hV``. Backward
costs twice the forward, so a training step is 3× the forward; full recomputation adds one more forward of the
layers (4×), selective recomputation one more attention core. With f = 4h and full MHA
this is the paper's ``72·l·h²·(1 + s/(6h) + V/(12·l·h))`` per token (``96 …`` with recomputation).
"""

from __future__ import annotations

import dataclasses
import re

from megakernels.validation import positive_int
from megakernels_models.models.registry import DEFAULT, PRESETS, family

RECOMPUTE = ("none", "selective", "full")
NORMS = ("layernorm", "rmsnorm")
POSITIONS = ("learned", "rope")
ACTIVATIONS = ("gelu_tanh", "gelu", "swiglu", "geglu")
GATED = ("swiglu", "geglu")  # the gated MLPs: act(x W_gate) * (x W_up)
LAYER_TYPES = ("full_attention", "sliding_attention")  # transformers' names of a layer's attention
# ``megakernels.ops.RopeScaling``'s fields and the ModelConfig fields they come from (its errors are reworded so).
_ROPE_FIELDS = {
    "kind": "rope_scaling",
    "factor": "rope_scaling_factor",
    "low_freq_factor": "rope_low_freq_factor",
    "high_freq_factor": "rope_high_freq_factor",
    "original_max_positions": "rope_original_max_positions",
    "beta_fast": "rope_beta_fast",
    "beta_slow": "rope_beta_slow",
    "mscale": "rope_mscale",
    "mscale_all_dim": "rope_mscale_all_dim",
    "truncate": "rope_truncate",
}
_ROPE_FIELD = re.compile(r"\b(" + "|".join(_ROPE_FIELDS) + r")\b")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A Transformer of a registered family (``registry.names()``); the fields every family has.

    ``ModelConfig(model=NAME, ...)`` (or ``ModelConfig(NAME, ...)``) is an instance of family NAME's subclass, which
    adds the family's own fields and rules; ``dataclasses.replace`` and pickling keep the class.

    Attributes:
        model: the family (``registry.names()``); the architecture fields below that are None take the family's
            values (its config class's ``DEFAULTS``: e.g. GPT's pre-norm LayerNorm, learned positions, tanh-GeLU MLP
            with biases and tied output embedding; Llama's RMSNorm, rotary positions, SwiGLU without biases).
        num_layers, hidden_size, num_heads: l, h, a.
        num_kv_heads: key/value heads (grouped-query attention; default ``num_heads``: multi-head).
        head_dim: the size of each attention head (default ``hidden_size / num_heads``; another value, as in
            Qwen 3's MoE models, makes the query width ``num_heads · head_dim`` differ from h: rotary models only).
        seq_length: s, tokens per sample (also the number of learned positions).
        vocab_size: V, the tokenizer's real vocabulary (padded for GEMMs inside the model, never in the math).
        ffn_hidden_size: the MLP's inner size f (default 4h).
        dropout: hidden dropout (after the embeddings and on each residual branch).
        attention_dropout: on the attention probabilities.
        layernorm_eps: of every LayerNorm / RMSNorm.
        init_std: std of the normal init (output projections use ``init_std / sqrt(2·l)``).
        norm_position: ``"pre"`` (a norm on each branch's input, a final norm; every preset) or ``"post"``
            (the original Transformer/BERT: a norm after each residual sum and after the embeddings, no final
            one; for models converted from HuggingFace BERT).
        norm: ``"layernorm"`` or ``"rmsnorm"``.
        position_embedding: ``"learned"`` (a table of ``seq_length`` positions) or ``"rope"`` (rotary, applied to
            queries and keys).
        rope_theta: the rotary base (10000 in Llama 2, 500000 in Llama 3).
        sliding_window: sliding-window attention (Mistral): each query sees the last ``sliding_window`` positions,
            its own included (HuggingFace's ``sliding_window``; ``|i - j| < w`` in a bidirectional encoder); None:
            every position. With ``layer_types``, the window of the sliding layers only.
        layer_types: each layer's attention, as transformers names it: ``"sliding_attention"`` (a window of
            ``sliding_window`` positions, rotary base ``local_rope_theta``) or ``"full_attention"`` (every position,
            ``rope_theta``); one entry a layer (gpt-oss alternates them, Gemma 3 has five sliding layers per full
            one). None: every layer alike (windowed by ``sliding_window`` if set).
        local_rope_theta: the rotary base of the sliding layers (Gemma 3's ``rope_local_base_freq``); None:
            ``rope_theta``. Needs ``layer_types`` and rotary positions.
        local_rope_scaling: whether ``rope_scaling`` applies to the sliding layers too (False: the full layers'
            only, as Gemma 3 scales its global layers).
        sinks: attention sinks (gpt-oss): each attention layer learns an fp32 logit per head (``sinks``, zero at
            the start) that joins every row's softmax denominator (``megakernels.ops.flash_attention``'s
            ``sinks``).
        rope_interleaved: rotate pairs ``(2i, 2i+1)`` (GPT-J, Meta's original Llama weights) instead of
            ``(i, i + d/2)`` (GPT-NeoX, HuggingFace's Llama).
        rope_scaling: position scaling of the rotary frequencies for long contexts: None, ``"linear"`` (position
            interpolation: every frequency / ``rope_scaling_factor``) or ``"llama3"`` (Llama 3.1+: frequencies
            whose wavelength exceeds ``rope_original_max_positions / rope_low_freq_factor`` divided by the factor,
            those below ``.. / rope_high_freq_factor`` kept, a blend between; ``megakernels.ops.RopeScaling``).
        rope_scaling_factor, rope_low_freq_factor, rope_high_freq_factor, rope_original_max_positions: its
            parameters (Llama 3.1: 8, 1, 4, 8192; Llama 3.2: 32, 1, 4, 8192).
            ``rope_scaling="yarn"`` (YaRN: gpt-oss, DeepSeek-V3) takes ``rope_scaling_factor`` and
            ``rope_original_max_positions`` with ``rope_beta_fast``, ``rope_beta_slow`` (32, 1), ``rope_mscale``,
            ``rope_mscale_all_dim`` (None: the attention factor is ``0.1 ln(factor) + 1``) and ``rope_truncate``
            (True; gpt-oss: False), each as ``megakernels.ops.RopeScaling``'s field without the prefix.
        activation: the MLP: ``"gelu_tanh"`` (GPT-2/Megatron), ``"gelu"`` (erf, BERT), ``"swiglu"``
            (``silu(x W_gate) * (x W_up)``, Llama) or ``"geglu"`` (``gelu_tanh(x W_gate) * (x W_up)``, Gemma).
        bias: biases in the linear layers.
        qkv_bias: biases on the query, key and value projections only (default ``bias``; Qwen 2.5: True with
            ``bias`` False). Needs rotary positions (the grouped-query attention block).
        qk_norm: an RMSNorm over each query and key head before the rotary embedding (Qwen 3).
        tie_embeddings: the output layer is the word embedding's table.
        num_experts: experts of each mixture-of-experts layer (0: every MLP is dense).
        moe_top_k: experts per token.
        moe_ffn_hidden_size: each expert's MLP size (default ``ffn_hidden_size``).
        moe_layer_freq: layer ``i`` is a MoE layer when ``i % moe_layer_freq == 0`` (1: every layer).
        moe_normalize: renormalise the top-k router weights (Mixtral) or not (Switch/GShard).
        moe_aux_loss_coeff, moe_z_loss_coeff: load-balancing and router z-loss coefficients.
        moe_capacity_factor: capacity per expert as a factor of the even share (None: dropless).
        moe_shared_experts: dense experts every token of a MoE layer also goes through.
        moe_first_dense: the first that many layers stay dense (DeepSeek's first_k_dense_replace).
        moe_score: the router's ``"softmax"`` or ``"sigmoid"`` (DeepSeek-V3) scores.
        moe_n_group, moe_topk_group: group-limited routing (experts in ``moe_n_group`` groups, only the
            ``moe_topk_group`` best eligible; 1, None: off).
        moe_routed_scaling: the routed experts' weights' factor (routed_scaling_factor).
        moe_expert_bias: DeepSeek's auxiliary-loss-free balancing bias in every router (``TopKRouter``).
        moe_seq_aux_loss: the load-balancing loss (``moe_aux_loss_coeff``) per sequence, averaged over the
            micro-batch's sequences (DeepSeek-V3's sequence-wise balance loss) instead of over its tokens at once.
        mtp_layers: multi-token prediction (DeepSeek-V3): that many sequential modules on the last pipeline stage,
            module ``k`` predicting the token ``k + 1`` after the next from the previous module's hidden state and
            the embedding of the token ``k`` ahead (``models.transformer.MultiTokenPrediction``; 0: none).
        mtp_loss_weight: λ: their mean loss enters the training gradient as ``λ · mtp_loss``.
    """

    model: str = DEFAULT
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
    norm_position: str = "pre"
    activation: str | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None
    norm: str | None = None
    position_embedding: str | None = None
    rope_theta: float = 10000.0
    rope_interleaved: bool = False
    rope_scaling: str | None = None
    rope_scaling_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_positions: int = 8192
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_mscale: float | None = None
    rope_mscale_all_dim: float | None = None
    rope_truncate: bool = True
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    local_rope_theta: float | None = None
    local_rope_scaling: bool = True
    sinks: bool = False
    bias: bool | None = None
    qkv_bias: bool | None = None
    qk_norm: bool = False
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
    moe_first_dense: int = 0
    moe_score: str = "softmax"
    moe_n_group: int = 1
    moe_topk_group: int | None = None
    moe_routed_scaling: float = 1.0
    moe_expert_bias: bool = False
    moe_seq_aux_loss: bool = False
    mtp_layers: int = 0
    mtp_loss_weight: float = 0.1

    family = None  # the family's name, set by each subclass
    DEFAULTS = {}  # the family's values of the architecture fields left None
    # Gemma's sandwich: each branch's output normalised too, before the residual sum (``TransformerLayer``)
    sandwich_norms = False
    # gpt-oss's mixture of experts: biases in the router and the experts, the softmax over the chosen logits
    moe_biases = False
    moe_softmax_topk = False

    def __new__(cls, *args, **kwargs):
        name = kwargs.get("model", args[0] if args else (cls.family or DEFAULT))
        target = cls if name == cls.family else family(name).config_class
        if not issubclass(target, cls):
            raise ValueError(f"{cls.__name__}: model={name!r} is not a {cls.family} model")
        return object.__new__(target)

    def __post_init__(self):
        if self.model != self.family:
            raise ValueError(f"{type(self).__name__}: model must be {self.family!r}, got {self.model!r}")
        self._check_family()
        for name, value in self.family_defaults().items():
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
        for name in ("num_layers", "hidden_size", "num_heads", "seq_length", "vocab_size"):
            positive_int(getattr(self, name), name, where="ModelConfig")
        if self.qkv_bias is None:
            object.__setattr__(self, "qkv_bias", self.bias)
        if (self.qkv_bias != self.bias or self.qk_norm) and self.position_embedding != "rope":
            raise ValueError(
                "ModelConfig: qkv_bias other than bias, and qk_norm, are options of the rotary (grouped-query) "
                "attention: they need position_embedding='rope'"
            )
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
        if self.head_dim is None:
            if self.hidden_size % self.num_heads:
                raise ValueError(
                    f"ModelConfig: hidden_size={self.hidden_size} is not divisible by num_heads={self.num_heads}"
                )
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        positive_int(self.head_dim, "head_dim", where="ModelConfig")
        if self.head_dim * self.num_heads != self.hidden_size and self.position_embedding != "rope":
            raise ValueError(
                f"ModelConfig: head_dim={self.head_dim} other than hidden_size / num_heads is an option of the "
                "rotary (grouped-query) attention: it needs position_embedding='rope'"
            )
        if self.position_embedding == "rope":
            if self.head_dim % 2:
                raise ValueError(f"ModelConfig: rotary embeddings need an even head_dim, got {self.head_dim}")
            if not self.rope_theta > 1:
                raise ValueError(f"ModelConfig: rope_theta must be > 1, got {self.rope_theta}")
        if self.rope_scaling is not None:
            if self.position_embedding != "rope":
                raise ValueError("ModelConfig: rope_scaling needs rotary positions (position_embedding='rope')")
            try:
                self.rope_scaling_spec()
            except (TypeError, ValueError) as e:
                # RopeScaling names its own fields: name this config's instead.
                message = _ROPE_FIELD.sub(lambda m: _ROPE_FIELDS[m[0]], str(e).removeprefix("RopeScaling: "))
                raise type(e)(f"ModelConfig: {message}") from None
        if self.sliding_window is not None:
            positive_int(self.sliding_window, "sliding_window", where="ModelConfig")
        self._check_layer_types()
        if self.num_experts:
            positive_int(self.num_experts, "num_experts", where="ModelConfig")
            if not 1 <= self.moe_top_k <= self.num_experts:
                raise ValueError(
                    f"ModelConfig: moe_top_k={self.moe_top_k} must be in 1..num_experts={self.num_experts}"
                )
            if self.activation == "geglu":
                raise ValueError("ModelConfig: activation='geglu' is a dense MLP's; the experts take swiglu or gelu")
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
            if self.moe_score not in ("softmax", "sigmoid"):
                raise ValueError(f"ModelConfig: moe_score must be 'softmax' or 'sigmoid', got {self.moe_score!r}")
            positive_int(self.moe_first_dense, "moe_first_dense", where="ModelConfig", minimum=0)
            positive_int(self.moe_n_group, "moe_n_group", where="ModelConfig")
            if self.num_experts % self.moe_n_group:
                raise ValueError(
                    f"ModelConfig: moe_n_group={self.moe_n_group} must divide num_experts={self.num_experts}"
                )
            groups = self.moe_n_group if self.moe_topk_group is None else self.moe_topk_group
            positive_int(groups, "moe_topk_group", where="ModelConfig")
            if groups > self.moe_n_group or self.moe_top_k > groups * (self.num_experts // self.moe_n_group):
                raise ValueError(
                    f"ModelConfig: moe_topk_group={groups} must be <= moe_n_group={self.moe_n_group} and leave "
                    f"moe_top_k={self.moe_top_k} experts eligible"
                )
            if not self.moe_routed_scaling > 0:
                raise ValueError(f"ModelConfig: moe_routed_scaling must be > 0, got {self.moe_routed_scaling}")
        positive_int(self.mtp_layers, "mtp_layers", where="ModelConfig", minimum=0)
        if not self.mtp_loss_weight >= 0:
            raise ValueError(f"ModelConfig: mtp_loss_weight must be >= 0, got {self.mtp_loss_weight}")
        if self.mtp_layers and self.norm_position != "pre":
            raise ValueError("ModelConfig: multi-token prediction (mtp_layers) is for pre-norm models")
        if self.mtp_layers and self.layer_types is not None:
            raise ValueError("ModelConfig: multi-token prediction (mtp_layers) with per-layer attention kinds")
        for name in ("dropout", "attention_dropout"):
            v = getattr(self, name)
            if not 0.0 <= v < 1.0:
                raise ValueError(f"ModelConfig: {name} must be in [0, 1), got {v}")
        if not self.init_std > 0 or not self.layernorm_eps > 0:
            raise ValueError("ModelConfig: init_std and layernorm_eps must be > 0")
        self._check_architecture()

    def _check_layer_types(self) -> None:
        """``layer_types`` (stored as a tuple), ``local_rope_theta`` and ``local_rope_scaling``."""
        types = self.layer_types
        if types is not None:
            if isinstance(types, str) or not isinstance(types, (list, tuple)):
                raise ValueError(
                    f"ModelConfig: layer_types must be a list of {' / '.join(LAYER_TYPES)}, one a layer, got {types!r}"
                )
            types = tuple(types)
            object.__setattr__(self, "layer_types", types)
            if len(types) != self.num_layers:
                raise ValueError(
                    f"ModelConfig: layer_types has {len(types)} entries, expected one for each of the "
                    f"num_layers={self.num_layers} layers"
                )
            bad = [t for t in types if t not in LAYER_TYPES]
            if bad:
                raise ValueError(f"ModelConfig: layer_types entries must be one of {LAYER_TYPES}, got {bad[0]!r}")
            if "sliding_attention" in types and self.sliding_window is None:
                raise ValueError("ModelConfig: layer_types has sliding_attention layers, which need sliding_window")
        local = self.local_rope_theta is not None or not self.local_rope_scaling
        if local and types is None:
            raise ValueError(
                "ModelConfig: local_rope_theta and local_rope_scaling are the sliding layers' rotary parameters: "
                "they need layer_types"
            )
        if local and self.position_embedding != "rope":
            raise ValueError("ModelConfig: local_rope_theta and local_rope_scaling need position_embedding='rope'")
        if self.local_rope_theta is not None and not self.local_rope_theta > 1:
            raise ValueError(f"ModelConfig: local_rope_theta must be > 1, got {self.local_rope_theta}")

    def layer_type(self, i: int) -> str:
        """Layer ``i``'s attention: ``layer_types[i]``, or for every layer without them ``"sliding_attention"``
        when ``sliding_window`` is set, else ``"full_attention"``."""
        if self.layer_types is not None:
            return self.layer_types[i]
        return "sliding_attention" if self.sliding_window is not None else "full_attention"

    def layer_window(self, i: int) -> int | None:
        """The sliding window of layer ``i`` (None: it attends every position)."""
        return self.sliding_window if self.layer_type(i) == "sliding_attention" else None

    def layer_rope(self, i: int):
        """``(theta, scaling)`` of layer ``i``'s rotary embedding: the sliding layers' ``local_rope_theta`` (when
        set) and, unless ``local_rope_scaling`` is False, ``rope_scaling_spec()``; the full layers' ``rope_theta``
        and ``rope_scaling_spec()``."""
        if self.layer_types is not None and self.layer_types[i] == "sliding_attention":
            theta = self.rope_theta if self.local_rope_theta is None else self.local_rope_theta
            return theta, (self.rope_scaling_spec() if self.local_rope_scaling else None)
        return self.rope_theta, self.rope_scaling_spec()

    # ---- what a family changes (its subclass overrides these) ---------------------------------------------------

    @property
    def softmax_scale(self) -> float | None:
        """The attention scores' scale (None: ``1 / sqrt(head_dim)``)."""
        return None

    @property
    def embedding_multiplier(self) -> float | None:
        """A factor on the word embeddings' output (Gemma's ``sqrt(hidden_size)``), or None."""
        return None

    @property
    def logit_softcap(self) -> float | None:
        """``c`` of a tanh soft cap on the output logits, ``c · tanh(logits / c)`` (Gemma 2's), or None."""
        return None

    @property
    def norm_offset(self) -> float:
        """Added to every RMSNorm's weight on each call: 0, or Gemma's 1 (``x / rms(x) · (1 + weight)``, the weight
        stored as HuggingFace stores it and initialised to zeros)."""
        return 0.0

    @property
    def swiglu_clamp(self) -> tuple[float, float] | None:
        """``(limit, alpha)`` of the experts' clamped SwiGLU (gpt-oss's; ``megakernels.ops.swiglu``), or None."""
        return None

    def _check_family(self) -> None:
        """The family's own fields' rules, before the defaults are filled in (may fill the family's own)."""

    def _check_architecture(self) -> None:
        """The family's rules on the shared fields, once every default is filled in."""

    def family_defaults(self) -> dict:
        """The values of the architecture fields left None (the class's ``DEFAULTS``)."""
        return self.DEFAULTS

    def shared(self) -> dict:
        """The values of the fields every family has (``ModelConfig``'s, without ``model``): another family's
        configuration of the same Transformer is ``OtherConfig(**cfg.shared(), ...)``."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(ModelConfig) if f.name != "model"}

    @classmethod
    def from_dict(cls, fields: dict) -> ModelConfig:
        """The configuration a checkpoint or file stored (``dataclasses.asdict``), by its ``model``.

        Configurations written before each family owned its fields carry every family's (``RETIRED``); a field the
        family does not have is accepted at that old default and dropped, and refused at any other value.

        Raises:
            ValueError: an unknown family, or a field the family does not have (naming it).
        """
        target = family(fields.get("model", DEFAULT)).config_class
        own = {f.name for f in dataclasses.fields(target)}
        foreign = sorted(k for k, v in fields.items() if k not in own and (k not in RETIRED or RETIRED[k] != v))
        if foreign:
            raise ValueError(
                f"ModelConfig: {', '.join(foreign)} {'is not a field' if len(foreign) == 1 else 'are not fields'} of "
                f"a {target.family} model"
            )
        return target(**{k: v for k, v in fields.items() if k in own})

    def rope_scaling_spec(self):
        """The rotary position scaling as a ``megakernels.ops.RopeScaling``, or None."""
        if self.rope_scaling is None:
            return None
        from megakernels.ops.rope import RopeScaling

        return RopeScaling(
            self.rope_scaling,
            self.rope_scaling_factor,
            self.rope_low_freq_factor,
            self.rope_high_freq_factor,
            self.rope_original_max_positions,
            beta_fast=self.rope_beta_fast,
            beta_slow=self.rope_beta_slow,
            mscale=self.rope_mscale,
            mscale_all_dim=self.rope_mscale_all_dim,
            truncate=self.rope_truncate,
        )

    @property
    def q_size(self) -> int:
        """Width of the query projection (and the output projection's input): ``num_heads · head_dim``."""
        return self.num_heads * self.head_dim

    @property
    def num_image_tokens(self) -> int:
        """Image tokens the model reads per sample before its text (0 for a text-only model)."""
        return 0

    @property
    def tokens_per_sample(self) -> int:
        """Positions of the hidden state a pipeline stage sends on: the image tokens (first) and the text tokens of
        a vision-language model; ``seq_length`` otherwise."""
        return self.seq_length + self.num_image_tokens

    def encoder_config(self) -> ModelConfig | None:
        """The configuration of an encoder on the first pipeline stage that reads other inputs than the text (a
        vision-language model's vision encoder), or None."""
        return None

    def language_config(self) -> ModelConfig:
        """The language model alone (a vision-language model's GPT or Llama); ``self`` otherwise."""
        return self

    def has_cross_attention_after(self, layer: int) -> bool:
        """Whether a gated cross-attention layer follows language layer ``layer``."""
        return False

    def report(self) -> tuple[dict, list[str]]:
        """What ``--dry-run`` adds for this family: report fields and lines of text (none by default)."""
        return {}, []

    def _layout_limits(self) -> dict:
        """``ModelShapes``' family-specific rules: ``tp_widths``, ``context_parallel``, ``sequence_parallel``."""
        return {}

    def layout_shapes(self):
        """The shapes the parallel layout's rules check (``megakernels.parallel.layout.ModelShapes``)."""
        from megakernels.parallel.layout import ModelShapes

        return ModelShapes(
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            ffn_hidden_size=self.ffn_hidden_size,
            num_layers=self.num_layers,
            seq_length=self.seq_length,
            num_experts=self.num_experts or 0,
            attention_dropout=self.attention_dropout,
            **self._layout_limits(),
        )

    def replace(self, **changes) -> ModelConfig:
        """A copy with ``changes``. Sizes derived from others follow them unless given: an MLP of 4h follows a new
        hidden size, multi-head attention (as many key/value heads as heads) a new head count, experts as wide as
        the dense MLP a new MLP width. A new ``model`` keeps the fields every family shares (the new family's own
        take their defaults unless given)."""
        c = dict(changes)
        if "hidden_size" in c and "ffn_hidden_size" not in c and self.ffn_hidden_size == 4 * self.hidden_size:
            c["ffn_hidden_size"] = 4 * c["hidden_size"]
        if "num_heads" in c and "num_kv_heads" not in c and self.num_kv_heads == self.num_heads:
            c["num_kv_heads"] = c["num_heads"]
        if ("hidden_size" in c or "num_heads" in c) and "head_dim" not in c and self.q_size == self.hidden_size:
            c["head_dim"] = None  # follows hidden_size / num_heads
        if "bias" in c and "qkv_bias" not in c and self.qkv_bias == self.bias:
            c["qkv_bias"] = c["bias"]
        self._follow(c)
        if (
            "ffn_hidden_size" in c
            and "moe_ffn_hidden_size" not in c
            and self.num_experts
            and self.moe_ffn_hidden_size == self.ffn_hidden_size
        ):
            c["moe_ffn_hidden_size"] = c["ffn_hidden_size"]
        if c.get("model", self.model) != self.model:  # the same Transformer in another family: the shared fields
            return ModelConfig(**{**self.shared(), **c})
        return dataclasses.replace(self, **c)

    def _follow(self, changes: dict) -> None:
        """``replace``'s rule for the family's own derived sizes (adds to ``changes``)."""

    # ---- cost model -------------------------------------------------------------------------------------------

    @property
    def kv_size(self) -> int:
        """Width of the key (and of the value) projection: ``num_kv_heads · head_dim``."""
        return self.num_kv_heads * self.head_dim

    def is_moe_layer(self, i: int) -> bool:
        """Whether layer ``i`` is a mixture-of-experts layer."""
        return self.num_experts > 0 and i >= self.moe_first_dense and i % self.moe_layer_freq == 0

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_layers))

    @property
    def mlp_matrices(self) -> int:
        """Weight matrices of the MLP: three when gated (gate, up, down: SwiGLU, GeGLU), else two."""
        return 3 if self.activation in GATED else 2

    def layer_attended_keys(self, i: int) -> int:
        """Keys each query of layer ``i`` is counted over: ``min(window, seq_length)`` for a windowed layer (its
        band), ``seq_length`` for a full one."""
        w = self.layer_window(i)
        return self.seq_length if w is None else min(w, self.seq_length)

    @property
    def attended_keys(self) -> float:
        """Keys each query's attention is counted over, averaged over the layers (``layer_attended_keys``: the
        window's band or the whole sequence), in the FLOPs and the activation memory of the scores."""
        if self.layer_types is None:
            return self.layer_attended_keys(0)
        return sum(self.layer_attended_keys(i) for i in range(self.num_layers)) / self.num_layers

    def forward_flops_per_token(self) -> dict[str, float]:
        """Forward FLOPs per token: ``{"layers_gemm", "attention", "head"}`` (all layers together), the
        multi-token prediction modules' included: each adds its projection ``2·2h·h``, one more layer (the next
        index's: a MoE layer after dense ones) and the output head again."""
        out = self.main_forward_flops_per_token()
        if self.mtp_layers:
            d = self.mtp_layers
            deeper = dataclasses.replace(self, num_layers=self.num_layers + d, mtp_layers=0)
            more = deeper.main_forward_flops_per_token()
            h = self.hidden_size
            out["layers_gemm"] = more["layers_gemm"] + 2.0 * 2 * h * h * d
            out["attention"] = more["attention"]
            out["head"] *= 1 + d
        return out

    def main_forward_flops_per_token(self) -> dict[str, float]:
        """``forward_flops_per_token`` without multi-token prediction (what a family overrides)."""
        h, f, l, V = self.hidden_size, self.ffn_hidden_size, self.num_layers, self.vocab_size
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
        q = self.q_size
        gemm = 2.0 * ((h * (q + 2 * self.kv_size) + q * h) * l + self.mlp_matrices * h * f * (l - moe) + moe_mlp * moe)
        attention = 4.0 * q * sum(self.layer_attended_keys(i) for i in range(l))
        head = 2.0 * h * V
        return {"layers_gemm": gemm, "attention": attention, "head": head}

    def flops_per_token(self, recompute: str = "none") -> float:
        """Training FLOPs per token (forward + backward = 3× forward, plus what recomputation repeats); for a
        vision-language model per *text* token (its FLOPs per sample over ``seq_length``).

        ``recompute="none"`` gives the *model* FLOPs that MFU is measured against; ``"full"``/``"selective"``
        give the hardware FLOPs actually executed."""
        if recompute not in RECOMPUTE:
            raise ValueError(f"flops_per_token: recompute must be one of {RECOMPUTE}, got {recompute!r}")
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
        The attention scores add ``5·a·s`` (softmax output, dropout mask and output; ``5·a·min(w, s)`` with a
        sliding window of w keys, the scores outside it never formed) unless FlashAttention or selective
        recomputation avoid storing them. Tensor parallelism divides all but the norms' and branches'
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
        mlp = lambda width: (4.0 if self.activation in GATED else 2.0) * width + 2.0 * width  # noqa: E731
        inside = mlp(f)
        if self.num_experts:  # a MoE layer keeps each token k times (its rows for the experts) plus the shared MLPs
            moe = self.moe_top_k * (2.0 * h + mlp(self.moe_ffn_hidden_size)) + self.moe_shared_experts * mlp(
                self.moe_ffn_hidden_size
            )
            share = self.num_moe_layers / self.num_layers
            inside = (1 - share) * inside + share * moe
        replicated = (2.0 + mask) * h + (2.0 + mask) * h + 4.0 * h  # branch inputs + residual masks, norms
        q = self.q_size
        split = (2.0 * q + 4.0 * kv + 2.0 * q) + inside  # Q, K, V, projection input; the MLP's inside
        scores = (
            0.0 if (recompute == "selective" or flash_attention or cp > 1) else 5.0 * a * min(s, self.attended_keys)
        )
        if sequence_parallel:
            return scale * s * b * (replicated + split + scores) / tp
        return scale * s * b * (replicated + (split + scores) / tp)


# Fields every configuration had before each family owned its own, at their defaults then: checkpoints and files
# written before carry them (``ModelConfig.from_dict``).
RETIRED = {
    "num_token_types": 2,
    "lm": None,
    "image_size": 32,
    "patch_size": 8,
    "image_channels": 3,
    "vision_layers": 2,
    "vision_hidden_size": 64,
    "vision_heads": 4,
    "vision_ffn_hidden_size": None,
    "vision_activation": "gelu_tanh",
    "vision_class_token": False,
    "vision_pre_norm": False,
    "vision_final_norm": True,
    "projector_hidden_size": None,
    "cross_attention_every": 0,
    "contrastive_coeff": 0.0,
    "contrastive_temperature": 0.07,
}


def sized(
    cls: type[ModelConfig], layers: int, hidden: int, heads: int, kv: int, seq: int, vocab: int, ffn: int, **fields
) -> ModelConfig:
    """A dropout-free configuration of family class ``cls`` by its sizes (layers, hidden, heads, key/value heads,
    sequence, vocabulary, MLP): how the presets of published decoders are written."""
    return cls(
        num_layers=layers,
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=kv,
        seq_length=seq,
        vocab_size=vocab,
        ffn_hidden_size=ffn,
        dropout=0.0,
        attention_dropout=0.0,
        **fields,
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


def stage_layers(num_layers: int, pp: int, vpp: int = 1, placement: str = "interleaved") -> list[list[range]]:
    """Which layers each pipeline rank holds: ``out[rank][chunk]`` is a range of layer indices.

    Virtual stage k holds layers ``[k·L/(pp·vpp), (k+1)·L/(pp·vpp))``; on rank r, chunk c is stage ``c·pp + r``
    (``placement="interleaved"``, Megatron's assignment; with vpp 1, contiguous blocks) or, under zb-v's
    ``placement="v"`` (vpp 2), stage r for chunk 0 and ``2·pp − 1 − r`` for chunk 1
    (``megakernels.parallel.pipeline.schedules.virtual_stage``). A layer's index is its place in the whole model
    whatever the placement, so checkpoints name it alike.

    Raises:
        ValueError: ``num_layers`` not divisible by ``pp·vpp``.
    """
    from megakernels.parallel.pipeline.schedules import virtual_stage

    stages = pp * vpp
    if num_layers % stages:
        rule = f"pp·vpp = {pp}·{vpp} = {stages}" if vpp > 1 else f"pp = {pp}"
        raise ValueError(
            f"num_layers={num_layers} is not divisible by {rule} (each pipeline stage needs the same number of layers)"
        )
    per = num_layers // stages
    out = []
    for r in range(pp):
        ks = [virtual_stage(placement, pp, r, c, vpp) for c in range(vpp)]
        out.append([range(k * per, (k + 1) * per) for k in ks])
    return out


def training_flops(forward: dict[str, float], recompute: str) -> float:
    """Training FLOPs from forward FLOPs ``{"layers_gemm", "attention", "head"}``: 3× the forward (backward is
    twice it), plus the layers again with full recomputation or the attention cores again with selective."""
    total = 3.0 * sum(forward.values())
    if recompute == "full":
        total += forward["layers_gemm"] + forward["attention"]
    elif recompute == "selective":
        total += forward["attention"]
    return total


def stage_times(cfg, recompute: str = "none") -> tuple[float, float, float]:
    """A pipeline stage's ``(t_forward, t_backward, t_weight)`` relative to its forward, from the model's FLOPs per
    token (``schedules.simulate``'s arguments): backward twice the forward plus what recomputation repeats; of it,
    the weight gradients the zero-bubble schedules defer to their W passes, the blocks' linears (``layers_gemm``:
    as many FLOPs as their forward). Rounded to three decimals (the zb-v orders planned for them are cached)."""
    forward = cfg.forward_flops_per_token()
    total = sum(forward.values())
    backward = training_flops(forward, recompute) - total
    return 1.0, round(backward / total, 3), round(forward["layers_gemm"] / total, 3)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def human(n: float, unit: str = "") -> str:
    """``1.23e9`` -> ``"1.23 G"`` (with unit)."""
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {prefix}{unit}"
    return f"{n:.3g} {unit}".rstrip()


__all__ = ["ModelConfig", "PRESETS", "preset", "stage_layers", "stage_times", "RECOMPUTE", "human", "ceil_div"]
