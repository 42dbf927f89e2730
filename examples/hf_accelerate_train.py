"""Train a HuggingFace causal LM patched with megakernels' fused kernels, through Accelerate, with FusedAdamW.

    accelerate launch --cpu --num_processes 2 examples/hf_accelerate_train.py --steps 50       # 2 CPU ranks, gloo
    accelerate launch --num_processes 8 examples/hf_accelerate_train.py --model PATH --steps 1000   # 8 GPUs
    accelerate launch --cpu --num_processes 2 examples/hf_accelerate_train.py --steps 100 \\
        --save-state ckpt                                        # then resume with --load-state ckpt --steps 200

Without ``--model`` it trains a small randomly initialised Llama (``build_model``) on synthetic sequences that
count in steps (``dataset``: learnable, so the loss falls within a few dozen steps). The model is patched by
``megakernels.integrations.transformers.apply`` before ``accelerator.prepare(model, optimizer, dataloader)``;
Accelerate wraps it in DistributedDataParallel (gloo on the CPU), which averages the gradients over the ranks.
Each global batch of ``--global-batch-size`` sequences is split over the ranks (``split_batches``), so a run's
losses do not depend on the number of processes. ``--save-state`` / ``--load-state`` use
``accelerator.save_state`` / ``load_state``: model, FusedAdamW state (moments and step counts) and the step reached.

``--log-json FILE`` (main process) writes ``{"world", "losses", "grad_norms"}``: per step the loss over the global
batch and the norm of every parameter's gradient after the all-reduce, on every rank (``grad_norms[step][rank]``).
"""

from __future__ import annotations

import argparse
import json

import torch

VOCAB = 64


def build_model(seed: int = 0, model: str | None = None):
    """``model`` (a HuggingFace name or path) or, by default, a 2-layer hidden-64 Llama with weights from ``seed``."""
    import transformers

    torch.manual_seed(seed)
    if model is not None:
        return transformers.AutoModelForCausalLM.from_pretrained(model)
    config = transformers.LlamaConfig(
        num_hidden_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=VOCAB,
        max_position_embeddings=128,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return transformers.LlamaForCausalLM(config)


def dataset(num: int, seq: int, vocab: int = VOCAB, seed: int = 0) -> torch.utils.data.TensorDataset:
    """``num`` sequences of ``seq`` tokens counting from a random start in a random stride of 1-3 (mod vocab, above
    the 3 special tokens)."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab - 3, (num, 1), generator=g)
    stride = torch.randint(1, 4, (num, 1), generator=g)
    return torch.utils.data.TensorDataset(3 + (start + stride * torch.arange(seq)) % (vocab - 3))


class Progress:
    """The step reached, checkpointed with the rest by ``accelerator.save_state``."""

    def __init__(self):
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HuggingFace model name or path (default: a small random Llama)")
    p.add_argument("--steps", type=int, default=50, help="total optimizer steps (a resumed run continues to it)")
    p.add_argument("--global-batch-size", type=int, default=8)
    p.add_argument("--seq-length", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--samples", type=int, default=4096, help="sequences in the synthetic data set (one pass)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-state", default=None, metavar="DIR", help="accelerator.save_state(DIR) at the end")
    p.add_argument("--load-state", default=None, metavar="DIR", help="accelerator.load_state(DIR) first")
    p.add_argument("--log-json", default=None, metavar="FILE")
    args = p.parse_args(argv)

    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration

    import megakernels.integrations.transformers as mkt
    from megakernels.optim import FusedAdamW

    accelerator = Accelerator(
        cpu=not torch.cuda.is_available(), dataloader_config=DataLoaderConfiguration(split_batches=True)
    )
    model = build_model(args.seed, args.model)
    mkt.apply(model)
    optimizer = FusedAdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    data = dataset(args.samples, args.seq_length, model.config.vocab_size, args.seed)
    loader = torch.utils.data.DataLoader(data, batch_size=args.global_batch_size, shuffle=False)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    progress = Progress()
    accelerator.register_for_checkpointing(progress)
    if args.load_state:
        accelerator.load_state(args.load_state)

    losses, grad_norms = [], []
    model.train()
    for (ids,) in accelerator.skip_first_batches(loader, progress.step):
        if progress.step >= args.steps:
            break
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        norms = torch.stack([p.grad.norm() for p in model.parameters()])
        grad_norms.append(accelerator.gather(norms[None]).tolist())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(accelerator.gather(loss.detach()[None]).mean().item())
        progress.step += 1
        if accelerator.is_main_process:
            print(f"step {progress.step:4d}  loss {losses[-1]:.4f}", flush=True)
    if args.save_state:
        accelerator.save_state(args.save_state)
    if args.log_json and accelerator.is_main_process:
        with open(args.log_json, "w") as f:
            json.dump({"world": accelerator.num_processes, "losses": losses, "grad_norms": grad_norms}, f)
    accelerator.end_training()


if __name__ == "__main__":
    main()
