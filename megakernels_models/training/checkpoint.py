"""Distributed checkpoints with torch.distributed.checkpoint (DCP): saved at one layout, loadable at any other.

Every tensor is saved in the coordinates of the *full, unpadded* model, under its global name (``layers.7.mlp.fc1.
weight``, whatever pipeline stage or local index holds it): a tensor-parallel shard is a chunk of its full tensor
at its offset (its marks in ``megakernels.parallel.params``: partition dim and stride; a padded vocabulary keeps
only its real rows), a replicated tensor is saved whole (once: DCP de-duplicates the copies of data-parallel
replicas, of the tied embedding on the first and last stage, ...). Loading asks for the chunks of the *current* layout,
and DCP reads whichever saved
chunks overlap them — so a checkpoint written at (tp, pp, dp) = (2, 2, 2) loads at (1, 1, 1) or (4, 1, 2).

What is saved: the model; the optimizer's fp32 masters (16-bit training) and Adam moments (Muon's momentum for the
matrices it steps) in the same per-parameter coordinates (ZeRO-1 shards are completed over the data-parallel group
first, so the checkpoint does not depend on dp either) and its step count; the loss scaler; the step (the data
position and the learning rate follow from it); each rank's RNG states (restored only at the same layout); the model
configuration (a mismatch is refused).

Atomicity, ``latest``, keep-K pruning and incremental checkpoints' shared files: ``checkpoint_store``. Asynchronous
and incremental saving by the trainer: ``checkpointer``. DIR must be one directory visible to every rank (a shared
file system across nodes).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import sys
import warnings

import torch
import torch.distributed as dist

import megakernels.parallel as mpu
from megakernels.parallel import fsdp
from megakernels.parallel import params as marks
from megakernels.parallel.init import shard_pieces
from megakernels_models.models.config import ModelConfig
from megakernels_models.training import checkpoint_store as store
from megakernels_models.training import checkpoint_verify as verified
from megakernels_models.training import syncpoints
from megakernels_models.training.checkpoint_verify import CheckpointError

LATEST = store.LATEST
GENERATION_CONFIG = store.GENERATION_CONFIG


# ---- tensors in full-model coordinates ----------------------------------------------------------------------


# Model state that is not a parameter but is checkpointed (replicated, no optimizer state): the MoE routers'
# auxiliary-loss-free balancing bias.
CHECKPOINTED_BUFFERS = ("expert_bias",)


def _global_name(chunk, name: str) -> str:
    m = re.match(r"layers\.(\d+)\.(.*)", name)
    if m:
        return f"layers.{chunk.layers[int(m.group(1))].layer_number}.{m.group(2)}"
    if name.startswith("output_embedding."):
        return "embedding.word." + name[len("output_embedding.") :]
    return name


def global_parameters(chunks) -> list[tuple[str, torch.nn.Parameter]]:
    """``(global name, param)`` of this rank's model chunks: layer ``i`` of the whole model is ``layers.i``
    whatever its index in the chunk; the last stage's copy of the tied embedding is ``embedding.word.weight``."""
    return [(_global_name(chunk, name), p) for chunk in chunks for name, p in chunk.named_parameters()]


def global_buffers(chunks) -> list[tuple[str, torch.Tensor]]:
    """``(global name, buffer)`` of the checkpointed buffers (``CHECKPOINTED_BUFFERS``) of this rank's chunks."""
    return [
        (_global_name(chunk, name), b)
        for chunk in chunks
        for name, b in chunk.named_buffers()
        if name.rpartition(".")[2] in CHECKPOINTED_BUFFERS
    ]


def _aliases(chunks) -> list[tuple[int, int]]:
    """``(i, j)`` indices into ``global_parameters(chunks)``: param i has the same global name as a later param j
    of this rank — the V placement's two copies of a tied embedding on pipeline rank 0. A state dict keeps the
    later one under the name (the same values: both copies take identical steps); after a load, i copies j."""
    last, out = {}, []
    names = [name for name, _ in global_parameters(chunks)]
    for j, name in enumerate(names):
        last[name] = j
    for i, name in enumerate(names):
        if last[name] != i:
            out.append((i, last[name]))
    return out


