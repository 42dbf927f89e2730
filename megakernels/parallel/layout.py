"""The parallel layout: the degrees of a run (tp, cp, pp, vpp, ep, dp) over its world, and every rule they obey.

One object answers for the layout everywhere: ``megakernels train`` validates its flags with it before any process
starts, ``megakernels plan`` enumerates only the layouts it accepts, and ``megakernels.parallel.initialize`` builds
its groups from it. A rule is written once, here, with one message that names the settings involved and the sizes.

Three kinds of rules:

- the degrees among themselves and against the world (``ParallelLayout.build``): positive sizes, ``tp·cp·pp``
  dividing the world size, dp following from it (or matching it when given), ep dividing dp, vpp needing pp, the V
  placement (``placement="v"``, the zb-v schedule's: two chunks per rank, rank r holding stages r and 2·pp−1−r)
  needing pp and two chunks;
- the degrees against the model's shapes (``check_model`` with ``ModelShapes``): whole heads and key/value heads
  per tensor-parallel rank, the widths split over tp, the layers over pp·vpp, the sequence over cp (and tp with
  sequence parallelism), the experts over ep, and which parallelisms the model family supports at all;
- the degrees against the batch (``check_batch``): micro-batches × dp dividing the global batch, and the
  interleaved schedule's micro-batches a multiple of pp.

Rank order (Megatron's): tp innermost, then cp, then dp (of which ep is the inner part), then pp.
"""

from __future__ import annotations

import dataclasses

from megakernels.validation import positive_int


class LayoutError(ValueError):
    """A layout that breaks a rule (the message names the settings and the sizes)."""


# How the degrees are named in messages: as the library's arguments, or as the trainer's flags.
ARGUMENTS = {k: k for k in ("tp", "cp", "pp", "vpp", "ep", "dp", "fsdp")} | {
    "sp": "sequence_parallel",
    "placement": "placement='v'",
}
FLAGS = {k: f"--{k}" for k in ("tp", "cp", "pp", "vpp", "ep", "dp")} | {
    "sp": "--sequence-parallel",
    "fsdp": "--fsdp-degree",
    "placement": "--schedule zb-v",
}
PLACEMENTS = ("interleaved", "v")  # megakernels.parallel.pipeline.schedules.PLACEMENTS


@dataclasses.dataclass(frozen=True)
class ModelShapes:
    """What the layout rules need to know of a model (its family fills it in).

    ``tp_widths``: further ``(name, size)`` pairs the tensor-parallel ranks split (a vision encoder's widths);
    ``context_parallel`` / ``sequence_parallel``: None when the family supports them, else the rest of the sentence
    that refuses them, after ``--cp 2`` / ``--sequence-parallel`` (": ... (why)", " is not supported ...").
    """

    num_heads: int
    num_kv_heads: int
    ffn_hidden_size: int
    num_layers: int
    seq_length: int
    num_experts: int = 0
    attention_dropout: float = 0.0
    tp_widths: tuple[tuple[str, int], ...] = ()
    context_parallel: str | None = None  # None: supported; else why not
    sequence_parallel: str | None = None  # None: supported; else why not


