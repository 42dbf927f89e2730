"""The output layer and vocab-parallel loss against the unsharded model: logits, per-token loss (F.cross_entropy over
the real vocabulary only) and the gradients of the hidden states and the (tied or own) weight, at tp 1, 2, 4 with
sequence parallelism off and on. One world of 4 gloo processes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import megakernels.parallel as mp
from megakernels.parallel import init
from tests.parallel.checks import Checks, assert_close, block, randn

CHECKS = Checks()
S, B, H, V = 8, 2, 16, 300  # V pads to 384 (tp 1) or 512 (tp 2, 4)
TPS = (1, 2, 4)
NORMAL = init.init_method_normal()


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_(True)


def _target(seed: int, ignore_some: bool = False) -> torch.Tensor:
    t = torch.randint(0, V, (S, B), generator=torch.Generator().manual_seed(seed))
    t[0, 0], t[1, 1] = 0, V - 1
    if ignore_some:
        t[2, 0] = t[5, 1] = -100
    return t


def _padded_table(seed: int, padded: int) -> torch.Tensor:
    return torch.cat([init.full_weight((V, H), seed, NORMAL), torch.zeros(padded - V, H)])


@CHECKS.add("parallel_lm_logits_against_the_tied_embedding")
def _(rank, world):
    for tp in TPS:
        for sp, parallel_output in ((False, True), (False, False), (True, True)):
            what = f"tp{tp} sp={sp} parallel_output={parallel_output}"
            mp.initialize(tp)
            r = mp.tp_rank()
            torch.manual_seed(16)
            emb = mp.VocabParallelEmbedding(V, H)
            vpad = emb.padded_num_embeddings
            w = _padded_table(emb.seed, vpad)
            h, dlogits = randn(S, B, H, seed=17), randn(S, B, vpad, seed=18)
            hin = _leaf(block(h, 0, r, tp) if sp else h)
            logits = mp.parallel_lm_logits(hin, emb.weight, parallel_output=parallel_output, sequence_parallel=sp)
            logits.backward(block(dlogits, -1, r, tp) if parallel_output else dlogits)

            hr, wr = _leaf(h.double()), _leaf(w.double())
            lr = hr @ wr.t()
            lr.backward(dlogits.double())
            assert_close(logits, block(lr, -1, r, tp) if parallel_output else lr, f"{what}: logits")
            assert_close(hin.grad, block(hr.grad, 0, r, tp) if sp else hr.grad, f"{what}: hidden grad")
            assert_close(emb.weight.grad, block(wr.grad, 0, r, tp), f"{what}: weight grad")
            mp.destroy()


@CHECKS.add("lm_head_loss_equals_unsharded_cross_entropy_over_the_real_vocabulary")
def _(rank, world):
    for tp in TPS:
        for sp in (False, True):
            for tied in (True, False):
                what = f"tp{tp} sp={sp} tied={tied}"
                mp.initialize(tp)
                r = mp.tp_rank()
                torch.manual_seed(20)
                emb = mp.VocabParallelEmbedding(V, H, sequence_parallel=sp)
                head = mp.ParallelLMHead(H, V, sequence_parallel=sp, tied_embedding=emb if tied else None)
                weight = emb.weight if tied else head.weight
                w = _padded_table(emb.seed if tied else head.seed, head.padded_vocab_size)[:V]
                h, target, dloss = randn(S, B, H, seed=21), _target(22), randn(S, B, seed=23)
                hin = _leaf(block(h, 0, r, tp) if sp else h)
                loss = head(hin, target)
                loss.backward(dloss)

                hr, wr = _leaf(h.double()), _leaf(w.double())
                lr = F.cross_entropy((hr @ wr.t()).view(-1, V), target.view(-1), reduction="none").view(S, B)
                lr.backward(dloss.double())
                assert loss.dtype == torch.float32 and loss.shape == (S, B)
                assert_close(loss, lr, f"{what}: loss")
                assert_close(hin.grad, block(hr.grad, 0, r, tp) if sp else hr.grad, f"{what}: hidden grad")
                grad = torch.cat([wr.grad, torch.zeros(head.padded_vocab_size - V, H, dtype=torch.float64)])
                assert_close(weight.grad, block(grad, 0, r, tp), f"{what}: weight grad")
                assert [n for n, _ in head.named_parameters()] == ([] if tied else ["weight"])
                mp.destroy()


@CHECKS.add("a_tied_table_folds_the_lookup_rows_into_the_heads_weight_gradient")
def _(rank, world):
    # the word embedding and the output layer on one table: the lookup's gradient rows go into the head's weight
    # gradient (nn.TiedEmbedding; other ranks' ids are masked rows adding zeros), equal to the unsharded model's
    for tp in TPS:
        for sp in (False, True):
            what = f"tp{tp} sp={sp}"
            mp.initialize(tp)
            r = mp.tp_rank()
            torch.manual_seed(24)
            emb = mp.VocabParallelEmbedding(V, H, sequence_parallel=sp)
            head = mp.ParallelLMHead(H, V, sequence_parallel=sp, tied_embedding=emb)
            ids, target, dloss = _target(25), _target(26), randn(S, B, seed=27)
            head(torch.tanh(emb(ids)), target).backward(dloss)

            wr = _leaf(_padded_table(emb.seed, head.padded_vocab_size)[:V].double())
            xr = torch.tanh(F.embedding(ids, wr))
            lr = F.cross_entropy((xr @ wr.t()).view(-1, V), target.view(-1), reduction="none").view(S, B)
            lr.backward(dloss.double())
            grad = torch.cat([wr.grad, torch.zeros(head.padded_vocab_size - V, H, dtype=torch.float64)])
            assert emb.tied.folds == 1, what
            assert_close(emb.weight.grad, block(grad, 0, r, tp), f"{what}: table grad")
            mp.destroy()


@CHECKS.add("ignore_index_and_label_smoothing_reach_the_loss")
def _(rank, world):
    mp.initialize(4)
    torch.manual_seed(24)
    head = mp.ParallelLMHead(H, V, label_smoothing=0.1)
    w = _padded_table(head.seed, head.padded_vocab_size)[:V]
    h, target = randn(S, B, H, seed=25), _target(26, ignore_some=True)
    loss = head(h, target)
    ref = F.cross_entropy(
        (h.double() @ w.double().t()).view(-1, V), target.view(-1), reduction="none", label_smoothing=0.1
    ).view(S, B)
    assert_close(loss, ref, "label smoothing 0.1 with ignored tokens")
    assert loss[2, 0] == 0 and loss[5, 1] == 0


@CHECKS.add("padding_does_not_change_the_loss")
def _(rank, world):
    mp.initialize(2)
    losses = []
    for multiple in (1, 128):
        torch.manual_seed(27)
        head = mp.ParallelLMHead(H, V, pad_multiple=multiple)
        losses.append(head(randn(S, B, H, seed=28), _target(29)))
    assert head.padded_vocab_size == 512
    assert_close(losses[1], losses[0], "loss with 212 padded columns vs with none")


@CHECKS.add("lm_head_errors")
def _(rank, world):
    mp.initialize(2)
    emb = mp.VocabParallelEmbedding(V, H)
    with pytest.raises(ValueError, match="tied_embedding is 300 x 16, expected vocab_size x hidden_size = 301 x 16"):
        mp.ParallelLMHead(H, V + 1, tied_embedding=emb)
    with pytest.raises(ValueError, match="parallel_lm_logits: hidden has shape"):
        mp.parallel_lm_logits(torch.zeros(4, 2, 8), emb.weight)
    head = mp.ParallelLMHead(H, V, tied_embedding=emb)
    bad = _target(30)
    bad[0, 0] = V  # a padded column is not a valid target
    with pytest.raises(ValueError, match=r"target holds 300, outside \[0, 300\)"):
        head(randn(S, B, H, seed=31), bad)


def _world(rank, world_size):
    return CHECKS.run(rank, world_size)


world = CHECKS.fixture(4, _world)


@pytest.mark.parametrize("name", CHECKS.names())
def test_lm_head(world, name):
    CHECKS.assert_passed(world, name)
