"""Llama: a causal language model of the Llama 2 / Llama 3 architecture, built only from megakernels modules.

    ids [b, s] ─ word embedding (vocab-parallel)                                               (first stage)
              ─ l × [ x + attention(rmsnorm(x)),  x + mlp(rmsnorm(x)) ]
                  attention: grouped-query (num_kv_heads), rotary positions on q and k (theta, fused RoPE)
                  mlp: silu(x W_gate) * (x W_up) W_down (fused SwiGLU), no biases anywhere
              ─ final RMSNorm ─ logits = h · W_outᵀ (own table, or tied) ─ vocab-parallel cross-entropy (last stage)

The same trainer, layouts and checkpoints as GPT (``gpt.py``): only the configuration differs
(``ModelConfig("llama", ...)`` takes the family's RMSNorm/RoPE/SwiGLU/no-bias/untied defaults). Under tensor
parallelism the query heads split over the ranks and the key/value heads split too when ``num_kv_heads`` is a
multiple of tp, or are replicated on the ranks whose query heads share them when tp exceeds them
(``megakernels.parallel.ParallelGroupedQueryAttention``).

    model = LlamaModel(preset("llama-tiny"), seed=1234)
    loss = model(ids, labels=labels)            # [s, b] fp32 per-token loss
"""

from __future__ import annotations

from megakernels_models.models.gpt.model import GPTModel


class LlamaModel(GPTModel):
    """A Llama pipeline chunk; ``forward`` as ``GPTModel``'s."""

    family = "llama"
