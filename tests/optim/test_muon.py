"""megakernels.optim.Muon against an fp64 reference written here, torch.optim.Muon and torch.optim.AdamW (peers),
its grouping rule, the per-logical-matrix orthogonalisation of fused weights, the state_dict round trip and its
errors."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from megakernels.ops.muon import newton_schulz_reference
from megakernels.optim import Muon, muon_param_groups
from megakernels.optim.muon import Layout, merge_matrices, split_matrices
from megakernels.parallel.params import mark_fused
from tests.models.muon_reference import ns64


def qkv_blocks(w: torch.Tensor, heads: int, d: int) -> list[torch.Tensor]:
    """Q, K and V of a head-major ``[heads * 3 * d, n]`` weight, by explicit row indices."""
    rows = lambda j: [h * 3 * d + j * d + i for h in range(heads) for i in range(d)]  # noqa: E731
    return [w[rows(j)] for j in range(3)]


class Tiny(nn.Module):
    """An embedding, a head-major fused QKV weight, two hidden matrices, a norm, a router, an output head."""

    def __init__(self, heads=2, d=4, h=8):
        super().__init__()
        torch.manual_seed(0)
        self.embedding = nn.Embedding(11, h)
        self.qkv = nn.Linear(h, 3 * heads * d, bias=False)
        mark_fused(self.qkv.weight, parts=3, head_dim=d, head_major=True)
        self.up = nn.Linear(h, 2 * h)
        self.down = nn.Linear(2 * h, h, bias=False)
        self.norm = nn.LayerNorm(h)
        self.router = nn.Linear(h, 3, bias=False)
        self.lm_head = nn.Linear(h, 11, bias=False)

    def forward(self, ids):
        x = self.embedding(ids)
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        x = x + self.down(torch.tanh(self.up(x + q * k + v)))
        x = self.norm(x) * torch.softmax(self.router(x), -1)[..., :1]
        return torch.nn.functional.cross_entropy(self.lm_head(x), (ids + 1) % 11)


def test_groups_by_rule():
    model = Tiny()
    groups = muon_param_groups(model)
    muon = {id(p) for p in groups[0]["params"]}
    assert groups[0]["use_muon"] and not groups[1]["use_muon"]
    assert muon == {id(model.qkv.weight), id(model.up.weight), id(model.down.weight)}
    rest = {id(p) for p in groups[1]["params"]}
    for p in (model.embedding.weight, model.router.weight, model.lm_head.weight, model.norm.weight, model.up.bias):
        assert id(p) in rest
    # a table tied to a Linear (the HF output head) goes to AdamW through the embedding that holds it
    tied = nn.ModuleDict({"emb": nn.Embedding(5, 4), "proj": nn.Linear(4, 5, bias=False)})
    tied.proj.weight = tied.emb.weight
    (only,) = muon_param_groups(tied)
    assert not only["use_muon"] and len(only["params"]) == 1


def test_split_merge_round_trip_and_logical_blocks():
    torch.manual_seed(1)
    w = torch.randn(2 * 3 * 4, 5)
    lay = Layout(3, 4, True)
    proj = split_matrices(w, lay, "projection")
    for got, want in zip(proj, qkv_blocks(w, 2, 4)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    heads = split_matrices(w, lay, "head")
    assert heads.shape == (6, 4, 5)
    # ordered by part, then head: q of head 1 (rows 12..15), k of head 0 (rows 4..7)
    torch.testing.assert_close(heads[1], w[12:16], rtol=0, atol=0)
    torch.testing.assert_close(heads[2], w[4:8], rtol=0, atol=0)
    for split in ("projection", "head", "none"):
        torch.testing.assert_close(merge_matrices(split_matrices(w, lay, split), lay, split, w.shape), w)
    gate_up = torch.randn(3, 2 * 6, 5)  # a stack of experts' [gate; up]
    blocks = split_matrices(gate_up, Layout(2), "projection")
    torch.testing.assert_close(blocks[3], gate_up[1, 6:], rtol=0, atol=0)
    torch.testing.assert_close(merge_matrices(blocks, Layout(2), "projection", gate_up.shape), gate_up)


def reference_run(model, steps, lr, wd, mu, scale_rule, split):
    """fp64: Muon by ``ns64`` per logical matrix, torch.optim.AdamW for the rest."""
    ref = copy.deepcopy(model).double()
    muon_names = {"qkv.weight", "up.weight", "down.weight"}
    mats = {n: p for n, p in ref.named_parameters() if n in muon_names}
    adam = torch.optim.AdamW(
        [p for n, p in ref.named_parameters() if n not in muon_names],
        lr=lr,
        betas=(0.9, 0.95),
        eps=1e-8,
        weight_decay=wd,
    )
    bufs = {n: torch.zeros_like(p) for n, p in mats.items()}
    ids = torch.arange(8) % 11
    for _ in range(steps):
        ref.zero_grad()
        ref(ids).backward()
        with torch.no_grad():
            for n, p in mats.items():
                g = p.grad
                bufs[n] = mu * bufs[n] + (1 - mu) * g
                u = (1 - mu) * g + mu * bufs[n]
                if n == "qkv.weight" and split == "projection":
                    heads, d = 2, 4
                    parts = qkv_blocks(u, heads, d)
                    out = torch.empty_like(u)
                    for j, part in enumerate(parts):
                        o = ns64(part)
                        m_, n_ = part.shape
                        s = 0.2 * math.sqrt(max(m_, n_)) if scale_rule == "match_rms_adamw" else max(1, m_ / n_) ** 0.5
                        rows = [h * 3 * d + j * d + i for h in range(heads) for i in range(d)]
                        out[rows] = s * o
                else:
                    m_, n_ = u.shape
                    s = 0.2 * math.sqrt(max(m_, n_)) if scale_rule == "match_rms_adamw" else max(1, m_ / n_) ** 0.5
                    out = s * ns64(u)
                p.mul_(1 - lr * wd).sub_(lr * out)
        adam.step()
    return ref


@pytest.mark.parametrize("scale_rule,split", [("match_rms_adamw", "projection"), ("original", "none")])
def test_equals_fp64_reference_20_steps(scale_rule, split):
    model = Tiny()
    lr, wd, mu = 0.02, 0.1, 0.95
    ref = reference_run(model, 20, lr, wd, mu, scale_rule, split)
    opt = Muon(model, lr=lr, weight_decay=wd, momentum=mu, lr_scale=scale_rule, split=split, ns_dtype="fp32")
    ids = torch.arange(8) % 11
    for _ in range(20):
        opt.zero_grad()
        model(ids).backward()
        opt.step()
    for (name, p), (_, r) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.double(), r, rtol=0, atol=2e-5, msg=name)
    moved = (model.qkv.weight.double() - Tiny().qkv.weight.double()).abs().max()
    assert moved > 0.05  # the trajectory went somewhere


def test_matches_torch_muon_in_bf16():
    """Plain matrices, bf16 Newton-Schulz: the same steps as torch.optim.Muon (which always runs bf16)."""
    torch.manual_seed(2)
    ws = [nn.Parameter(torch.randn(12, 20) * 0.1), nn.Parameter(torch.randn(20, 12) * 0.1)]
    start = [w.detach().clone() for w in ws]
    theirs = [nn.Parameter(w.detach().clone()) for w in ws]
    ours = Muon(ws, lr=0.01, weight_decay=0.1, lr_scale="match_rms_adamw", ns_dtype="bf16")
    peer = torch.optim.Muon(theirs, lr=0.01, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    for step in range(5):
        for w, t in zip(ws, theirs):
            g = torch.sin(w.detach() * (step + 1)) + 0.1
            w.grad, t.grad = g.clone(), g.clone()
        ours.step()
        peer.step()
    for w, t, w0 in zip(ws, theirs, start):
        assert (w.detach() - w0).abs().max() > 0.02  # moved well beyond the tolerance
        torch.testing.assert_close(w, t, rtol=0, atol=2e-3)


def test_newton_schulz_reference_batched_equals_per_matrix():
    torch.manual_seed(3)
    x = torch.randn(3, 6, 9, dtype=torch.float64)
    got = newton_schulz_reference(x)
    for i in range(3):
        torch.testing.assert_close(got[i], ns64(x[i]), rtol=1e-12, atol=1e-12)
    tall = newton_schulz_reference(x.mT)
    torch.testing.assert_close(tall, got.mT)
    s = torch.linalg.svdvals(got)
    assert s.min() > 0.5 and s.max() < 1.3  # the quintic's band around 1


def test_state_dict_round_trip_continues_bit_exact():
    ids = torch.arange(8) % 11

    def run(model, opt, n):
        for _ in range(n):
            opt.zero_grad()
            model(ids).backward()
            opt.step()

    a = Tiny()
    opt_a = Muon(a, lr=0.02, ns_dtype="fp32")
    run(a, opt_a, 6)
    b = Tiny()
    opt_b = Muon(b, lr=0.02, ns_dtype="fp32")
    run(b, opt_b, 3)
    saved_model, saved_opt = copy.deepcopy(b.state_dict()), copy.deepcopy(opt_b.state_dict())
    c = Tiny()
    c.load_state_dict(saved_model)
    opt_c = Muon(c, lr=0.02, ns_dtype="fp32")
    opt_c.load_state_dict(saved_opt)
    kinds = {k for st in saved_opt["state"].values() for k in st}
    assert kinds == {"momentum_buffer", "step", "exp_avg", "exp_avg_sq"}
    run(c, opt_c, 3)
    for (name, p), q in zip(a.named_parameters(), c.parameters()):
        assert torch.equal(p, q), name


def test_lr_schedule_reaches_both_parts():
    model = Tiny()
    opt = Muon(model, lr=0.1)
    torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.0)  # sets every group's lr to 0 at once
    assert [g["lr"] for g in opt.param_groups] == [0.0, 0.0]
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.arange(4)).backward()
    opt.step()
    for p, q in zip(model.parameters(), before):
        assert torch.equal(p, q)  # lr 0 everywhere: nothing moves, not even by weight decay


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"momentum": 1.0}, "momentum"),
        ({"lr": -1.0}, "lr"),
        ({"lr_scale": "rms"}, "lr_scale"),
        ({"split": "rows"}, "split"),
        ({"ns_dtype": "fp8"}, "ns_dtype"),
        ({"ns_steps": 0}, "ns_steps"),
    ],
)
def test_bad_hyper_parameters_are_named(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        Muon([nn.Parameter(torch.zeros(3, 4))], **kwargs)


def test_vector_in_muon_group_is_refused():
    with pytest.raises(ValueError, match="use_muon=False"):
        Muon([nn.Parameter(torch.zeros(3))])
    with pytest.raises(ValueError, match="AdamW group"):
        Muon([{"params": [nn.Parameter(torch.zeros(3))], "use_muon": False, "momentum": 0.9}])
