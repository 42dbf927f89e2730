"""Mixture of experts against plain PyTorch written out here (fp64, one token at a time): the router's top-k and
its losses (DeepSeek-V3's sequence-wise balance loss included), permutation and capacity dropping, the whole
layer's output and every gradient (the auxiliary losses' included); then the layer split over tensor-, sequence-
and expert-parallel ranks against the single process, in one world of 4 gloo processes, with each token dispatcher
(all-to-all, overlapped chunks, all-gather, a registered external one)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import megakernels.parallel as mp
from megakernels.parallel import init
from megakernels.parallel.launch import single_process_world
from megakernels.parallel.moe import MoELayer, dispatcher, permute, set_aux_loss_scale, unpermute
from megakernels.parallel.moe.router import TopKRouter
from tests.parallel.checks import Checks, assert_close, block, randn

H, F_, E, K = 8, 12, 4, 2
S, B = 8, 2
CHECKS = Checks()


def _expert(x, fc1, fc2):
    gate, up = (x @ fc1.t()).split(F_, -1)
    return (F.silu(gate) * up) @ fc2.t()


def moe_reference(x, router, fc1, fc2, top_k=K, normalize=True, capacity=None):
    """``x`` [T, h]; per token: softmax router, top-k, renormalised weights, the weighted sum of its experts' SwiGLU
    MLPs (an assignment past an expert's capacity, in token order, contributes nothing). Also the Switch and z
    losses."""
    logits = x @ router.t()
    probs = logits.softmax(-1)
    w, idx = probs.topk(top_k, -1)
    if normalize:
        w = w / w.sum(-1, keepdim=True)
    used = [0] * router.shape[0]
    out = []
    for t in range(x.shape[0]):
        y = torch.zeros_like(x[t])
        for j in range(top_k):
            e = int(idx[t, j])
            if capacity is None or used[e] < capacity:
                y = y + w[t, j] * _expert(x[t], fc1[e], fc2[e])
            used[e] += 1
        out.append(y)
    counts = torch.bincount(idx.flatten(), minlength=router.shape[0]).double()
    f = counts / (x.shape[0] * top_k)
    aux = router.shape[0] * (f * probs.mean(0)).sum()
    z = torch.logsumexp(logits, -1).square().mean()
    return torch.stack(out), aux, z


def test_permutation_sorts_by_expert_and_unpermute_weights_and_sums():
    x = torch.arange(5.0).repeat_interleave(2).view(5, 2)  # token t is [t, t]
    experts = torch.tensor([[2, 0], [0, 1], [2, 1], [0, 2], [1, 0]])
    perm = permute(x, experts, 3)
    assert perm.group_sizes.tolist() == [4, 3, 3]
    assert perm.rows[:, 0].tolist() == [0, 1, 3, 4, 1, 2, 4, 0, 2, 3]  # expert 0's tokens, then 1's, then 2's
    weights = torch.rand(5, 2)
    out = unpermute(perm.rows * 10, perm, weights)  # "experts" multiply by 10
    torch.testing.assert_close(out, 10 * x * weights.sum(1, keepdim=True))


def test_capacity_keeps_each_experts_earliest_tokens():
    x = torch.arange(6.0).unsqueeze(1)
    experts = torch.tensor([[0], [0], [1], [0], [1], [0]])
    perm = permute(x, experts, 2, capacity=2)
    assert perm.group_sizes.tolist() == [2, 2] and perm.dropped == 2
    assert perm.rows[:, 0].tolist() == [0, 1, 2, 4]  # tokens 3 and 5 of expert 0 are over capacity
    out = unpermute(perm.rows, perm, torch.ones(6, 1))
    assert out[:, 0].tolist() == [0, 1, 2, 0, 4, 0]  # dropped tokens get nothing (they keep their residual)


@pytest.mark.parametrize("normalize", [True, False])
def test_router_top_k_and_losses_match_the_switch_formulas(normalize):
    torch.manual_seed(0)
    router = TopKRouter(H, E, K, normalize, seed=3).double()
    x = torch.randn(10, H, dtype=torch.float64)
    w, idx, st = router(x)
    probs = (x @ router.weight.t()).softmax(-1)
    ref_w, ref_idx = probs.topk(K, -1)
    if normalize:
        ref_w = ref_w / ref_w.sum(-1, keepdim=True)
    assert torch.equal(idx, ref_idx)
    torch.testing.assert_close(w.double(), ref_w)
    _, aux, z = moe_reference(
        x,
        router.weight.detach(),
        torch.zeros(E, 2 * F_, H, dtype=torch.float64),
        torch.zeros(E, H, F_, dtype=torch.float64),
        normalize=normalize,
    )
    torch.testing.assert_close(st["aux_loss"].double(), aux)
    torch.testing.assert_close(st["z_loss"].double(), z)
    assert st["tokens_per_expert"].sum() == 10 * K


def _layer_params(layer):
    """The full (single-process) router, fc1 [E, 2F, H] and fc2 [E, H, F] of a layer built at any layout."""
    seed = 77
    fc1 = torch.stack(
        [
            init.full_weight((2 * F_, H), init.derive_seed(seed, f"experts.{e}.fc1"), init.init_method_normal())
            for e in range(E)
        ]
    )
    fc2 = torch.stack(
        [
            init.full_weight((H, F_), init.derive_seed(seed, f"experts.{e}.fc2"), init.init_method_normal())
            for e in range(E)
        ]
    )
    return layer.router.weight.detach().double(), fc1.double(), fc2.double()


@pytest.mark.parametrize("capacity_factor", [None, 0.75])
def test_the_layer_and_its_gradients_match_the_per_token_reference(capacity_factor):
    with single_process_world(parallel=True):
        layer = MoELayer(
            H, F_, E, K, seed=77, aux_loss_coeff=0.3, z_loss_coeff=0.1, capacity_factor=capacity_factor
        ).double()
        x = randn(S, B, H, seed=1).double().requires_grad_(True)
        dy = randn(S, B, H, seed=2).double()
        set_aux_loss_scale(1.0)
        out = layer(x)
        out.backward(dy)
        router, fc1, fc2 = (t.clone().requires_grad_(True) for t in _layer_params(layer))
        xr = x.detach().clone().requires_grad_(True)
        capacity = None if capacity_factor is None else math.ceil(capacity_factor * S * B * K / E)
        ref, aux, z = moe_reference(xr.view(-1, H), router, fc1, fc2, capacity=capacity)
        ((ref * dy.view(-1, H)).sum() + 0.3 * aux + 0.1 * z).backward()
    torch.testing.assert_close(out.view(-1, H), ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(layer.router.weight.grad, router.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(layer.experts.fc1.grad, fc1.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(layer.experts.fc2.grad, fc2.grad, rtol=1e-10, atol=1e-12)


def test_deepseek_routing_matches_the_per_token_reference():
    """Sigmoid scores, group-limited top-k (2 groups of 2, 1 eligible), the balancing bias moving the choice only,
    normalised weights times the routed scaling: output and gradients against the written-out routing."""
    with single_process_world(parallel=True):
        layer = MoELayer(
            H, F_, E, K, seed=77, score="sigmoid", n_group=2, topk_group=1, routed_scaling=2.5, expert_bias=True
        ).double()
        assert layer.router.expert_bias.dtype == torch.float32  # kept in fp32 through .double()
        bias = torch.tensor([0.0, 0.3, -0.2, 0.1])
        layer.router.expert_bias.copy_(bias)
        x = randn(S, B, H, seed=1).double().requires_grad_(True)
        dy = randn(S, B, H, seed=2).double()
        layer(x).backward(dy)
        out = layer(x.detach()).detach()
        router, fc1, fc2 = (t.clone().requires_grad_(True) for t in _layer_params(layer))
        xr = x.detach().clone().requires_grad_(True)
        scores = torch.sigmoid(xr.view(-1, H) @ router.t())
        key = scores.detach() + bias.double()
        ref = []
        for t in range(S * B):
            groups = key[t].view(2, 2).sum(-1)  # a group's two best keys: both of its two experts
            g = int(groups.argmax())
            pair = key[t, 2 * g : 2 * g + 2]
            chosen = [2 * g + int(i) for i in pair.argsort(descending=True, stable=True)]
            w = scores[t, chosen] / scores[t, chosen].sum() * 2.5
            ref.append(sum(w[j] * _expert(xr.view(-1, H)[t], fc1[e], fc2[e]) for j, e in enumerate(chosen)))
        ref = torch.stack(ref)
        (ref * dy.view(-1, H)).sum().backward()
        # the balancing bias keeps the loads of both training forwards until the next update
        assert layer.router.expert_load.sum() == 2 * S * B * K
    torch.testing.assert_close(out.view(-1, H), ref.detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(layer.router.weight.grad, router.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(layer.experts.fc1.grad, fc1.grad, rtol=1e-10, atol=1e-12)


def sequence_aux_reference(x, router, fc1, fc2, sequences):
    """``x`` [s·b, h] sequence-first; per token: sigmoid scores, the top-k, their scores normalised, the weighted
    sum of the experts; the sequence-wise balance loss written out sequence by sequence: ``E · Σ_i f_i · P_i`` over
    the sequence's tokens (``f_i`` its share of the assignments, ``P_i`` the mean of ``s_ti / Σ_j s_tj``), averaged
    over the sequences."""
    scores = torch.sigmoid(x @ router.t())
    idx = scores.detach().topk(K, -1).indices
    out = []
    for t in range(x.shape[0]):
        w = scores[t, idx[t]] / scores[t, idx[t]].sum()
        out.append(sum(w[j] * _expert(x[t], fc1[e], fc2[e]) for j, e in enumerate(idx[t].tolist())))
    losses = []
    for b in range(sequences):
        rows = list(range(b, x.shape[0], sequences))
        counts = torch.bincount(idx[rows].flatten(), minlength=E).double()
        f = counts / (len(rows) * K)
        P = (scores[rows] / scores[rows].sum(-1, keepdim=True)).mean(0)
        losses.append(E * (f * P).sum())
    return torch.stack(out), torch.stack(losses).mean()


def test_the_sequence_wise_balance_loss_matches_the_per_sequence_reference():
    """DeepSeek-V3's sequence-wise loss (weight 0.3 here): the layer's output and every gradient against the
    written-out loss of each sequence; with one sequence it is the batch-wise loss."""
    with single_process_world(parallel=True):
        layer = MoELayer(H, F_, E, K, seed=77, score="sigmoid", aux_loss_coeff=0.3, seq_aux_loss=True).double()
        x = randn(S, B, H, seed=1).double().requires_grad_(True)
        dy = randn(S, B, H, seed=2).double()
        set_aux_loss_scale(1.0)
        out = layer(x)
        out.backward(dy)
        router, fc1, fc2 = (t.clone().requires_grad_(True) for t in _layer_params(layer))
        xr = x.detach().clone().requires_grad_(True)
        ref, aux = sequence_aux_reference(xr.view(-1, H), router, fc1, fc2, B)
        ((ref * dy.view(-1, H)).sum() + 0.3 * aux).backward()
        one = layer.router(x.detach().view(-1, H), sequences=1)[2]["aux_loss"]
        layer.router.seq_aux = False
        batch = layer.router(x.detach().view(-1, H))[2]["aux_loss"]
        with pytest.raises(ValueError, match="16 tokens are not 3 sequences"):
            MoELayer(H, F_, E, K, seed=77, seq_aux_loss=True).router(x.detach().view(-1, H), sequences=3)
    torch.testing.assert_close(out.view(-1, H), ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(layer.router.weight.grad, router.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(layer.experts.fc1.grad, fc1.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(one, batch, rtol=1e-12, atol=0)
    assert abs(float(aux.detach()) - float(batch)) > 1e-6  # two sequences differ from all tokens at once here


def test_the_balancing_bias_moves_by_the_sign_of_the_load_gap():
    from megakernels.parallel.moe.router import update_expert_biases

    router = TopKRouter(H, E, K, score="sigmoid", expert_bias=True)
    router.expert_load.copy_(torch.tensor([5.0, 1.0, 3.0, 3.0]))  # mean 3
    assert update_expert_biases(router, 0.01) == pytest.approx(0.01 * 2**0.5)
    assert torch.equal(router.expert_bias, torch.tensor([-0.01, 0.01, 0.0, 0.0]))
    assert torch.equal(router.expert_load, torch.zeros(E))  # forgotten after the update
    assert "expert_bias" in router.state_dict() and "expert_load" not in router.state_dict()
    with pytest.raises(ValueError, match="rate must be a finite number"):
        update_expert_biases(router, -1.0)


@CHECKS.add("fp8_dispatch_sends_fp8_rows_and_stays_within_their_rounding")
def _(rank, world):
    from megakernels.parallel import comm

    mp.initialize(1, ep=4)
    x = randn(S, B, H, seed=50 + rank)
    dy = randn(S, B, H, seed=60 + rank)
    results = {}
    for fp8, chunks in ((False, 1), (True, 1), (True, 2)):
        layer = MoELayer(H, F_, E, K, seed=77, fp8_dispatch=fp8, a2a_chunks=chunks)
        xin = x.clone().requires_grad_(True)
        with comm.count_bytes() as sent:
            out = layer(xin)
        out.backward(dy)
        results[fp8, chunks] = out.detach(), xin.grad, layer.experts.fc1.grad, sent["all_to_all"]
    ref, ref_dx, ref_dw, ref_bytes = results[False, 1]
    for key in ((True, 1), (True, 2)):
        out, dx, dw, nbytes = results[key]
        assert not torch.equal(out, ref), key  # the rows really travelled as FP8
        assert_close(out, ref, f"fp8 dispatch {key}: output", rtol=0.08)
        assert_close(dx, ref_dx, f"fp8 dispatch {key}: input grad", rtol=0.08)
        assert_close(dw, ref_dw, f"fp8 dispatch {key}: fc1 grad", rtol=0.08)
        # the dispatch's S·B·K fp32 rows (4 B an element) went as 1 B an element + a 4 B scale a row; the combine
        # (the rows this rank's experts served, back to their senders) as before
        rows = S * B * K
        assert nbytes == ref_bytes - rows * H * 4 + rows * (H + 4), (key, nbytes, ref_bytes)
    with pytest.raises(ValueError, match="FP8 dispatch is the alltoall dispatcher's"):
        MoELayer(H, F_, E, K, dispatcher="allgather", fp8_dispatch=True)
    mp.destroy()


@CHECKS.add("the_balancing_bias_is_the_same_on_every_data_parallel_rank")
def _(rank, world):
    from megakernels.parallel.moe.router import update_expert_biases

    mp.initialize(1, ep=2)
    layer = MoELayer(H, F_, E, K, seed=77, score="sigmoid", expert_bias=True).double()
    layer(randn(S, B, H, seed=30 + rank).double())  # each rank its own tokens, so its own loads
    local = layer.router.expert_load.clone()
    total = local.clone()
    torch.distributed.all_reduce(total)
    update_expert_biases(layer, 0.5, mp.dp_group())
    assert torch.equal(layer.router.expert_bias, 0.5 * torch.sign(total.mean() - total))
    biases = [torch.empty(E) for _ in range(world)]
    torch.distributed.all_gather(biases, layer.router.expert_bias)
    assert all(torch.equal(b, biases[0]) for b in biases)
    mp.destroy()


class _FakeBackend:
    """An external dispatcher as a backend would register one: here the all-to-all one, its calls counted."""

    calls = 0

    def __init__(self, group, num_experts, chunks):
        self.inner = dispatcher.AllToAllDispatcher(group, num_experts, chunks)

    def __call__(self, *args):
        type(self).calls += 1
        return self.inner(*args)


LAYOUTS = (
    (2, 1, False, "alltoall", 1),
    (2, 1, True, "alltoall", 1),
    (1, 2, False, "alltoall", 1),
    (1, 4, False, "alltoall", 1),
    (2, 2, True, "alltoall", 1),
    (1, 4, False, "alltoall", 3),  # overlapped chunks (of 16 tokens: 5, 5, 6)
    (2, 2, True, "alltoall", 2),
    (1, 4, False, "allgather", 1),
    (2, 2, True, "allgather", 1),
    (1, 2, False, "fake", 2),
    (1, 4, False, "alltoall", 1, 0.75),  # a capacity: fixed splits, no counts exchanged
    (2, 2, True, "alltoall", 1, 0.75),
)


def test_bad_dispatcher_arguments_are_named():
    with single_process_world(parallel=True):
        with pytest.raises(ValueError, match="dispatcher must be one of alltoall, allgather"):
            MoELayer(H, F_, E, K, dispatcher="nope")
        with pytest.raises(ValueError, match="chunks must be a positive int"):
            MoELayer(H, F_, E, K, a2a_chunks=0)
    with pytest.raises(ValueError, match="chunks must be a positive int"):
        dispatcher.configure("alltoall", 0)


@CHECKS.add("chunked_and_all_gather_dispatch_refuse_a_capacity")
def _(rank, world):
    mp.initialize(1, ep=2)
    x = randn(S, B, H, seed=3).double()
    for name, chunks in (("alltoall", 2), ("allgather", 1)):
        layer = MoELayer(H, F_, E, K, seed=77, capacity_factor=1.0, dispatcher=name, a2a_chunks=chunks).double()
        with pytest.raises(ValueError, match="no capacity factor"):
            layer(x)
    mp.destroy()


@CHECKS.add("the_sequence_wise_loss_split_over_tp_and_sp_matches_the_single_process")
def _(rank, world):
    """Each TP rank routes its share of every sequence: the per-sequence sums are over the TP group."""
    for tp, sp in ((2, True), (4, False)):
        mp.initialize(tp)
        layer = MoELayer(
            H, F_, E, K, sp, seed=77, score="sigmoid", aux_loss_coeff=0.3, seq_aux_loss=True
        ).double()  # fmt: skip
        x, dy = randn(S, B, H, seed=10).double(), randn(S, B, H, seed=20).double()
        xin = (block(x, 0, mp.tp_rank(), tp) if sp else x).clone().requires_grad_(True)
        set_aux_loss_scale(1.0)
        layer(xin).backward(block(dy, 0, mp.tp_rank(), tp) if sp else dy)
        mp.allreduce_sequence_parallel_grads(layer)
        router, fc1, fc2 = (t.clone().requires_grad_(True) for t in _layer_params(layer))
        xr = x.clone().requires_grad_(True)
        ref, aux = sequence_aux_reference(xr.view(-1, H), router, fc1, fc2, B)
        ((ref * dy.view(-1, H)).sum() + 0.3 * aux).backward()
        what = f"tp{tp} sp={sp}"
        assert_close(layer.router.weight.grad, router.grad, f"{what}: router grad", rtol=1e-10)
        want = block(xr.grad, 0, mp.tp_rank(), tp) if sp else xr.grad
        assert_close(xin.grad, want, f"{what}: input grad", rtol=1e-10)
        mp.destroy()


@CHECKS.add("the_layer_split_over_tp_sp_and_ep_matches_the_single_process")
def _(rank, world):
    dispatcher.register("fake", _FakeBackend)
    from megakernels.parallel import comm

    for tp, ep, sp, name, chunks, *factor in LAYOUTS:
        mp.initialize(tp, ep=ep)
        factor = factor[0] if factor else None
        capacity = None if factor is None else math.ceil(factor * S * B * K / E)
        what = f"tp{tp} ep{ep} sp={sp} {name} x{chunks} capacity {capacity}"
        calls = _FakeBackend.calls
        layer = MoELayer(
            H, F_, E, K, sp, seed=77, aux_loss_coeff=0.3, dispatcher=name, a2a_chunks=chunks, capacity_factor=factor
        ).double()
        # each data-parallel rank its own tokens (the expert-parallel exchange mixes them)
        d = mp.dp_rank()
        x = randn(S, B, H, seed=10 + d).double()
        dy = randn(S, B, H, seed=20 + d).double()
        xin = (block(x, 0, mp.tp_rank(), tp) if sp else x).clone().requires_grad_(True)
        set_aux_loss_scale(1.0)
        with comm.record_events() as events:
            out = layer(xin)
        counted = ("launch", "all_to_all_counts") in events
        assert counted == (ep > 1 and name in ("alltoall", "fake") and capacity is None), what
        out.backward(block(dy, 0, mp.tp_rank(), tp) if sp else dy)
        mp.allreduce_sequence_parallel_grads(layer)
        params = _layer_params(layer)
        router, fc1, fc2 = (t.clone().requires_grad_(True) for t in params)
        xr = x.clone().requires_grad_(True)
        ref, aux, _ = moe_reference(xr.view(-1, H), router, fc1, fc2, capacity=capacity)
        ((ref * dy.view(-1, H)).sum() + 0.3 * aux).backward()
        ref = ref.view(S, B, H)
        # this rank's experts also served the tokens of the other ranks of its expert-parallel group
        group_first = d - mp.ep_rank()
        for peer in range(group_first, group_first + ep):
            if peer != d:
                _, f1, f2 = (t.clone().requires_grad_(True) for t in params)
                x_p = randn(S, B, H, seed=10 + peer).double().view(-1, H)
                out_p, aux_p, _ = moe_reference(x_p, params[0], f1, f2, capacity=capacity)
                (out_p * randn(S, B, H, seed=20 + peer).double().view(-1, H)).sum().backward()
                fc1.grad += f1.grad
                fc2.grad += f2.grad
        assert_close(out, block(ref, 0, mp.tp_rank(), tp) if sp else ref, f"{what}: output", rtol=1e-10)
        assert_close(
            xin.grad, block(xr.grad, 0, mp.tp_rank(), tp) if sp else xr.grad, f"{what}: input grad", rtol=1e-10
        )
        assert_close(layer.router.weight.grad, router.grad, f"{what}: router grad", rtol=1e-10)
        first, n = mp.ep_rank() * (E // ep), E // ep
        r = mp.tp_rank()
        shard1 = torch.cat([block(fc1.grad[:, :F_], 1, r, tp), block(fc1.grad[:, F_:], 1, r, tp)], 1)
        assert_close(
            layer.experts.fc1.grad, shard1[first : first + n], f"{what}: fc1 grad (this rank's experts)", rtol=1e-10
        )
        assert_close(
            layer.experts.fc2.grad, block(fc2.grad, 2, r, tp)[first : first + n], f"{what}: fc2 grad", rtol=1e-10
        )
        assert _FakeBackend.calls == calls + (name == "fake"), what
        mp.destroy()


def _world(rank, world_size):
    return CHECKS.run(rank, world_size)


world = CHECKS.fixture(4, _world)


@pytest.mark.parametrize("name", CHECKS.names())
def test_moe_parallel(world, name):
    CHECKS.assert_passed(world, name)