@dataclasses.dataclass(frozen=True)
class ParallelLayout:
    """A validated layout; build it with ``ParallelLayout.build``. ``world_size = tp·cp·pp·dp``; ``vpp`` is None
    without virtual pipeline stages; ``placement`` where the virtual stages sit (``"interleaved"``: stage
    ``chunk·pp + rank``; ``"v"``: zb-v's two chunks per rank, stages r and ``2·pp−1−r`` on rank r); ``names`` says
    how messages name the degrees (``ARGUMENTS`` or ``FLAGS``)."""

    world_size: int
    tp: int = 1
    cp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1
    vpp: int | None = None
    sequence_parallel: bool = False
    fsdp: int | None = None  # FSDP's shard degree (dp·cp: ZeRO-2/3 over every data-parallel rank; less: HSDP)
    placement: str = "interleaved"
    source: str = "torch.distributed's world"
    names: dict = dataclasses.field(default_factory=lambda: ARGUMENTS, compare=False, repr=False)

    # ---- the degrees ----------------------------------------------------------------------------------------

    @classmethod
    def build(
        cls,
        world_size: int,
        *,
        tp: int = 1,
        cp: int = 1,
        pp: int = 1,
        ep: int = 1,
        vpp: int | None = None,
        dp: int | None = None,
        sequence_parallel: bool = False,
        fsdp: int | None = None,
        placement: str = "interleaved",
        source: str = "torch.distributed's world",
        names: dict = ARGUMENTS,
    ) -> ParallelLayout:
        """The layout of ``world_size`` ranks at these degrees; ``dp`` defaults to ``world_size // (tp·cp·pp)``.
        ``source`` says where the world size came from (for messages: ``--nproc or torchrun's WORLD_SIZE``).
        ``placement="v"`` (zb-v) takes ``vpp`` None or 2 and sets it to 2.

        Raises:
            LayoutError: a degree that is not a positive int, the world size not divisible by ``tp·cp·pp``, a
                given ``dp`` that does not match, ``vpp > 1`` without pipeline parallelism, ep not dividing dp, an
                unknown placement, the V placement without pipeline parallelism or with another ``vpp``.
        """
        n = names
        if placement not in PLACEMENTS:
            raise LayoutError(f"placement must be one of {', '.join(PLACEMENTS)}, got {placement!r}")
        tp, cp, pp, ep, vpp, dp = (
            positive_int(v, n[k], allow_none=k in ("vpp", "dp"), error=LayoutError)
            for k, v in (("tp", tp), ("cp", cp), ("pp", pp), ("ep", ep), ("vpp", vpp), ("dp", dp))
        )
        if placement == "v":
            if vpp not in (None, 2):
                raise LayoutError(
                    f"{n['placement']} places two model chunks on every pipeline rank (the V); {n['vpp']} {vpp} asks "
                    f"for {vpp}: leave {n['vpp']} out"
                )
            if pp == 1:
                raise LayoutError(
                    f"{n['placement']} needs pipeline parallelism ({n['pp']} > 1): its two model chunks per rank form "
                    "a V across the pipeline ranks"
                )
            vpp = 2
        if vpp is not None and vpp > 1 and pp == 1:
            raise LayoutError(f"{n['vpp']} {vpp} needs pipeline parallelism ({n['pp']} > 1)")
        model = tp * cp * pp
        if world_size % model:
            raise LayoutError(
                f"the world size {world_size} ({source}) is not divisible by {_product(n, tp=tp, cp=cp, pp=pp)}"
            )
        derived = world_size // model
        if dp is not None and dp != derived:
            raise LayoutError(
                f"{n['dp']} {dp} does not match world size / ({_names(n, cp > 1)}) = {world_size} / "
                f"{model} = {derived} (world size from {source}; leave {n['dp']} out and it follows "
                "the world)"
            )
        if derived % ep:
            raise LayoutError(
                f"{n['ep']} {ep} does not divide the data-parallel size {derived} (expert-parallel "
                "groups are carved out of the data-parallel ranks)"
            )
        if fsdp is not None:
            fsdp = positive_int(fsdp, n["fsdp"], error=LayoutError)
            ranks = derived * cp  # FSDP shards over the data- and context-parallel ranks, as gradients reduce
            if ranks % fsdp:
                raise LayoutError(
                    f"{n['fsdp']} {fsdp} does not divide the data-parallel ranks dp × cp = {derived} × "
                    f"{cp} = {ranks} (parameters are sharded over {fsdp} of them and replicated across the rest)"
                )
            experts = ranks // ep  # the ranks holding the same experts: theirs are sharded over min(fsdp, experts)
            if fsdp < experts and experts % fsdp:
                raise LayoutError(
                    f"{n['fsdp']} {fsdp} does not divide the experts' data-parallel ranks dp × cp / ep = {experts}"
                )
        return cls(
            world_size,
            tp=tp,
            cp=cp,
            pp=pp,
            dp=derived,
            ep=ep,
            vpp=vpp,
            sequence_parallel=sequence_parallel,
            fsdp=fsdp,
            placement=placement,
            source=source,
            names=names,
        )

    @property
    def model_parallel_size(self) -> int:
        return self.tp * self.cp * self.pp

    def rank_coordinates(self, rank: int) -> dict[str, int]:
        """``{"tp", "cp", "dp", "pp"}`` coordinates of a global rank in the rank order."""
        tp, cp, dp = self.tp, self.cp, self.dp
        return {"tp": rank % tp, "cp": (rank // tp) % cp, "dp": (rank // (tp * cp)) % dp, "pp": rank // (tp * cp * dp)}

    # ---- the model --------------------------------------------------------------------------------------------

    def check_model(self, m: ModelShapes) -> None:
        """The rules between the degrees and the model's shapes.

        Raises:
            LayoutError: the first broken rule.
        """
        problem = self.model_problem(m)
        if problem:
            raise LayoutError(problem)

    def model_problem(self, m: ModelShapes) -> str | None:
        """The first rule ``check_model`` finds broken, or None (for enumerating layouts without exceptions)."""
        n, tp, cp, pp, ep, sp = self.names, self.tp, self.cp, self.pp, self.ep, self.sequence_parallel
        if m.num_heads % tp:
            return f"{n['tp']} {tp} does not divide num_heads={m.num_heads} (each TP rank holds whole heads)"
        kv = m.num_kv_heads
        if kv % tp and tp % kv:
            return (
                f"{n['tp']} {tp} and num_kv_heads={kv}: the key/value heads must split evenly over the "
                "tensor-parallel ranks (num_kv_heads a multiple of tp) or be replicated on groups of ranks (tp a "
                "multiple of num_kv_heads)"
            )
        if cp > 1:
            if m.context_parallel is not None:
                return f"{n['cp']} {cp}{m.context_parallel}"
            if m.seq_length % (2 * cp * (tp if sp else 1)):
                rule = "2 × cp × tp" if sp else "2 × cp"
                return (
                    f"{n['cp']} {cp} needs seq_length={m.seq_length} divisible by {rule} (each rank holds two "
                    "equal chunks of every sequence)"
                )
            if m.attention_dropout > 0:
                return (
                    f"{n['cp']} {cp} with attention dropout {m.attention_dropout}: ring attention has no "
                    "attention dropout (set the dropout to 0)"
                )
        if sp and m.sequence_parallel is not None:
            return f"{n['sp']} {m.sequence_parallel}"
        if m.ffn_hidden_size % tp:
            return f"{n['tp']} {tp} does not divide ffn_hidden_size={m.ffn_hidden_size}"
        for name, size in m.tp_widths:
            if size % tp:
                return f"{n['tp']} {tp} does not divide {name}={size} (split over the tensor-parallel ranks)"
        vpp = self.vpp or 1
        if m.num_layers % (pp * vpp):
            rule = f"{n['pp']} × {n['vpp']} = {pp} × {vpp} = {pp * vpp}" if vpp > 1 else f"{n['pp']} {pp}"
            if self.placement == "v":
                rule = f"{n['placement']}'s two chunks per rank × {n['pp']} = 2 × {pp} = {2 * pp}"
            return f"{rule} does not divide num_layers={m.num_layers} (equal layers per stage)"
        if ep > 1 and not m.num_experts:
            return f"{n['ep']} {ep} needs a mixture-of-experts model (num_experts > 0)"
        if m.num_experts and m.num_experts % ep:
            return (
                f"{n['ep']} {ep} does not divide num_experts={m.num_experts} (each rank holds the same number of "
                "experts)"
            )
        tokens = m.seq_length // cp
        if m.num_experts and tp > 1 and tokens % tp:
            return (
                f"{n['tp']} {tp} must divide the tokens per rank ({tokens}) of a MoE model (each TP rank routes "
                "its share of the tokens)"
            )
        if sp and tokens % tp:
            what = f"seq_length={m.seq_length}" if cp == 1 else f"the tokens per rank, seq_length / cp = {tokens}"
            return f"{n['sp']} needs {n['tp']} {tp} to divide {what}"
        return None

    # ---- the batch --------------------------------------------------------------------------------------------

    def check_batch(
        self,
        micro_batch_size: int,
        global_batch_size: int,
        names: tuple[str, str] = ("--micro-batch-size", "--global-batch-size"),
    ) -> int:
        """The micro-batches per step of each data-parallel rank.

        Raises:
            LayoutError: the global batch not divisible by micro-batch × dp, or an interleaved schedule whose
                micro-batches are not a multiple of pp.
        """
        problem = self.batch_problem(micro_batch_size, global_batch_size, names)
        if problem:
            raise LayoutError(problem)
        return global_batch_size // (micro_batch_size * self.dp)

    def batch_problem(
        self,
        micro_batch_size: int,
        global_batch_size: int,
        names: tuple[str, str] = ("--micro-batch-size", "--global-batch-size"),
    ) -> str | None:
        n, dp, mbs, gbs = self.names, self.dp, micro_batch_size, global_batch_size
        if gbs % (mbs * dp):
            return (
                f"{names[1]} {gbs} is not divisible by {names[0]} × dp = {mbs} × {dp} = {mbs * dp} (dp = world "
                f"size {self.world_size} from {self.source} / {_names(ARGUMENTS, self.cp > 1)} "
                f"{self.model_parallel_size})"
            )
        m = gbs // (mbs * dp)
        vpp = self.vpp or 1
        if vpp > 1 and self.placement == "interleaved" and m % self.pp:
            return (
                f"the interleaved schedule ({n['vpp']} {vpp}) needs the number of micro-batches per step "
                f"(global / (micro × dp) = {m}) to be a multiple of {n['pp']} {self.pp}"
            )
        return None


def _names(n: dict, with_cp: bool) -> str:
    return " × ".join(n[k] for k in (("tp", "cp", "pp") if with_cp else ("tp", "pp")))


def _product(n: dict, **sizes) -> str:
    """``--tp × --pp = 2 × 1 = 2`` (cp shown only when it is > 1)."""
    keys = [k for k in sizes if k != "cp" or sizes["cp"] > 1]
    total = 1
    for k in keys:
        total *= sizes[k]
    return f"{' × '.join(n[k] for k in keys)} = {' × '.join(str(sizes[k]) for k in keys)} = {total}"
