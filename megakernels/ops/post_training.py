"""Post-training losses from the LM head's hidden states and weight, the ``[tokens, vocab]`` logits never held:
preference optimisation (DPO with its sigmoid, IPO and hinge losses and label smoothing; ORPO, SimPO, CPO; KTO),
policy gradients (GRPO and its DAPO, Dr. GRPO, BNPO, GSPO and CISPO variants, with clipping, the k3 KL to a
reference and TRL's aggregation modes) and distillation (forward and reverse KL and the generalised JSD against a
teacher's hidden states or log-probabilities).

Every preference and policy loss is a function of per-token log-probabilities (and entropies) of the given tokens
that adds up over pairs or sequences: ``chunked_loss.run_loss`` computes it in chunks of whole pairs / sequences and
takes the gradient in the forward pass (the chunk's logits once; the backward only scales), so the memory of a loss
is one chunk's logits and its GEMMs are the full-logits loss's three. Under ``torch.compile`` (and for pairs too
long for a chunk) the same formulas run on ``ops.logprobs.linear_logprobs``, whose backward recomputes each chunk's
logits. Distillation compares two whole distributions a token: its own chunked ops (``megakernels::linear_distill_*``)
and the same gradient-in-the-forward path. The figures returned beside a loss are detached. Vocab parallelism
(``group``, ``sequence_parallel``) follows ``linear_cross_entropy``'s contract throughout.

Token layout: ``hidden [..., h]`` with ``target`` of its leading shape (``ignore_index`` where no loss is taken:
prompts and padding); each token belongs to a sequence: by default the row of a 2-D ``target`` (``[sequences,
length]``), or ``sequences`` (int, ``target``'s shape, ``-1`` for none) for packed rows. Paired preference losses
take ``2·B`` sequences, the chosen ones first (``0..B-1``) and their rejected partners after (``B..2B-1``), as TRL
concatenates them. The formulas are TRL's (``DPOTrainer``, ``CPOTrainer``, ``ORPOTrainer``, ``KTOTrainer``,
``GRPOTrainer``, ``generalized_jsd_loss``); tests hold them to TRL's own code and to fp64 full-logits references.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megakernels.ops import _checks, gemm
from megakernels.ops.chunked_loss import run_loss
from megakernels.ops.linear_cross_entropy import check_head, gather_rows, reduce_scatter_rows
from megakernels.ops.logprobs import linear_logprobs

PREFERENCE_LOSSES = ("sigmoid", "ipo", "hinge")
GRPO_LOSSES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo")
DIVERGENCES = ("forward_kl", "reverse_kl", "jsd")
HEAD_KEYWORDS = frozenset({"ignore_index", "group", "vocab_size", "chunk_tokens", "bias", "sequence_parallel"})


# ---- per-sequence sums ---------------------------------------------------------------------------------------------


def _sequence_ids(op: str, target: torch.Tensor, sequences: torch.Tensor | None) -> tuple[torch.Tensor, int]:
    """Each token's sequence (``-1``: none) and the number of sequences."""
    if sequences is None:
        if target.dim() != 2:
            raise ValueError(
                f"{op}: target must be [sequences, length] without sequences=, got shape {tuple(target.shape)}"
            )
        n, s = target.shape
        return torch.arange(n, device=target.device).repeat_interleave(s), n
    if not isinstance(sequences, torch.Tensor) or sequences.shape != target.shape or sequences.is_floating_point():
        raise ValueError(f"{op}: sequences must be an integer tensor of target's shape {tuple(target.shape)}")
    flat = sequences.reshape(-1).long()
    return flat, int(flat.max().item()) + 1 if flat.numel() and flat.max() >= 0 else 0


def sequence_sums(
    values: torch.Tensor, seq: torch.Tensor, n: int, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ values, number of tokens) per sequence over the ``mask``ed tokens: two ``[n]`` fp32 tensors."""
    keep = mask & (seq >= 0)
    idx = seq.clamp(min=0)
    sums = torch.zeros(n, dtype=torch.float32, device=values.device).index_add(0, idx, (values * keep).float())
    counts = torch.zeros(n, dtype=torch.float32, device=values.device).index_add(0, idx, keep.float())
    return sums, counts


def _head(hidden, weight, target, head: dict, op: str):
    """Per-token log-probabilities (flat) and the loss mask of ``target``."""
    logp = linear_logprobs(hidden, weight, target, **head)
    return logp.reshape(-1), (target.reshape(-1) != head.get("ignore_index", -100))


def sequence_logprobs(
    hidden, weight, target, *, sequences=None, average: bool = False, **head
) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ log p of each sequence's labelled tokens — their mean with ``average`` —, its token count), ``[n]`` fp32:
    what a reference model contributes to a preference loss (``head``: ``linear_logprobs``' keywords)."""
    seq, n = _sequence_ids("sequence_logprobs", target, sequences)
    logp, mask = _head(hidden, weight, target, head, "sequence_logprobs")
    sums, counts = sequence_sums(logp, seq, n, mask)
    return (sums / counts.clamp(min=1.0) if average else sums), counts


def _head_args(op: str, hidden, weight, target, head: dict, temperature=1.0) -> dict:
    """``head`` (``linear_logprobs``' keywords) checked as ``linear_cross_entropy`` checks them, in the form
    ``chunked_loss.run_loss`` takes."""
    unknown = sorted(set(head) - HEAD_KEYWORDS)
    if unknown:
        raise TypeError(f"{op}: unexpected keyword argument(s) {', '.join(unknown)}")
    temperature = _checks.real(op, "temperature", temperature)
    if not temperature > 0:
        raise ValueError(f"{op}: temperature must be > 0, got {temperature}")
    sp = bool(head.get("sequence_parallel", False))
    ignore_index, vocab, vocab_start, chunk = check_head(
        op, hidden, weight, target, head.get("ignore_index", -100), 0.0, head.get("group"), head.get("vocab_size"),
        head.get("chunk_tokens"), head.get("bias"), sp,
    )  # fmt: skip
    return dict(
        ignore_index=ignore_index, group=head.get("group"), sequence_parallel=sp, vocab=vocab, vocab_start=vocab_start,
        chunk=chunk, inv_temp=1.0 / temperature, bias=head.get("bias"),
    )  # fmt: skip


