"""The checkpoint writer (``checkpoint.write``): torch.distributed.checkpoint's file-system writer with the
sync point, the digests and the incremental entries of ``Writer``'s docstring. A module of its own so that
``checkpoint`` imports DCP (~0.8 s: it imports sympy) only when a checkpoint is written or read, not in every
process that trains."""

from __future__ import annotations

import dataclasses
import os

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import _StorageInfo as StorageInfo

from megakernels_models.training import checkpoint_verify as verified
from megakernels_models.training import syncpoints


@dataclasses.dataclass
class _Digested(StorageInfo):
    """A write result's storage info with the digest of its bytes, on its way to the coordinating rank."""

    digest: str | None = None


class Writer(dcp.FileSystemWriter):
    """DCP's file-system writer, with three additions: the ``checkpoint-write-<step>`` sync point (``syncpoints``)
    once this rank's data files are written and before the metadata commits the checkpoint; the digest of every
    byte range it wrote (``checkpoint_verify``), written as the checkpoint's digest table before the metadata; and
    the entries ``reuse`` (left out of the state dict being saved) taken from the checkpoint at ``previous``, their
    chunks pointing at the files that hold them (``checkpoint_store``: an incremental checkpoint)."""

    def __init__(self, path: str, step: int, reuse=(), previous: str | None = None):
        super().__init__(path)
        self._point = f"checkpoint-write-{step:08d}"
        self._reuse, self._previous = set(reuse), previous

    def write_data(self, plan, planner):
        done = super().write_data(plan, planner)
        results = done.wait()
        for i, r in enumerate(results):
            info = r.storage_data
            digest = verified.digest_of(str(self.path), info)
            results[i] = dataclasses.replace(
                r,
                storage_data=_Digested(
                    info.relative_path, info.offset, info.length, info.transform_descriptors, digest=digest
                ),
            )
        syncpoints.reach(self._point)
        out = torch.futures.Future()
        out.set_result(results)
        return out

    def finish(self, metadata, results):
        digests = {}
        plain = []
        for rank_results in results:
            out = []
            for r in rank_results:
                info = r.storage_data
                if isinstance(info, _Digested):
                    digests[verified.range_key(info.relative_path, info.offset, info.length)] = info.digest
                    info = StorageInfo(info.relative_path, info.offset, info.length, info.transform_descriptors)
                out.append(dataclasses.replace(r, storage_data=info))
            plain.append(out)
        results = plain
        if self._reuse:
            from torch.distributed.checkpoint.storage import WriteResult

            old = dcp.FileSystemReader(self._previous).read_metadata()
            here = os.path.basename(os.path.normpath(self._previous))
            for key in self._reuse:
                metadata.state_dict_metadata[key] = old.state_dict_metadata[key]
            moved = [
                WriteResult(
                    index=index,
                    size_in_bytes=info.length,
                    storage_data=dataclasses.replace(
                        info,
                        relative_path=info.relative_path
                        if info.relative_path.startswith("../")
                        else f"../{here}/{info.relative_path}",
                    ),
                )
                for index, info in old.storage_data.items()
                if index.fqn in self._reuse
            ]
            results = [*results, moved]
        # The digests are written before DCP's metadata, which commits the checkpoint: a complete checkpoint
        # always has them.
        verified.write_digests(str(self.path), digests, self._previous if self._reuse else None)
        super().finish(metadata, results)
