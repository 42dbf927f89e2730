"""HuggingFace transformers models on megakernels' kernels, run by ``megakernels bench --ops hf``:

- ``hf_train``: one training step of a transformers model patched by ``megakernels.integrations.transformers.apply``
  against the same model unpatched (transformers' own modules, its default SDPA attention and its loss), both
  built from one set of weights and timed one after the other in this process. Two passes: ``fwd+bwd`` (forward
  with the causal-LM loss, backward: the patching alone) and ``step`` (that plus the optimizer: FusedAdamW for the
  patched model, torch.optim.AdamW with its default implementation for the unpatched one: what a user switching to
  megakernels changes). Models: GPT-2 small's layer shape (hidden 768, 12 heads, MLP 3072, learned positions,
  LayerNorm, GeLU) and a Llama layer shape (hidden 768, 12 heads over 4 key/value heads, SwiGLU 2048, RMSNorm,
  RoPE), 2 layers and an 8k vocabulary so a step takes about a second on a CPU; ``--quick`` shrinks them further.
  Work is the model FLOPs ``6·N·tokens`` (N: the parameters outside the embedding tables; attention not counted).

transformers is optional: without it the op is skipped with a note. Never asserts on time; the pytest-benchmark
suite (benchmarks/test_bench_hf.py) times the same steps.
"""

from __future__ import annotations

import copy

import torch

from megakernels.bench import ceilings as ceil
from megakernels.bench.common import DTYPES, OURS, Request, TablePrinter, result_row, timed_in_turns

FAMILY = "hf"
BASELINE = "transformers"
DEFAULT_DTYPES = ("float32",)
# name -> (family, layers, hidden, heads, kv heads, MLP width, vocab, batch, sequence)
MODELS = {
    "gpt2-small-2l": ("gpt2", 2, 768, 12, 12, 3072, 8192, 2, 256),
    "llama-768-2l": ("llama", 2, 768, 12, 4, 2048, 8192, 2, 256),
}
QUICK_MODELS = {
    "gpt2-tiny": ("gpt2", 1, 64, 4, 4, 256, 512, 2, 32),
    "llama-tiny": ("llama", 1, 64, 4, 2, 176, 512, 2, 32),
}
PASSES = ("fwd+bwd", "step")


def missing() -> str | None:
    """Why the benchmark cannot run here (transformers not installed or too old), else None."""
    try:
        import megakernels.integrations.transformers as mkt

        mkt.require_transformers("megakernels bench --ops hf_train")
    except ImportError as e:
        return str(e)
    return None


def build(spec, dtype=torch.float32, seed: int = 0):
    """The unpatched transformers causal LM of ``spec`` (a MODELS value), weights from ``seed``, dropout 0."""
    import transformers as tf

    family, layers, hidden, heads, kv, ffn, vocab, _, seq = spec
    torch.manual_seed(seed)
    if family == "gpt2":
        config = tf.GPT2Config(
            n_layer=layers,
            n_embd=hidden,
            n_head=heads,
            n_inner=ffn,
            vocab_size=vocab,
            n_positions=seq,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=0,
        )
        return tf.GPT2LMHeadModel(config).to(dtype)
    config = tf.LlamaConfig(
        num_hidden_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        intermediate_size=ffn,
        vocab_size=vocab,
        max_position_embeddings=seq,
        bos_token_id=0,
        eos_token_id=0,
        tie_word_embeddings=False,
    )
    return tf.LlamaForCausalLM(config).to(dtype)


def pair(spec, dtype=torch.float32):
    """(unpatched, patched) models with the same weights."""
    import megakernels.integrations.transformers as mkt

    plain = build(spec, dtype)
    patched = copy.deepcopy(plain)
    mkt.apply(patched)
    return plain, patched


def batch(spec, seed: int = 0) -> torch.Tensor:
    """Token ids ``[batch, seq]`` of ``spec``."""
    *_, vocab, b, seq = spec
    return torch.randint(0, vocab, (b, seq), generator=torch.Generator().manual_seed(seed))


def step_fn(model, ids: torch.Tensor, optimizer=None):
    """A zero-argument training step: loss forward, backward, and ``optimizer.step()`` when given; grads dropped."""
    model.train()

    def step():
        model(input_ids=ids, labels=ids).loss.backward()
        if optimizer is not None:
            optimizer.step()
        model.zero_grad(set_to_none=True)
        if ids.is_cuda:  # the steps are timed on the host
            torch.cuda.synchronize()

    return step


def optimizer_for(model, patched: bool):
    """FusedAdamW for the patched model, torch.optim.AdamW (its default implementation) for the unpatched one."""
    from megakernels.optim import FusedAdamW

    cls = FusedAdamW if patched else torch.optim.AdamW
    return cls(model.parameters(), lr=1e-4, weight_decay=0.01)


def model_flops(model, tokens: int) -> int:
    """``6·N·tokens``: N counts the parameters outside the embedding tables."""
    embed = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    n = sum(p.numel() for p in model.parameters() if id(p) not in embed)
    return 6 * n * tokens


def run(request: Request) -> list[dict]:
    """A row per (model, dtype, pass): ours (patched) against transformers' own modules, the two taking turns step
    by step (a step lasts about a second on a CPU: a calibrated block per implementation would see the machine's
    drift as a difference between them); ``min_run_time`` sets the number of turns (10 per second of it, at least 5)."""
    why = missing()
    if why is not None:
        request.notes.append(f"hf_train skipped: {why}")
        return []
    rows, table = [], TablePrinter(request.log)
    reps = max(5, round(10 * request.min_run_time))
    for name, spec in (QUICK_MODELS if request.quick else MODELS).items():
        for dtype_name in request.dtypes_or(DEFAULT_DTYPES):
            plain, patched = (m.to(request.device) for m in pair(spec, DTYPES[dtype_name]))
            ids = batch(spec).to(request.device)
            for pass_ in PASSES:
                opt = pass_ == "step"
                steps = {
                    OURS: step_fn(patched, ids, optimizer_for(patched, True) if opt else None),
                    BASELINE: step_fn(plain, ids, optimizer_for(plain, False) if opt else None),
                }
                times = timed_in_turns(steps, reps)
                value, cname = ceil.for_unit(request.ceilings, "TFLOP/s", dtype_name)
                tokens = ids.numel()
                row = result_row(
                    "hf_train",
                    FAMILY,
                    dtype=dtype_name,
                    shape=f"{spec[7]}x{spec[8]}",
                    pass_=pass_,
                    variant=name,
                    size=tokens,
                    size_label="tokens",
                    unit="TFLOP/s",
                    work=model_flops(plain, tokens),
                    times=times,
                    ceiling=value,
                    ceiling_name=cname,
                )
                rows.append(row)
                table(row)
    return rows