def _entries(chunks) -> list[tuple[str, torch.nn.Parameter, int | None]]:
    """``(global name, param, expert index)`` of every tensor a checkpoint stores for this rank: one per parameter
    (``global_parameters``), and for the stacked weights of mixture-of-experts layers one per local expert, named by
    its global index (``...experts.fc1`` row ``i`` -> ``...experts.<first + i>.fc1``), so expert parallelism does not
    change the names."""
    out = []
    for name, p in global_parameters(chunks):
        rec = marks.info(p)
        if not rec.expert_parallel:
            out.append((name, p, None))
            continue
        head, _, leaf = name.rpartition(".")
        out += [(f"{head}.{rec.expert_first + i}.{leaf}", p, i) for i in range(p.shape[0])]
    return out


def _select(t: torch.Tensor, index: int | None) -> torch.Tensor:
    return t if index is None else t[index]


def _chunks_of(p: torch.Tensor, shape=None) -> tuple[list[int], int, list[list[tuple[int, int, int]]]]:
    """(full shape, partition dim, per TP rank the pieces ``(full offset, local offset, size)`` it declares along
    that dim) of a parameter (or, ``shape`` given, of one expert's matrix of it), from its marks
    (``megakernels.parallel.params``): a replicated parameter is one piece; a sharded one is its
    ``init.shard_pieces``, cut to the first ``real_size`` entries. Of ``replicas`` ranks holding the same block only
    the first declares it (they hold the same values; ``_sync_replicas``)."""
    rec = marks.info(p)
    shape = p.shape if shape is None else shape
    tp = mpu.tp_size() if rec.tensor_parallel else 1
    dim = rec.partition_dim
    n = shape[dim]
    full_len = n * tp // rec.replicas
    full = list(shape)
    full[dim] = full_len if rec.real_size is None else rec.real_size
    pieces = []
    for t in range(tp):
        mine = []
        if t % rec.replicas == 0:
            for full_off, local_off, size in shard_pieces(full_len, t, tp, rec.partition_stride, rec.replicas):
                size = max(0, min(full_off + size, full[dim]) - full_off)
                if size:
                    mine.append((full_off, local_off, size))
        pieces.append(mine)
    return full, dim, pieces


def _sharded(local: torch.Tensor, p: torch.Tensor):
    """``local`` (shaped like ``p``) as the part of the full tensor this rank holds: a plain tensor when it is the
    whole tensor, else a ShardedTensor describing every TP rank's pieces."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata
    from torch.distributed._shard.sharded_tensor.metadata import TensorProperties

    full, dim, pieces = _chunks_of(p, local.shape)
    if len(pieces) == 1:  # one rank holds it all (its pieces are the whole dimension, in order)
        return local.narrow(dim, 0, full[dim])
    tp_rank = mpu.tp_rank()
    ranks = dist.get_process_group_ranks(mpu.tp_group())
    metas, shards = [], []
    for t, mine in enumerate(pieces):
        for full_off, local_off, size in mine:
            offsets, sizes = [0] * len(full), list(full)
            offsets[dim], sizes[dim] = full_off, size
            meta = ShardMetadata(offsets, sizes, f"rank:{ranks[t]}/{local.device}")
            metas.append(meta)
            if t == tp_rank:
                shards.append(Shard(local.narrow(dim, local_off, size), meta))
    md = ShardedTensorMetadata(metas, torch.Size(full), TensorProperties(dtype=local.dtype))
    return ShardedTensor._init_from_local_shards_and_global_metadata(shards, md)


def _sync_replicas(pairs) -> None:
    """After loading: copy each replicated block (``params`` replicas > 1) from the first rank of its replica group,
    which loaded it, to the others. ``pairs``: ``(param, tensor shaped like it)``."""
    for p, t in pairs:
        c = marks.info(p).replicas
        if c > 1 and mpu.tp_size() > 1:
            group = mpu.tp_replica_group(c)
            dist.broadcast(t, dist.get_global_rank(group, 0), group=group)


def _templates(params: list[torch.Tensor], opt) -> list[dict[str, torch.Tensor]]:
    """Zero optimizer states shaped like each param, those ``opt.state_names`` lists: Adam moments or Muon's
    momentum, plus an fp32 master for 16-bit params."""
    return [{k: torch.zeros(p.shape, dtype=torch.float32, device=p.device) for k in opt.state_names(p)} for p in params]


def _holds_states_of(keys: set[str], chunks, opt) -> bool:
    """Whether a checkpoint's entries ``keys`` hold every moment ``opt`` keeps (a checkpoint of the other optimizer,
    AdamW's for a Muon run or back, does not)."""
    return all(
        f"optimizer.{k}.{name}" in keys for name, p, _ in _entries(chunks) for k in opt.state_names(p) if k != "master"
    )


