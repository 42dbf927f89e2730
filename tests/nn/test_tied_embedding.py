"""megakernels.nn.TiedEmbedding: the lookup's gradient folded into the output layer's gives the table the gradient
autograd gives it through F.embedding + F.linear — in every backward shape that reaches the table (loss through
the head, a loss of the lookup alone, extra uses of the table, accumulation over backwards, a backward that asks
for other inputs only, copies of the model), against fp64."""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from megakernels.nn.tied_embedding import TiedEmbedding

V, H = 64, 8  # more rows than a batch's ids (48): the fold pays


class DenseBackwards(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func._opname == "embedding_dense_backward"
        return func(*args, **(kwargs or {}))


def lm_loss(weight, ids, table=None, padding_idx=None):
    """Lookup -> a nonlinearity -> logits against the same table -> cross-entropy on shifted ids."""
    e = table.lookup(ids, padding_idx) if table else F.embedding(ids, weight, padding_idx)
    h = torch.tanh(1.3 * e)
    logits = table.logits(h) if table else F.linear(h, weight)
    return F.cross_entropy(logits.reshape(-1, V).float(), ids.reshape(-1).roll(1))


def ids_with_repeats(seed=0):
    return torch.randint(0, 9, (2, 24), generator=torch.Generator().manual_seed(seed))  # each id ~5 times


def table0():
    return torch.randn(V, H, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("padding_idx", [None, 3, -61])
def test_the_folded_gradient_is_autograds(dtype, padding_idx):
    ids = ids_with_repeats()
    ref = table0().requires_grad_()
    lm_loss(ref, ids, padding_idx=padding_idx).backward()
    plain = table0().to(dtype).requires_grad_()
    lm_loss(plain, ids, padding_idx=padding_idx).backward()
    w = table0().to(dtype).requires_grad_()
    table = TiedEmbedding(w)
    with DenseBackwards() as seen:
        lm_loss(w, ids, table, padding_idx).backward()
    assert seen.calls == 0 and table.folds == 1
    if dtype == torch.bfloat16:  # each row rounded once, as in autograd's sum of the two tables
        err, err_plain = (w.grad.double() - ref.grad).abs().max(), (plain.grad.double() - ref.grad).abs().max()
        assert err <= 1.5 * err_plain + 1e-4
    else:  # fp32 sums of the same numbers in the same order: the same bits as autograd's
        torch.testing.assert_close(w.grad, plain.grad, rtol=0, atol=0)
        torch.testing.assert_close(w.grad.double(), ref.grad, rtol=1e-6, atol=1e-7)


def test_backwards_that_do_not_send_the_head_gradient_fall_back_to_the_dense_lookup():
    ids = ids_with_repeats()
    ref = table0().requires_grad_()
    w = table0().requires_grad_()
    table = TiedEmbedding(w)
    # a loss of the lookup alone: no head gradient reaches the table
    with DenseBackwards() as seen:
        (table.lookup(ids) ** 2).sum().backward()
    (F.embedding(ids, ref) ** 2).sum().backward()
    assert seen.calls == 1 and table.folds == 0
    torch.testing.assert_close(w.grad, ref.grad, rtol=0, atol=0)
    # a backward asking for the hidden states' gradient only runs the head but not the table's accumulator: the rows
    # its lookup would keep never reach the table, and the next backward must not add them
    h = torch.tanh(table.lookup(ids))
    torch.autograd.grad((table.logits(h) ** 2).sum(), [h])
    lm_loss(w, ids, table).backward()
    lm_loss(ref, ids).backward()
    torch.testing.assert_close(w.grad, ref.grad, rtol=1e-12, atol=1e-12)
    assert table._kept == []
    # as many ids as rows: the dense lookup gradient, no fold
    many = torch.randint(0, V, (2, V // 2 + 1), generator=torch.Generator().manual_seed(5))
    before = table.folds
    lm_loss(w, many, table).backward()
    lm_loss(ref, many).backward()
    assert table.folds == before
    torch.testing.assert_close(w.grad, ref.grad, rtol=1e-12, atol=1e-12)


def test_other_uses_of_the_table_and_accumulation_over_backwards():
    ids = ids_with_repeats()
    ref = table0().requires_grad_()
    w = table0().requires_grad_()
    table = TiedEmbedding(w)
    for step in range(3):  # a penalty on the table joins the sum the rows are added into; .grad accumulates
        (lm_loss(w, ids_with_repeats(step), table) + 0.1 * (w**2).sum()).backward()
        (lm_loss(ref, ids_with_repeats(step)) + 0.1 * (ref**2).sum()).backward()
        torch.testing.assert_close(w.grad, ref.grad, rtol=1e-12, atol=1e-12)
    # two forwards, one backward: both lookups' rows are folded in that backward
    (lm_loss(w, ids, table) + lm_loss(w, ids.flip(0), table)).backward()
    (lm_loss(ref, ids) + lm_loss(ref, ids.flip(0))).backward()
    torch.testing.assert_close(w.grad, ref.grad, rtol=1e-12, atol=1e-12)
    assert table.folds == 4


def test_no_fold_without_autograd_or_for_second_order_gradients():
    ids = ids_with_repeats()
    w = table0().requires_grad_()
    table = TiedEmbedding(w)
    with torch.no_grad():
        assert table.logits(table.lookup(ids)).grad_fn is None
    # create_graph: the lookup returns its own gradient and both backwards are differentiable (a gradient penalty)
    ref = table0().requires_grad_()
    (g,) = torch.autograd.grad(lm_loss(w, ids, table), [w], create_graph=True)
    (g_ref,) = torch.autograd.grad(lm_loss(ref, ids), [ref], create_graph=True)
    torch.testing.assert_close(g, g_ref, rtol=1e-12, atol=1e-12)
    assert table.folds == 0
    (g**2).sum().backward()  # an ordinary backward (through the first one's ops and the forward's): folds again
    (g_ref**2).sum().backward()
    torch.testing.assert_close(w.grad, ref.grad, rtol=1e-10, atol=1e-12)


def test_a_copied_model_folds_into_its_own_table():
    class LM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(table0())
            self.tied = TiedEmbedding(self.weight)

        def forward(self, ids):
            return lm_loss(self.weight, ids, self.tied)

    ids = ids_with_repeats()
    model = LM()
    twin = copy.deepcopy(model)
    assert twin.tied.weight is twin.weight
    model(ids).backward()
    twin(ids).backward()
    assert twin.tied.folds == 1 and model.tied.folds == 1
    torch.testing.assert_close(twin.weight.grad, model.weight.grad, rtol=0, atol=0)
    buf = io.BytesIO()  # picklable: the table and the count, not the backward's state
    torch.save(model.tied, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert loaded.folds == 1 and loaded._kept == [] and torch.equal(loaded.weight, model.weight)


def test_a_table_that_is_not_a_2d_float_leaf_is_refused():
    with pytest.raises(ValueError, match="weight must be a 2-D floating-point"):
        TiedEmbedding(torch.zeros(3, dtype=torch.float32))
    with pytest.raises(ValueError, match="weight must be a 2-D floating-point"):
        TiedEmbedding(torch.zeros(3, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match="leaf"):
        TiedEmbedding(torch.zeros(3, 4, requires_grad=True) * 2)


def test_linear_cross_entropy_over_the_table_takes_the_lookup_rows():
    """The fused LM head + loss as the output layer (``ops.linear_cross_entropy`` signals its dense weight
    gradient, ``dense_gradient_sent``): the table's gradient is autograd's through F.embedding + F.linear + CE."""
    from megakernels import ops

    ids = ids_with_repeats()
    target = ids.reshape(-1).roll(1).reshape(ids.shape)
    ref = table0().requires_grad_()
    F.cross_entropy(F.linear(torch.tanh(F.embedding(ids, ref)), ref).reshape(-1, V), target.reshape(-1)).backward()
    runs = []
    for tied in (False, True):  # fp32 (the op's dtypes): the plain lookup and the folded one
        w = table0().float().requires_grad_()
        table = TiedEmbedding(w) if tied else None
        with DenseBackwards() as seen:
            e = table.lookup(ids) if tied else F.embedding(ids, w)
            ops.linear_cross_entropy(torch.tanh(e), w, target, chunk_tokens=16).mean().backward()
        assert seen.calls == (0 if tied else 1)
        runs.append(w.grad)
    assert table.folds == 1
    torch.testing.assert_close(runs[1], runs[0], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(runs[1].double(), ref.grad, rtol=1e-5, atol=1e-6)
