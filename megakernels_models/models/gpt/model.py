"""GPT: a causal language model built only from megakernels modules (tensor/sequence/pipeline parallel).

    ids [b, s] ─ word (vocab-parallel) + position embedding ─ dropout          (first pipeline stage)
              ─ l × pre-norm Transformer layer (causal FlashAttention, fused bias-GeLU MLP)
              ─ final LayerNorm ─ logits = h · Eᵀ (E the word embedding, tied) ─ vocab-parallel cross-entropy
                                                                                     (last pipeline stage)

One ``GPTModel`` is one pipeline chunk: with pp = 1 it is the whole model. The logits are never gathered over the
tensor-parallel group; the loss is that of the unpadded, unsharded model (``megakernels.parallel.lm_head``). With
``fused_linear_ce`` (the trainer's choice: ``TrainArgs.fused_head``) the last two steps are one,
``ops.linear_cross_entropy``: the logits are computed a chunk of tokens at a time and never held whole, with the
same per-token loss and gradients (hidden's summed over the tensor-parallel group, or reduce-scattered to the
sequence shards under sequence parallelism, as ``parallel_lm_logits`` does).

    model = GPTModel(preset("gpt-tiny"), seed=1234)
    loss = model(ids, labels=labels)            # [s, b] fp32 per-token loss
"""

from __future__ import annotations

import torch

from megakernels.ops import linear_cross_entropy
from megakernels.parallel import state
from megakernels.parallel.lm_head import parallel_lm_logits, vocab_parallel_cross_entropy
from megakernels_models.models.config import ModelConfig
from megakernels_models.models.transformer import LanguageModel, shifted


class GPTModel(LanguageModel):
    """A GPT pipeline chunk (see ``LanguageModel`` for the arguments; attention is causal).

    ``forward(ids=None, labels=None, hidden=None)``:
        ids: ``[b, s]`` token ids (first stage); hidden: ``[s, b, h]`` from the previous stage (other stages).
        labels: ``[b, s]`` next-token ids (``-100`` = ignore); on the last stage with labels the result is the
            per-token fp32 loss ``[s, b]``; without labels, the vocab-parallel logits ``[s, b, V_pad/tp]``.
        kv_cache: a ``megakernels.nn.KVCache`` for incremental decoding (``generate.py``).
        documents: packed sequences, ``(ids, positions)`` int ``[b, s]`` (``LanguageModel.encode``), or None.
    On other stages the result is the hidden state to send on.
    """

    family = "gpt"

    def __init__(self, config: ModelConfig, seed: int, **kwargs):
        if config.model != self.family:
            raise ValueError(f"{type(self).__name__}: config.model is {config.model!r}, expected {self.family!r}")
        super().__init__(config, seed, causal=True, **kwargs)

    def forward(
        self,
        ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        hidden: torch.Tensor | None = None,
        kv_cache=None,
        documents=None,
        mtp: bool = False,
    ):
        """See the class docstring. ``mtp`` (a last stage with multi-token prediction, with ``labels`` and the
        micro-batch's whole ``ids``): returns ``(loss, mtp_losses)``, the per-token losses ``[s, b]`` of the main
        head and of each depth ``k`` (predicting label ``i + k``, -100 past the end or across documents)."""
        predict = mtp and self.mtp is not None and labels is not None
        if predict and ids is None:
            raise ValueError(f"{type(self).__name__}: multi-token prediction needs the micro-batch's ids [b, s]")
        inputs = {} if predict else None
        x = self.encode(ids, hidden, kv_cache=kv_cache, documents=documents, mtp_inputs=inputs)
        if not self.post_process:
            return x
        if labels is not None:
            loss = self._token_loss(x, labels)
            if not predict:
                return loss
            docs = None if documents is None else documents[0]
            heads = self.mtp_hidden(ids, inputs, docs)
            return loss, [self._token_loss(y, shifted(labels, k, -100, docs)) for k, y in enumerate(heads, 1)]
        logits = parallel_lm_logits(x, self.output_weight, True, self.sequence_parallel)
        cap = self.config.logit_softcap
        return logits if cap is None else cap * torch.tanh(logits / cap)

    def _token_loss(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The per-token fp32 loss ``[s, b]`` of hidden states ``x`` (the output layer's input) and ``labels``
        ``[b, s]``."""
        cap = self.config.logit_softcap  # Gemma 2's tanh cap: inside the loss kernels
        if self.fused_linear_ce:
            return linear_cross_entropy(
                x,
                self.output_weight,
                labels.t().contiguous(),
                group=state.tp_group(),
                vocab_size=self.config.vocab_size,
                sequence_parallel=self.sequence_parallel,
                softcap=cap,
            )
        logits = parallel_lm_logits(x, self.output_weight, True, self.sequence_parallel)
        return vocab_parallel_cross_entropy(logits, labels.t().contiguous(), self.config.vocab_size, softcap=cap)
