"""A checkpoint as an ordinary module: ``load_pretrained(DIR)`` gives a single-process model whose
``model(input_ids)`` returns batch-first logits over the real vocabulary, whatever layout saved the checkpoint (or a
converted HuggingFace model), with its tokenizer.

    lm = load_pretrained("ckpt", device="cpu")
    logits = lm(torch.tensor([[1, 2, 3]]))                     # [1, 3, vocab]
    print(lm.tokenizer.decode(lm.generate(prompt_ids, max_new_tokens=20)[0].tolist()))

The model's layers are megakernels' parallel layers at tp = pp = 1, which need ``megakernels.parallel``
initialised: ``load_pretrained`` initialises a one-process world (gloo, or nccl on CUDA) when none exists and
keeps it for the life of the process (``release()`` ends it earlier, e.g. before training in the same process); in
an initialised world it must be one rank with tp = pp = 1.

``megakernels generate`` (``add_parser``/``main``) loads a checkpoint this way and streams a continuation of a prompt
(``generate.generate``).
"""

from __future__ import annotations

import atexit
import sys

import torch
import torch.distributed as dist
from torch import nn

_OWNED = False  # whether load_pretrained created the process group (and so tears it down)
_INITIALISED = False  # whether it initialised megakernels.parallel


def _ensure_world(device: str) -> None:
    global _OWNED, _INITIALISED
    import datetime

    from megakernels.parallel import state

    if state.is_initialized():
        if state.tp_size() * state.pp_size() * state.cp_size() != 1:
            raise RuntimeError(
                "load_pretrained: megakernels.parallel is initialised with a model-parallel layout; "
                "load a checkpoint for one process in a world with tp = pp = cp = 1"
            )
        return
    if not dist.is_initialized():
        dist.init_process_group(
            "nccl" if device == "cuda" else "gloo",
            store=dist.HashStore(),
            rank=0,
            world_size=1,
            timeout=datetime.timedelta(seconds=600),
        )
        _OWNED = True
        atexit.register(release)
    elif dist.get_world_size() != 1:
        raise RuntimeError(
            "load_pretrained: torch.distributed has several ranks; call it in a one-rank world or "
            "initialise megakernels.parallel with tp = pp = 1"
        )
    state.initialize(1, 1)
    _INITIALISED = True


def release() -> None:
    """End the one-process world ``load_pretrained`` started (models loaded by it cannot run afterwards); a no-op
    when it started none."""
    global _OWNED, _INITIALISED
    from megakernels.parallel import state

    if _INITIALISED:
        state.destroy()
        _INITIALISED = False
    if _OWNED and dist.is_initialized():
        dist.destroy_process_group()
    _OWNED = False


class PretrainedLM(nn.Module):
    """A causal language model loaded from a checkpoint (see the module docstring).

    Attributes: ``model`` (the GPT/Llama chunk), ``config`` (its ``ModelConfig``), ``tokenizer`` (the checkpoint's
    ``tokenizer.json``, else the byte tokenizer where the vocabulary holds it, else None: logits need none),
    ``special_tokens`` (the bos/eos/pad ids that travel with the checkpoint), ``eos_token_ids``.

    ``forward(input_ids [b, s], kv_cache=None)`` -> fp32 logits ``[b, s, vocab_size]`` (padding columns dropped).
    """

    def __init__(self, model: nn.Module, config, tokenizer, special_tokens: dict | None = None):
        super().__init__()
        self.model, self.config, self.tokenizer = model, config, tokenizer
        self.special_tokens = dict(special_tokens or {})

    @property
    def eos_token_ids(self) -> list[int]:
        """The ids generation stops on: the checkpoint's ``eos_token_id`` (one or several), else the tokenizer's
        end-of-document token, else none."""
        eos = self.special_tokens.get("eos_token_id")
        if eos is not None:
            return [eos] if isinstance(eos, int) else list(eos)
        if self.tokenizer is not None and self.tokenizer.has("eod"):
            return [self.tokenizer.eod]
        return []

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, kv_cache=None) -> torch.Tensor:
        if input_ids.dim() != 2:
            raise ValueError(f"PretrainedLM: input_ids must be [batch, tokens], got shape {tuple(input_ids.shape)}")
        logits = self.model(input_ids, kv_cache=kv_cache)
        return logits.transpose(0, 1)[..., : self.config.vocab_size].float()

    def generate(self, input_ids: torch.Tensor, **kwargs) -> torch.Tensor:
        """``megakernels_models.inference.generate.generate`` on this model."""
        from megakernels_models.inference.generate import generate

        return generate(self, input_ids, **kwargs)


