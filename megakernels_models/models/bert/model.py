"""BERT, pre-norm: a bidirectional encoder with a masked-LM head and a sentence-order-prediction head.

    ids, token_types [b, s] ─ word (vocab-parallel) + position + token-type embedding ─ dropout   (first stage)
              ─ l × pre-norm Transformer layer (bidirectional attention, padding keys masked out)
              ─ final LayerNorm ─┬ MLM: dense ─ GeLU ─ LayerNorm ─ h · Eᵀ + b (E tied) ─ vocab-parallel CE
                                 └ SOP: pooler (dense + tanh on the first token) ─ 2-way classifier ─ CE
                                                                                              (last stage)

Pre-norm rather than the original post-norm: Megatron-LM found that BERT past 336M parameters only trains stably
with the LayerNorms moved to the branch inputs (Shoeybi et al. 2019, §3.3), so every preset uses it. The original
post-norm form (``ModelConfig(norm_position="post", activation="gelu")``: LayerNorm after the embeddings and after
each residual sum, no final one) exists for checkpoints converted from HuggingFace's ``BertForPreTraining``.
The padding mask (``padding_mask`` ``[b, s]``, True = padding) is needed by every pipeline stage: each reads it
from the batch itself, as each reads the batch's other small tensors.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megakernels.nn import FusedLayerNorm
from megakernels.ops.bias_gelu import bias_gelu
from megakernels.parallel import init, state
from megakernels.parallel.lm_head import parallel_lm_logits, vocab_parallel_cross_entropy
from megakernels.parallel.mappings import gather_from_sequence_parallel_region
from megakernels.parallel.params import mark_sequence_parallel, mark_tensor_parallel
from megakernels_models.models.config import ModelConfig
from megakernels_models.models.transformer import LanguageModel, replicated_linear


class BertModel(LanguageModel):
    """A BERT pipeline chunk (see ``LanguageModel`` for the arguments; attention is bidirectional).

    ``forward(ids=None, token_types=None, padding_mask=None, mlm_labels=None, sop_labels=None, hidden=None)``:
        ids, token_types: ``[b, s]`` (first stage); hidden: ``[s, b, h]`` from the previous stage (other stages).
        padding_mask: ``[b, s]`` bool, True = padding token (its key is masked out); every stage.
        mlm_labels: ``[b, s]`` original ids at masked positions, ``-100`` elsewhere; sop_labels: ``[b]`` in {0, 1}.
    On the last stage with labels: ``(mlm_loss [s, b] fp32 per token, 0 where ignored; sop_loss [b] fp32)``;
    without labels: ``(mlm_logits [s, b, V_pad/tp], sop_logits [b, 2])``. On other stages: the hidden state.
    """

    family = "bert"

    def __init__(self, config: ModelConfig, seed: int, *, device=None, dtype=None, **kwargs):
        if config.model != self.family:
            raise ValueError(f"BertModel: config.model is {config.model!r}, expected {self.family!r}")
        super().__init__(config, seed, causal=False, token_types=True, device=device, dtype=dtype, **kwargs)
        if self.post_process:
            c, h = config, config.hidden_size
            factory = {"device": device, "dtype": dtype}
            self.mlm_dense = replicated_linear(h, h, init.derive_seed(seed, "mlm.dense"), c.init_std, **factory)
            self.mlm_norm = FusedLayerNorm(h, c.layernorm_eps, **factory)
            # The output bias is vocab-parallel like the tied table: [V_pad/tp], padding columns never used.
            self.mlm_bias = torch.nn.Parameter(torch.zeros(self.padded_vocab_size // state.tp_size(), **factory))
            mark_tensor_parallel(self.mlm_bias, dim=0, real_size=config.vocab_size)
            self.pooler = replicated_linear(h, h, init.derive_seed(seed, "pooler"), c.init_std, **factory)
            self.sop_head = replicated_linear(h, 2, init.derive_seed(seed, "sop_head"), c.init_std, **factory)
            if self.sequence_parallel:
                mark_sequence_parallel(self.mlm_dense, self.mlm_norm)

    def forward(self, ids=None, token_types=None, padding_mask=None, mlm_labels=None, sop_labels=None, hidden=None):
        mask = None if padding_mask is None else padding_mask[:, None, None, :]
        x = self.encode(ids, hidden, token_types, mask)
        if not self.post_process:
            return x
        # Sentence order from the first token ([CLS]); under SP it lives on TP rank 0's shard, so gather the
        # sequence (the pooler is replicated: its gradient is split back, not summed).
        full = (
            gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False) if self.sequence_parallel else x
        )
        sop_logits = self.sop_head(torch.tanh(self.pooler(full[0])))
        y = F.linear(x, self.mlm_dense.weight)
        y = self.mlm_norm(bias_gelu(y, self.mlm_dense.bias, "none"))
        logits = parallel_lm_logits(y, self.word_embedding_weight, True, self.sequence_parallel, bias=self.mlm_bias)
        if mlm_labels is None:
            return logits, sop_logits
        mlm = vocab_parallel_cross_entropy(logits, mlm_labels.t().contiguous(), self.config.vocab_size)
        sop = F.cross_entropy(sop_logits.float(), sop_labels, reduction="none")
        return mlm, sop
