"""The megakernels command: train, preprocess, convert, eval and bench (docs/training.md).

``megakernels train`` with no flags runs the embedded default: a tiny GPT on the Python standard library's sources
with the byte tokenizer on the CPU, a few minutes, the loss falling. Invalid flags are reported before any process
starts, with the rule that was broken, and exit with status 2; a failed rank exits with status 1 and its error.
"""

from __future__ import annotations

import argparse
import sys

from megakernels_models.arguments import ArgumentError, TrainArgs
from megakernels_models.settings import HelpFormatter, add_settings, given


class Parser(argparse.ArgumentParser):
    """argparse's parser, whose errors are one line (the usage of a command with a hundred flags buries the
    mistake); ``--help`` still prints everything."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _train_parser(sub) -> argparse.ArgumentParser:
    from megakernels_models.models.config import PRESETS

    p = sub.add_parser(
        "train",
        help="train a model (default: a tiny GPT on the Python stdlib, CPU)",
        description="Train a model on any tensor x pipeline x data-parallel layout. Without flags: "
        "a tiny GPT on the\nPython standard library's sources, byte tokenizer, CPU, a few minutes.\n\n"
        f"Presets: {', '.join(PRESETS)}.",
        formatter_class=HelpFormatter,
    )
    add_settings(p, TrainArgs)
    g = p.add_argument_group("configuration files")
    g.add_argument(
        "--config",
        metavar="FILE",
        default=None,
        help="YAML or JSON file of settings (names as the flags; "
        "'architecture:' for the model's fields); flags given here override it",
    )
    g.add_argument(
        "--print-config", action="store_true", help="print the resolved configuration (a file --config takes) and exit"
    )
    return p


def parse_train_args(argv: list[str]) -> TrainArgs:
    """``megakernels train`` flags -> ``TrainArgs`` (argparse errors exit with status 2)."""
    parser = Parser(prog="megakernels")
    sub = parser.add_subparsers(dest="command", required=True)
    _train_parser(sub)
    return _train_args(parser.parse_args(["train", *argv]))


def _train_args(ns: argparse.Namespace) -> TrainArgs:
    values = given(ns, TrainArgs)
    if getattr(ns, "config", None):
        from megakernels_models.config_file import load

        values = {**load(ns.config), **values}
    if values.get("preset") == "":
        values["preset"] = "none"
    return TrainArgs(**values)


def _run_train(ns: argparse.Namespace) -> int:
    from megakernels.parallel.launch import WorldFailed
    from megakernels_models.training.checkpoint import CheckpointError
    from megakernels_models.training.train import run

    args = None
    try:
        args = _train_args(ns)
        if ns.print_config:
            from megakernels_models.arguments import validate
            from megakernels_models.config_file import dump, resolved

            print(dump(resolved(args, validate(args, check_memory=False, check_outputs=False))), end="")
            return 0
        records = run(args)
    except (ArgumentError, CheckpointError) as e:
        print(f"megakernels train: error: {e}", file=sys.stderr)
        return 2
    except WorldFailed as e:
        print(f"megakernels train: a rank failed: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # a second Ctrl-C (the first stops after the step, saving), or one before training
        print(_interrupted(args.save if args is not None else getattr(ns, "save", None)), file=sys.stderr)
        return 130
    if records and not args.dry_run and records[-1].get("failed"):
        return 1  # the run said why (one line) as it stopped
    if records and not args.dry_run:
        first, last = records[0], records[-1]
        msg = (
            f"done: {len(records)} steps, loss {first['loss']:.4f} -> {last['loss']:.4f}, "
            f"{last['tokens_per_s']:.0f} tokens/s, {last['tflops_per_device']:.3g} TFLOP/s per device, "
            f"MFU {last['mfu']:.1%}"
        )
        if "val_loss" in last:
            msg += f", val loss {last['val_loss']:.4f} (ppl {last['val_ppl']:.2f})"
        print(msg)
        mem = dict(first.get("memory_per_param_bytes") or {})
        host = mem.pop("host", None)
        if mem:
            print(
                "memory per parameter (measured on the last rank): "
                + " + ".join(f"{k} {v:.2f}" for k, v in mem.items())
                + f" = {sum(mem.values()):.2f} bytes"
                + (f" on the device, {host:.2f} in host memory" if host is not None else "")
            )
    return 0


def _interrupted(save: str | None) -> str:
    """The line of a run ended by SIGINT before it could stop after a step: where it can resume from."""
    where = ""
    if save:
        from megakernels_models.training.checkpoint import CheckpointError, find_latest

        try:
            latest = find_latest(save)
        except (CheckpointError, OSError):
            latest = None
        where = f"; the latest checkpoint is {latest}" if latest else f"; no checkpoint in {save}"
    return f"megakernels train: interrupted: ended at once without saving{where}"


def _add_train(sub) -> None:
    _train_parser(sub).set_defaults(_run=_run_train)


# Subcommands: name -> "module:function" that adds its parser to the subparsers (``set_defaults(_run=...)``, a
# function of the parsed namespace returning the exit status). Imported only to build the parser.
SUBCOMMANDS = {
    "train": "megakernels_models.cli:_add_train",
    "preprocess": "megakernels_models.data.preprocess:add_parser",
    "convert": "megakernels_models.convert:add_parser",
    "eval": "megakernels_models.inference.evaluate:add_parser",
    "generate": "megakernels_models.inference.pretrained:add_parser",
    "plan": "megakernels_models.planning.plan:add_parser",
    "checkpoint": "megakernels_models.training.checkpoint_verify:add_parser",
    "bench": "megakernels_models.bench:add_parser",
}


def build_parser() -> argparse.ArgumentParser:
    import importlib

    parser = Parser(prog="megakernels", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for spec in SUBCOMMANDS.values():
        module, fn = spec.split(":")
        getattr(importlib.import_module(module), fn)(sub)
    return parser


# Packages of the `train` and `bench` extras (pip install 'megakernels[train]'); the library needs none of them.
EXTRAS = {
    "tqdm": "train",
    "tensorboard": "train",
    "tokenizers": "train",
    "sentencepiece": "train",
    "safetensors": "train",
    "yaml": "train",
    "jinja2": "train",
    "PIL": "train",
    "matplotlib": "bench",
}


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return ns._run(ns)
    except ModuleNotFoundError as e:
        top = (e.name or "").split(".")[0]
        if top not in EXTRAS:
            raise
        print(
            f"megakernels {ns.command}: needs {top}, part of the '{EXTRAS[top]}' extra: "
            f"pip install 'megakernels[{EXTRAS[top]}]'",
            file=sys.stderr,
        )
        return 2


if __name__ == "__main__":
    sys.exit(main())
