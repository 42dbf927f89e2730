"""The Gemma family (Gemma 3 text): a causal language model with five sliding-window (local) layers per full
(global) one, each type with its rotary base (10 000 local, 1 000 000 global; the global layers of 4B+ scaled
linearly by 8), an RMSNorm over each query and key head, sandwich norms (each branch's input and output
normalised), embeddings scaled by ``sqrt(hidden_size)``, a tanh-GeLU gated MLP (GeGLU), the output layer tied to
the word embedding, the scores scaled by ``query_pre_attn_scalar ** -0.5``, and an optional tanh cap on the
final logits (``final_logit_softcapping``, Gemma 2's).

Gemma's RMSNorm multiplies by ``1 + weight`` (``norm_offset`` 1: the fused RMSNorm adds the one in fp32 on each
call), so a norm's weight is HuggingFace's tensor itself, initialised to zeros as theirs.

Presets: ``gemma-tiny`` (the CPU default), ``gemma3-1b``, ``gemma3-4b``, ``gemma3-12b``, ``gemma3-27b`` (the text
models).
"""

from __future__ import annotations

import dataclasses
import math

from megakernels_models.models.config import ModelConfig, sized
from megakernels_models.models.registry import FamilySpec, register
from megakernels_models.models.tasks import CausalLMTask
from megakernels_models.settings import setting


@dataclasses.dataclass(frozen=True)
class GemmaConfig(ModelConfig):
    """A Gemma model (``ModelConfig``'s fields, Gemma's defaults) and its own fields.

    Attributes:
        query_pre_attn_scalar: the scores are scaled by ``query_pre_attn_scalar ** -0.5`` (None: ``head_dim``).
        final_logit_softcapping: ``c`` of ``c · tanh(logits / c)`` on the output logits, or None.
    """

    model: str = "gemma"
    qk_norm: bool = True
    query_pre_attn_scalar: float | None = None
    final_logit_softcapping: float | None = None
    family = "gemma"
    sandwich_norms = True
    DEFAULTS = dict(norm="rmsnorm", position_embedding="rope", activation="geglu", bias=False, tie_embeddings=True)

    def _check_family(self) -> None:
        for name in ("query_pre_attn_scalar", "final_logit_softcapping"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise ValueError(f"GemmaConfig: {name} must be > 0 or None, got {v}")
        if self.num_experts:
            raise ValueError("GemmaConfig: num_experts must be 0 (Gemma's MLPs are dense)")

    def _check_architecture(self) -> None:
        if self.norm != "rmsnorm" or self.position_embedding != "rope" or self.norm_position != "pre":
            raise ValueError("GemmaConfig: Gemma is a pre-norm RMSNorm model with rotary positions")

    @property
    def softmax_scale(self) -> float | None:
        return None if self.query_pre_attn_scalar is None else float(self.query_pre_attn_scalar) ** -0.5

    @property
    def embedding_multiplier(self) -> float | None:
        return math.sqrt(self.hidden_size)

    @property
    def logit_softcap(self) -> float | None:
        return self.final_logit_softcapping

    @property
    def norm_offset(self) -> float:
        return 1.0


@dataclasses.dataclass
class GemmaSettings:
    """``megakernels train``'s flags for this family (each replaces the preset's field of the same name)."""

    query_pre_attn_scalar: float | None = setting(
        None, "the attention scores are scaled by this ** -0.5 (default: the preset's, else the head dim)", "Gemma"
    )
    final_logit_softcapping: float | None = setting(
        None, "c of the cap c * tanh(logits / c) on the output logits (default: the preset's, none)", "Gemma"
    )


def pattern(num_layers: int, every: int = 6) -> tuple[str, ...]:
    """Gemma 3's layer types: every ``every``-th layer full, the others sliding (transformers' rule)."""
    return tuple("full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(num_layers))


def _gemma(layers, hidden, heads, kv, seq, vocab, ffn, *, window, head_dim, scalar, scaled) -> GemmaConfig:
    scaling = dict(rope_scaling="linear", rope_scaling_factor=8.0, local_rope_scaling=False) if scaled else {}
    return sized(
        GemmaConfig,
        layers,
        hidden,
        heads,
        kv,
        seq,
        vocab,
        ffn,
        layernorm_eps=1e-6,
        head_dim=head_dim,
        query_pre_attn_scalar=scalar,
        sliding_window=window,
        layer_types=pattern(layers),
        rope_theta=1e6,
        local_rope_theta=1e4,
        **scaling,
    )


PRESETS = {
    # byte-level vocabulary, for the CPU: one full layer of six, a window shorter than the sequence
    "gemma-tiny": _gemma(6, 256, 8, 2, 256, 261, 704, window=64, head_dim=32, scalar=48, scaled=True),
    "gemma3-1b": _gemma(26, 1152, 4, 1, 8192, 262144, 6912, window=512, head_dim=256, scalar=256, scaled=False),
    "gemma3-4b": _gemma(34, 2560, 8, 4, 8192, 262208, 10240, window=1024, head_dim=256, scalar=256, scaled=True),
    "gemma3-12b": _gemma(48, 3840, 16, 8, 8192, 262208, 15360, window=1024, head_dim=256, scalar=256, scaled=True),
    "gemma3-27b": _gemma(62, 5376, 32, 16, 8192, 262208, 21504, window=1024, head_dim=128, scalar=168, scaled=True),
}


def _model():
    from megakernels_models.models.gemma.model import GemmaModel

    return GemmaModel


def _hf(config):
    from megakernels_models.convert import gemma3

    return gemma3


SPEC = register(
    FamilySpec("gemma", "Gemma", GemmaConfig, _model, CausalLMTask, "tokens", PRESETS, hf=_hf, settings=GemmaSettings)
)
