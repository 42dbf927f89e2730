"""megakernels.ops.gemm: fp32 CPU products through oneDNN against fp64 PyTorch, the cases left to PyTorch, and the
route: chosen by a measurement on this machine (cached per CPU, thread count and torch), or by
MEGAKERNELS_CPU_GEMM. The products' tests take the oneDNN route whatever this machine measured (the variable)."""

import json

import pytest
import torch
import torch.nn.functional as F

from megakernels import host
from megakernels.ops import gemm

pytestmark = pytest.mark.skipif(not gemm.available(), reason="oneDNN is not built into this torch")


@pytest.fixture(autouse=True)
def onednn_route(request, monkeypatch):
    """The oneDNN route for the products' tests (the route's own tests, on a fresh cache, set what they need)."""
    if "fresh_cache" not in request.fixturenames:
        monkeypatch.setenv(gemm.ENV, "onednn")


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


@pytest.fixture
def spy(monkeypatch):
    """Counts the products handed to oneDNN."""
    calls = []
    real = gemm._onednn

    def counted(x2, w, bias):
        calls.append((tuple(x2.shape), tuple(w.shape)))
        return real(x2, w, bias)

    monkeypatch.setattr(gemm, "_onednn", counted)
    return calls


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(512, 768), (2, 96, 768)])
def test_linear_forward_and_backward_equal_fp64_in_fp32(spy, shape, bias):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g, requires_grad=True)
    w = torch.randn(1024, 768, generator=g, requires_grad=True)
    b = torch.randn(1024, generator=g, requires_grad=True) if bias else None
    dy = torch.randn(*shape[:-1], 1024, generator=g)
    y = gemm.linear(x, w, b)
    y.backward(dy)
    assert len(spy) == 3  # the forward, dX and dW products
    xd, wd = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    bd = b.detach().double().requires_grad_() if bias else None
    yd = F.linear(xd, wd, bd)
    yd.backward(dy.double())
    assert y.shape == yd.shape and y.dtype == torch.float32
    # fp32 products with fp32 sums (K = 768 or the token count): a few ulps of the largest entry
    for got, ref in ((y, yd), (x.grad, xd.grad), (w.grad, wd.grad)) + (((b.grad, bd.grad),) if bias else ()):
        assert _rel(got, ref) < 1e-5


def test_transposed_operands_and_mm_equal_fp64(spy):
    g = torch.Generator().manual_seed(1)
    a = torch.randn(384, 700, generator=g)
    bt = torch.randn(512, 700, generator=g).t()  # [700, 512], a transposed view
    got = gemm.mm(a, bt)
    assert spy and _rel(got, a.double() @ bt.double()) < 1e-5
    got = gemm.linear_nograd(a.t().contiguous().t(), torch.randn(300, 700, generator=g).t().contiguous().t())
    assert got.shape == (384, 300)


def test_small_products_other_dtypes_and_devices_stay_with_pytorch(spy):
    x, w = torch.randn(16, 32), torch.randn(64, 32)
    assert torch.equal(gemm.linear(x, w), F.linear(x, w))  # below MIN_FLOPS: PyTorch's result, bit for bit
    xb, wb = torch.randn(512, 768, dtype=torch.bfloat16), torch.randn(1024, 768, dtype=torch.bfloat16)
    assert torch.equal(gemm.linear(xb, wb), F.linear(xb, wb))
    xm, wm = torch.randn(512, 768, device="meta"), torch.randn(1024, 768, device="meta")
    assert gemm.linear(xm, wm).shape == (512, 1024)
    assert spy == []


def test_products_autograd_would_record_stay_with_pytorch(spy):
    # mm under grad mode with an operand that requires grad: oneDNN's op has no derivative
    a = torch.randn(512, 768, requires_grad=True)
    b = torch.randn(768, 1024)
    out = gemm.mm(a, b)
    assert out.grad_fn is not None and spy == []


