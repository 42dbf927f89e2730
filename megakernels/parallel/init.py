"""Layout-independent weight initialisation: a seed defines the full weight; a rank generates only its shard.

docs/design.md §4: the same seed gives the same model for every (tp, pp, dp). Initialising the full "master" weight on
every rank and slicing it meets that, but costs the full tensor's memory on every rank (a 51200 × 12288 embedding is
2.4 GiB in fp32). Instead the full ``[rows, cols]`` weight is *defined* in blocks of ``INIT_BLOCK_ROWS`` rows:

    block k = rows [k·B, min((k+1)·B, real_rows)) = init_method(empty [.., cols], Generator(seed_k))
    seed_k  = mix(seed, k)                     (a 64-bit hash, so neighbouring blocks' streams are unrelated)
    rows >= real_rows (vocab padding) are zeros

A rank whose shard is a range of rows (column-parallel, vocab-parallel) generates only the blocks its rows touch;
a rank whose shard is a range of columns (row-parallel) generates every block one at a time and keeps its columns,
so no rank ever holds more than one block beyond its shard. Generation is on the CPU in fp32, so a CUDA model, a
CPU model and a meta-device model materialised later get the same values. Because a block's content depends only on
``(seed, k, cols)`` and the number of real rows, the real rows never depend on the amount of padding.

``init_method(tensor, generator)`` fills a CPU fp32 tensor in place; it must treat elements as i.i.d. (as
``normal_``/``uniform_`` do), since it sees blocks, not the whole weight. The layers draw their seed from the
default CPU generator (one draw each), so ``torch.manual_seed(s)`` before building a model fixes it for any layout.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable

import torch

INIT_BLOCK_ROWS = 128
_MASK64 = (1 << 64) - 1

InitMethod = Callable[[torch.Tensor, torch.Generator], None]


def init_method_normal(std: float = 0.02) -> InitMethod:
    """``N(0, std²)`` elements (Megatron's default init with ``std=0.02``)."""
    if not std > 0:
        raise ValueError(f"init_method_normal: std must be > 0, got {std}")

    def init(t: torch.Tensor, generator: torch.Generator) -> None:
        t.normal_(0.0, std, generator=generator)

    return init


def scaled_init_method_normal(std: float, num_layers: int) -> InitMethod:
    """``N(0, (std / sqrt(2 · num_layers))²)``: GPT-2/Megatron's init of the layers that write into the residual."""
    if int(num_layers) < 1:
        raise ValueError(f"scaled_init_method_normal: num_layers must be >= 1, got {num_layers}")
    return init_method_normal(std / math.sqrt(2.0 * num_layers))


def draw_seed() -> int:
    """A 63-bit seed drawn from the default CPU generator (consumes one draw of its stream)."""
    return int(torch.randint(0, 2**62, (), dtype=torch.int64).item())


def derive_seed(seed: int, name: str) -> int:
    """A 63-bit seed for the part ``name`` (e.g. ``"layers.3.mlp.fc1"``) of a model whose seed is ``seed``.

    A model that seeds each layer by its *name* rather than by drawing from a generator in construction order
    gets the same weights whichever subset of layers a rank builds (pipeline stages build only theirs)."""
    return _mix(int(seed), zlib.crc32(name.encode())) >> 1


def _mix(seed: int, block: int) -> int:
    # splitmix64 of (seed, block): consecutive blocks and seeds give unrelated generator seeds.
    z = (seed * 0x9E3779B97F4A7C15 + (block + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _block(seed: int, k: int, nrows: int, cols: int, init_method: InitMethod) -> torch.Tensor:
    g = torch.Generator().manual_seed(_mix(seed, k))
    out = torch.empty(nrows, cols, dtype=torch.float32)
    init_method(out, g)
    return out


@torch.no_grad()
def init_shard_(shard: torch.Tensor, full_shape: tuple[int, int], partition_dim: int, rank: int, world: int,
                seed: int, init_method: InitMethod, real_rows: int | None = None) -> torch.Tensor:
    """Fill ``shard`` with block ``rank`` of ``world`` (along ``partition_dim``) of the seed-defined full weight.

    Args:
        shard: the ``[rows / world, cols]`` (dim 0) or ``[rows, cols / world]`` (dim 1) tensor to fill, any float
            dtype and device; left untouched on the meta device.
        full_shape: ``(rows, cols)`` of the full weight (rows including padding).
        partition_dim: 0 (contiguous blocks of rows) or 1 (of columns).
        rank, world: which block, of how many.
        seed: the weight's seed.
        init_method: ``init_method(tensor, generator)``, see the module docstring.
        real_rows: rows at and past this index are zeros (vocab padding); default ``rows``.

    Returns:
        ``shard``.

    Raises:
        ValueError: a shard shape that is not the block of ``full_shape``, ``partition_dim`` not 0/1, or
            ``real_rows`` outside ``0..rows``.
    """
    rows, cols = full_shape
    real_rows = rows if real_rows is None else real_rows
    if partition_dim not in (0, 1):
        raise ValueError(f"init_shard_: partition_dim must be 0 or 1, got {partition_dim}")
    if not 0 <= real_rows <= rows:
        raise ValueError(f"init_shard_: real_rows must be in 0..{rows}, got {real_rows}")
    expected = (rows // world, cols) if partition_dim == 0 else (rows, cols // world)
    if (rows, cols)[partition_dim] % world or tuple(shard.shape) != expected:
        raise ValueError(f"init_shard_: shard has shape {tuple(shard.shape)}, expected {expected} (block {rank} of "
                         f"{world} of {full_shape} along dim {partition_dim})")
    if shard.device.type == "meta":
        return shard
    if partition_dim == 0:
        r0, r1 = rank * expected[0], (rank + 1) * expected[0]
        c0, c1 = 0, cols
    else:
        r0, r1 = 0, rows
        c0, c1 = rank * expected[1], (rank + 1) * expected[1]
    shard.zero_()
    B = INIT_BLOCK_ROWS
    for k in range(r0 // B, (min(r1, real_rows) + B - 1) // B):
        lo, hi = k * B, min((k + 1) * B, real_rows)
        block = _block(seed, k, hi - lo, cols, init_method)
        a, b = max(lo, r0), min(hi, r1)
        if a < b:
            shard[a - r0:b - r0].copy_(block[a - lo:b - lo, c0:c1])
    return shard


def full_weight(full_shape: tuple[int, int], seed: int, init_method: InitMethod,
                real_rows: int | None = None) -> torch.Tensor:
    """The whole seed-defined weight as a CPU fp32 tensor (what a single-process model holds)."""
    return init_shard_(torch.empty(full_shape), full_shape, 0, 0, 1, seed, init_method, real_rows)
