"""``megakernels bench --plan-check``: the rank correlation, the CPU device profile, the comparison's plumbing (with
the trainer replaced by known step times) and its argument errors. The real run (4 layouts × 4 processes, minutes)
is a benchmark: its result is in benchmarks/results/, not asserted here."""

from __future__ import annotations

import math

import pytest

from megakernels_models.bench import plan_check
from megakernels_models.cli import main
from megakernels_models.planning import costs


@pytest.mark.parametrize(
    "measured, tau",
    [
        (["a", "b", "c", "d"], 1.0),
        (["d", "c", "b", "a"], -1.0),
        (["b", "a", "c", "d"], 1 - 2 * 1 / 6),  # one discordant pair of six
        (["b", "a", "d", "c"], 1 - 2 * 2 / 6),
    ],
)
def test_kendall_tau_counts_discordant_pairs(measured, tau):
    assert plan_check._kendall(["a", "b", "c", "d"], measured) == pytest.approx(tau)


def test_cpu_device_profile_is_measured_and_finite():
    d = plan_check.cpu_device(4)
    assert d.name == "CPU" and d.tflops_32 > 0 and math.isfinite(d.tflops_32)
    assert d.intra_gbps > 0 and d.inter_gbps == d.intra_gbps and 0 < d.latency_s < 1


def test_run_compares_predicted_and_measured_orders(monkeypatch):
    """With the trainer's step times fixed (tp4 fastest, dp4 slowest), run reports them, orders both sides and
    scores the agreement with the model's own predictions."""
    import megakernels_models.training.train as train
    from megakernels_models.arguments import validate

    step_s = {(1, 1): 4.0, (2, 1): 2.0, (1, 2): 3.0, (4, 1): 1.0}  # (tp, pp) -> seconds per step
    tokens = {}

    def fake_run(args):
        tokens[args.tp, args.pp] = args.global_batch_size * validate(args).seq_length
        return [{"tokens_per_s": 1.0}] + [{"tokens_per_s": tokens[args.tp, args.pp] / step_s[args.tp, args.pp]}] * 2

    monkeypatch.setattr(train, "run", fake_run)
    monkeypatch.setattr(plan_check, "cpu_device", lambda n: costs.Device("CPU", 0.05, 0.05, 0.5, 1e6, 1.0, 1.0, 3e-4))
    out = plan_check.run(plan_check.default_args(3), warmup=1, log=lambda *_: None)
    assert out["measured"] == pytest.approx({"dp4": 4.0, "tp2-dp2": 2.0, "pp2-dp2": 3.0, "tp4": 1.0})
    assert out["measured_order"] == ["tp4", "tp2-dp2", "pp2-dp2", "dp4"]
    assert sorted(out["predicted_order"]) == sorted(plan_check.LAYOUTS)
    assert all(v > 0 for v in out["predicted"].values())
    assert out["kendall_tau"] == pytest.approx(plan_check._kendall(out["predicted_order"], out["measured_order"]))
    assert out["agree"] == (out["predicted_order"] == out["measured_order"])


def test_plan_check_refuses_other_modes(capsys):
    assert main(["bench", "--plan-check", "--static"]) == 2
    assert "--plan-check" in capsys.readouterr().err
