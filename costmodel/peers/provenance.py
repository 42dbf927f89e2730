"""Which source each group of rows of a Liger-format CSV measured, read from the peer's own history.

``python costmodel/peers/provenance.py --repo DIR CSV [CSV ...]`` (``DIR`` a clone of Liger-Kernel's repository,
the ``fetch`` of linkedin/Liger-Kernel). For every group of peer rows (kernel, named release, timestamp) it finds the
first commit of ``benchmark/data/all_benchmark_data.csv`` that holds the group's timestamp, and compares the kernel's
module at that commit with the module of the release the model uses for the group (``command.resolve_version``). A row
written by the same commit as a rewrite of its kernel ran that rewrite, whatever release the benchmark machine had
installed: such groups print ``DIFFERS`` with the releases whose module equals the commit's, and belong in
``drivers.SOURCE_RELEASE`` when the difference is in the timed code (a changed comment is not). Nothing is fitted."""

from __future__ import annotations

import argparse
import collections
import csv
import subprocess

from costmodel.peers import command, drivers


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repo", required=True, help="a clone of Liger-Kernel's repository")
    ap.add_argument("csv", nargs="+")
    args = ap.parse_args(argv)

    def git(*a: str) -> str:
        return subprocess.run(["git", "-C", args.repo, *a], capture_output=True, text=True, check=False).stdout

    def module(ref: str, path: str) -> str:
        return git("show", f"{ref}:src/liger_kernel/{path}")

    tags = [t for t in git("tag", "--sort=creatordate").split() if t.startswith("v")]
    groups: dict = collections.Counter()
    for f in args.csv:
        with open(f, newline="") as fh:
            for r in csv.DictReader(fh):
                if r["kernel_provider"].startswith("liger") and r["metric_name"] == "speed":
                    groups[(r["kernel_name"], r["liger_version"], r.get("timestamp", ""))] += 1
    for (kernel, version, stamp), n in sorted(groups.items()):
        path = drivers.MODULES.get(kernel)
        if path is None or not stamp:
            print(f"{kernel:28s} {version:7s} {stamp} ({n} rows): no module or no timestamp")
            continue
        log = git("log", "--format=%h %cs", "-S", stamp, "--", "benchmark/data/all_benchmark_data.csv").split("\n")
        log = [c for c in log if c]
        if not log:
            print(f"{kernel:28s} {version:7s} {stamp} ({n} rows): no commit holds the timestamp")
            continue
        commit = log[-1].split()[0]
        used = command.resolve_version(kernel, version)
        src = module(commit, path)
        same = src == module("v" + used, path)
        match = ", ".join(t for t in tags if module(t, path) == src) or "none"
        print(
            f"{kernel:28s} {version:7s} {stamp} ({n} rows): written by {log[-1]}, modelled with {used}: "
            f"{'same' if same else 'DIFFERS'} (releases with the commit's module: {match})"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
