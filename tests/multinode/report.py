"""The results report of ``scripts/multinode_check.sh``: every check's outcome in every repetition (pytest's JUnit
XML) and the figures the checks recorded (``common.record``), as ``benchmarks/results/<date>-<machine>-multinode``
``.json`` (one result a check and repetition, for ``benchmarks/results_table.py``) and ``.md``.

    python -m tests.multinode.report --records rec-1.jsonl rec-2.jsonl ... --junit run-1.xml run-2.xml ... \\
        --out benchmarks/results --command "bash scripts/multinode_check.sh"
"""

from __future__ import annotations

import argparse
import json
import os
import re
import xml.etree.ElementTree as ET

from megakernels.bench.common import machine


def outcomes(path: str) -> dict[str, str]:
    """test id -> passed | failed | error | skipped, from one JUnit XML file."""
    out = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        state = "passed"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                state = {"failure": "failed"}.get(child.tag, child.tag)
        out[name] = state
    return out


def build(records: list[str], junit: list[str], command: str) -> dict:
    """The report of repetitions ``i`` = 1, 2, ...: ``junit[i-1]`` (outcomes) and ``records[i-1]`` (figures)."""
    runs = [outcomes(p) for p in junit]
    results = []
    for i, (run, rec_path) in enumerate(zip(runs, records), 1):
        for test, state in sorted(run.items()):
            results.append({"name": test, "repetition": i, "outcome": state})
        if os.path.exists(rec_path):
            with open(rec_path) as f:
                for rec in (json.loads(line) for line in f if line.strip()):
                    figures = {k: v for k, v in rec.items() if k not in ("check", "time")}
                    results.append({"name": rec["check"], "repetition": i, **figures})
    tests = sorted({t for r in runs for t in r})
    return {
        "machine": machine("cpu"),
        "command": command,
        "repetitions": len(runs),
        "passed_of_repetitions": {t: sum(r.get(t) == "passed" for r in runs) for t in tests},
        "results": results,
    }


def markdown(report: dict) -> str:
    m = report["machine"]
    lines = [
        f"# Multi-node checks: two network namespaces, torchrun across them, a real Slurm — CPU, {m['date']}",
        "",
        f'- Machine: the development VM, "{m["cpu"]}", {m["threads"]} threads, no GPU; torch {m["torch"]}, '
        f"Python {m['python']}. Commit {m['commit']}.",
        f"- Command: `{report['command']}` ({report['repetitions']} repetitions of `pytest tests/multinode`).",
        "- Two hosts: network namespaces joined by a veth pair (10.231.0.1, 10.231.0.2), each process with its node's "
        "host name (mk-node0, mk-node1) and /etc/hosts; torchrun per node (c10d rendezvous at mk-node0, 2 ranks a "
        "node, gloo); Slurm 22.05 (Debian's slurm-wlm: slurmctld + a slurmd per node, munge). The model and batch "
        "are the layout suite's (4 layers, hidden 32, seq 16, global batch 8, fp32, dropout 0, 6 steps); "
        '"identical" = the single process\'s loss at every step to 1e-5 relative.',
        "",
        "| check | passed |",
        "|---|---|",
    ]
    for test, n in report["passed_of_repetitions"].items():
        lines.append(f"| `{test}` | {n} of {report['repetitions']} |")
    lines += ["", "Figures recorded by the checks (every repetition):", ""]
    by_check: dict[str, list[dict]] = {}
    for r in report["results"]:
        if "outcome" not in r:
            by_check.setdefault(r["name"], []).append(r)
    lines += ["| check | figures per repetition |", "|---|---|"]
    for name, recs in by_check.items():
        keys = [k for k in recs[0] if k not in ("name", "repetition")]
        cells = []
        for k in keys:
            vals = [r.get(k) for r in recs]
            fmt = (lambda v: f"{v:.2e}") if "fraction" in k else (lambda v: f"{v:.1f}")
            cells.append(f"{k}: " + ", ".join(fmt(v) for v in vals if isinstance(v, float)))
        lines.append(f"| {name} | {'; '.join(cells)} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.multinode.report")
    p.add_argument("--records", nargs="+", required=True, help="each repetition's figures (common.record)")
    p.add_argument("--junit", nargs="+", required=True, help="each repetition's pytest --junitxml")
    p.add_argument("--out", required=True, help="the results directory")
    p.add_argument("--command", required=True)
    p.add_argument("--name", default="multinode")
    a = p.parse_args(argv)
    report = build(a.records, a.junit, a.command)
    m = report["machine"]
    cpu = re.sub(r"[^a-z0-9]+", "-", m["cpu"].lower().replace("amd ", "").replace("intel(r) ", "")).strip("-")
    stem = os.path.join(a.out, f"{m['date']}-cpu-{cpu}-{a.name}")
    with open(stem + ".json", "w") as f:
        json.dump(report, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(markdown(report))
    print(stem + ".json")
    return 0 if all(n == report["repetitions"] for n in report["passed_of_repetitions"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
