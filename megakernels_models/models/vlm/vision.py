"""The vision side of a vision-language model: a ViT encoder and the projector into the language model's space.

    images uint8 [b, H, W, C] ─ pixels in [-1, 1] ─ patches [N, b, p²·C] (row-major patches, each (row, col, channel))
          ─ patch projection (column-parallel linear, gathered) (─ class token) ─ + learned 2D positions ─ dropout
          (─ LayerNorm, CLIP's "pre-layernorm") ─ l × bidirectional pre-norm Transformer layer ─ (final LayerNorm)
          ─ projector: column-parallel fc1 ─ fused bias-GeLU ─ row-parallel fc2  ─>  image tokens [N, b, h]

The Transformer layers are the ones every family stacks (``transformer.TransformerLayer`` of
``VLMConfig.encoder_config()``: FlashAttention without a mask, fused LayerNorm, fused bias-GeLU MLP), seeded under
``vision``: the encoder's weights depend on the model's seed only, never on the layout. The position table has one
learned vector per grid cell (``(image_size / patch_size)²``, plus one for the class token), as ViT and CLIP.
"""

from __future__ import annotations

import torch
from torch import nn

from megakernels.nn import FusedLayerNorm
from megakernels.ops.bias_gelu import bias_gelu
from megakernels.parallel import init
from megakernels.parallel.linear import ColumnParallelLinear, RowParallelLinear
from megakernels_models.models.config import ModelConfig
from megakernels_models.models.transformer import TransformerLayer, dropout, replicated_embedding


def patchify(pixels: torch.Tensor, patch_size: int) -> torch.Tensor:
    """``[b, H, W, C]`` -> ``[N, b, p·p·C]``: patches in row-major order, each flattened as (row, col, channel).

    Raises:
        ValueError: not 4-D, or H or W not divisible by ``patch_size``.
    """
    if pixels.dim() != 4:
        raise ValueError(f"patchify: images must be [b, H, W, C], got shape {tuple(pixels.shape)}")
    b, H, W, C = pixels.shape
    p = patch_size
    if H % p or W % p:
        raise ValueError(f"patchify: image size {H}x{W} is not divisible by the patch size {p}")
    x = pixels.reshape(b, H // p, p, W // p, p, C).permute(1, 3, 0, 2, 4, 5)
    return x.reshape((H // p) * (W // p), b, p * p * C)


def to_pixels(images: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """uint8 images (0..255) -> ``dtype`` pixels in [-1, 1] (mean 0.5, std 0.5 per channel); float input is taken
    as already normalised."""
    if images.dtype == torch.uint8:
        return images.to(dtype) * (2.0 / 255.0) - 1.0
    return images.to(dtype)


class VisionEncoder(nn.Module):
    """The ViT of a vision-language model (see the module docstring).

    Args:
        config: a ``model="vlm"`` configuration (its ``image_*``, ``patch_size`` and ``vision_*`` fields).
        seed: the model's seed (weights are seeded under ``vision``).
        attention, recompute: as ``TransformerLayer``.
        device, dtype: of the parameters.

    Forward: ``images`` ``[b, H, W, C]`` (uint8, or float pixels already normalised) -> features
    ``[num_image_tokens, b, vision_hidden_size]``.

    Raises:
        ValueError: images whose shape is not ``[b, image_size, image_size, image_channels]``.
    """

    def __init__(
        self,
        config: ModelConfig,
        seed: int,
        *,
        attention: str = "flash",
        recompute: str = "none",
        device=None,
        dtype=None,
    ):
        super().__init__()
        c, v = config, config.encoder_config()
        self.config, seed = config, init.derive_seed(seed, "vision")
        self.dropout_p = c.dropout
        h, n = c.vision_hidden_size, c.num_image_tokens
        self.patch = ColumnParallelLinear(
            c.patch_size**2 * c.image_channels,
            h,
            True,
            gather_output=True,
            init_method=init.init_method_normal(c.init_std),
            seed=init.derive_seed(seed, "patch"),
            device=device,
            dtype=dtype,
        )
        self.positions = replicated_embedding(n, h, init.derive_seed(seed, "positions"), c.init_std, device, dtype)
        self.class_token = None
        if c.vision_class_token:
            self.class_token = nn.Parameter(torch.empty(h, device=device, dtype=dtype))
            if self.class_token.device.type != "meta":
                with torch.no_grad():
                    self.class_token.copy_(
                        init.full_weight(
                            (1, h), init.derive_seed(seed, "class_token"), init.init_method_normal(c.init_std)
                        )[0]
                    )
        factory = {"device": device, "dtype": dtype}
        self.pre_norm = FusedLayerNorm(h, c.layernorm_eps, **factory) if c.vision_pre_norm else None
        self.layers = nn.ModuleList(
            TransformerLayer(v, i, seed, causal=False, attention=attention, recompute=recompute, **factory)
            for i in range(v.num_layers)
        )
        self.final_norm = FusedLayerNorm(h, c.layernorm_eps, **factory) if c.vision_final_norm else None

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        c = self.config
        want = (c.image_size, c.image_size, c.image_channels)
        if images.dim() != 4 or tuple(images.shape[1:]) != want:
            raise ValueError(
                f"VisionEncoder: images must be [b, {want[0]}, {want[1]}, {want[2]}] (image_size "
                f"{c.image_size}, {c.image_channels} channels), got shape {tuple(images.shape)}"
            )
        x = self.patch(patchify(to_pixels(images, self.patch.weight.dtype), c.patch_size))  # [N, b, hv]
        if self.class_token is not None:
            x = torch.cat([self.class_token.expand(1, x.shape[1], -1), x])
        x = dropout(x + self.positions.weight.unsqueeze(1), self.dropout_p, self.training, False)
        if self.pre_norm is not None:
            x = self.pre_norm(x)
        for layer in self.layers:
            x = layer(x)
        return self.final_norm(x) if self.final_norm is not None else x


class Projector(nn.Module):
    """LLaVA-1.5's alignment projector: a 2-layer MLP from the vision features to the language model's embedding
    space, ``fc2(gelu(fc1(x) + b1)) + b2`` with fc1 column- and fc2 row-parallel (one all-reduce forward).

    Forward: ``[n, b, vision_hidden_size]`` -> ``[n, b, hidden_size]``.
    """

    def __init__(self, config: ModelConfig, seed: int, *, device=None, dtype=None):
        super().__init__()
        c, seed = config, init.derive_seed(seed, "projector")
        normal = init.init_method_normal(c.init_std)
        self.fc1 = ColumnParallelLinear(
            c.vision_hidden_size,
            c.projector_hidden_size,
            True,
            skip_bias_add=True,
            init_method=normal,
            seed=init.derive_seed(seed, "fc1"),
            device=device,
            dtype=dtype,
        )
        self.fc2 = RowParallelLinear(
            c.projector_hidden_size,
            c.hidden_size,
            True,
            init_method=normal,
            seed=init.derive_seed(seed, "fc2"),
            device=device,
            dtype=dtype,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, b1 = self.fc1(x)
        return self.fc2(bias_gelu(y, b1, "tanh"))
