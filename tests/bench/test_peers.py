"""Optional peers (apex, flash-attn, Liger-Kernel): skipped with a note when absent; run side by side when present
(a stand-in package shows that the hooks call them like any other implementation)."""

from __future__ import annotations

import sys
import types

import pytest
import torch
import torch.nn.functional as F

from megakernels.bench import norms, peers


@pytest.fixture
def no_peers_installed(monkeypatch):
    for name in peers.PACKAGES:
        monkeypatch.setitem(sys.modules, name, None)  # import raises ModuleNotFoundError


def test_absent_peers_are_skipped_with_one_note_each(no_peers_installed):
    p = peers.Peers("cuda")
    assert p.norm("layer_norm") == {} and p.norm("rms_norm") == {} and p.adamw() == {}
    assert p.attention(torch.bfloat16) == {} and p.cross_entropy() == {}
    assert sorted(p.notes) == sorted(
        f"peer {n} ({label}): not installed; skipped" for n, (label, _) in peers.PACKAGES.items()
    )


def test_disabled_peers_are_not_even_imported(no_peers_installed):
    p = peers.Peers("cuda", enabled=False)
    assert p.norm("rms_norm") == {} and p.notes == []


def test_a_quick_norms_run_prints_the_notes(no_peers_installed, capsys):
    from megakernels_models.cli import main

    assert (
        main(["bench", "--ops", "rms_norm", "--dtype", "float32", "--quick", "--no-compile", "--min-run-time", "0.01"])
        == 0
    )
    out = capsys.readouterr().out
    assert "note: peer apex (NVIDIA apex): not installed; skipped" in out
    assert "note: peer liger_kernel (Liger-Kernel): not installed; skipped" in out


class _StandInRMSNorm(torch.nn.Module):
    def __init__(self, hidden, eps=1e-6):
        super().__init__()
        self.weight, self.eps = torch.nn.Parameter(torch.ones(hidden)), eps

    def forward(self, x):
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class _Broken(_StandInRMSNorm):
    def forward(self, x):
        raise RuntimeError("no kernel for this shape")


@pytest.fixture
def stand_in_liger(monkeypatch):
    """A fake ``liger_kernel`` whose RMSNorm is torch's, marked as running on the CPU."""
    pkg, sub = types.ModuleType("liger_kernel"), types.ModuleType("liger_kernel.transformers")
    sub.LigerRMSNorm, pkg.transformers = _StandInRMSNorm, sub
    monkeypatch.setitem(sys.modules, "liger_kernel", pkg)
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", sub)
    monkeypatch.setitem(sys.modules, "apex", None)
    monkeypatch.setitem(peers.PACKAGES, "liger_kernel", ("stand-in", False))
    return sub


def test_an_installed_peer_applies_our_weight_and_gets_its_gradient(stand_in_liger):
    fn = peers.Peers("cpu").norm("rms_norm")["liger_kernel"]
    x, w = torch.randn(4, 16), torch.randn(16, requires_grad=True)
    y = fn(x, w)
    torch.testing.assert_close(y, F.rms_norm(x, (16,), w, 1e-6))
    y.sum().backward()
    assert w.grad is not None


def test_an_installed_peer_is_a_column_of_the_row(stand_in_liger):
    p = peers.Peers("cpu")
    rows = norms.measure(
        ["rms_norm"], ["float32"], [(64, 32)], with_compile=False, min_run_time=0.01, peers=p, log=lambda s: None
    )
    assert all("liger_kernel" in r["speedups"] and r["rates"]["liger_kernel"] > 0 for r in rows)
    assert p.notes == ["peer apex (NVIDIA apex): not installed; skipped"]


def test_a_peer_that_fails_is_dropped_from_the_row_with_a_note(stand_in_liger):
    stand_in_liger.LigerRMSNorm = _Broken
    p = peers.Peers("cpu")
    rows = norms.measure(
        ["rms_norm"], ["float32"], [(64, 32)], with_compile=False, min_run_time=0.01, peers=p, log=lambda s: None
    )
    assert all("liger_kernel" not in r["times_ms"] for r in rows)
    assert any("peer liger_kernel failed on rms_norm float32 64x32: RuntimeError" in n for n in p.notes)


def test_peers_that_need_cuda_are_skipped_on_the_cpu(stand_in_liger, monkeypatch):
    monkeypatch.setitem(peers.PACKAGES, "liger_kernel", ("stand-in", True))
    p = peers.Peers("cpu")
    assert p.norm("rms_norm") == {}
    assert "peer liger_kernel (stand-in): installed, but its kernels need CUDA (--device cuda); skipped" in p.notes
