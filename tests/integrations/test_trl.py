"""megakernels.integrations.trl: TRL's trainers (SFT, DPO, GRPO) on tiny patched models with megakernels' fused
head serving TRL's ``fused_lm_head=True`` calls (counted: ``linear_cross_entropy`` runs, and ``linear_logprobs``
for GRPO's policy) train like TRL's own head on the unpatched model (fp32: losses within 1e-5, each parameter
within 1e-4 relative, in norm); the head's statistics equal an fp64 reference, the entropy's gradient included;
``apply(model, fused_head=True)`` after a trainer is built leaves TRL's head in place."""

from __future__ import annotations

import contextlib
import sys
import types
import warnings

import pytest
import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

import megakernels.integrations.transformers as mkt
import megakernels.integrations.trl as mktrl
from tests.integrations import hf_models as H
from tests.integrations.test_transformers import MegakernelsOps

FAMILY = "llama"


def _tokenizer():
    """A word-level tokenizer over the tiny models' vocabulary: ``"t<i>"`` is token i."""
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(H.VOCAB)}, unk_token="t3"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", bos_token="t1", eos_token="t2", unk_token="t3")


def _text(g, lo: int, hi: int) -> str:
    n = int(torch.randint(lo, hi, (1,), generator=g))
    return " ".join(f"t{int(i)}" for i in torch.randint(3, H.VOCAB, (n,), generator=g))


def _args(config_class, **extra):
    extra.setdefault("per_device_train_batch_size", 4)
    extra.setdefault("gradient_checkpointing", False)  # TRL's default (on) only where a test says so
    extra.setdefault("max_steps", 3)
    return config_class(
        output_dir="unused",
        learning_rate=1e-2,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        bf16=False,  # TRL's default is bf16 autocast: these compare fp32 runs
        seed=0,
        disable_tqdm=True,
        save_strategy="no",
        dataloader_num_workers=0,
        **extra,
    )


def _run(trainer_class, config, data, ours: bool, model=None, **extra):
    """Train a fresh tiny model (or ``model``, a saved one's path: loaded under the class patch for ours), patched
    with megakernels' head over TRL's, or with TRL's own head on the unpatched model. Returns the logged history,
    the trained parameters and the megakernels ops that ran."""
    if model is None:
        model = H.build(FAMILY)
        if ours:
            mkt.apply(model)
    patches = contextlib.ExitStack()
    if ours:
        patches.enter_context(mktrl.patch_trl())
        if isinstance(model, str):
            patches.enter_context(mkt.patch_classes(FAMILY))
    with patches:
        trainer = trainer_class(model=model, args=config, train_dataset=data, processing_class=_tokenizer(), **extra)
    with MegakernelsOps() as seen:
        trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return logs, {n: p.detach() for n, p in trainer.model.named_parameters()}, seen.names


CROSS_ENTROPY = ("linear_cross_entropy_stats", "linear_cross_entropy_grad")


def _same_training(ref, ours, metrics=("loss",), ops=CROSS_ENTROPY):
    (logs0, params0, _), (logs1, params1, seen) = ref, ours
    assert set(ops) <= seen, (ops, seen)
    assert len(logs1) == len(logs0) == 3
    for key in metrics:
        torch.testing.assert_close([h[key] for h in logs1], [h[key] for h in logs0], rtol=0, atol=1e-5, msg=key)
    for name, p in params0.items():  # Adam's steps amplify rounding in the elements of tiny gradients: per tensor
        rel = float((params1[name] - p).norm() / p.norm())
        assert rel <= 1e-4, f"{name} differs by {rel:.2e} relative"


def test_sft_trains_like_trls_own_head():
    from trl import SFTConfig, SFTTrainer

    g = torch.Generator().manual_seed(0)
    data = Dataset.from_dict({"text": [_text(g, 5, 12) for _ in range(12)]})
    config = _args(SFTConfig, max_length=16, gradient_checkpointing=True)  # TRL's default: the head under it
    ref = _run(SFTTrainer, config, data, ours=False)
    # the metrics TRL's head feeds (entropy, top-1 accuracy) come from megakernels' statistics pass
    _same_training(ref, _run(SFTTrainer, config, data, ours=True), ("loss", "entropy", "mean_token_accuracy"))


def test_dpo_trains_like_trls_own_head():
    from trl import DPOConfig, DPOTrainer

    g = torch.Generator().manual_seed(1)
    rows = [(_text(g, 3, 6), _text(g, 2, 5), _text(g, 2, 5)) for _ in range(8)]
    data = Dataset.from_dict({k: [r[i] for r in rows] for i, k in enumerate(("prompt", "chosen", "rejected"))})
    config = _args(DPOConfig, per_device_train_batch_size=2, max_length=16)
    # the reference model (unpatched in both runs) gets the fused head too
    ref = _run(DPOTrainer, config, data, ours=False, ref_model=H.build(FAMILY))
    ours = _run(DPOTrainer, config, data, ours=True, ref_model=H.build(FAMILY))
    _same_training(ref, ours, ("loss", "rewards/margins", "logits/chosen"))


