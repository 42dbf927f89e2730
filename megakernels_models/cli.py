"""The ``megakernels`` command (DESIGN.md §5): ``megakernels train|... [flags]``.

``megakernels train`` with no flags runs the embedded default: a tiny GPT on the Python standard library's sources
with the byte tokenizer on the CPU, a few minutes, the loss falling. Invalid flags are reported before any process
starts, with the rule that was broken, and exit with status 2; a failed rank exits with status 1 and its error.
"""

from __future__ import annotations

import argparse
import sys

from megakernels_models.arguments import ArgumentError, TrainArgs


def _train_parser(sub) -> argparse.ArgumentParser:
    d = TrainArgs()
    p = sub.add_parser("train", help="train GPT or BERT (default: a tiny GPT on the Python stdlib, CPU)",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("model")
    g.add_argument("--model", choices=["gpt", "bert"], default=None, help="model family (default: the preset's)")
    g.add_argument("--preset", default=d.preset, help="gpt-tiny, bert-tiny, gpt-1.2b, gpt-2.5b, gpt-4.2b, gpt-8.3b, "
                   "gpt-1.3b, bert-336m, bert-1.3b, bert-3.9b; 'none' to give every size")
    for name in ("num_layers", "hidden_size", "num_heads", "seq_length", "vocab_size", "ffn_hidden_size"):
        g.add_argument("--" + name.replace("_", "-"), type=int, default=None, help="overrides the preset")
    g.add_argument("--dropout", type=float, default=None, help="hidden and attention dropout (default: preset's)")
    g.add_argument("--attention", choices=["flash", "torch"], default=d.attention)
    g = p.add_argument_group("layout")
    for name, help_ in (("tp", "tensor-parallel size"), ("pp", "pipeline-parallel size")):
        g.add_argument("--" + name, type=int, default=getattr(d, name), help=help_)
    g.add_argument("--vpp", type=int, default=None, help="virtual stages per pipeline rank (interleaved 1F1B)")
    g.add_argument("--dp", type=int, default=None, help="data-parallel size (default: world / (tp·pp))")
    g.add_argument("--nproc", type=int, default=d.nproc, help="local processes to spawn (gloo on CPU)")
    g.add_argument("--device", choices=["cpu", "cuda"], default=d.device)
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--schedule", choices=["1f1b", "gpipe"], default=d.schedule, help="pipeline schedule (--vpp "
                   "selects interleaved 1F1B)")
    g = p.add_argument_group("optimisation")
    for name, typ in (("micro_batch_size", int), ("global_batch_size", int), ("steps", int), ("lr", float),
                      ("min_lr", float), ("weight_decay", float), ("clip_grad", float), ("seed", int)):
        g.add_argument("--" + name.replace("_", "-"), type=typ, default=getattr(d, name))
    g.add_argument("--warmup-steps", type=int, default=None, help="linear warmup (default: a tenth of --steps)")
    g.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default=d.precision)
    g.add_argument("--recompute", choices=["none", "selective", "full"], default=d.recompute)
    g.add_argument("--distributed-optimizer", action="store_true", help="ZeRO-1: shard optimizer state over dp")
    g = p.add_argument_group("data")
    g.add_argument("--data", default=None, help="PREFIX[,WEIGHT,PREFIX...] (default: the Python stdlib sources)")
    g.add_argument("--tokenizer", default=d.tokenizer, help="byte | hf:PATH | spm:PATH")
    g.add_argument("--split", default=d.split, help="train,valid,test weights over documents")
    g.add_argument("--corpus-bytes", type=int, default=d.corpus_bytes, help="cap of the default corpus")
    g = p.add_argument_group("checkpoints, evaluation and logs")
    g.add_argument("--save", default=None, metavar="DIR", help="save checkpoints here (atomic, DCP)")
    g.add_argument("--save-interval", type=int, default=None, help="steps between checkpoints (and at the end)")
    g.add_argument("--keep-checkpoints", type=int, default=d.keep_checkpoints, help="the last K are kept")
    g.add_argument("--load", default=None, metavar="DIR", help="resume from DIR's latest checkpoint (any layout)")
    g.add_argument("--eval-interval", type=int, default=d.eval_interval, help="0 = never")
    g.add_argument("--eval-steps", type=int, default=d.eval_steps)
    g.add_argument("--log-jsonl", default=None, help="one JSON object per step")
    g.add_argument("--tensorboard", default=None, metavar="DIR")
    g.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    g.add_argument("--peak-tflops", type=float, default=None, help="device peak for MFU (default: table/measured)")
    g.add_argument("--timeout", type=float, default=d.timeout, help="collective timeout in seconds")
    g.add_argument("--dry-run", action="store_true", help="validate and report costs without training")
    return p


def parse_train_args(argv: list[str]) -> TrainArgs:
    """``megakernels train`` flags -> ``TrainArgs`` (argparse errors exit with status 2)."""
    parser = argparse.ArgumentParser(prog="megakernels")
    sub = parser.add_subparsers(dest="command", required=True)
    _train_parser(sub)
    return _train_args(parser.parse_args(["train", *argv]))


def _train_args(ns: argparse.Namespace) -> TrainArgs:
    ns = vars(ns).copy()
    ns.pop("command")
    ns.pop("_run", None)
    if ns["preset"] in ("none", ""):
        ns["preset"] = None
    return TrainArgs(**ns)


def _run_train(ns: argparse.Namespace) -> int:
    args = _train_args(ns)
    from megakernels.parallel.launch import WorldFailed
    from megakernels_models.checkpoint import CheckpointError
    from megakernels_models.train import run

    try:
        records = run(args)
    except (ArgumentError, CheckpointError) as e:
        print(f"megakernels train: error: {e}", file=sys.stderr)
        return 2
    except WorldFailed as e:
        print(f"megakernels train: a rank failed: {e}", file=sys.stderr)
        return 1
    if records and not args.dry_run:
        first, last = records[0], records[-1]
        msg = (f"done: {len(records)} steps, loss {first['loss']:.4f} -> {last['loss']:.4f}, "
               f"{last['tokens_per_s']:.0f} tokens/s, {last['tflops_per_device']:.3g} TFLOP/s per device, "
               f"MFU {last['mfu']:.1%}")
        if "val_loss" in last:
            msg += f", val loss {last['val_loss']:.4f} (ppl {last['val_ppl']:.2f})"
        print(msg)
        mem = first.get("memory_per_param_bytes")
        if mem:
            print("memory per parameter (measured on the last rank): " + " + ".join(
                f"{k} {v:.2f}" for k, v in mem.items()) + f" = {sum(mem.values()):.2f} bytes")
    return 0


def _add_train(sub) -> None:
    _train_parser(sub).set_defaults(_run=_run_train)


# Subcommands: name -> "module:function" that adds its parser to the subparsers (``set_defaults(_run=...)``, a
# function of the parsed namespace returning the exit status). Imported only to build the parser.
SUBCOMMANDS = {
    "train": "megakernels_models.cli:_add_train",
    "preprocess": "megakernels_models.data.preprocess:add_parser",
    "convert": "megakernels_models.convert:add_parser",
    "eval": "megakernels_models.evaluate:add_parser",
    "bench": "megakernels_models.bench.cli:add_parser",
}


def build_parser() -> argparse.ArgumentParser:
    import importlib

    parser = argparse.ArgumentParser(prog="megakernels", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for spec in SUBCOMMANDS.values():
        module, fn = spec.split(":")
        getattr(importlib.import_module(module), fn)(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    return ns._run(ns)


if __name__ == "__main__":
    sys.exit(main())