def load_chunk(path: str, device: str, accepts, refusal) -> tuple[nn.Module, object]:
    """(the whole model as one chunk at tp = pp = 1 with the checkpoint's weights, in evaluation mode, its config
    without dropout); needs an initialised one-rank world.

    Raises:
        CheckpointError: no checkpoint at ``path``. ValueError: ``refusal(config)`` when ``accepts(its family's
        spec)`` is false.
    """
    from megakernels_models.models.config import ModelConfig
    from megakernels_models.models.registry import family, task_for
    from megakernels_models.training import checkpoint

    ckpt = checkpoint.read_latest(path)
    cfg = ModelConfig.from_dict(checkpoint.read_meta(ckpt)["config"]).replace(dropout=0.0, attention_dropout=0.0)
    if not accepts(family(cfg)):
        raise ValueError(refusal(cfg))
    model = task_for(cfg).build_chunk(0, device=device).eval()
    checkpoint.load(ckpt, [model], None, cfg)
    return model, cfg


def load_pretrained(
    path: str, device: str = "cpu", dtype: torch.dtype | None = None, tokenizer: str | None = None
) -> PretrainedLM:
    """The causal language model (GPT or Llama family) of the checkpoint at ``path`` (a ``--save`` directory or
    one ``step-N`` in it), on ``device`` in ``dtype`` (default fp32), in evaluation mode.

    Raises:
        CheckpointError: no checkpoint there. ValueError: a BERT checkpoint (not a causal LM), or a tokenizer that
        does not fit the model.
    """
    from megakernels_models.convert import checkpoint_special_tokens, checkpoint_tokenizer
    from megakernels_models.data.tokenizer import build_tokenizer
    from megakernels_models.models.registry import titles

    _ensure_world(device)
    model, cfg = load_chunk(
        path,
        device,
        lambda spec: spec.text_generation,
        lambda cfg: (
            f"load_pretrained: {path!r} holds a {cfg.model} model, not a text-only causal language model "
            f"({titles(lambda s: s.text_generation)})"
        ),
    )
    if dtype is not None:
        model = model.to(dtype)
    spec = tokenizer or checkpoint_tokenizer(path)
    tok = build_tokenizer(spec or "byte")
    if tok.vocab_size > cfg.vocab_size:
        if spec is not None:
            raise ValueError(
                f"load_pretrained: the tokenizer has {tok.vocab_size} ids, the model only {cfg.vocab_size}"
            )
        tok = None  # no tokenizer travels with it and the byte one does not fit: logits need none
    return PretrainedLM(model, cfg, tok, checkpoint_special_tokens(path))


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="continue a prompt with a trained or converted GPT/Llama checkpoint")
    p.add_argument("--load", required=True, metavar="DIR", help="a checkpoint (any layout)")
    p.add_argument("--prompt", required=True, help="the text to continue")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=None, help="sampling seed")
    p.add_argument(
        "--tokenizer",
        default=None,
        help="byte | hf:PATH | spm:PATH (default: the checkpoint's tokenizer.json, else byte)",
    )
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.set_defaults(_run=main)


def main(ns) -> int:
    """``megakernels generate``: continue ``--prompt``, streaming the text as it is decoded."""
    from megakernels_models.inference.generate import generate
    from megakernels_models.training.checkpoint import CheckpointError

    try:
        lm = load_pretrained(ns.load, ns.device, tokenizer=ns.tokenizer)
        if lm.tokenizer is None:
            raise ValueError(
                f"--load {ns.load} has no tokenizer.json and the byte tokenizer does not fit its vocabulary of "
                f"{lm.config.vocab_size}: give --tokenizer"
            )
        ids = torch.as_tensor(lm.tokenizer.encode(ns.prompt), dtype=torch.long, device=ns.device)[None]
        if ids.shape[1] == 0:
            raise ValueError("--prompt encodes to no tokens")
        sys.stdout.write(ns.prompt)
        pending: list[int] = []

        def stream(tok):  # decode as soon as the pending tokens form whole characters
            pending.append(int(tok[0]))
            text = lm.tokenizer.decode(pending)
            if "\ufffd" not in text:
                sys.stdout.write(text)
                sys.stdout.flush()
                pending.clear()

        eos = lm.eos_token_ids or None
        generate(lm, ids, ns.max_new_tokens, ns.temperature, ns.top_k, ns.top_p, ns.seed, eos, on_token=stream)
        sys.stdout.write("\n")
    except (CheckpointError, ValueError, OSError) as e:
        print(f"megakernels generate: error: {e}", file=sys.stderr)
        return 2
    return 0
