"""ParallelOptimizer with ``offload=True``: fp32 masters, Adam moments and gradient copies in host memory, stepped
by the C++ CPU AdamW. On the CPU the trajectory is the non-offloaded one bit for bit (fp32 and bf16, with clipping
and the fp16 loss scaler); the state lives in host tensors (pinned for CUDA params), the memory accounting moves it
off the device, and checkpoints' per-parameter state is the same. The CUDA path (side stream, pinned buffers) is
in the ``cuda``-marked tests. Each reduced bucket's gradients reach the host during backward, and the next forward
waits for each bucket's parameter copy when the module owning it starts. dp > 1 and ZeRO-1 (bit for bit against the
device step, the copies after each bucket's collective) and the gradients finalize_model_grads changes after the
sync (sequence parallel, the tied embedding) are checked in test_ddp.py's world; the trainer with ZeRO-1 and offload
in the layout suite (``dp2-zero1-offload``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import megakernels.parallel as mp
from megakernels.optim import DynamicLossScaler
from megakernels.parallel.ddp import DistributedDataParallel, finalize_model_grads
from megakernels.parallel.optimizer import ParallelOptimizer, host_bytes_per_param, memory_bytes_per_param


def _model(dtype, device="cpu") -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 4)).to(device=device, dtype=dtype)


def _trajectory(dtype, offload: bool, precision: str, steps: int = 5, device="cpu", scaler=None, bucket_size=300):
    model = _model(dtype, device)
    ddp = DistributedDataParallel(model, bucket_size=bucket_size)
    opt = ParallelOptimizer(
        ddp, lr=1e-2, weight_decay=0.1, precision=precision, clip_grad=0.5, offload=offload, loss_scaler=scaler
    )
    x = torch.linspace(-2, 2, 5 * 16, device=device).reshape(5, 16).to(dtype)
    out = []
    for _ in range(steps):
        opt.zero_grad()
        (ddp(x).float().square().mean() * opt.loss_scale).backward()
        finalize_model_grads([ddp])
        stepped, norm = opt.step()
        out.append((stepped, norm, [p.detach().clone() for p in model.parameters()]))
    return out, opt


@pytest.mark.parametrize(
    "dtype,precision", [(torch.float32, "fp32"), (torch.bfloat16, "bf16"), (torch.float16, "fp16")]
)
def test_offloaded_steps_equal_the_device_steps_bit_for_bit_on_the_cpu(dtype, precision):
    scaler = (lambda: DynamicLossScaler(initial_scale=2.0**8)) if precision == "fp16" else (lambda: None)
    ref, _ = _trajectory(dtype, False, precision, scaler=scaler())
    got, opt = _trajectory(dtype, True, precision, scaler=scaler())
    for (s_ref, n_ref, p_ref), (s, n, p) in zip(ref, got):
        assert s == s_ref and n == n_ref
        for a, b in zip(p, p_ref):
            assert torch.equal(a, b)
    # every piece's master is a host copy, not a view of the param
    assert all(piece.main.data_ptr() != piece.flat.data_ptr() for piece in opt.pieces)


def test_offload_moves_the_optimizer_state_off_the_device_in_the_accounting():
    _, opt = _trajectory(torch.bfloat16, True, "bf16", steps=1)
    n = sum(piece.hi - piece.lo for piece in opt.pieces)
    got = opt.memory_bytes()
    assert got["optimizer"] == 0 and got["host"] == 16 * n  # fp32 master + 2 moments + gradient copy
    assert memory_bytes_per_param("bf16", False, offload=True) == (2.0, 4.0, 0.0)
    assert memory_bytes_per_param("bf16", True, 4, offload=True) == (2.0, 4.0, 0.0)
    assert host_bytes_per_param(True, 4) == 4.0 and host_bytes_per_param(False) == 16.0


def test_offloaded_param_state_round_trips_into_a_device_optimizer():
    """Checkpoints hold the per-parameter state: an offloaded run's state loads into a non-offloaded optimizer
    (and back) and the next steps agree bit for bit."""
    _, off = _trajectory(torch.bfloat16, True, "bf16", steps=2)
    states, step = off.param_state()
    model = _model(torch.bfloat16)
    for p, q in zip(model.parameters(), [piece.param for piece in off.pieces][::-1]):
        p.data.copy_(q)
    ddp = DistributedDataParallel(model, bucket_size=300)
    on = ParallelOptimizer(ddp, lr=1e-2, weight_decay=0.1, precision="bf16", clip_grad=0.5)
    on.load_param_state(
        {p: states[q] for p, q in zip(model.parameters(), [piece.param for piece in off.pieces][::-1])}, step
    )
    back, step_back = on.param_state()
    for p, q in zip(model.parameters(), [piece.param for piece in off.pieces][::-1]):
        for k in states[q]:
            assert torch.equal(back[p][k], states[q][k]), k
    assert step_back == step == 2


def _first_layer_backward_marker(model, events):
    def mark(module, inputs, out):
        out.register_hook(lambda g: events.append(("start", "first_layer_backward")))

    model[0].register_forward_hook(mark)


def test_each_bucket_is_copied_to_the_host_as_soon_as_it_is_reduced_during_backward():
    model = _model(torch.float32)
    ddp = DistributedDataParallel(model, bucket_size=1)  # a bucket per param: 6 buckets, 2 in the first layer
    opt = ParallelOptimizer(ddp, lr=1e-2, offload=True)
    x = torch.linspace(-2, 2, 5 * 16).reshape(5, 16)
    with mp.record_events() as events:
        _first_layer_backward_marker(model, events)
        ddp(x).square().mean().backward()
        events.append(("end", "backward"))
        finalize_model_grads([ddp])
    start = events.index(("start", "first_layer_backward"))
    copy = ("copy", "grads_to_host")
    assert events[:start] == [copy] * 4 and events[start + 1 :] == [copy] * 2 + [("end", "backward")], events
    for piece in opt.pieces:  # the host copies hold the reduced gradients before step() runs
        assert torch.equal(piece.main.grad, piece.grad)


class _Tied(nn.Module):
    """A head reading a table whose own forward never runs (the last pipeline stage's tied embedding)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body, self.norm, self.table = nn.Linear(16, 8), nn.LayerNorm(8), nn.Embedding(4, 8)

    def forward(self, x):
        return self.norm(self.body(x)) @ self.table.weight.t()


def test_the_next_forward_waits_for_each_parameter_copy_when_the_module_owning_it_starts():
    model = _Tied()
    ddp = DistributedDataParallel(model, bucket_size=1)
    opt = ParallelOptimizer(ddp, lr=1e-2, offload=True)
    x = torch.linspace(-2, 2, 3 * 16).reshape(3, 16)
    seen = []

    def check(module, args):  # runs after the optimizer's pre-hook of the same module
        seen.append({n: opt._copies.in_flight(p) for n, p in model.named_parameters()})

    for m in (model, model.body, model.norm):
        m.register_forward_pre_hook(check)
    for _ in range(2):
        opt.zero_grad()
        ddp(x).square().mean().backward()
        finalize_model_grads([ddp])
        seen.clear()
        opt.step()
        assert all(opt._copies.in_flight(p) for p in model.parameters())
        ddp(x)
        # the table, whose forward never runs, when the model's starts; the others when their own module starts
        body, norm = {"body.weight", "body.bias"}, {"norm.weight", "norm.bias"}
        assert seen == [
            {n: n in body | norm for n in seen[0]},
            {n: n in norm for n in seen[0]},
            {n: False for n in seen[0]},
        ], seen


@pytest.mark.cuda
def test_cuda_offload_keeps_pinned_host_state_and_follows_the_device_trajectory():
    ref, _ = _trajectory(torch.bfloat16, False, "bf16", device="cuda", bucket_size=1)
    got, opt = _trajectory(torch.bfloat16, True, "bf16", device="cuda", bucket_size=1)
    for piece in opt.pieces:
        assert piece.main.device.type == "cpu" and piece.main.is_pinned() and piece.main.grad.is_pinned()
        st = opt._adam.state[piece.main]
        assert st["exp_avg"].device.type == "cpu"
    for (_, n_ref, p_ref), (_, n, p) in zip(ref, got):
        assert n == pytest.approx(n_ref, rel=1e-5)
        for a, b in zip(p, p_ref):  # the CPU and CUDA AdamW kernels may round differently by an ulp
            torch.testing.assert_close(a.float(), b.float(), rtol=1e-2, atol=1e-2)


def _cuda_setup(bucket_size=1):
    model = _model(torch.bfloat16, "cuda")
    ddp = DistributedDataParallel(model, bucket_size=bucket_size)
    opt = ParallelOptimizer(ddp, lr=1e-2, precision="bf16", offload=True)
    x = torch.linspace(-2, 2, 5 * 16, device="cuda").reshape(5, 16).bfloat16()
    return model, ddp, opt, x


@pytest.mark.cuda
def test_cuda_gradients_are_copied_per_bucket_from_backward_on_the_copy_stream():
    model, ddp, opt, x = _cuda_setup()
    opt.zero_grad()
    ddp(x).float().square().mean().backward()
    # every bucket's copy was issued from backward, on the copy stream, before finalize_model_grads or step()
    assert len(opt._copies._copied) == len(ddp.buckets) == len(list(model.parameters()))
    finalize_model_grads([ddp])
    opt._copies._d2h.synchronize()
    for piece in opt.pieces:
        assert torch.equal(piece.main.grad, piece.grad.cpu())


@pytest.mark.cuda
def test_cuda_next_forward_waits_for_the_parameter_copies_on_the_device():
    model, ddp, opt, x = _cuda_setup()
    opt.zero_grad()
    ddp(x).float().square().mean().backward()
    finalize_model_grads([ddp])
    opt.step()
    assert all(opt._copies.in_flight(p) for p in model.parameters())
    expected = {id(piece.param): piece.main.bfloat16() for piece in opt.pieces}  # host: the masters rounded
    out = ddp(x)  # the compute stream waits for each module's copy event; the host does not wait
    assert not any(opt._copies.in_flight(p) for p in model.parameters())
    ref = _model(torch.bfloat16)
    with torch.no_grad():
        for p, q in zip(ref.parameters(), model.parameters()):
            p.copy_(expected[id(q)].view(q.shape))
            assert torch.equal(q.cpu(), p)
    torch.testing.assert_close(out.float().cpu(), ref(x.cpu()).float(), rtol=2e-2, atol=2e-2)
