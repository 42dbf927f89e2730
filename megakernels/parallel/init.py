"""Layout-independent weight initialisation: a seed defines the full weight; a rank generates only its shard.

docs/parallelism.md: the same seed gives the same model for every (tp, pp, dp). Initialising the full "master" weight on
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


def shard_pieces(
    full_len: int, rank: int, world: int, stride: int = 1, replicas: int = 1
) -> list[tuple[int, int, int]]:
    """``(full offset, local offset, length)`` of the pieces a rank holds along a partitioned dimension of
    ``full_len``: the dimension is ``stride`` equal segments (e.g. the gate and up halves of a packed SwiGLU
    projection), each cut into ``world / replicas`` blocks, and rank ``r`` holds block ``r // replicas`` of every
    segment (``replicas`` consecutive ranks share a block, e.g. a key/value head serving several query shards).

    Raises:
        ValueError: sizes that do not divide.
    """
    if world % replicas or full_len % (stride * (world // replicas)):
        raise ValueError(
            f"shard_pieces: {full_len} does not split into {stride} segment(s) of {world // replicas} "
            f"block(s) (world {world}, replicas {replicas})"
        )
    seg = full_len // stride
    blk = seg * replicas // world
    i = rank // replicas
    return [(j * seg + i * blk, j * blk, blk) for j in range(stride)]


@torch.no_grad()
def init_shard_(
    shard: torch.Tensor,
    full_shape: tuple[int, int],
    partition_dim: int,
    rank: int,
    world: int,
    seed: int,
    init_method: InitMethod,
    real_rows: int | None = None,
    stride: int = 1,
    replicas: int = 1,
) -> torch.Tensor:
    """Fill ``shard`` with rank ``rank``'s part (``shard_pieces`` along ``partition_dim``) of the seed-defined full
    weight: with the defaults, block ``rank`` of ``world``.

    Args:
        shard: the tensor to fill (``full_shape`` with the partitioned dim divided by ``world / replicas``), any
            float dtype and device; left untouched on the meta device.
        full_shape: ``(rows, cols)`` of the full weight (rows including padding).
        partition_dim: 0 (blocks of rows) or 1 (of columns).
        rank, world: whose part, of how many ranks.
        seed: the weight's seed.
        init_method: ``init_method(tensor, generator)``, see the module docstring.
        real_rows: rows at and past this index are zeros (vocab padding); default ``rows``.
        stride, replicas: see ``shard_pieces``.

    Returns:
        ``shard``.

    Raises:
        ValueError: a shard shape that is not the part of ``full_shape``, ``partition_dim`` not 0/1, or
            ``real_rows`` outside ``0..rows``.
    """
    rows, cols = full_shape
    real_rows = rows if real_rows is None else real_rows
    if partition_dim not in (0, 1):
        raise ValueError(f"init_shard_: partition_dim must be 0 or 1, got {partition_dim}")
    if not 0 <= real_rows <= rows:
        raise ValueError(f"init_shard_: real_rows must be in 0..{rows}, got {real_rows}")
    parts = world // replicas if world % replicas == 0 else 0
    expected = (rows // max(parts, 1), cols) if partition_dim == 0 else (rows, cols // max(parts, 1))
    if not parts or (rows, cols)[partition_dim] % (parts * stride) or tuple(shard.shape) != expected:
        raise ValueError(
            f"init_shard_: shard has shape {tuple(shard.shape)}, expected {expected} (part {rank} of "
            f"{world} of {full_shape} along dim {partition_dim}, stride {stride}, replicas {replicas})"
        )
    if shard.device.type == "meta":
        return shard
    shard.zero_()
    for full_off, local_off, n in shard_pieces((rows, cols)[partition_dim], rank, world, stride, replicas):
        if partition_dim == 0:
            _fill(
                shard[local_off : local_off + n],
                (full_off, full_off + n),
                (0, cols),
                cols,
                seed,
                init_method,
                real_rows,
            )
        else:
            _fill(
                shard[:, local_off : local_off + n],
                (0, rows),
                (full_off, full_off + n),
                cols,
                seed,
                init_method,
                real_rows,
            )
    return shard


def _fill(
    dst: torch.Tensor,
    row_range: tuple[int, int],
    col_range: tuple[int, int],
    cols: int,
    seed: int,
    init_method: InitMethod,
    real_rows: int,
) -> None:
    """Copy rows ``[r0, r1)`` and columns ``[c0, c1)`` of the full ``[.., cols]`` weight into ``dst``, generating
    only the blocks of rows they touch, one at a time."""
    (r0, r1), (c0, c1) = row_range, col_range
    B = INIT_BLOCK_ROWS
    for k in range(r0 // B, (min(r1, real_rows) + B - 1) // B):
        lo, hi = k * B, min((k + 1) * B, real_rows)
        block = _block(seed, k, hi - lo, cols, init_method)
        a, b = max(lo, r0), min(hi, r1)
        if a < b:
            dst[a - r0 : b - r0].copy_(block[a - lo : b - lo, c0:c1])


def full_weight(
    full_shape: tuple[int, int], seed: int, init_method: InitMethod, real_rows: int | None = None
) -> torch.Tensor:
    """The whole seed-defined weight as a CPU fp32 tensor (what a single-process model holds)."""
    return init_shard_(torch.empty(full_shape), full_shape, 0, 0, 1, seed, init_method, real_rows)