def _optimizer_states(opt, params: list[torch.Tensor]) -> tuple[list[dict[str, torch.Tensor]], int]:
    """Complete per-parameter optimizer states for every param (under ZeRO-1 each rank has only its pieces, the
    rest zeros, so a sum over the group the states are sharded over completes them: the data- and context-parallel
    ranks, or for experts the ranks holding the same experts) and the AdamW step count."""
    got, step = opt.param_state()
    out = [got.get(p) or t for p, t in zip(params, _templates(params, opt))]
    if opt.distributed or opt.fsdp:  # ZeRO-1 pieces, or FSDP shards
        steps = torch.tensor([float(step)], device=params[0].device)
        for expert, group in ((False, mpu.dp_cp_group()), (True, mpu.expert_dp_group())):
            flat = [t for p, st in zip(params, out) if marks.is_expert_parallel(p) == expert for t in st.values()]
            if flat and dist.get_world_size(group) > 1:
                buf = torch._utils._flatten_dense_tensors(flat)
                dist.all_reduce(buf, group=group)
                for t, r in zip(flat, torch._utils._unflatten_dense_tensors(buf, flat)):
                    t.copy_(r)
        if mpu.dp_cp_size() > 1:
            dist.all_reduce(steps, op=dist.ReduceOp.MAX, group=mpu.dp_cp_group())
        step = int(steps.item())
    return out, step


def _plain_params(chunks, load: bool) -> dict[int, torch.Tensor]:
    """The FSDP-sharded parameters (``megakernels.parallel.fsdp``) as plain TP-local tensors, by ``id``: gathered
    over their data-parallel mesh to save (collective), or empty ones to load into (``fsdp.assign_full`` then keeps
    this rank's shard). A checkpoint thus never depends on FSDP's sharding."""
    out = {}
    for _, p in global_parameters(chunks):
        if fsdp.is_fsdp_param(p):
            # to load: zeros, as the rows a checkpoint does not hold (a padded vocabulary's) must stay
            out[id(p)] = torch.zeros(p.shape, dtype=p.dtype, device=p.device) if load else fsdp.full(p)
    return out


def _state_dict(chunks, opt, states=None, stage=None, plain=None) -> dict:
    """Every tensor under its global name, as ``_sharded`` views (of ``stage(key, tensor)``'s copies when given);
    ``states`` (per param, as ``global_parameters``) are stored beside the model as ``optimizer.<state>.<name>``;
    ``plain``: ``_plain_params``' tensors standing for FSDP parameters."""
    state_of = {} if states is None else {id(p): st for (_, p), st in zip(global_parameters(chunks), states)}
    stage = stage or (lambda key, t: t)
    plain = plain or {}
    sd = {}
    for name, p, index in _entries(chunks):
        value = plain.get(id(p), p.detach())
        sd[f"model.{name}"] = _sharded(stage(f"model.{name}", _select(value, index)), p)
        for k, t in state_of.get(id(p), {}).items():
            sd[f"optimizer.{k}.{name}"] = _sharded(stage(f"optimizer.{k}.{name}", _select(t, index)), p)
    for name, b in global_buffers(chunks):
        sd[f"model.{name}"] = stage(f"model.{name}", b)
    return sd


