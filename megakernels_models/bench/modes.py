"""The trainer's modes of ``megakernels bench`` (``megakernels.bench.cli.Extension``s): ``--e2e`` (training
throughput, ``e2e``) and ``--plan-check`` (does ``megakernels plan`` order layouts as this machine runs them,
``plan_check``). Their modules load when a mode runs; building the parser imports only their flags."""

from __future__ import annotations

import sys

from megakernels.bench.cli import Extension


class E2E(Extension):
    dest = "e2e"

    def add_arguments(self, p) -> None:
        p.add_argument(
            "--e2e",
            default=None,
            metavar="PRESET",
            help="end-to-end training throughput of PRESET against an eager PyTorch model of its shape "
            "(comma list; gpt-tiny, gpt-1.3b, ..., gpt-cpu-s256, gpt-cpu-s1024, llama-tiny, llama3-8b, ...)",
        )
        from megakernels_models.bench import e2e

        e2e.add_arguments(p)

    def prepare(self, ns):
        from megakernels_models.bench import e2e

        return e2e.prepare(ns)

    def run(self, ns, state):
        from megakernels_models.bench import e2e

        return e2e.run(ns, state)


class PlanCheck(Extension):
    dest = "plan_check"
    alone = True

    def add_arguments(self, p) -> None:
        p.add_argument(
            "--plan-check",
            action="store_true",
            help="does megakernels plan order four layouts as this "
            "machine runs them? (4 local processes; writes DIR/plan_check.json with --out)",
        )

    def prepare(self, ns) -> None:
        if ns.ops is not None:
            raise ValueError("--plan-check: the layout-order check runs alone; drop --ops")

    def run(self, ns, state) -> int:
        """``megakernels bench --plan-check``; 1 when a rank failed."""
        from megakernels.bench.common import machine, machine_line, write_json
        from megakernels.parallel.launch import WorldFailed
        from megakernels_models.bench import plan_check

        info = machine("cpu")
        print(machine_line(info))
        try:
            result = plan_check.run(plan_check.default_args(ns.warmup + ns.steps), warmup=ns.warmup)
        except WorldFailed as e:
            print(f"megakernels bench: a rank failed: {e}", file=sys.stderr)
            return 1
        path = write_json(ns.out, "plan_check.json", {"machine": info, **result})
        if path:
            print(f"wrote {path}")
        return 0