def _counts(seq: torch.Tensor, n: int, mask: torch.Tensor) -> torch.Tensor:
    """Each sequence's number of labelled tokens, ``[n]`` fp32."""
    keep = mask & (seq >= 0)
    return torch.zeros(n, dtype=torch.float32, device=seq.device).index_add(0, seq.clamp(min=0), keep.float())


def _paired(op: str, hidden, weight, target, sequences, head: dict, pair_share):
    """A paired preference loss through ``chunked_loss.run_loss``, chunks of whole pairs: ``pair_share(chosen,
    rejected, chosen_tokens, rejected_tokens, pairs, totals)`` (the chunk's pairs' summed log-probabilities and token
    counts, ``[k]`` each, the pairs' indices, and the batch's ``totals``: ``pairs`` B and ``chosen`` the chosen
    completions' tokens) returns the chunk's share of the loss and its figures. Returns ``(loss, figures)``."""
    seq, n = _sequence_ids(op, target, sequences)
    hd = _head_args(op, hidden, weight, target, head)
    if n % 2 or n == 0:
        raise ValueError(f"{op}: expected 2·B sequences (B chosen, then their B rejected partners), got {n}")
    mask = target.reshape(-1) != hd["ignore_index"]
    counts = _counts(seq, n, mask)
    b = n // 2
    totals = {"pairs": b, "chosen": counts[:b].sum().clamp(min=1.0)}

    def tail(logp, ent, idx, lseq, sel):
        sums = torch.zeros(sel.numel(), dtype=torch.float32, device=logp.device).index_add(0, lseq, logp.float())
        c = sel < b
        return pair_share(sums[c], sums[~c], counts[sel[c]], counts[sel[~c]], sel[c], totals)

    units = [[p, p + b] for p in range(b)]
    return run_loss(op, hidden, weight, target, seq, n, mask, units, tail, hd, entropy=False)


# ---- preference losses --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class PreferenceLoss:
    """A paired preference loss and what trainers log: the mean ``loss``; per pair the implicit ``chosen_rewards``
    and ``rejected_rewards`` (β times the policy's log-ratio to the reference where there is one, else β times the
    policy's log-probability), their ``margins`` and whether the chosen one wins (``accuracy``); the policy's
    ``chosen_logps`` / ``rejected_logps`` and, for ORPO and CPO, the chosen sequences' ``nll``. Only ``loss`` is
    differentiable (its gradient is taken in the forward pass); the figures are detached: a loss built on
    ``chosen_logps`` needs ``sequence_logprobs``."""

    loss: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor
    chosen_logps: torch.Tensor
    rejected_logps: torch.Tensor
    nll: torch.Tensor | None = None

    @property
    def margins(self) -> torch.Tensor:
        return self.chosen_rewards - self.rejected_rewards

    @property
    def accuracy(self) -> torch.Tensor:
        return (self.chosen_rewards > self.rejected_rewards).float().mean()


def _reference(op: str, ref_logps, n: int, device) -> torch.Tensor:
    if not isinstance(ref_logps, torch.Tensor) or ref_logps.shape != (n,):
        raise ValueError(f"{op}: ref_logps must be a [{n}] tensor (each sequence's reference log-probability)")
    return ref_logps.to(device=device, dtype=torch.float32).detach()


def _beta(op: str, beta) -> float:
    beta = _checks.real(op, "beta", beta)
    if not beta > 0:
        raise ValueError(f"{op}: beta must be > 0, got {beta}")
    return beta


def _label_smoothing(op: str, eps) -> float:
    eps = _checks.real(op, "label_smoothing", eps)
    if not 0.0 <= eps < 0.5:
        raise ValueError(f"{op}: label_smoothing must be in [0, 0.5), got {eps}")
    return eps


def dpo_loss(
    hidden, weight, target, ref_logps, *, beta=0.1, loss_type="sigmoid", label_smoothing=0.0, sequences=None, **head
) -> PreferenceLoss:
    """Direct preference optimisation (Rafailov et al. 2023) on ``2·B`` sequences (chosen first): with
    ``Δ = (log π(c) − log π_ref(c)) − (log π(r) − log π_ref(r))`` (sums over each completion's tokens),
    ``sigmoid``: ``−(1−ε) log σ(βΔ) − ε log σ(−βΔ)`` (conservative DPO's label smoothing ε); ``hinge``:
    ``relu(1 − βΔ)``; ``ipo``: ``(Δ/len − 1/(2β))²`` with each log-ratio averaged over its tokens (TRL's IPO). The mean
    over pairs.

    Args:
        hidden, weight, target: the policy's hidden states, LM head and tokens (``target`` ``ignore_index`` outside
            the completions).
        ref_logps: ``[2·B]`` the reference model's summed log-probabilities of the same sequences (precomputed, or
            ``sequence_logprobs`` of the reference's hidden states and head).
        beta, loss_type, label_smoothing: as above (``loss_type`` one of ``PREFERENCE_LOSSES``).
        sequences: packed rows' sequence ids (module docstring).
        head: ``linear_logprobs``' keywords (``ignore_index``, ``group``, ``vocab_size``, ``chunk_tokens``, ``bias``,
            ``sequence_parallel``).

    Raises:
        ValueError: an unknown ``loss_type``, a ``beta`` ≤ 0, ``label_smoothing`` outside [0, 0.5), an odd number of
        sequences, a ``ref_logps`` of the wrong shape; and what ``linear_logprobs`` raises.
    """
    op = "dpo_loss"
    beta, eps = check_dpo(op, beta, loss_type, label_smoothing)
    n = _sequence_ids(op, target, sequences)[1]
    ref = _reference(op, ref_logps, n, hidden.device)
    b = n // 2

    def share(chosen, rejected, len_c, len_r, pairs, totals):
        losses, ratio_c, ratio_r = dpo_pair_losses(
            chosen, rejected, ref[pairs], ref[pairs + b], len_c, len_r, beta=beta, loss_type=loss_type,
            label_smoothing=eps,
        )  # fmt: skip
        return losses.sum() / totals["pairs"], {"c": chosen, "r": rejected, "rc": ratio_c, "rr": ratio_r}

    loss, aux = _paired(op, hidden, weight, target, sequences, head, share)
    return PreferenceLoss(loss, beta * aux["rc"], beta * aux["rr"], aux["c"], aux["r"])


