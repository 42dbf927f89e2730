"""A vision-language model: a ViT encoder and an alignment projector (``vision.py``) in front of our GPT or Llama.

    images [b, H, W, C] ─ VisionEncoder ─ Projector ─ image tokens [n, b, h] ┐                      (first stage)
    ids [b, s] ─ word embedding (GPT: + learned positions) ─ text [s, b, h]  ┴ x = [image; text] [n + s, b, h]
        prefix (LLaVA, cross_attention_every = 0): l × causal Transformer layer over all of x
        cross  (Flamingo, every N-th layer):      the layers run over the text; after every N-th one a gated
                                                  cross-attention layer (text queries, image keys/values,
                                                  FlashAttention with sq ≠ sk, non-causal) — the image tokens ride
                                                  along unchanged in x, so every pipeline stage has them
    ─ final norm ─ logits of the text positions ─ vocab-parallel cross-entropy (caption tokens)    (last stage)
      (+ a CLIP-style contrastive loss between the mean image token and the mean caption token, optional)

The hidden state a pipeline stage sends on is always ``[n + s, b, h]`` (``ModelConfig.tokens_per_sample``), so the
pipeline schedules, the trainer and checkpoints are the language models' own; the vision encoder and the
projector live on the first stage. Parameter names: the language model's (``embedding.*``, ``layers.<i>.*``,
``final_norm``, ``output_layer``), ``vision.*``, ``projector.*`` and ``cross.<i>.*`` (after layer i).
Gated layers start as the identity (``tanh(0) = 0`` gates, as Flamingo), so a pre-trained language model's
behaviour is unchanged before training. Sequence and context parallelism are not supported (the arguments refuse
them).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megakernels.ops import linear_cross_entropy
from megakernels.parallel import init, state
from megakernels.parallel.blocks import ParallelCrossAttention, ParallelMLP
from megakernels.parallel.lm_head import parallel_lm_logits, vocab_parallel_cross_entropy
from megakernels.parallel.random import checkpoint
from megakernels_models.models.config import ModelConfig
from megakernels_models.models.transformer import LanguageModel, make_norm
from megakernels_models.models.vlm.vision import Projector, VisionEncoder


class GatedCrossAttentionLayer(nn.Module):
    """Flamingo's gated cross-attention dense layer:
    ``x = x + tanh(α)·xattn(norm(x), image)``, ``x = x + tanh(β)·mlp(norm(x))``, α = β = 0 at init.

    Forward: ``text`` ``[s, b, h]``, ``image`` ``[n, b, h]`` -> ``[s, b, h]``.
    """

    def __init__(
        self,
        config: ModelConfig,
        layer_number: int,
        seed: int,
        *,
        attention: str = "flash",
        recompute: str = "none",
        device=None,
        dtype=None,
    ):
        super().__init__()
        c, name = config, f"cross.{layer_number}"
        normal = init.init_method_normal(c.init_std)
        scaled = init.scaled_init_method_normal(c.init_std, c.num_layers)
        factory = {"device": device, "dtype": dtype}
        self.recompute_layer = recompute == "full"
        self.norm = make_norm(c, **factory)
        self.attention = ParallelCrossAttention(
            c.hidden_size,
            c.num_heads,
            core=attention,
            attention_dropout=c.attention_dropout,
            bias=c.bias,
            recompute=recompute == "selective",
            init_method=normal,
            output_init_method=scaled,
            seed=init.derive_seed(seed, f"{name}.attention"),
            **factory,
        )
        self.mlp_norm = make_norm(c, **factory)
        self.mlp = ParallelMLP(
            c.hidden_size,
            c.ffn_hidden_size,
            approximate="tanh" if c.activation == "gelu_tanh" else "none",
            activation="swiglu" if c.activation == "swiglu" else "gelu",
            bias=c.bias,
            init_method=normal,
            output_init_method=scaled,
            seed=init.derive_seed(seed, f"{name}.mlp"),
            **factory,
        )
        self.attention_gate = nn.Parameter(torch.zeros(1, **factory))
        self.mlp_gate = nn.Parameter(torch.zeros(1, **factory))

    def _forward(self, text: torch.Tensor, image: torch.Tensor) -> torch.Tensor:
        x = text + torch.tanh(self.attention_gate) * self.attention(self.norm(text), image)
        return x + torch.tanh(self.mlp_gate) * self.mlp(self.mlp_norm(x))

    def forward(self, text: torch.Tensor, image: torch.Tensor) -> torch.Tensor:
        if self.recompute_layer and torch.is_grad_enabled():
            return checkpoint(self._forward, text, image)
        return self._forward(text, image)


def contrastive_loss(
    image: torch.Tensor, text: torch.Tensor, caption_mask: torch.Tensor, temperature: float
) -> torch.Tensor:
    """CLIP's symmetric InfoNCE over a micro-batch: sample i's image against every sample's caption and back.

    Args:
        image: ``[n, b, h]`` image tokens; text: ``[s, b, h]`` text tokens; caption_mask: bool ``[b, s]`` (True on
            the caption's tokens); temperature: the logits' divisor.

    Returns:
        fp32 ``[b]``: each sample's loss, ``(CE(image_i -> captions) + CE(caption_i -> images)) / 2``.
    """
    img = F.normalize(image.float().mean(0), dim=-1)
    mask = caption_mask.t().unsqueeze(-1).to(torch.float32)  # [s, b, 1]
    txt = F.normalize((text.float() * mask).sum(0) / mask.sum(0).clamp(min=1.0), dim=-1)
    logits = img @ txt.t() / temperature
    target = torch.arange(logits.shape[0], device=logits.device)
    return 0.5 * (
        F.cross_entropy(logits, target, reduction="none") + F.cross_entropy(logits.t(), target, reduction="none")
    )


class VLMModel(LanguageModel):
    """A vision-language pipeline chunk (see the module docstring; the arguments are ``LanguageModel``'s; attention
    in the language model is causal, in the vision encoder bidirectional).

    ``forward(images=None, ids=None, labels=None, hidden=None)``:
        images: ``[b, H, W, C]`` uint8 (first stage); ids: ``[b, s]`` text ids (first stage); hidden:
            ``[n + s, b, h]`` from the previous stage (other stages).
        labels: ``[b, s]`` next-token ids of the text positions (``-100`` = ignore: padding).
    On the last stage with labels: the per-token fp32 loss ``[s, b]`` (0 where ignored), and with
    ``contrastive_coeff > 0`` also the per-sample contrastive loss ``[b]`` (a tuple); without labels the text
    positions' vocab-parallel logits ``[s, b, V_pad/tp]``. On other stages: the hidden state to send on.

    Raises:
        ValueError: ``config.model`` is not ``"vlm"``, or sequence parallelism.
    """

    family = "vlm"

    def __init__(
        self,
        config: ModelConfig,
        seed: int,
        *,
        layers: range | None = None,
        pre_process: bool = True,
        post_process: bool = True,
        sequence_parallel: bool = False,
        attention: str = "flash",
        recompute: str = "none",
        fused_linear_ce: bool = True,
        device=None,
        dtype=None,
    ):
        if config.model != self.family:
            raise ValueError(f"VLMModel: config.model is {config.model!r}, expected 'vlm'")
        if sequence_parallel:
            raise ValueError("VLMModel: sequence parallelism is not supported (the image tokens are replicated)")
        super().__init__(
            config,
            seed,
            layers=layers,
            pre_process=pre_process,
            post_process=post_process,
            causal=True,
            attention=attention,
            recompute=recompute,
            fused_linear_ce=fused_linear_ce,
            device=device,
            dtype=dtype,
        )
        factory = {"device": device, "dtype": dtype}
        self.vision = self.projector = None
        if pre_process:
            self.vision = VisionEncoder(config, seed, attention=attention, recompute=recompute, **factory)
            self.projector = Projector(config, seed, **factory)
        self.cross = nn.ModuleDict(
            {
                str(layer.layer_number): GatedCrossAttentionLayer(
                    config, layer.layer_number, seed, attention=attention, recompute=recompute, **factory
                )
                for layer in self.layers
                if config.has_cross_attention_after(layer.layer_number)
            }
        )

    def forward(
        self,
        images: torch.Tensor | None = None,
        ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        hidden: torch.Tensor | None = None,
    ):
        c, n = self.config, self.config.num_image_tokens
        if self.pre_process:
            if images is None or ids is None:
                raise ValueError("VLMModel: the first pipeline stage needs images [b, H, W, C] and ids [b, s]")
            x = torch.cat([self.projector(self.vision(images)), self.embedding(ids.t())])
        elif hidden is None:
            raise ValueError("VLMModel: a later pipeline stage needs hidden from the previous one")
        else:
            x = hidden
        if not c.cross_attention_every:
            for layer in self.layers:
                x = layer(x)
        else:
            image, text = x[:n], x[n:]
            for layer in self.layers:
                text = layer(text)
                cross = self.cross[str(layer.layer_number)] if str(layer.layer_number) in self.cross else None
                text = cross(text, image) if cross is not None else text
            x = torch.cat([image, text])
        if not self.post_process:
            return x
        x = self.final_norm(x) if self.final_norm is not None else x
        if labels is not None and self.fused_linear_ce:  # the logits never held (GPTModel's)
            loss = linear_cross_entropy(
                x[n:], self.output_weight, labels.t().contiguous(), group=state.tp_group(), vocab_size=c.vocab_size
            )
        else:
            logits = parallel_lm_logits(x[n:], self.output_weight, True, False)
            if labels is None:
                return logits
            loss = vocab_parallel_cross_entropy(logits, labels.t().contiguous(), c.vocab_size)
        if not c.contrastive_coeff:
            return loss
        return loss, contrastive_loss(x[:n], x[n:], labels != -100, c.contrastive_temperature)
