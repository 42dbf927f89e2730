"""``python -m costmodel [--static ... | --measure-peers FILE ...]``: ``megakernels bench`` with the cost model's modes,
from a checkout where the tool is not installed (a lent GPU machine: the repository on ``PYTHONPATH``)."""

from __future__ import annotations

import argparse
import sys

from costmodel.cli import modes
from megakernels.bench import cli


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m costmodel",
        description=sys.modules["costmodel.cli"].__doc__.replace("``", ""),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    cli.configure(parser, modes())
    ns = parser.parse_args(sys.argv[1:] if argv is None else argv)
    return ns._run(ns)


if __name__ == "__main__":
    raise SystemExit(main())
