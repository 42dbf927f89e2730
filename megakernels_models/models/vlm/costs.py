"""What a vision-language model (``vlm.py``) costs: FLOPs per sample, counted as ``config.py`` counts a language
model's (Narayanan et al. 2021, §5.1: 2 FLOPs per multiply-add, backward twice the forward).

Per sample, forward:

- vision encoder: the patch projection ``2·(p²·C)·hv`` per patch, then its Transformer over the image tokens (the
  language-model formula with ``s`` = image tokens, no head);
- projector: ``2·(hv·hp + hp·h)`` per image token;
- language model: with the image tokens as a prefix (LLaVA) every layer runs over image + text tokens; with
  cross-attention (Flamingo) the layers run over the text only and each gated cross-attention layer adds, per text
  token, its query and output projections ``4h²``, its MLP and ``4·n·h`` for the scores and weighted sum over the
  ``n`` image tokens, and per image token its key/value projection ``4h²``; the LM head runs on the text tokens.
"""

from __future__ import annotations


def vlm_forward_flops_per_sample(cfg) -> dict[str, float]:
    """Forward FLOPs of one sample: ``{"layers_gemm", "attention", "head"}`` (the vision encoder, projector and
    cross-attention layers counted in ``layers_gemm``/``attention``)."""
    n, s, h = cfg.num_image_tokens, cfg.seq_length, cfg.hidden_size
    vision = cfg.encoder_config().forward_flops_per_token()
    patch = 2.0 * cfg.patch_size**2 * cfg.image_channels * cfg.vision_hidden_size * cfg.num_patches
    projector = 2.0 * (cfg.vision_hidden_size + h) * cfg.projector_hidden_size * n
    lm_tokens = s if cfg.cross_attention_every else s + n
    lm = cfg.language_config().replace(seq_length=lm_tokens).forward_flops_per_token()
    cross = sum(cfg.has_cross_attention_after(i) for i in range(cfg.num_layers))
    cross_gemm = cross * (s * (4.0 * h * h + 2.0 * cfg.mlp_matrices * h * cfg.ffn_hidden_size) + n * 4.0 * h * h)
    return {
        "layers_gemm": vision["layers_gemm"] * n + patch + projector + lm["layers_gemm"] * lm_tokens + cross_gemm,
        "attention": vision["attention"] * n + lm["attention"] * lm_tokens + cross * 4.0 * s * n * h,
        "head": lm["head"] * s,
    }


def vlm_flops_per_sample(cfg, recompute: str = "none") -> float:
    """Training FLOPs of one sample (3× the forward, plus what recomputation repeats, as ``flops_per_token``)."""
    from megakernels_models.models.config import training_flops

    return training_flops(vlm_forward_flops_per_sample(cfg), recompute)
