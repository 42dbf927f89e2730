"""The cost model's modes of ``megakernels bench`` (entry-point group ``megakernels.bench``, registered by this
package's pyproject.toml), so a development checkout keeps one command:

    megakernels bench --static [--ops NAME,...] [--out DIR]
    megakernels bench --static --peer-csv FILE [--peer-path DIR] [--out DIR]
    megakernels bench --measure-peers FILE --device cuda [--out DIR]

``--static`` measures nothing: it compiles every shipped GPU kernel config as a launch gets it and prints the static
cost report (SASS, resources, a predicted fraction of the H200's ceiling; README.md), ``DIR/static.json`` with
--out. ``--static --peer-csv FILE`` predicts every row of a Liger-Kernel benchmark CSV with the same model (the
peer's kernels compiled for each row's GPU) and writes ``DIR/calibration.json`` (rows with published and predicted
ms, and a summary of the errors); ``--peer-path DIR`` is where the liger-kernel versions the rows name are installed
(``DIR/liger-kernel-<version>``; default ``~/.cache/megakernels/peers``). ``--measure-peers FILE`` measures
instead, on a GPU: at every shape of the CSV it times our kernels and the installed Liger-Kernel's and writes
``DIR/measured.csv`` in the same format (``peers.measure``), rows that ``--static --peer-csv`` reads back as
published ones.
"""

from __future__ import annotations

import os
import sys

from megakernels.bench.cli import OPS, Extension, resolve_ops


def _error(message: str) -> int:
    print(f"megakernels bench: error: {message}", file=sys.stderr)
    return 2


class Static(Extension):
    """``--static`` (the report) and ``--static --peer-csv`` (the calibration rows)."""

    dest = "static"
    alone = True

    def add_arguments(self, p) -> None:
        p.add_argument(
            "--static",
            action="store_true",
            help="the static cost report of the GPU kernels (compiles for sm_90, needs no GPU; DIR/static.json)",
        )
        p.add_argument(
            "--peer-csv",
            default=None,
            metavar="FILE",
            help="with --static: predict the rows of a Liger-Kernel benchmark CSV (DIR/calibration.json)",
        )
        p.add_argument(
            "--peer-path",
            default=None,
            metavar="DIR",
            help="where liger-kernel versions are installed: DIR/liger-kernel-<version> "
            "(default ~/.cache/megakernels/peers)",
        )

    def given(self, ns) -> bool:
        return ns.static or ns.peer_csv is not None or ns.peer_path is not None

    def prepare(self, ns):
        from costmodel import registry

        if not ns.static:
            flag = "--peer-csv" if ns.peer_csv is not None else "--peer-path"
            raise ValueError(
                f"{flag}: predicts a peer CSV's rows with --static; to measure them on a GPU, --measure-peers FILE"
            )
        if ns.peer_csv is not None and not os.path.exists(ns.peer_csv):
            raise ValueError(f"--peer-csv: no file {ns.peer_csv}")
        extra = tuple(dict.fromkeys(e.name.split(".")[0] for e in registry.entries()))
        return resolve_ops(ns.ops, False, extra)

    def run(self, ns, ops) -> int:
        if ns.peer_csv is not None:
            return predict_peer(ns.peer_csv, ns.peer_path, ns.out)
        return report(ops, ns.out)


class MeasurePeers(Extension):
    """``--measure-peers FILE``: ours and the installed peer timed at a CSV's shapes on this device."""

    dest = "measure_peers"
    alone = True

    def add_arguments(self, p) -> None:
        p.add_argument(
            "--measure-peers",
            default=None,
            metavar="FILE",
            help="time ours and the installed Liger-Kernel at the shapes of a Liger-Kernel benchmark CSV on "
            "--device (DIR/measured.csv, rows --static --peer-csv reads)",
        )

    def prepare(self, ns):
        from costmodel.peers import table

        if not os.path.exists(ns.measure_peers):
            raise ValueError(f"--measure-peers: no file {ns.measure_peers}")
        try:
            table.read_csv(ns.measure_peers)
        except ValueError as e:  # not a Liger-format CSV
            raise ValueError(f"--measure-peers: {e}") from None

    def run(self, ns, state) -> int:
        from costmodel.peers import measure

        res = measure.measure(ns.measure_peers, ns.device, repeats=3 if ns.quick else 20, warmup=1 if ns.quick else 3)
        for n in res["notes"]:
            print(f"note: {n}")
        print(f"{len(res['rows'])} rows measured on {res['gpu']}")
        if ns.out:
            os.makedirs(ns.out, exist_ok=True)
            path = os.path.join(ns.out, "measured.csv")
            measure.write_csv(path, res["rows"])
            print(f"wrote {path}")
        return 0 if res["rows"] else 1


def modes() -> list[Extension]:
    """The entry point: the cost model's modes of ``megakernels bench``."""
    return [Static(), MeasurePeers()]


def predict_peer(csv_path: str, peer_path: str | None, out: str | None) -> int:
    """``megakernels bench --static --peer-csv FILE``: the CSV's rows through the static model; 1 when no row could
    be modelled."""
    from costmodel.peers import command
    from megakernels.bench.common import write_json

    payload = command.run(csv_path, peer_path)
    s = payload["summary"]
    for name, st in [("overall", s["overall"]), *s["per_gpu"].items()]:
        if st["rows"]:
            print(
                f"{name}: {st['rows']} rows, median |error| {100 * st['median_abs_rel_error']:.1f}%, "
                f"p90 {100 * st['p90_abs_rel_error']:.1f}%"
            )
    for reason in s["not_modelled"]["reasons"]:
        print(f"not modelled: {reason}")
    path = write_json(out, "calibration.json", payload)
    if path:
        print(f"wrote {path}")
    return 0 if s["overall"]["rows"] else 1


def report(ops: list[str], out: str | None) -> int:
    """``megakernels bench --static``: the report for ``ops``; 1 when a kernel could not be analysed."""
    from costmodel import report as static_report
    from megakernels.bench.common import write_json

    rows = static_report.run(static_report.select(ops=None if set(ops) == set(OPS) else ops), jobs=os.cpu_count() or 1)
    failed = [r for r in rows if "error" in r]
    path = write_json(out, "static.json", static_report.payload(rows))
    if path:
        print(f"wrote {path}")
    if failed:
        print(
            f"megakernels bench --static: {len(failed)} of {len(rows)} kernels could not be analysed", file=sys.stderr
        )
    return 1 if failed else 0
