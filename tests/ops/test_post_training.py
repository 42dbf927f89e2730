"""The post-training losses (megakernels.ops.logprobs, megakernels.ops.post_training): forward and gradients against
plain full-logits fp64 implementations and against TRL's own loss code, with -100 masking, padding, packed sequences,
temperature, several chunks, a bias and a padded vocabulary; the custom ops pass opcheck; under a vocab-parallel
group of 2 (and sequence parallelism) they equal the unsharded op."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F
import trl.experimental.gkd.gkd_trainer as gkd
from trl.experimental.cpo.cpo_trainer import CPOTrainer
from trl.experimental.orpo.orpo_trainer import ORPOTrainer

from megakernels.ops import logprobs as lp_ops
from megakernels.ops import post_training as pt
from tests.parallel.harness import run_world

V, H = 40, 16


def _setup(seqs=6, length=9, seed=0, vocab_pad=6):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(seqs, length, H, generator=g)
    weight = torch.randn(V + vocab_pad, H, generator=g) * 0.5
    bias = torch.randn(V + vocab_pad, generator=g) * 0.1
    target = torch.randint(0, V, (seqs, length), generator=g)
    target[:, :3] = -100  # prompts
    target[1, -2:] = -100  # padding
    return hidden, weight, bias, target


def _leaves(*ts):
    return [t.detach().clone().requires_grad_() for t in ts]


def _full_logp(hidden, weight, bias, target, temperature=1.0):
    """fp64 per-token log-probabilities and log-distributions from the whole logits (the reference)."""
    logits = (hidden.double() @ weight.double().T + bias.double())[..., :V] / temperature
    logq = torch.log_softmax(logits, -1)
    logp = logq.gather(-1, target.clamp(min=0)[..., None])[..., 0] * (target != -100)
    return logp, logq


def _grads(loss, leaves):
    return torch.autograd.grad(loss, leaves)


def _close(got, ref, atol=2e-5, rtol=2e-4):
    for a, b in zip(got, ref):
        torch.testing.assert_close(a.double(), b.double(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("temperature, entropy", [(1.0, False), (0.7, True), (1.0, True)])
def test_logprobs_and_entropy_match_the_full_logits(temperature, entropy):
    hidden, weight, bias, target = _setup()
    h, w, b = _leaves(hidden, weight, bias)
    out = lp_ops.linear_logprobs(
        h, w, target, vocab_size=V, bias=b, temperature=temperature, entropy=entropy, chunk_tokens=7
    )
    logp, ent = out if entropy else (out, None)
    h2, w2, b2 = _leaves(hidden.double(), weight.double(), bias.double())
    ref_lp, ref_ent = lp_ops.linear_logprobs_reference(h2, w2, target, vocab_size=V, bias=b2, temperature=temperature)
    torch.testing.assert_close(logp.double(), ref_lp, atol=2e-5, rtol=1e-5)
    assert (logp[target == -100] == 0).all()
    dl = torch.randn_like(logp)
    loss, ref_loss = (logp * dl).sum(), (ref_lp * dl.double()).sum()
    if entropy:
        torch.testing.assert_close(ent.double(), ref_ent, atol=2e-5, rtol=1e-5)
        de = torch.randn_like(ent)
        loss, ref_loss = loss + (ent * de).sum(), ref_loss + (ref_ent * de.double()).sum()
    _close(_grads(loss, [h, w, b]), _grads(ref_loss, [h2, w2, b2]))


def test_the_logprobs_custom_ops_pass_opcheck():
    hidden, weight, bias, target = _setup(seqs=2, length=5)
    x, t = hidden.reshape(-1, H), target.reshape(-1)
    torch.library.opcheck(torch.ops.megakernels.linear_logprobs_stats, (x, weight, bias, t, 0, V, 4, 0.5))
    lse = torch.randn(x.shape[0])
    args = (x, weight, bias, t, lse, torch.randn(x.shape[0]), torch.randn(x.shape[0]), torch.randn(x.shape[0]))
    torch.library.opcheck(torch.ops.megakernels.linear_logprobs_grad, (*args, 0, V, 4, 0.5, True, True))


def _pairs_ref(logp, target):
    mask = (target != -100).double()
    return logp.sum(1), mask.sum(1)


@pytest.mark.parametrize("loss_type", pt.PREFERENCE_LOSSES)
def test_dpo_matches_the_full_logits_reference(loss_type):
    hidden, weight, bias, target = _setup()
    ref = torch.randn(6, generator=torch.Generator().manual_seed(1))
    smoothing = 0.1 if loss_type == "sigmoid" else 0.0
    h, w = _leaves(hidden, weight)
    out = pt.dpo_loss(h, w, target, ref, beta=0.2, loss_type=loss_type, label_smoothing=smoothing, vocab_size=V,
                      chunk_tokens=5)  # fmt: skip
    h2, w2 = _leaves(hidden.double(), weight.double())
    logp, _ = _full_logp(h2, w2, torch.zeros(V + 6), target)
    sums, counts = _pairs_ref(logp, target)
    (c, r), (rc, rr) = sums.chunk(2), ref.double().chunk(2)
    d = (c - rc) - (r - rr)
    if loss_type == "sigmoid":
        ref_loss = (-(1 - smoothing) * F.logsigmoid(0.2 * d) - smoothing * F.logsigmoid(-0.2 * d)).mean()
    elif loss_type == "hinge":
        ref_loss = torch.relu(1 - 0.2 * d).mean()
    else:
        lc, lr = counts.chunk(2)
        ref_loss = (((c - rc) / lc - (r - rr) / lr - 1 / 0.4) ** 2).mean()
    torch.testing.assert_close(out.loss.double(), ref_loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.chosen_rewards.double(), 0.2 * (c - rc).detach(), atol=1e-5, rtol=1e-5)
    assert out.accuracy == ((c - rc) > (r - rr)).float().mean()
    _close(_grads(out.loss, [h, w]), _grads(ref_loss, [h2, w2]))


def test_packed_sequences_give_the_rows_result():
    """Six sequences packed into two rows (their ids beside the tokens) give the per-row layout's loss and
    gradient."""
    hidden, weight, _, target = _setup()
    ref = torch.randn(6)
    h, w = _leaves(hidden, weight)
    rows = pt.dpo_loss(h, w, target, ref, vocab_size=V)
    packed_h, packed_t = h.reshape(2, 27, H), target.reshape(2, 27)
    seq = torch.arange(6).repeat_interleave(9).reshape(2, 27)
    packed = pt.dpo_loss(packed_h, w, packed_t, ref, sequences=seq, vocab_size=V)
    torch.testing.assert_close(packed.loss, rows.loss)
    _close(_grads(packed.loss, [h, w]), _grads(rows.loss, [h, w]), atol=1e-6)


def _trl_stub(cls, **fields):
    """A TRL trainer object holding only what its loss method reads."""
    return types.SimpleNamespace(**fields, accelerator=types.SimpleNamespace(device=torch.device("cpu")))


def test_orpo_simpo_and_cpo_match_trls_losses():
    hidden, weight, _, target = _setup()
    h, w = _leaves(hidden, weight)
    logp, _ = _full_logp(hidden, weight, torch.zeros(V + 6), target)
    sums, counts = _pairs_ref(logp, target)
    avg = sums / counts
    c_avg, r_avg = avg.float().chunk(2)
    c_sum, r_sum = sums.float().chunk(2)

    orpo = pt.orpo_loss(h, w, target, beta=0.1, vocab_size=V)
    stub = _trl_stub(ORPOTrainer, beta=0.1)
    trl_losses = ORPOTrainer.odds_ratio_loss(stub, c_avg, r_avg)[0]
    nll = -c_sum.sum() / counts.chunk(2)[0].sum()
    torch.testing.assert_close(orpo.loss, (nll - trl_losses.mean()).float(), atol=1e-5, rtol=1e-5)  # TRL's total

    for loss_type, kwargs, ours in (
        ("simpo", dict(simpo_gamma=1.0), lambda: pt.simpo_loss(h, w, target, beta=2.0, gamma=1.0, vocab_size=V)),
        ("sigmoid", {}, lambda: pt.cpo_loss(h, w, target, beta=0.1, alpha=0.0, vocab_size=V)),
    ):
        beta = 2.0 if loss_type == "simpo" else 0.1
        stub = _trl_stub(CPOTrainer, beta=beta, loss_type=loss_type, label_smoothing=0.0, alpha=0.0, **kwargs)
        c, r = (c_avg, r_avg) if loss_type == "simpo" else (c_sum, r_sum)
        trl_losses = CPOTrainer.cpo_loss(stub, c, r)[0]
        torch.testing.assert_close(ours().loss, trl_losses.mean().float(), atol=1e-5, rtol=1e-5)


def test_kto_matches_the_formula():
    hidden, weight, _, target = _setup()
    ref, desirable = torch.randn(6), torch.tensor([True, False, True, True, False, False])
    kl_logps, ref_kl = torch.randn(4), torch.randn(4)
    h, w = _leaves(hidden, weight)
    out = pt.kto_loss(h, w, target, ref, desirable, kl_logps, ref_kl, beta=0.3, desirable_weight=1.2, vocab_size=V)
    logp, _ = _full_logp(hidden, weight, torch.zeros(V + 6), target)
    ratio = logp.sum(1) - ref.double()
    kl = (kl_logps - ref_kl).mean().clamp(min=0).double()
    want = torch.where(desirable, 1.2 * (1 - torch.sigmoid(0.3 * (ratio - kl))), 1 - torch.sigmoid(0.3 * (kl - ratio)))
    torch.testing.assert_close(out.loss.double(), want.mean(), atol=1e-5, rtol=1e-5)


def _trl_grpo(logp, old, ref, adv, mask, loss_type, level, beta, eps_low, eps_high, max_len, n_items):
    """TRL's GRPOTrainer._compute_loss arithmetic, on fp64 per-token log-probabilities."""
    log_ratio = logp - old
    if level == "sequence":
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0))[:, None]
    c1, adv = torch.exp(log_ratio), adv[:, None]
    if loss_type == "cispo":
        ptl = -torch.clamp(c1, max=eps_high).detach() * adv * logp
    else:
        ptl = -torch.min(c1 * adv, torch.clamp(c1, 1 - eps_low, 1 + eps_high) * adv)
    ptl = ptl + beta * (torch.exp(ref - logp) - (ref - logp) - 1)
    if loss_type == "grpo":
        return ((ptl * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "bnpo":
        return (ptl * mask).sum() / mask.sum()
    if loss_type == "dr_grpo":
        return (ptl * mask).sum() / (ptl.shape[0] * max_len)
    return (ptl * mask).sum() / n_items


@pytest.mark.parametrize("loss_type", pt.GRPO_LOSSES)
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_grpo_family_matches_trls_arithmetic_on_the_full_logits(loss_type, level):
    hidden, weight, bias, target = _setup()
    g = torch.Generator().manual_seed(2)
    adv = torch.randn(6, generator=g)
    base, _ = _full_logp(hidden, weight, bias, target, temperature=0.9)
    mask = (target != -100).double()
    old = (base.float() + 0.01 * torch.randn(6, 9, generator=g)) * mask.float()
    ref = base.float() + 0.01 * torch.randn(6, 9, generator=g)
    eps_high = 5.0 if loss_type == "cispo" else 0.28
    h, w, b = _leaves(hidden, weight, bias)
    out = pt.grpo_loss(h, w, target, adv, old_logps=old, ref_logps=ref, loss_type=loss_type, beta=0.04,
                       epsilon_high=eps_high, importance_sampling=level, max_completion_length=9,
                       num_items_in_batch=torch.tensor(20.0), temperature=0.9, vocab_size=V, bias=b,
                       chunk_tokens=11)  # fmt: skip
    h2, w2, b2 = _leaves(hidden.double(), weight.double(), bias.double())
    logp, logq = _full_logp(h2, w2, b2, target, temperature=0.9)
    ref_loss = _trl_grpo(logp, old.double(), ref.double(), adv.double(), mask, loss_type, level, 0.04, 0.2, eps_high,
                         9, 20.0)  # fmt: skip
    torch.testing.assert_close(out.loss.double(), ref_loss, atol=1e-5, rtol=1e-5)
    entropy = -(logq.exp() * logq).sum(-1)
    torch.testing.assert_close(out.entropy.double(), (entropy * mask).sum() / mask.sum(), atol=1e-5, rtol=1e-5)
    _close(_grads(out.loss, [h, w, b]), _grads(ref_loss, [h2, w2, b2]))


def test_the_entropy_bonus_reaches_the_gradient():
    hidden, weight, _, target = _setup()
    h, w = _leaves(hidden, weight)
    adv = torch.zeros(6)  # no policy gradient: the bonus alone
    out = pt.grpo_loss(h, w, target, adv, entropy_coef=0.5, vocab_size=V)
    h2, w2 = _leaves(hidden.double(), weight.double())
    _, logq = _full_logp(h2, w2, torch.zeros(V + 6), target)
    mask = (target != -100).double()
    ref = -0.5 * ((-(logq.exp() * logq).sum(-1)) * mask).sum() / mask.sum()
    torch.testing.assert_close(out.loss.double(), ref, atol=1e-6, rtol=1e-5)
    _close(_grads(out.loss, [h, w]), _grads(ref, [h2, w2]))


def _each_loss(h, w, target, **kw):
    """Every chunked-by-sequence loss on the same inputs: name -> (loss, its detached figures)."""
    g = torch.Generator().manual_seed(4)
    ref, adv = torch.randn(6, generator=g), torch.randn(6, generator=g)
    old = 0.05 * torch.randn(6, 9, generator=g) - 3.0
    desirable = torch.tensor([True, False, True, True, False, False])
    out = {}
    dpo = pt.dpo_loss(h, w, target, ref, beta=0.2, label_smoothing=0.1, **kw)
    out["dpo"] = dpo.loss, [dpo.chosen_rewards, dpo.rejected_rewards, dpo.chosen_logps, dpo.accuracy]
    ipo = pt.dpo_loss(h, w, target, ref, loss_type="ipo", **kw)
    out["ipo"] = ipo.loss, [ipo.margins]
    orpo = pt.orpo_loss(h, w, target, **kw)
    out["orpo"] = orpo.loss, [orpo.nll, orpo.chosen_rewards]
    simpo = pt.simpo_loss(h, w, target, **kw)
    out["simpo"] = simpo.loss, [simpo.rejected_logps]
    cpo = pt.cpo_loss(h, w, target, alpha=0.5, **kw)
    out["cpo"] = cpo.loss, [cpo.nll]
    kto = pt.kto_loss(h, w, target, ref, desirable, ref[:3], ref[3:], **kw)
    out["kto"] = kto.loss, [kto.chosen_rewards, kto.rejected_rewards]
    for level in ("token", "sequence"):
        grpo = pt.grpo_loss(h, w, target, adv, old_logps=old, ref_logps=old + 0.1, beta=0.04, loss_type="bnpo",
                            importance_sampling=level, entropy_coef=0.1, temperature=0.8, **kw)  # fmt: skip
        out[f"grpo-{level}"] = grpo.loss, [grpo.kl, grpo.entropy, grpo.clip_fraction]
    t_hidden, t_weight = torch.randn(*h.shape, generator=g), torch.randn(*w.shape, generator=g)
    kw = {k: v for k, v in kw.items() if k != "bias"}
    out["jsd"] = pt.distill_loss(h, w, target, teacher_hidden=t_hidden, teacher_weight=t_weight, beta=0.3, **kw), []
    return out


def test_the_gradient_taken_in_the_forward_pass_equals_the_recomputing_path(monkeypatch):
    """The losses' default path takes the gradient in the forward pass, chunks of whole pairs / sequences (and
    distillation's, token chunks); where a pair is more than MAX_UNIT_CHUNKS chunks, and under torch.compile, they
    differentiate through the recomputing custom ops instead. All give the same loss, figures and gradients (scaled
    by the upstream gradient), and the same loss under no_grad."""
    from megakernels.ops import chunked_loss

    calls = []
    real = chunked_loss.linear_logprobs
    monkeypatch.setattr(chunked_loss, "linear_logprobs", lambda *a, **k: calls.append(1) or real(*a, **k))
    hidden, weight, bias, target = _setup()
    results = {}
    # a pair's 12 labelled tokens: 3 chunks of 5 (in the forward), 12 of 1 (recomputing); "compiled": recomputing
    for case, chunk in (("forward", 5), ("large pairs", 1), ("compiled", 5)):
        calls.clear()
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: case == "compiled")
        h, w, b = _leaves(hidden, weight, bias)
        losses = _each_loss(h, w, target, vocab_size=V, bias=b, chunk_tokens=chunk)
        assert bool(calls) == (case != "forward")
        grads = {name: _grads(2.5 * loss, [h, w, b] if name != "jsd" else [h, w]) for name, (loss, _) in losses.items()}
        with torch.no_grad():
            quiet = {name: loss for name, (loss, _) in _each_loss(h, w, target, vocab_size=V, bias=b,
                                                                     chunk_tokens=chunk).items()}  # fmt: skip
        results[case] = losses, grads, quiet
    fast, fast_grads, _ = results["forward"]
    for case in results:
        other, other_grads, quiet = results[case]
        for name in fast:
            msg = f"{name}, {case}"
            torch.testing.assert_close(other[name][0], fast[name][0], atol=1e-6, rtol=1e-5, msg=msg)
            torch.testing.assert_close(quiet[name], fast[name][0].detach(), atol=1e-6, rtol=1e-5, msg=msg)
            for a, b in zip(other[name][1], fast[name][1]):
                assert not a.requires_grad
                torch.testing.assert_close(a.float(), b.float(), atol=1e-6, rtol=1e-5, msg=msg)
            _close(other_grads[name], fast_grads[name])


def test_group_advantages():
    rewards = torch.tensor([1.0, 0.0, 0.0, 3.0, 3.0, 3.0])
    adv = pt.group_advantages(rewards, 3)
    torch.testing.assert_close(adv[:3], (rewards[:3] - 1 / 3) / (rewards[:3].std() + 1e-4))
    assert torch.equal(adv[3:], torch.zeros(3))
    with pytest.raises(ValueError, match="groups of 4"):
        pt.group_advantages(rewards, 4)


@pytest.mark.parametrize("kind, beta", [("forward_kl", 0.5), ("reverse_kl", 0.5), ("jsd", 0.3), ("jsd", 0.0)])
@pytest.mark.parametrize("teacher", ["hidden", "logprobs"])
def test_distillation_matches_trls_generalised_jsd(kind, beta, teacher):
    hidden, weight, _, target = _setup()
    g = torch.Generator().manual_seed(3)
    t_hidden, t_weight = torch.randn(6, 9, H, generator=g), torch.randn(V + 6, H, generator=g) * 0.5
    temperature = 1.5
    h, w = _leaves(hidden, weight)
    t_logits = (t_hidden.double() @ t_weight.double().T)[..., :V]
    if teacher == "hidden":
        extra = dict(teacher_hidden=t_hidden, teacher_weight=t_weight)
    else:
        extra = dict(teacher_logprobs=torch.log_softmax(t_logits / temperature, -1).float())
    out = pt.distill_loss(h, w, target, kind=kind, beta=beta, temperature=temperature, vocab_size=V, chunk_tokens=8,
                          **extra)  # fmt: skip
    h2, w2 = _leaves(hidden.double(), weight.double())
    s_logits = (h2 @ w2.T)[..., :V]
    trl_beta = {"forward_kl": 0.0, "reverse_kl": 1.0, "jsd": beta}[kind]
    ref = gkd.GKDTrainer.generalized_jsd_loss(s_logits, t_logits, labels=target, beta=trl_beta, temperature=temperature)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    _close(_grads(out, [h, w]), _grads(ref, [h2, w2]))


def test_the_distillation_custom_ops_pass_opcheck():
    hidden, weight, _, _ = _setup(seqs=2, length=4)
    x = hidden.reshape(-1, H)
    t = torch.log_softmax(torch.randn(x.shape[0], V), -1)
    fwd = (x, weight, None, None, None, None, t, 3, 1.0, V, "jsd", 0.5)
    torch.library.opcheck(torch.ops.megakernels.linear_distill_fwd, fwd)
    bwd = (x, weight, None, None, None, None, t, torch.randn(x.shape[0]), 3, 1.0, V, "jsd", 0.5, True, True)
    torch.library.opcheck(torch.ops.megakernels.linear_distill_bwd, bwd)


def test_bad_arguments_are_named():
    hidden, weight, _, target = _setup()
    with pytest.raises(ValueError, match="loss_type"):
        pt.dpo_loss(hidden, weight, target, torch.zeros(6), loss_type="nope", vocab_size=V)
    with pytest.raises(ValueError, match="ref_logps"):
        pt.dpo_loss(hidden, weight, target, torch.zeros(5), vocab_size=V)
    with pytest.raises(ValueError, match="2·B sequences"):
        pt.cpo_loss(hidden[:5], weight, target[:5], vocab_size=V)
    with pytest.raises(ValueError, match="ref_logps"):
        pt.grpo_loss(hidden, weight, target, torch.zeros(6), beta=0.1, vocab_size=V)
    with pytest.raises(ValueError, match="max_completion_length"):
        pt.grpo_loss(hidden, weight, target, torch.zeros(6), loss_type="dr_grpo", vocab_size=V)
    with pytest.raises(ValueError, match="teacher"):
        pt.distill_loss(hidden, weight, target, vocab_size=V)
    with pytest.raises(ValueError, match="temperature"):
        lp_ops.linear_logprobs(hidden, weight, target, temperature=0.0, vocab_size=V)


def _sharded_world(rank, world):
    """In a TP group of 2: logprobs with entropy, JSD distillation and DPO, plain and sequence-parallel, and GRPO
    (plain), against the same ops unsharded on this rank; returns the largest differences."""
    import torch.distributed as dist

    group = dist.group.WORLD
    hidden, weight, bias, target = _setup(seqs=4, length=6)
    g = torch.Generator().manual_seed(5)
    t_hidden, t_weight = torch.randn(4, 6, H, generator=g), torch.randn(V + 6, H, generator=g)
    vl = (V + 6) // world
    rows = slice(rank * vl, (rank + 1) * vl)
    coef = torch.arange(24.0).view(4, 6)

    refs, adv = torch.randn(4, generator=g), torch.randn(4, generator=g)

    def run(h, w, b, tw, grp, sp, grpo):
        tgt, th, c, ids = target, t_hidden, coef, None
        if sp:  # [s, b, h], this rank's sequence shard
            h, th = (x.transpose(0, 1).chunk(world)[rank] for x in (h, th))
            tgt, c, ids = target.t(), coef.t(), torch.arange(4)[None, :].expand(6, 4)
        kw = dict(group=grp, vocab_size=V, sequence_parallel=sp, chunk_tokens=5)
        logp, ent = lp_ops.linear_logprobs(h, w, tgt, bias=b, temperature=0.8, entropy=True, **kw)
        jsd = pt.distill_loss(h, w, tgt, teacher_hidden=th, teacher_weight=tw, kind="jsd", beta=0.4, **kw)
        dpo = pt.dpo_loss(h, w, tgt, refs, sequences=ids, bias=b, **kw).loss
        total = (logp * c).sum() + ent.sum() + jsd + dpo
        if grpo:
            total = total + pt.grpo_loss(h, w, tgt, adv, loss_type="bnpo", entropy_coef=0.1, temperature=0.8, bias=b,
                                         **kw).loss  # fmt: skip
        return total

    worst = 0.0
    for sp in (False, True):
        h, w, b = _leaves(hidden, weight, bias)
        full = run(h, w, b, t_weight, None, False, not sp)
        ref = torch.autograd.grad(full, [h, w, b])
        h2, w2, b2 = _leaves(hidden, weight, bias)
        loss = run(h2, w2[rows], b2[rows], t_weight[rows], group, sp, not sp)
        sharded = torch.autograd.grad(loss, [h2, w2, b2])
        worst = max(worst, abs(float(loss) - float(full)) / abs(float(full)))  # the whole loss on every rank
        gh = sharded[0].clone()
        if sp:
            dist.all_reduce(gh)  # each rank's sequence shard's gradient
        worst = max(worst, float((gh - ref[0]).abs().max() / ref[0].abs().max()))
        for got, want in zip(sharded[1:], ref[1:]):
            worst = max(worst, float((got[rows] - want[rows]).abs().max() / want.abs().max()))
    return worst


def test_vocab_and_sequence_parallel_equal_the_unsharded_ops():
    assert max(run_world(2, _sharded_world, timeout=120)) < 1e-5
