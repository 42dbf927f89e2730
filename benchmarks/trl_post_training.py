"""Peak memory and time of a TRL DPOTrainer and GRPOTrainer step with megakernels' fused LM head
(``megakernels.integrations.trl.patch_trl``) against TRL's own fused head, on the CPU, in fp32.

    python -m benchmarks.trl_post_training [--vocab 128256] [--hidden 256] [--layers 2] [--tokens 1024]
                                           [--trainers dpo,grpo] [--out DIR]

The method of ``benchmarks.post_training_losses``: each (trainer, head) runs in a fresh process; a small random
Llama (``transformers.LlamaConfig``, the given vocabulary and sizes, untied) and its reference are built, the
trainer runs two steps, and a callback resets the process's peak resident memory (``/proc/self/clear_refs``) when
the second step begins and reads it (``VmHWM``) when it ends: the peak above the resident memory at its start, and
its time. DPO: one pair a device batch, prompt 16 tokens and chosen and rejected completions of ``tokens`` each;
GRPO: 2 prompts of 16 tokens, 2 completions each of ``tokens`` tokens at most (sampling is not timed apart: the
step's time includes it), beta 0.04 (a reference). TRL's head on the CPU scores every position of the padded
batch; megakernels' only the labelled ones. The machine's load average is recorded before and after. Never
asserts.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TRAINERS = ("dpo", "grpo")


def _tokenizer(vocab: int):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t3"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", bos_token="t1", eos_token="t2", unk_token="t3")


def _model(spec: dict):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    h = spec["hidden"]
    config = LlamaConfig(
        vocab_size=spec["vocab"], hidden_size=h, intermediate_size=2 * h, num_hidden_layers=spec["layers"],
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=4 * spec["tokens"] + 64,
        tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def _text(g, n: int, vocab: int) -> str:
    import torch

    return " ".join(f"t{int(i)}" for i in torch.randint(3, vocab, (n,), generator=g))


def _one(spec: dict) -> dict:
    """One point, in this (fresh) process: ``{"ms", "peak_mib", "served"}`` (``served``: whether the trained
    model's forward is megakernels' head)."""
    import contextlib

    import torch
    from datasets import Dataset
    from transformers import TrainerCallback

    from megakernels.bench.common import proc_status_bytes, reset_peak_rss

    torch.set_num_threads(spec["threads"])
    ours = spec["head"] == "megakernels"
    g = torch.Generator().manual_seed(0)
    v, t = spec["vocab"], spec["tokens"]
    patches = contextlib.ExitStack()
    if ours:
        import megakernels.integrations.transformers as mkt
        import megakernels.integrations.trl as mktrl

        patches.enter_context(mktrl.patch_trl())
        patches.enter_context(mkt.patch_classes("llama"))  # the models built (or loaded by TRL) are patched
    seen = {}

    class Peak(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 1:
                seen["base"] = reset_peak_rss()
                seen["t0"] = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 2:
                seen["ms"] = (time.perf_counter() - seen["t0"]) * 1e3
                seen["peak_mib"] = (proc_status_bytes("VmHWM") - seen["base"]) / 2**20

    common = dict(
        output_dir="unused", learning_rate=1e-4, report_to=[], use_cpu=True, bf16=False, seed=0, disable_tqdm=True,
        save_strategy="no", dataloader_num_workers=0, max_steps=2, gradient_checkpointing=False, logging_steps=1,
    )  # fmt: skip
    with patches:
        if spec["trainer"] == "dpo":
            from trl import DPOConfig, DPOTrainer

            model, ref = _model(spec), _model(spec)
            rows = [(_text(g, 16, v), _text(g, t, v), _text(g, t, v)) for _ in range(4)]
            data = Dataset.from_dict({k: [r[i] for r in rows] for i, k in enumerate(("prompt", "chosen", "rejected"))})
            config = DPOConfig(per_device_train_batch_size=1, max_length=2 * t + 64, **common)
            trainer = DPOTrainer(
                model=model, ref_model=ref, args=config, train_dataset=data, processing_class=_tokenizer(v)
            )
        else:
            import tempfile

            from trl import GRPOConfig, GRPOTrainer

            path = tempfile.mkdtemp(prefix="trl-grpo-")  # TRL loads the policy's reference from the path
            _model(spec).save_pretrained(path)
            _tokenizer(v).save_pretrained(path)
            data = Dataset.from_dict({"prompt": [_text(g, 16, v) for _ in range(8)]})
            config = GRPOConfig(
                per_device_train_batch_size=4, num_generations=2, max_completion_length=t, beta=0.04, **common
            )

            def reward(completions, **kwargs):
                return [float(len(c)) for c in completions]

            trainer = GRPOTrainer(
                model=path, args=config, train_dataset=data, processing_class=_tokenizer(v), reward_funcs=reward
            )
        trainer.add_callback(Peak())
    trainer.train()
    served = bool(getattr(trainer.model.forward, "megakernels_trl", False))
    return {"ms": seen["ms"], "peak_mib": seen["peak_mib"], "served": served}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.trl_post_training", description=__doc__.split("\n")[0])
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--tokens", type=int, default=1024, help="tokens of each completion")
    p.add_argument("--trainers", default=",".join(TRAINERS))
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--out", default=None)
    p.add_argument("--point", default=None, help=argparse.SUPPRESS)  # a child's spec
    args = p.parse_args(argv)
    if args.point:
        print(json.dumps(_one(json.loads(args.point))))
        return 0
    trainers = [x for x in args.trainers.split(",") if x]
    bad = [x for x in trainers if x not in TRAINERS]
    if bad:
        p.error(f"--trainers: unknown {bad}; choose from {', '.join(TRAINERS)}")
    from megakernels.bench.common import machine, machine_line, run_point, write_json

    info, load0, rows = machine("cpu"), list(os.getloadavg()), []
    print(machine_line(info))
    print(f"{'trainer':<9}{'mk ms':>10}{'TRL ms':>10}{'speed-up':>10}{'mk MiB':>10}{'TRL MiB':>10}{'peak ratio':>12}")
    for trainer in trainers:
        got = {}
        for head in ("megakernels", "trl"):
            spec = dict(vars(args), trainer=trainer, head=head)
            for k in ("point", "out", "trainers"):
                spec.pop(k)
            got[head] = run_point("benchmarks.trl_post_training", spec, ROOT)
        row = {"trainer": trainer, **{f"{k}_{h}": x for h, d in got.items() for k, x in d.items()}}
        rows.append(row)
        if "ms_megakernels" in row and "ms_trl" in row:
            print(
                f"{trainer:<9}{row['ms_megakernels']:>10.0f}{row['ms_trl']:>10.0f}"
                f"{row['ms_trl'] / row['ms_megakernels']:>9.2f}x{row['peak_mib_megakernels']:>10.0f}"
                f"{row['peak_mib_trl']:>10.0f}{row['peak_mib_megakernels'] / row['peak_mib_trl']:>12.2f}"
            )
        else:
            print(f"{trainer:<9} failed: {got}")
    payload = {"machine": info, "load": {"before": load0, "after": list(os.getloadavg())}, "config": vars(args)}
    path = write_json(args.out, "trl_post_training.json", {**payload, "results": rows})
    if path:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