def test_grpo_with_a_temperature_trains_like_trls_own_head(tmp_path):
    """GRPO samples completions (at temperature 0.7, which the head applies too) and trains on their log-probs;
    the model and its reference are loaded by TRL from a path (ours: under the class patch)."""
    from trl import GRPOConfig, GRPOTrainer

    g = torch.Generator().manual_seed(2)
    data = Dataset.from_dict({"prompt": [_text(g, 3, 6) for _ in range(8)]})

    def reward(completions, **kwargs):  # longer completions, and those with small token ids, score higher
        return [len(c.split()) - 0.01 * sum(int(t[1:]) for t in c.split()) for c in completions]

    config = _args(
        GRPOConfig,
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=4,
        temperature=0.7,
        beta=0.04,  # a reference model: its head is served too
    )
    H.build(FAMILY).save_pretrained(tmp_path)
    _tokenizer().save_pretrained(tmp_path)
    ref = _run(GRPOTrainer, config, data, ours=False, model=str(tmp_path), reward_funcs=reward)
    ours = _run(GRPOTrainer, config, data, ours=True, model=str(tmp_path), reward_funcs=reward)
    # the policy's log-probabilities and entropies come from one fused op, the reference's from the cross-entropy
    served = ("linear_logprobs_stats", "linear_logprobs_grad", "linear_cross_entropy_stats")
    _same_training(ref, ours, ("loss", "entropy", "kl"), served)


def test_apply_with_the_fused_head_after_a_trainer_keeps_trls_head():
    """TRL replaced the model's forward with its fused head: apply(fused_head=True) leaves it (one warning says
    so) and the trainer trains; under patch_trl the head it leaves is megakernels'."""
    from trl import SFTConfig, SFTTrainer

    g = torch.Generator().manual_seed(0)
    data = Dataset.from_dict({"text": [_text(g, 5, 12) for _ in range(8)]})
    for patched in (False, True):
        model = H.build(FAMILY)
        with mktrl.patch_trl() if patched else contextlib.nullcontext():
            args = _args(SFTConfig, max_steps=1)
            trainer = SFTTrainer(model=model, args=args, train_dataset=data, processing_class=_tokenizer())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            done = mkt.apply(trainer.model, fused_head=True)
        ours = [w for w in caught if "keep transformers' forward" in str(w.message)]
        assert done["fused_head"] == patched and len(ours) == (0 if patched else 1)
        with MegakernelsOps() as seen:
            trainer.train()
        assert ("linear_cross_entropy_stats" in seen.names) == patched
        assert all(torch.isfinite(torch.tensor(h["loss"])) for h in trainer.state.log_history if "loss" in h)


def test_patch_trl_reverts_and_refuses_a_second_patch():
    import trl.trainer.sft_trainer as sft
    import trl.trainer.utils as utils

    original = utils.add_fused_lm_head
    with mktrl.patch_trl() as patch:
        assert patch.active and sft.add_fused_lm_head is utils.add_fused_lm_head is not original
        with pytest.raises(ValueError, match="TRL is patched already"):
            mktrl.patch_trl()
        # a TRL module first imported while patched takes the function from trl.trainer.utils, as trainers do
        later = types.ModuleType("trl.imported_while_patched")
        exec("from trl.trainer.utils import add_fused_lm_head", later.__dict__)
        sys.modules[later.__name__] = later
    try:
        assert not patch.active and sft.add_fused_lm_head is utils.add_fused_lm_head is original
        assert later.add_fused_lm_head is original
    finally:
        del sys.modules[later.__name__]


def test_head_statistics_match_an_fp64_reference_with_the_entropys_gradient():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(37, 16, generator=g, requires_grad=True)
    weight = torch.randn(50, 16, generator=g, requires_grad=True)
    bias = torch.randn(50, generator=g, requires_grad=True)
    target = torch.randint(0, 50, (37,), generator=g)
    target[:5] = (hidden[:5].detach() @ weight.detach().T + bias.detach()).argmax(-1)  # some targets are the argmax
    entropy, log_sq, mean, top1 = mktrl.head_statistics(hidden, weight, bias, target, chunk_tokens=8)
    z = hidden.double() @ weight.double().T + bias.double()
    log_p = torch.log_softmax(z, -1)
    ref_entropy = -(log_p.exp() * log_p).sum(-1)
    torch.testing.assert_close(entropy.double(), ref_entropy, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(log_sq.double(), torch.logsumexp(2 * log_p, -1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mean.double(), z.mean(-1), rtol=1e-5, atol=1e-5)
    assert torch.equal(top1, z.argmax(-1) == target) and top1[:5].all()
    assert not (log_sq.requires_grad or mean.requires_grad or top1.requires_grad)
    weights = torch.randn(37, generator=g)
    got = torch.autograd.grad((entropy * weights).sum(), (hidden, weight, bias))
    expected = torch.autograd.grad((ref_entropy * weights.double()).sum(), (hidden, weight, bias))
    for a, b in zip(got, expected):
        torch.testing.assert_close(a.double(), b.double(), rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="weight and bias must be in hidden's dtype"):
        mktrl.head_statistics(hidden, weight.double(), bias, target)