def test_double_backward_runs_pytorch_products():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(256, 512, generator=g, dtype=torch.float32, requires_grad=True)
    w = torch.randn(512, 512, generator=g, requires_grad=True)
    (dx,) = torch.autograd.grad(gemm.linear(x, w).square().sum(), x, create_graph=True)
    (ddw,) = torch.autograd.grad(dx.sum(), w)
    xd, wd = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    (dxd,) = torch.autograd.grad(F.linear(xd, wd).square().sum(), xd, create_graph=True)
    (ddwd,) = torch.autograd.grad(dxd.sum(), wd)
    assert _rel(dx, dxd) < 1e-5 and _rel(ddw, ddwd) < 1e-5


def test_turned_off_by_the_environment(monkeypatch, spy):
    monkeypatch.setenv("MEGAKERNELS_CPU_GEMM", "torch")
    x, w = torch.randn(512, 768), torch.randn(1024, 768)
    assert torch.equal(gemm.linear(x, w), F.linear(x, w)) and spy == []


def test_compiled_linear_traces_pytorch_ops():
    x, w = torch.randn(512, 768), torch.randn(1024, 768, requires_grad=True)
    f = torch.compile(gemm.linear, backend="eager", fullgraph=True)
    y = f(x, w)
    y.sum().backward()
    assert _rel(y, F.linear(x.double(), w.detach().double())) < 1e-5 and w.grad is not None


def test_parameters_are_routed_and_subclasses_are_not(spy):
    x = torch.randn(512, 768)
    w = torch.nn.Parameter(torch.randn(1024, 768))
    gemm.linear(x, w).sum().backward()
    assert len(spy) == 2  # forward and dW (x needs no gradient)

    class Other(torch.Tensor):
        pass

    spy.clear()
    gemm.mm(x.as_subclass(Other), torch.randn(768, 1024))
    assert spy == []


@pytest.mark.parametrize("chunk", [None, 96])  # one chunk (dW is oneDNN's product) and several (accumulated)
@pytest.mark.parametrize("bias", [False, True])
def test_linear_cross_entropy_routed_in_fp32_equals_fp64(spy, chunk, bias):
    from megakernels.ops.linear_cross_entropy import linear_cross_entropy, linear_cross_entropy_reference

    g = torch.Generator().manual_seed(3)
    t, h, v = 300, 256, 2048
    x = torch.randn(t, h, generator=g, requires_grad=True)
    w = (torch.randn(v, h, generator=g) / h**0.5).requires_grad_(True)
    b = (torch.randn(v, generator=g) * 0.1).requires_grad_(True) if bias else None
    target = torch.randint(0, v, (t,), generator=g)
    target[::7] = -100
    dl = torch.rand(t, generator=g)
    loss = linear_cross_entropy(x, w, target, chunk_tokens=chunk, bias=b)
    loss.backward(dl)
    assert spy  # the chunks' products went to oneDNN
    xd, wd = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    bd = b.detach().double().requires_grad_() if bias else None
    ref = linear_cross_entropy_reference(xd, wd, target, bias=bd)
    ref.backward(dl.double())
    assert _rel(loss, ref) < 1e-5
    for got, want in ((x.grad, xd.grad), (w.grad, wd.grad)) + (((b.grad, bd.grad),) if bias else ()):
        assert _rel(got, want) < 1e-5


def test_a_weight_updated_in_place_is_read_again():
    """oneDNN must not reuse a packed copy of a weight the optimizer has since changed (nor of an input)."""
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(512, 768, generator=g), torch.randn(1024, 768, generator=g)
    gemm.linear_nograd(x, w)
    w.add_(1.0)
    x.mul_(2.0)
    assert _rel(gemm.linear_nograd(x, w), x.double() @ w.double().t()) < 1e-5
    assert _rel(gemm.mm(x, w.t()), x.double() @ w.double().t()) < 1e-5


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    """An empty cache folder and no choice made in this process yet; the route measured (no override)."""
    monkeypatch.setenv("MEGAKERNELS_CACHE", str(tmp_path))
    monkeypatch.delenv(gemm.ENV, raising=False)
    monkeypatch.setattr(gemm, "_chosen", {})
    return tmp_path / gemm.CACHE_FILE


