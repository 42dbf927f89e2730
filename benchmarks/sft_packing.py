"""What packing buys supervised fine-tuning: the same conversations trained packed and one a sample (padded).

    python -m benchmarks.sft_packing [--quick] [--seq-length 512] [--steps 12] [--out DIR]

Makes a small chat tokenizer and the example conversations' chat dataset (examples/data/chat_small.jsonl,
``preprocess --chat``), then trains the same Llama (fp32, one process, FlashAttention with document masking) on
it twice, ``--sft`` and ``--sft --no-sft-packing``, and reads each step's wall time from the trainer's JSONL log.
The figure is real (non-padding) tokens per second: each mode's real tokens per sample (the dataset's own count)
times the global batch, over its median step time (the first step, which warms up, left out). Packed, a sample
holds several whole conversations and attention stays within each (the cost of a sample follows the sum of its
conversations' squared lengths, not the sample's); unpacked, most of a sample is padding. Never asserts on time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile

from megakernels.bench.common import machine, machine_line, write_json

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "examples", "data", "chat_small.jsonl")


def _data(root: str, seq_length: int) -> tuple[str, str]:
    from megakernels_models.data import chat

    tok = os.path.join(root, "tok")
    chat.write_small_tokenizer(tok, chat.conversation_texts([EXAMPLE]), 512)
    chat.preprocess_chat([EXAMPLE], os.path.join(root, "chat"), tok, seq_length)
    return os.path.join(root, "chat"), tok


def _run(packed: bool, args, data: str, tok: str, root: str) -> dict:
    from megakernels.parallel.launch import single_process_world
    from megakernels_models.arguments import TrainArgs, validate
    from megakernels_models.data.build import build_datasets
    from megakernels_models.training.train import train

    mode = "packed" if packed else "unpacked"
    log = os.path.join(root, f"{mode}.jsonl")
    ta = TrainArgs(
        preset="none",
        model="llama",
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_heads=8,
        num_kv_heads=2,
        seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size,
        global_batch_size=args.micro_batch_size,
        steps=args.steps,
        lr=1e-3,
        eval_interval=0,
        progress=False,
        sft=True,
        sft_packing=packed,
        data=data,
        tokenizer=f"hf:{tok}",
        log_jsonl=log,
        peak_tflops=1.0,
    )
    stats = build_datasets(ta, validate(ta))[0].stats
    with single_process_world():
        records = train(ta)
    t = [r["elapsed_s"] for r in records]
    step = statistics.median([b - a for a, b in zip(t[1:], t[2:])])
    real_per_sample = stats["tokens"] / stats["samples"]
    return {
        "mode": mode,
        "samples_per_epoch": stats["samples"],
        "real_tokens_per_sample": real_per_sample,
        "efficiency": stats["efficiency"],
        "step_s": step,
        "real_tokens_per_s": real_per_sample * ta.global_batch_size / step,
        "losses": [r["loss"] for r in records],
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.sft_packing",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="a small model, few steps (a smoke run)")
    parser.add_argument("--seq-length", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--out", help="write DIR/sft_packing.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.seq_length, args.hidden, args.layers, args.steps = 256, 64, 2, 4
    info = machine("cpu")
    print(machine_line(info))
    with tempfile.TemporaryDirectory(prefix="megakernels-sft-packing-") as root:
        data, tok = _data(root, args.seq_length)
        rows = [_run(p, args, data, tok, root) for p in (True, False)]
    print(f"{'mode':>9} {'samples/epoch':>14} {'real tokens/sample':>19} {'step s':>8} {'real tokens/s':>14}")
    for r in rows:
        print(
            f"{r['mode']:>9} {r['samples_per_epoch']:>14} {r['real_tokens_per_sample']:>19.1f} {r['step_s']:>8.3f} "
            f"{r['real_tokens_per_s']:>14.0f}"
        )
    ratio = rows[0]["real_tokens_per_s"] / rows[1]["real_tokens_per_s"]
    print(f"packed / unpacked real tokens per second = {ratio:.2f}")
    write_json(
        args.out,
        "sft_packing.json",
        {"machine": info, "settings": vars(args), "results": rows, "packed_over_unpacked": ratio},
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
