"""``python -m megakernels.bench [--ops ...]``: ``megakernels bench`` of the kernel library alone (no trainer: no
``--e2e`` or ``--plan-check``)."""

from __future__ import annotations

import argparse
import sys

from megakernels.bench import cli


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m megakernels.bench",
        description=cli.__doc__.replace("``", ""),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    cli.configure(parser)
    ns = parser.parse_args(sys.argv[1:] if argv is None else argv)
    return ns._run(ns)


if __name__ == "__main__":
    raise SystemExit(main())