def check_dpo(op: str, beta, loss_type: str, label_smoothing) -> tuple[float, float]:
    """``(beta, label_smoothing)`` checked for DPO (``op`` names the caller in the message).

    Raises:
        ValueError: an unknown ``loss_type``, a ``beta`` ≤ 0, ``label_smoothing`` outside [0, 0.5).
    """
    if loss_type not in PREFERENCE_LOSSES:
        raise ValueError(f"{op}: loss_type must be one of {', '.join(PREFERENCE_LOSSES)}, got {loss_type!r}")
    return _beta(op, beta), _label_smoothing(op, label_smoothing)


def dpo_pair_losses(
    chosen, rejected, ref_chosen, ref_rejected, chosen_tokens, rejected_tokens, *, beta, loss_type, label_smoothing
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DPO's per-pair losses (``dpo_loss``'s formulas) from the sequences' summed log-probabilities: the policy's
    ``chosen`` and ``rejected``, the reference's ``ref_chosen`` and ``ref_rejected`` and the completions' token
    counts (IPO averages over them), all ``[B]`` fp32. Returns ``(losses, chosen log-ratios, rejected
    log-ratios)``, each ``[B]``: what a trainer that computes the sums itself (``megakernels train --dpo``) needs.

    Raises:
        ValueError: as ``check_dpo``.
    """
    beta, eps = check_dpo("dpo_pair_losses", beta, loss_type, label_smoothing)
    ratio_c, ratio_r = chosen - ref_chosen, rejected - ref_rejected
    delta = ratio_c - ratio_r
    if loss_type == "sigmoid":
        losses = -(1 - eps) * F.logsigmoid(beta * delta) - eps * F.logsigmoid(-beta * delta)
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * delta)
    else:
        losses = (
            ratio_c / chosen_tokens.clamp(min=1.0) - ratio_r / rejected_tokens.clamp(min=1.0) - 1 / (2 * beta)
        ) ** 2
    return losses, ratio_c, ratio_r


def orpo_loss(hidden, weight, target, *, beta=0.1, sequences=None, **head) -> PreferenceLoss:
    """Odds-ratio preference optimisation (Hong et al. 2024): the chosen completions' NLL (mean over their tokens)
    minus ``β · mean log σ(log odds(c) − log odds(r))``, each log-probability averaged over its completion's tokens
    and ``log odds(y) = log p − log(1 − p)``; rewards are ``β`` times the averaged log-probabilities (TRL's).

    Raises:
        ValueError: as ``dpo_loss``.
    """
    op = "orpo_loss"
    beta = _beta(op, beta)

    def share(c_sum, r_sum, len_c, len_r, pairs, totals):
        chosen, rejected = c_sum / len_c.clamp(min=1.0), r_sum / len_r.clamp(min=1.0)
        log_odds = (chosen - rejected) - (torch.log1p(-torch.exp(chosen)) - torch.log1p(-torch.exp(rejected)))
        nll = -c_sum.sum() / totals["chosen"]
        return nll - beta * F.logsigmoid(log_odds).sum() / totals["pairs"], {"c": chosen, "r": rejected, "nll": nll}

    loss, aux = _paired(op, hidden, weight, target, sequences, head, share)
    return PreferenceLoss(loss, beta * aux["c"], beta * aux["r"], aux["c"], aux["r"], aux["nll"])


def simpo_loss(hidden, weight, target, *, beta=2.0, gamma=0.5, label_smoothing=0.0, sequences=None, **head):
    """Simple preference optimisation (Meng et al. 2024): ``−(1−ε) log σ(β Δ̄ − γ) − ε log σ(−(β Δ̄ − γ))`` with
    ``Δ̄`` the difference of the length-averaged log-probabilities, no reference model (TRL's CPO trainer with
    ``loss_type="simpo"``: ``gamma`` is its ``simpo_gamma``).

    Raises:
        ValueError: as ``dpo_loss``.
    """
    op = "simpo_loss"
    beta, eps = _beta(op, beta), _label_smoothing(op, label_smoothing)
    gamma = _checks.real(op, "gamma", gamma)

    def share(c_sum, r_sum, len_c, len_r, pairs, totals):
        chosen, rejected = c_sum / len_c.clamp(min=1.0), r_sum / len_r.clamp(min=1.0)
        z = beta * (chosen - rejected) - gamma
        losses = -(1 - eps) * F.logsigmoid(z) - eps * F.logsigmoid(-z)
        return losses.sum() / totals["pairs"], {"c": chosen, "r": rejected}

    loss, aux = _paired(op, hidden, weight, target, sequences, head, share)
    return PreferenceLoss(loss, beta * aux["c"], beta * aux["r"], aux["c"], aux["r"])


def cpo_loss(hidden, weight, target, *, beta=0.1, alpha=1.0, label_smoothing=0.0, sequences=None, **head):
    """Contrastive preference optimisation (Xu et al. 2024): ``−(1−ε) log σ(βΔ) − ε log σ(−βΔ)`` on the summed
    log-probabilities, no reference model, plus ``alpha`` times the chosen completions' NLL (TRL's ``cpo_alpha``).

    Raises:
        ValueError: as ``dpo_loss``.
    """
    op = "cpo_loss"
    beta, eps = _beta(op, beta), _label_smoothing(op, label_smoothing)
    alpha = _checks.real(op, "alpha", alpha, minimum=0.0)

    def share(chosen, rejected, len_c, len_r, pairs, totals):
        z = beta * (chosen - rejected)
        nll = -chosen.sum() / totals["chosen"]
        losses = -(1 - eps) * F.logsigmoid(z) - eps * F.logsigmoid(-z)
        return losses.sum() / totals["pairs"] + alpha * nll, {"c": chosen, "r": rejected, "nll": nll}

    loss, aux = _paired(op, hidden, weight, target, sequences, head, share)
    return PreferenceLoss(loss, beta * aux["c"], beta * aux["r"], aux["c"], aux["r"], aux["nll"])


@dataclasses.dataclass
class KTOLoss:
    """KTO's mean ``loss``, its detached ``kl`` estimate, and the desirable and undesirable sequences' rewards."""

    loss: torch.Tensor
    kl: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor


def kto_loss(
    hidden, weight, target, ref_logps, desirable, kl_logps, ref_kl_logps, *, beta=0.1, desirable_weight=1.0,
    undesirable_weight=1.0, sequences=None, **head,
) -> KTOLoss:  # fmt: skip
    """Kahneman-Tversky optimisation (Ethayarajh et al. 2024) of unpaired sequences: with ``r = log π(y) − log
    π_ref(y)`` (sums) and ``z = max(0, mean(kl_logps − ref_kl_logps))`` (the KL estimate from mismatched completions,
    detached), desirable sequences cost ``λ_D (1 − σ(β (r − z)))`` and undesirable ones ``λ_U (1 − σ(β (z − r)))``;
    the mean over sequences (TRL's ``KTOTrainer``).

    Args:
        ref_logps: ``[n]`` the reference's summed log-probabilities; desirable: ``[n]`` bool; kl_logps,
            ref_kl_logps: ``[k]`` the policy's and the reference's log-probabilities of the mismatched pairs.

    Raises:
        ValueError: shapes that do not match, a beta ≤ 0; what ``linear_logprobs`` raises.
    """
    op = "kto_loss"
    beta = _beta(op, beta)
    seq, n = _sequence_ids(op, target, sequences)
    hd = _head_args(op, hidden, weight, target, head)
    if not isinstance(desirable, torch.Tensor) or desirable.shape != (n,):
        raise ValueError(f"{op}: desirable must be a [{n}] bool tensor")
    if not isinstance(ref_logps, torch.Tensor) or ref_logps.shape != (n,):
        raise ValueError(f"{op}: ref_logps must be a [{n}] tensor")
    kl = (kl_logps.float() - ref_kl_logps.float()).mean().clamp(min=0).detach().to(hidden.device)
    ref = ref_logps.to(hidden.device).float().detach()
    desirable = desirable.to(hidden.device).bool()

    def tail(logp, ent, idx, lseq, sel):
        ratio = torch.zeros(sel.numel(), dtype=torch.float32, device=logp.device).index_add(0, lseq, logp.float())
        ratio = ratio - ref[sel]
        losses = torch.where(
            desirable[sel],
            desirable_weight * (1 - torch.sigmoid(beta * (ratio - kl))),
            undesirable_weight * (1 - torch.sigmoid(beta * (kl - ratio))),
        )
        return losses.sum() / n, {"rewards": beta * ratio}

    mask = target.reshape(-1) != hd["ignore_index"]
    loss, aux = run_loss(op, hidden, weight, target, seq, n, mask, [[s] for s in range(n)], tail, hd, entropy=False)
    rewards = aux["rewards"]
    return KTOLoss(loss, kl, rewards[desirable], rewards[~desirable])


# ---- policy-gradient losses ---------------------------------------------------------------------------------------


@dataclasses.dataclass
class PolicyLoss:
    """A policy-gradient loss, and what trainers log: the ``loss``; the tokens' mean ``kl`` to the reference (0
    without one), mean ``entropy`` and ``clip_fraction`` (tokens whose ratio the clipping held), detached."""

    loss: torch.Tensor
    kl: torch.Tensor
    entropy: torch.Tensor
    clip_fraction: torch.Tensor


def grpo_loss(
    hidden, weight, target, advantages, *, old_logps=None, ref_logps=None, loss_type="grpo", beta=0.0,
    epsilon_low=0.2, epsilon_high=None, importance_sampling="token", max_completion_length=None,
    num_items_in_batch=None, entropy_coef=0.0, temperature=1.0, **head,
) -> PolicyLoss:  # fmt: skip
    """Group-relative policy optimisation (Shao et al. 2024) and its variants, on ``[sequences, length]`` tokens
    (``target`` ``ignore_index`` outside the completions): the ratio ``ρ = exp(log π − log π_old)`` per token
    (``importance_sampling="sequence"``: one ratio a sequence from its mean log-ratio, GSPO), the clipped surrogate
    ``−min(ρ A, clip(ρ, 1−ε_low, 1+ε_high) A)`` (``cispo``: ``−sg(min(ρ, ε_high)) A log π``), plus ``beta`` times the
    k3 estimate of the KL to the reference ``exp(r − log π) − (r − log π) − 1``, aggregated as TRL names it:
    ``grpo`` (mean over each sequence's tokens, then over sequences), ``bnpo`` (over all tokens), ``dr_grpo`` (the
    sum over ``sequences × max_completion_length``), ``dapo``/``cispo`` (the sum over ``num_items_in_batch``
    tokens). ``entropy_coef`` subtracts that times the tokens' mean entropy (an exploration bonus).

    Args:
        advantages: ``[sequences]`` (or ``[sequences, length]``) group-normalised advantages.
        old_logps: ``target``-shaped log-probabilities of the policy that sampled (default: this one's, detached:
            one optimisation step per generation). ref_logps: the reference's, with ``beta`` > 0.
        temperature: the sampling temperature the logits are divided by.
        head: ``linear_logprobs``' keywords.

    Raises:
        ValueError: an unknown ``loss_type`` or ``importance_sampling``, a missing ``ref_logps`` with beta > 0,
        ``max_completion_length`` / ``num_items_in_batch`` missing for the modes that need them, shapes that do not
        match; and what ``linear_logprobs`` raises.
    """
    op = "grpo_loss"
    if loss_type not in GRPO_LOSSES:
        raise ValueError(f"{op}: loss_type must be one of {', '.join(GRPO_LOSSES)}, got {loss_type!r}")
    if importance_sampling not in ("token", "sequence"):
        raise ValueError(f"{op}: importance_sampling must be 'token' or 'sequence', got {importance_sampling!r}")
    if target.dim() != 2:
        raise ValueError(f"{op}: target must be [sequences, length], got shape {tuple(target.shape)}")
    epsilon_high = epsilon_low if epsilon_high is None else epsilon_high
    beta = _checks.real(op, "beta", beta, minimum=0.0)
    if beta > 0 and ref_logps is None:
        raise ValueError(f"{op}: beta > 0 needs ref_logps (the reference's per-token log-probabilities)")
    if loss_type == "dr_grpo" and not max_completion_length:
        raise ValueError(f"{op}: loss_type='dr_grpo' needs max_completion_length")
    if loss_type in ("dapo", "cispo") and num_items_in_batch is None:
        raise ValueError(f"{op}: loss_type={loss_type!r} needs num_items_in_batch (the batch's completion tokens)")
    want_entropy = entropy_coef != 0.0
    hd = _head_args(op, hidden, weight, target, head, temperature)
    for name, t in (("old_logps", old_logps), ("ref_logps", ref_logps)):
        if t is not None and t.shape != target.shape:
            raise ValueError(f"{op}: {name} must have target's shape {tuple(target.shape)}, got {tuple(t.shape)}")
    s_count = target.shape[0]
    adv = advantages.float().to(hidden.device).detach()
    if adv.dim() == 1 and adv.shape[0] != s_count:
        raise ValueError(f"{op}: advantages must be [{s_count}] (one a sequence), got {tuple(adv.shape)}")
    if adv.dim() != 1 and adv.shape != target.shape:
        raise ValueError(f"{op}: advantages must be [{s_count}] or target's shape, got {tuple(adv.shape)}")
    old_flat = None if old_logps is None else old_logps.float().detach().reshape(-1).to(hidden.device)
    ref_flat = None if ref_logps is None else ref_logps.float().detach().reshape(-1).to(hidden.device)
    mask = target.reshape(-1) != hd["ignore_index"]
    seq = torch.arange(s_count, device=target.device).repeat_interleave(target.shape[1])
    counts = _counts(seq, s_count, mask)
    tokens = counts.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        denom = s_count * max_completion_length
    elif loss_type in ("dapo", "cispo"):
        denom = num_items_in_batch.to(hidden.device) if torch.is_tensor(num_items_in_batch) else num_items_in_batch

    def tail(logp, ent, idx, lseq, sel):
        a = adv[sel][lseq] if adv.dim() == 1 else adv.reshape(-1)[idx]
        old = logp.detach() if old_flat is None else old_flat[idx]
        log_ratio = logp - old
        k = sel.numel()
        if importance_sampling == "sequence":
            per_seq = torch.zeros(k, dtype=torch.float32, device=logp.device).index_add(0, lseq, log_ratio)
            log_ratio = (per_seq / counts[sel].clamp(min=1.0))[lseq]
        ratio = torch.exp(log_ratio)
        if loss_type == "cispo":
            per_token = -torch.clamp(ratio, max=epsilon_high).detach() * a * logp
            clipped = (ratio > epsilon_high).float()
        else:
            clipped_ratio = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
            per_token = -torch.min(ratio * a, clipped_ratio * a)
            clipped = (ratio * a > clipped_ratio * a).float()
        kl = torch.zeros_like(logp)
        if beta > 0:
            d = ref_flat[idx] - logp
            kl = torch.exp(d) - d - 1
            per_token = per_token + beta * kl
        if loss_type == "grpo":
            per_seq = torch.zeros(k, dtype=torch.float32, device=logp.device).index_add(0, lseq, per_token)
            share = (per_seq / counts[sel].clamp(min=1.0)).sum() / s_count
        elif loss_type == "bnpo":
            share = per_token.sum() / tokens
        else:
            share = per_token.sum() / denom
        if want_entropy:
            share = share - entropy_coef * ent.sum() / tokens
        return share, {"kl": kl.sum(), "entropy": ent.sum(), "clipped": clipped.sum()}

    units = [[s] for s in range(s_count)]
    loss, aux = run_loss(op, hidden, weight, target, seq, s_count, mask, units, tail, hd, entropy=True)
    return PolicyLoss(loss, aux["kl"] / tokens, aux["entropy"] / tokens, aux["clipped"] / tokens)


def group_advantages(rewards: torch.Tensor, group_size: int, scale: bool = True, eps: float = 1e-4) -> torch.Tensor:
    """GRPO's advantages: each reward minus its group's mean (``group_size`` consecutive completions of one prompt),
    divided by the group's standard deviation with ``scale`` (Dr. GRPO leaves it out).

    Raises:
        ValueError: a reward count that is not a multiple of ``group_size``.
    """
    rewards = rewards.float().reshape(-1)
    if group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"group_advantages: {rewards.numel()} rewards do not split into groups of {group_size}")
    g = rewards.view(-1, group_size)
    adv = g - g.mean(1, keepdim=True)
    if scale:
        adv = adv / (g.std(1, keepdim=True) + eps)
    return adv.reshape(-1)


# ---- distillation -------------------------------------------------------------------------------------------------


def divergence(student_logp: torch.Tensor, teacher_logp: torch.Tensor, kind: str, beta: float) -> torch.Tensor:
    """Per-row divergence of two log-distributions over the last dim: ``forward_kl`` ``KL(teacher ‖ student)``,
    ``reverse_kl`` ``KL(student ‖ teacher)``, ``jsd`` ``β KL(teacher ‖ M) + (1−β) KL(student ‖ M)``, ``M = β p_t +
    (1−β) p_s`` (TRL's ``generalized_jsd_loss``: β = 0 and 1 are its forward and reverse KL)."""
    if kind == "forward_kl" or (kind == "jsd" and beta == 0.0):
        return (teacher_logp.exp() * (teacher_logp - student_logp)).nan_to_num(0.0).sum(-1)
    if kind == "reverse_kl" or (kind == "jsd" and beta == 1.0):
        return (student_logp.exp() * (student_logp - teacher_logp)).nan_to_num(0.0).sum(-1)
    mix = torch.logsumexp(torch.stack([student_logp + math.log1p(-beta), teacher_logp + math.log(beta)]), 0)
    kl_t = (teacher_logp.exp() * (teacher_logp - mix)).nan_to_num(0.0).sum(-1)
    kl_s = (student_logp.exp() * (student_logp - mix)).nan_to_num(0.0).sum(-1)
    return beta * kl_t + (1 - beta) * kl_s


def divergence_grad(student_logp: torch.Tensor, teacher_logp: torch.Tensor, kind: str, beta: float) -> torch.Tensor:
    """∂ divergence / ∂ student logits, row by row: ``p_s − p_t`` for the forward KL, else ``p (g − Σ p g)`` with
    ``g`` the divergence's derivative in the student's probabilities — ``log p_s − log p_t + 1`` for the reverse KL,
    ``(1−β)(log p_s − log M)`` for the generalised JSD — through the softmax."""
    p = student_logp.exp()
    if kind == "forward_kl" or (kind == "jsd" and beta == 0.0):
        return p - teacher_logp.exp()
    if kind == "reverse_kl" or (kind == "jsd" and beta == 1.0):
        g = student_logp - teacher_logp
    else:
        mix = torch.logsumexp(torch.stack([student_logp + math.log1p(-beta), teacher_logp + math.log(beta)]), 0)
        g = (1 - beta) * (student_logp - mix)
    g = g.nan_to_num(0.0, posinf=0.0, neginf=0.0)
    return p * (g - (p * g).sum(-1, keepdim=True))


def _full_chunk(h, weight, bias, inv_temp: float, n_valid: int, group):
    """A chunk's fp32 logits over temperature on the whole vocabulary (the shards gathered over ``group``), the
    padding columns cut."""
    x = gemm.linear_nograd(h, weight, bias).float() * inv_temp
    if group is not None and dist.get_world_size(group) > 1 and x.device.type != "meta":
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        x = torch.cat(parts, 1)
    return x[:, :n_valid]


@torch.no_grad()
def distill_forward_chunks(s_hidden, s_weight, s_bias, t_hidden, t_weight, t_bias, t_logp, chunk, inv_temp, n_valid,
                           kind, beta, group=None):  # fmt: skip
    """Per-token divergences ``[T]`` fp32 of the student's distribution against the teacher's (its hidden states and
    head, or its log-probabilities ``t_logp [T, V]``), chunk by chunk."""
    t = s_hidden.shape[0]
    out = torch.empty(t, dtype=torch.float32, device=s_hidden.device)
    for a in range(0, t, chunk):
        b = min(t, a + chunk)
        s = torch.log_softmax(_full_chunk(s_hidden[a:b], s_weight, s_bias, inv_temp, n_valid, group), -1)
        if t_logp is None:
            te = torch.log_softmax(_full_chunk(t_hidden[a:b], t_weight, t_bias, inv_temp, n_valid, group), -1)
        else:
            te = t_logp[a:b, :n_valid].float()
        out[a:b] = divergence(s, te, kind, beta)
    return out


@torch.no_grad()
def distill_backward_chunks(s_hidden, s_weight, s_bias, t_hidden, t_weight, t_bias, t_logp, ddiv, chunk, inv_temp,
                            n_valid, kind, beta, group=None, need_hidden=True, need_weight=True,
                            divergences=False):  # fmt: skip
    """(dX, dW, db) of ``Σ ddiv · divergence``: each chunk's student logits (re)computed, the divergence's gradient
    in them (``divergence_grad``), then the two GEMMs on this rank's vocab shard. With ``divergences`` the per-token
    divergences ``[T]`` too, a fourth element: the forward pass and the gradient in one (``ddiv`` known before)."""
    t = s_hidden.shape[0]
    v_local = s_weight.shape[0]
    rank = dist.get_rank(group) if group is not None and dist.get_world_size(group) > 1 else 0
    dx = torch.zeros_like(s_hidden) if need_hidden else s_hidden.new_empty(0)
    dw = (
        torch.zeros(s_weight.shape, dtype=torch.float32, device=s_weight.device)
        if need_weight
        else s_weight.new_empty(0)
    )
    need_bias = s_bias is not None and need_weight
    db = torch.zeros(v_local, dtype=torch.float32, device=s_weight.device) if need_bias else s_weight.new_empty(0)
    div = torch.empty(t if divergences else 0, dtype=torch.float32, device=s_hidden.device)
    for a in range(0, t, chunk):
        b = min(t, a + chunk)
        x = _full_chunk(s_hidden[a:b], s_weight, s_bias, inv_temp, n_valid, group)
        if t_logp is None:
            te = torch.log_softmax(_full_chunk(t_hidden[a:b], t_weight, t_bias, inv_temp, n_valid, group), -1)
        else:
            te = t_logp[a:b, :n_valid].float()
        s = torch.log_softmax(x, -1)
        del x
        if divergences:
            div[a:b] = divergence(s, te, kind, beta)
        g = divergence_grad(s, te, kind, beta) * ddiv[a:b, None]
        local = torch.zeros((b - a, v_local), dtype=torch.float32, device=g.device)
        lo = rank * v_local
        width = max(0, min(v_local, n_valid - lo))
        local[:, :width] = g[:, lo : lo + width]
        local = (local * inv_temp).to(s_hidden.dtype)
        if need_hidden:
            dx[a:b] = gemm.mm(local, s_weight)
        if need_weight:
            dw.add_(gemm.mm(local.t(), s_hidden[a:b]).float())
            if need_bias:
                db += local.float().sum(0)
    grads = dx, dw.to(s_weight.dtype), db.to(s_weight.dtype)
    return (*grads, div) if divergences else grads


@torch.library.custom_op("megakernels::linear_distill_fwd", mutates_args=())
def _distill_fwd(
    s_hidden: torch.Tensor,
    s_weight: torch.Tensor,
    s_bias: torch.Tensor | None,
    t_hidden: torch.Tensor | None,
    t_weight: torch.Tensor | None,
    t_bias: torch.Tensor | None,
    t_logp: torch.Tensor | None,
    chunk: int,
    inv_temp: float,
    n_valid: int,
    kind: str,
    beta: float,
) -> torch.Tensor:
    return distill_forward_chunks(
        s_hidden, s_weight, s_bias, t_hidden, t_weight, t_bias, t_logp, chunk, inv_temp, n_valid, kind, beta
    )


@_distill_fwd.register_fake
def _(s_hidden, s_weight, s_bias, t_hidden, t_weight, t_bias, t_logp, chunk, inv_temp, n_valid, kind, beta):
    return s_hidden.new_empty(s_hidden.shape[0], dtype=torch.float32)


@torch.library.custom_op("megakernels::linear_distill_bwd", mutates_args=())
def _distill_bwd(
    s_hidden: torch.Tensor,
    s_weight: torch.Tensor,
    s_bias: torch.Tensor | None,
    t_hidden: torch.Tensor | None,
    t_weight: torch.Tensor | None,
    t_bias: torch.Tensor | None,
    t_logp: torch.Tensor | None,
    ddiv: torch.Tensor,
    chunk: int,
    inv_temp: float,
    n_valid: int,
    kind: str,
    beta: float,
    need_hidden: bool,
    need_weight: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return distill_backward_chunks(
        s_hidden, s_weight, s_bias, t_hidden, t_weight, t_bias, t_logp, ddiv, chunk, inv_temp, n_valid, kind, beta,
        None, need_hidden, need_weight,
    )  # fmt: skip


@_distill_bwd.register_fake
def _(s_hidden, s_weight, s_bias, t_hidden, t_weight, t_bias, t_logp, ddiv, chunk, inv_temp, n_valid, kind, beta,
      need_hidden, need_weight):  # fmt: skip
    dx = torch.empty_like(s_hidden) if need_hidden else s_hidden.new_empty(0)
    dw = torch.empty_like(s_weight) if need_weight else s_weight.new_empty(0)
    db = s_weight.new_empty(s_weight.shape[0] if s_bias is not None and need_weight else 0)
    return dx, dw, db


def _distill_rows(s_hidden, t_hidden, group, sp: bool):
    """``(comm, shape, x, tx)``: whether ``group`` has several ranks, the student's full hidden shape, and the
    student's and teacher's (or None) rows ``[tokens, h]`` (gathered over ``group`` under sequence parallelism)."""
    comm = group is not None and dist.get_world_size(group) > 1
    full = gather_rows(s_hidden, group) if sp and comm else s_hidden
    tx = None
    if t_hidden is not None:
        tfull = gather_rows(t_hidden, group) if sp and comm else t_hidden
        tx = tfull.reshape(-1, tfull.shape[-1]).contiguous()
    return comm, full.shape, full.reshape(-1, full.shape[-1]).contiguous(), tx


def _hidden_grad(dx, shape, group, sp: bool, comm: bool):
    """The student's hidden gradient ``[tokens, h]`` back in ``shape``: this rank's rows of the sum over ``group``
    under sequence parallelism (reduce-scatter), else the sum itself (all-reduce)."""
    dx = dx.view(shape)
    if comm:
        if sp:
            return reduce_scatter_rows(dx, group)
        if dx.device.type != "meta":
            dist.all_reduce(dx, group=group)
    return dx


class _Distill(torch.autograd.Function):
    @staticmethod
    def forward(ctx, s_hidden, s_weight, s_bias, t_hidden, t_weight, t_bias, t_logp, chunk, inv_temp, n_valid, kind,
                beta, group, sp):  # fmt: skip
        comm, shape, x, tx = _distill_rows(s_hidden, t_hidden, group, sp)
        args = (chunk, inv_temp, n_valid, kind, beta)
        if comm:  # the gathered vocabulary: collectives inside the chunks, outside the custom op
            div = distill_forward_chunks(x, s_weight, s_bias, tx, t_weight, t_bias, t_logp, *args, group=group)
        else:
            div = _distill_fwd(x, s_weight, s_bias, tx, t_weight, t_bias, t_logp, *args)
        ctx.save_for_backward(s_hidden, s_weight, s_bias, t_hidden, t_weight, t_bias, t_logp)
        ctx.args, ctx.group, ctx.sp, ctx.shape = args, group, sp, shape
        return div

    @staticmethod
    def backward(ctx, ddiv):
        s_hidden, s_weight, s_bias, t_hidden, t_weight, t_bias, t_logp = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
        group, sp = ctx.group, ctx.sp
        comm, _, x, tx = _distill_rows(s_hidden, t_hidden, group, sp)
        ddiv = ddiv.float().contiguous()
        if comm:
            dx, dw, db = distill_backward_chunks(
                x, s_weight, s_bias, tx, t_weight, t_bias, t_logp, ddiv, ctx.args[0], ctx.args[1], ctx.args[2],
                ctx.args[3], ctx.args[4], group, need_hidden, need_weight,
            )  # fmt: skip
        else:
            dx, dw, db = _distill_bwd(
                x, s_weight, s_bias, tx, t_weight, t_bias, t_logp, ddiv, *ctx.args, need_hidden, need_weight
            )
        if need_hidden:
            dx = _hidden_grad(dx, ctx.shape, group, sp, comm)
        return (
            dx if need_hidden else None,
            dw if ctx.needs_input_grad[1] else None,
            db if s_bias is not None and ctx.needs_input_grad[2] else None,
        ) + (None,) * 11


class _DistillInForward(torch.autograd.Function):
    """``Σ ddiv · divergence`` with ``ddiv`` known before (the mask over the normaliser): the gradient taken with the
    divergences, chunk by chunk (student and teacher logits once each), the backward scaling it."""

    @staticmethod
    def forward(ctx, s_hidden, s_weight, s_bias, t_hidden, t_weight, t_bias, t_logp, ddiv, args, group, sp, need):
        comm, shape, x, tx = _distill_rows(s_hidden, t_hidden, group, sp)
        need_hidden, need_weight = need
        dx, dw, db, div = distill_backward_chunks(
            x, s_weight, s_bias, tx, t_weight, t_bias, t_logp, ddiv, *args, group, need_hidden, need_weight, True
        )
        if need_hidden:
            dx = _hidden_grad(dx, shape, group, sp, comm)
        ctx.grads = (dx if need_hidden else None, dw if need_weight else None)
        ctx.grads += (db if need_weight and s_bias is not None else None,)
        return (div * ddiv).sum()

    @staticmethod
    def backward(ctx, g):
        grads = tuple(None if t is None else t * g for t in ctx.grads)
        ctx.grads = None
        return grads + (None,) * 9


def distill_loss(
    hidden, weight, target, *, teacher_hidden=None, teacher_weight=None, teacher_logprobs=None, kind="jsd", beta=0.5,
    temperature=1.0, teacher_bias=None, num_items_in_batch=None, **head,
):  # fmt: skip
    """Knowledge distillation, token by token, the student's logits never held whole (nor the teacher's, given as
    hidden states and head): the mean over labelled tokens (``target`` != ``ignore_index``; or the sum over
    ``num_items_in_batch``) of ``divergence(student, teacher)`` (``kind``: one of ``DIVERGENCES``; ``beta`` the
    generalised JSD's weight), both distributions at ``temperature``.

    Args:
        hidden, weight, target: the student's hidden states ``[..., h]``, LM head and labels (only their mask is read).
        teacher_hidden, teacher_weight (+ ``teacher_bias``): the teacher's hidden states (same leading shape) and full
            LM head (the teacher's vocabulary = the student's); or ``teacher_logprobs`` ``[..., V]``: its
            log-probabilities at the temperature. The teacher gets no gradient.
        head: ``group``, ``vocab_size``, ``chunk_tokens``, ``bias``, ``sequence_parallel``, ``ignore_index`` as
            ``linear_cross_entropy`` (with ``group`` the teacher's head is sharded like the student's).

    Returns:
        The scalar loss (fp32).

    Raises:
        ValueError: neither or both teacher forms, an unknown ``kind``, ``beta`` outside [0, 1], mismatched shapes;
        what ``linear_cross_entropy`` raises for the student's arguments.
    """
    op = "distill_loss"
    if kind not in DIVERGENCES:
        raise ValueError(f"{op}: kind must be one of {', '.join(DIVERGENCES)}, got {kind!r}")
    beta = _checks.real(op, "beta", beta)
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"{op}: beta must be in [0, 1], got {beta}")
    temperature = _checks.real(op, "temperature", temperature)
    if not temperature > 0:
        raise ValueError(f"{op}: temperature must be > 0, got {temperature}")
    if (teacher_logprobs is None) == (teacher_hidden is None or teacher_weight is None):
        raise ValueError(f"{op}: give the teacher as teacher_hidden and teacher_weight, or as teacher_logprobs")
    group, sp = head.get("group"), bool(head.get("sequence_parallel", False))
    ignore_index, vocab, _, chunk = check_head(
        op, hidden, weight, target, head.get("ignore_index", -100), 0.0, group, head.get("vocab_size"),
        head.get("chunk_tokens"), head.get("bias"), sp,
    )  # fmt: skip
    if teacher_hidden is not None:
        if teacher_hidden.shape[:-1] != hidden.shape[:-1] or teacher_weight.shape[0] != weight.shape[0]:
            raise ValueError(
                f"{op}: teacher_hidden must have hidden's leading shape {tuple(hidden.shape[:-1])} and teacher_weight "
                f"{weight.shape[0]} rows (the student's vocabulary shard)"
            )
        t_logp = None
        th, tw = teacher_hidden.detach(), teacher_weight.detach()
    else:
        if teacher_logprobs.shape[:-1] != target.shape or teacher_logprobs.shape[-1] < vocab:
            raise ValueError(f"{op}: teacher_logprobs must be {tuple(target.shape)} + [V >= {vocab}]")
        t_logp = teacher_logprobs.detach().reshape(-1, teacher_logprobs.shape[-1]).contiguous()
        th = tw = None
    bias = head.get("bias")
    mask = (target.reshape(-1) != ignore_index).float()
    if num_items_in_batch is not None:
        denom = num_items_in_batch.to(mask.device) if torch.is_tensor(num_items_in_batch) else num_items_in_batch
    else:
        denom = mask.sum().clamp(min=1.0)
    grad = torch.is_grad_enabled()
    need = (grad and hidden.requires_grad, grad and (weight.requires_grad or (bias is not None and bias.requires_grad)))
    if any(need) and not torch.compiler.is_compiling() and hidden.device.type != "meta":
        args = (chunk, 1.0 / temperature, vocab, kind, beta)
        tb = None if teacher_bias is None else teacher_bias.detach()
        return _DistillInForward.apply(
            hidden, weight.contiguous(), None if bias is None else bias.contiguous(), th, tw, tb, t_logp,
            (mask / denom).float().detach(), args, group, sp, need,
        )  # fmt: skip
    div = _Distill.apply(
        hidden, weight.contiguous(), None if bias is None else bias.contiguous(), th, tw,
        None if teacher_bias is None else teacher_bias.detach(), t_logp, chunk, 1.0 / temperature, vocab, kind, beta,
        group, sp,
    )  # fmt: skip
    return (div * mask).sum() / denom