@pytest.mark.parametrize("onednn_s,route", [(0.5, "onednn"), (0.9, "onednn"), (0.95, "torch"), (2.0, "torch")])
def test_the_route_is_the_measured_faster_one_and_measured_once_per_machine(fresh_cache, monkeypatch, onednn_s, route):
    """Times of 1 s for PyTorch and ``onednn_s`` for oneDNN (the timer replaced): oneDNN only at 0.9 of PyTorch's
    time or less; the choice is cached under this CPU (model and flags digest), thread count and torch version, so
    the next process reads it instead of measuring; nothing about the vendor enters."""
    clock = iter(range(10**6))
    monkeypatch.setattr(gemm.time, "perf_counter", lambda: next(clock))  # every call to measure takes 1 tick
    monkeypatch.setattr(gemm, "MEASURED", ((64, 32, 48), (16, 32, 64)))  # timed by the clock: small is enough
    real = gemm.measure
    calls = []

    def measured(trials=gemm._TRIALS):
        got = real(trials)
        calls.append(got)
        return {**got, "onednn_s": onednn_s, "torch_s": 1.0, "route": "onednn" if onednn_s <= 0.9 else "torch"}

    monkeypatch.setattr(gemm, "measure", measured)
    assert gemm.route() == route and gemm.enabled() == (route == "onednn")
    assert gemm.describe()["source"] == "measured" and len(calls) == 1
    assert calls[0]["onednn_s"] == calls[0]["torch_s"] == len(gemm.MEASURED)  # 1 tick a product, best of 5
    key = f"{host.cpu_key()}|threads={torch.get_num_threads()}|torch={torch.__version__}"
    assert json.loads(fresh_cache.read_text())[key]["route"] == route
    monkeypatch.setattr(gemm, "_chosen", {})  # another process on the same machine
    assert gemm.route() == route and gemm.describe()["source"] == "cache" and len(calls) == 1
    torch.set_num_threads(torch.get_num_threads() + 1)  # another thread count is another measurement
    try:
        gemm.route()
        assert len(calls) == 2
    finally:
        torch.set_num_threads(torch.get_num_threads() - 1)


def test_the_route_measurement_times_both_and_applies_the_rule(fresh_cache):
    got = gemm.measure(trials=2)
    assert got["onednn_s"] > 0 and got["torch_s"] > 0
    assert got["route"] == ("onednn" if got["onednn_s"] <= gemm.ONEDNN_AT_MOST * got["torch_s"] else "torch")


def test_the_route_set_by_the_environment_beats_the_measurement(fresh_cache, monkeypatch, spy):
    monkeypatch.setattr(gemm, "measure", lambda trials=gemm._TRIALS: pytest.fail("measured despite the variable"))
    x, w = torch.randn(512, 768), torch.randn(1024, 768)
    monkeypatch.setenv(gemm.ENV, "torch")
    assert torch.equal(gemm.linear(x, w), F.linear(x, w)) and spy == []
    assert gemm.describe() == {"route": "torch", "source": gemm.ENV, "threads": torch.get_num_threads()}
    monkeypatch.setenv(gemm.ENV, "onednn")
    gemm.linear(x, w)
    assert len(spy) == 1 and not fresh_cache.exists()
    monkeypatch.setenv(gemm.ENV, "mkl")
    with pytest.raises(ValueError, match="MEGAKERNELS_CPU_GEMM must be one of auto, onednn, torch, got 'mkl'"):
        gemm.linear(x, w)


def test_the_machine_names_the_cpu_model_and_flags():
    """From /proc/cpuinfo's first processor (an x86 block and an Arm one), the key carrying a digest of the
    flags whatever their order."""
    x86 = "processor\t: 0\nvendor_id\t: X\nmodel name\t: Some CPU 9000\nflags\t\t: fpu sse avx2\n\nprocessor\t: 1\n"
    assert host._from_cpuinfo(x86) == {"model": "Some CPU 9000", "flags": "fpu sse avx2"}
    arm = "processor\t: 0\nFeatures\t: fp asimd sve\nCPU implementer\t: 0x41\nCPU part\t: 0xd40\n"
    assert host._from_cpuinfo(arm) == {"model": "Arm implementer 0x41 part 0xd40", "flags": "fp asimd sve"}
    info = host.cpu()
    assert info["model"] and isinstance(info["flags"], str)
    with open(host.CPUINFO) as f:
        text = f.read()
    assert info == host._from_cpuinfo(text)
    assert host.cpu_key().startswith(info["model"] + "|flags=")
