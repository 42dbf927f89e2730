"""A key/value cache for incremental decoding: each attention layer appends the keys and values of the tokens it
has just seen and attends over everything cached so far, so generating a token costs one token's forward.

    cache = KVCache()
    logits = model(prompt_ids, cache=cache)          # fills the cache; cache.offset == prompt length
    logits = model(next_id[:, None], cache=cache)    # one new token, attending to prompt + itself

Layers are told apart by the module (``update(layer, k, v)``). The queries of new tokens are the last positions
of the keys, which is the bottom-right aligned causal mask of the attention cores.
"""

from __future__ import annotations

import torch


class KVCache:
    """Keys and values per attention layer (``[batch, tokens, kv_heads, head_dim]``), and ``offset``: the position
    of the next token (the number already cached). The model advances ``offset`` after each forward."""

    def __init__(self):
        self._kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.offset = 0

    def update(self, layer, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``k``, ``v`` (``[b, new, kv_heads, d]``) to ``layer``'s cache; returns everything cached for it."""
        key = id(layer)
        if key in self._kv:
            k0, v0 = self._kv[key]
            k, v = torch.cat([k0, k], 1), torch.cat([v0, v], 1)
        self._kv[key] = (k, v)
        return k, v

    def advance(self, tokens: int) -> None:
        self.offset += tokens

    def positions(self, tokens: int, device=None) -> torch.Tensor:
        """The positions of the next ``tokens`` tokens."""
        return torch.arange(self.offset, self.offset + tokens, device=device)