def _rng_state() -> dict:
    out = {"cpu": torch.get_rng_state(), "tracker": mpu.get_rng_tracker().get_states()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state()
    return out


def _layout() -> dict:
    return {
        "tp": mpu.tp_size(),
        "pp": mpu.pp_size(),
        "dp": mpu.dp_size(),
        "cp": mpu.cp_size(),
        "vpp": mpu.vpp_size(),
        "placement": mpu.pipeline_placement(),
        "world": dist.get_world_size(),
    }


# ---- save ---------------------------------------------------------------------------------------------------


def __getattr__(name: str):
    """``Writer`` (``checkpoint_writer``, which imports DCP) on first use."""
    if name == "Writer":
        from megakernels_models.training.checkpoint_writer import Writer

        return Writer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def state_to_save(step: int, chunks, opt, config: ModelConfig, train_config: dict | None = None, stage=None) -> dict:
    """The checkpoint's state dict for this rank (collective: ZeRO-1 states are completed over their group).
    ``stage(name, tensor) -> tensor`` (optional) replaces each model / optimizer tensor by a copy (host staging for
    an asynchronous save) before it is described as a shard."""
    params = [p for _, p in global_parameters(chunks)]
    states, opt_step = _optimizer_states(opt, params)
    sd = _state_dict(chunks, opt, states, stage, _plain_params(chunks, load=False))
    sd[f"rng.rank{dist.get_rank()}"] = _rng_state()
    # One JSON string (DCP would flatten a dict into one entry per leaf).
    sd["meta"] = json.dumps(
        {
            "step": int(step),
            "optimizer_step": opt_step,
            "config": dataclasses.asdict(config),
            "layout": _layout(),
            "train_config": train_config,
            "loss_scaler": opt.loss_scaler.state_dict() if opt.loss_scaler is not None else None,
            "optimizer": getattr(opt, "optimizer", "adamw"),
        }
    )
    return sd


def describe_error(e: BaseException) -> str:
    """One line for a failed save's error; for DCP's (raised on every rank), each failing rank's own error."""
    api = sys.modules.get("torch.distributed.checkpoint.api")  # not imported: no DCP error can have happened
    if api is not None and isinstance(e, api.CheckpointException):
        return "; ".join(f"rank {r}: {type(exc).__name__}: {exc}" for r, (exc, _) in sorted(e.failures.items()))
    return f"{type(e).__name__}: {e}"


def _chunk_bytes(sd: dict) -> dict[tuple, int]:
    """``{(entry, chunk offsets): bytes}`` that this rank would write of ``sd``."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    out = {}
    for key, value in sd.items():
        if isinstance(value, ShardedTensor):
            for shard in value.local_shards():
                out[(key, tuple(shard.metadata.shard_offsets))] = shard.tensor.numel() * shard.tensor.element_size()
        elif isinstance(value, torch.Tensor):
            out[(key, ())] = value.numel() * value.element_size()
        elif isinstance(value, str):
            out[(key, ())] = len(value.encode())
        else:
            out[(key, ())] = 4096  # a pickled object (RNG states): small
    return out


def bytes_to_write(sd: dict, group=None) -> int:
    """The bytes a save of ``sd`` writes over all ranks (collective): each chunk once, as DCP de-duplicates the
    copies that replicas hold."""
    views = [None] * dist.get_world_size(group)
    dist.all_gather_object(views, _chunk_bytes(sd), group=group)
    merged = {}
    for v in views:
        merged.update(v)
    return sum(merged.values())


SPACE_MARGIN = 1.05  # DCP's headers and the metadata, over the tensors' bytes


def write(
    sd: dict,
    save_dir: str,
    step: int,
    *,
    keep: int = 3,
    train_config: dict | None = None,
    group=None,
    reuse=(),
    previous: str | None = None,
) -> str:
    """Write ``sd`` as the checkpoint of ``step`` and commit it (``checkpoint_store``: temporary directory, DCP,
    digests, rename, ``latest``, pruning). Every rank calls it, with the same ``reuse`` (entries left out of ``sd``
    that the checkpoint ``previous`` holds unchanged). ``group``: the process group DCP coordinates over (default:
    the world's). Returns the checkpoint's path.

    Before writing, the free space of ``save_dir`` is checked against the bytes the save needs; a save that fails
    (there, in DCP's write on any rank, or in the commit) removes its temporary directory, so the space it took is
    free for the next try, and the previous checkpoint stays ``latest``.

    Raises:
        CheckpointError: not enough free space, or the save failed (one line: what failed on which rank).
    """
    import torch.distributed.checkpoint as dcp  # here, not at import: DCP costs ~0.8 s (it imports sympy)
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

    from megakernels_models.training.checkpoint_writer import Writer

    final = os.path.join(save_dir, store.step_name(step))
    tmp = os.path.join(save_dir, f".tmp-{store.step_name(step)}")
    rank0 = dist.get_rank() == 0
    src = dist.get_global_rank(group, 0) if group is not None else 0
    need = bytes_to_write(sd, group)

    def agree(fn) -> None:  # rank 0 acts; every rank learns whether it failed
        failed = [None]
        if rank0:
            try:
                failed[0] = fn()
            except Exception as e:  # noqa: BLE001 - every rank must learn that it failed
                failed[0] = f"{type(e).__name__}: {e}"
        dist.broadcast_object_list(failed, src=src, group=group)
        if failed[0] is not None:
            if rank0:
                shutil.rmtree(tmp, ignore_errors=True)
            syncpoints.note(f"checkpoint-failed-{step:08d}")
            raise CheckpointError(f"the checkpoint of step {step} was not saved: {failed[0]}")

    def prepare() -> str | None:
        os.makedirs(save_dir, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # the remains of a save killed before it could clean up
        free = shutil.disk_usage(save_dir).free
        if free < need * SPACE_MARGIN:
            return (
                f"not enough disk space in {save_dir}: it needs about {need / 2**20:.1f} MiB, "
                f"{free / 2**20:.1f} MiB are free"
            )
        os.makedirs(tmp)
        return None

    agree(prepare)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # ShardedTensor's deprecation notice (see module notes)
            dcp.save(sd, storage_writer=Writer(tmp, step, reuse, previous), process_group=group)
    except (Exception, CheckpointException) as e:  # DCP raises on every rank when any rank's write failed
        error = describe_error(e)
        agree(lambda: error)
    # DCP returned: every rank's files, the digests and the metadata are written

    def commit() -> None:
        store.commit(tmp, final, error=CheckpointError)
        _keep_tokenizer(save_dir, (train_config or {}).get("tokenizer"))
        _keep_generation_config(save_dir, (train_config or {}).get("load"))
        store.prune(save_dir, keep)

    agree(commit)
    return final


def save(
    save_dir: str, step: int, chunks, opt, config: ModelConfig, keep: int = 3, train_config: dict | None = None
) -> str:
    """Write the checkpoint of ``step`` to ``save_dir/step-<step>`` atomically (see the module docstring); every
    rank calls it; ``train_config`` (the run's resolved settings) is stored with the metadata. Returns the
    checkpoint's path. (The trainer's ``Checkpointer`` adds asynchronous and incremental saving.)"""
    return write(
        state_to_save(step, chunks, opt, config, train_config), save_dir, step, keep=keep, train_config=train_config
    )


def _keep_tokenizer(save_dir: str, spec: str | None) -> None:
    """A run with a HuggingFace tokenizer keeps its ``tokenizer.json`` beside its checkpoints (generation and
    conversion find it there), with the rest of its directory's tokenizer files (special tokens, chat template)
    when the tokenizer is a directory or a file named ``tokenizer.json`` in one."""
    if not spec or not spec.startswith("hf:"):
        return
    src = spec[3:]
    if os.path.isdir(src) or os.path.basename(src) == "tokenizer.json":
        store.copy_tokenizer(src if os.path.isdir(src) else os.path.dirname(src) or ".", save_dir)
    else:  # a tokenizer file of its own name (data/web.tokenizer.json): that file alone
        store.copy_beside(src, os.path.join(save_dir, "tokenizer.json"))


def _keep_generation_config(save_dir: str, load_dir: str | None) -> None:
    """A run resumed from a directory holding ``generation_config.json`` (a converted model's special tokens) keeps
    it beside its own checkpoints (export and generation read it there)."""
    if load_dir:
        store.copy_beside(os.path.join(load_dir, GENERATION_CONFIG), os.path.join(save_dir, GENERATION_CONFIG))


# ---- load ---------------------------------------------------------------------------------------------------


def find_latest(load_dir: str) -> str | None:
    """``checkpoint_store.find_latest``: the checkpoint to resume from, None when there is none yet.

    Raises:
        CheckpointError: ``load_dir`` exists and is not a directory.
    """
    return store.find_latest(load_dir, error=CheckpointError)


def read_latest(load_dir: str) -> str:
    """The newest checkpoint in ``load_dir`` that verifies (``checkpoint_verify.select``: a damaged newer one is
    reported and skipped), for readers that need a checkpoint (evaluation, conversion, generation). Collective when
    a process group is initialised.

    Raises:
        CheckpointError: no such directory, no complete checkpoint in it, or none that verifies.
    """
    if not os.path.isdir(load_dir):
        raise CheckpointError(f"--load {load_dir!r}: no such directory")
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    path = verified.select(load_dir, lambda line: rank0 and print(f"megakernels: {line}", file=sys.stderr))
    if path is None:
        raise CheckpointError(
            f"--load {load_dir!r}: no complete checkpoint (step-N directory with DCP's {store.METADATA}) in it"
        )
    return path


def _config_mismatch(saved: dict, config: ModelConfig) -> list[str]:
    now = dataclasses.asdict(config)
    try:  # a checkpoint from before a field existed holds that field's default
        saved = dataclasses.asdict(ModelConfig(**{k: v for k, v in saved.items() if k in now}))
    except (TypeError, ValueError):
        pass
    skip = {"dropout", "attention_dropout"}  # training-time settings, not the weights' shapes
    if now.get("position_embedding") != "learned":  # no position table: the sample length is a training setting
        skip.add("seq_length")
    return [
        f"{k}: checkpoint {saved.get(k)!r}, now {v!r}" for k, v in now.items() if k not in skip and saved.get(k) != v
    ]


def read_meta(path: str) -> dict:
    """The checkpoint's metadata: ``step``, ``optimizer_step``, ``config`` (ModelConfig fields), ``layout``,
    ``loss_scaler``. Reads only that entry; works with or without a process group."""
    import torch.distributed.checkpoint as dcp  # here, not at import: DCP costs ~0.8 s (it imports sympy)
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

    verified.read_metadata(path)  # a clear error for a missing or damaged metadata file
    sd = {"meta": ""}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(sd, checkpoint_id=path, no_dist=not dist.is_initialized())
        meta = json.loads(sd["meta"])
        if not isinstance(meta, dict) or not {"step", "config"} <= meta.keys():
            raise ValueError("not the checkpoint's meta record")
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - a damaged entry fails in many ways
        raise CheckpointError(
            f"checkpoint {path}: its 'meta' entry is unreadable ({describe_error(e)[:200]})"
        ) from None
    return meta


def saved_keys(path: str) -> set[str]:
    """The entries of the checkpoint at ``path`` (``model.<name>``, ``optimizer.<state>.<name>``, ...)."""
    return set(verified.read_metadata(path).state_dict_metadata)


def load(path: str, chunks, opt, config: ModelConfig) -> int:
    """Load the checkpoint at ``path`` into this rank's chunks and optimizer (any saved layout); returns the step
    it was saved at. Every rank calls it. A checkpoint without optimizer state (converted from another format)
    or ``opt=None`` loads the model only; the optimizer then starts fresh.

    Raises:
        CheckpointError: the checkpoint belongs to another model configuration (naming the fields), or lacks a
            parameter of the model.
    """
    import torch.distributed.checkpoint as dcp  # here, not at import: DCP costs ~0.8 s (it imports sympy)
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

    meta = read_meta(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        bad = _config_mismatch(meta["config"], config)
        if bad:
            raise CheckpointError(f"checkpoint {path} is for another model: " + "; ".join(bad))
        keys = saved_keys(path)
        names = [n for n, _, _ in _entries(chunks)] + [n for n, _ in global_buffers(chunks)]
        missing = [f"model.{n}" for n in names if f"model.{n}" not in keys]
        if missing:
            raise CheckpointError(
                f"checkpoint {path} lacks {', '.join(missing[:5])}"
                + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            )
        params = [p for _, p in global_parameters(chunks)]
        with_optimizer = opt is not None and any(k.startswith("optimizer.") for k in keys)
        if with_optimizer and not _holds_states_of(keys, chunks, opt):
            with_optimizer = False  # another optimizer's state: the model loads, this optimizer starts fresh
            if dist.get_rank() == 0:
                print(
                    f"megakernels: checkpoint {path} holds the state of another optimizer than "
                    f"{getattr(opt, 'optimizer', 'adamw')!r}: loading the model only, the optimizer starts fresh",
                    file=sys.stderr,
                    flush=True,
                )
        targets = _templates(params, opt) if with_optimizer else None
        plain = _plain_params(chunks, load=True)
        sd = _state_dict(chunks, opt, targets, plain=plain)
        rng_key = f"rng.rank{dist.get_rank()}"
        same_layout = {"cp": 1, "placement": "interleaved", **meta["layout"]} == _layout() and any(
            k.startswith(rng_key + ".") for k in keys
        )
        if same_layout:
            sd[rng_key] = _rng_state()
        try:
            dcp.load(sd, checkpoint_id=path)
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP raises on every rank
            raise CheckpointError(f"loading checkpoint {path} failed: {describe_error(e)[:500]}") from None
    _sync_replicas(
        [(p, plain.get(id(p), p.data)) for p in params]
        + ([(p, t) for p, st in zip(params, targets) for t in st.values()] if targets else [])
    )
    with torch.no_grad():
        for i, j in _aliases(chunks):  # a tied embedding's copies on one rank: the state dict loaded the later one
            plain.get(id(params[i]), params[i].data).copy_(plain.get(id(params[j]), params[j].data))
            if targets:
                for k, t in targets[i].items():
                    t.copy_(targets[j][k])
    for p in params:
        if id(p) in plain:
            fsdp.assign_full(p, plain[id(p)])
    if opt is not None:
        # Without saved state: masters from the loaded params, moments fresh (step 0).
        states = zip(params, targets) if with_optimizer else ((p, {}) for p in params)
        opt.load_param_state(dict(states), int(meta["optimizer_step"]) if with_optimizer else 0)
        if opt.loss_scaler is not None and meta["loss_scaler"] is not None:
            opt.loss_scaler.load_state_dict(meta["loss_scaler"])
    if same_layout:
        rng = sd[rng_key]
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng:
            torch.cuda.set_rng_state(rng["cuda"])
        mpu.get_rng_tracker().set_states(rng["tracker"])
    return int(meta["step"])
