"""The public API under a derandomized fuzz of good, unusual and bad input (tests/fuzz): never a crash, hang,
unclean exception or silent wrong answer. The fuzz runs in one child process; a child that dies (a segfault or an
abort in a kernel) or hangs fails the test with the case it was running."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = 300  # ~5 s of cases after ~3 s of imports on the CI machine
TIMEOUT_S = 240


def _text(out) -> str:
    if out is None:
        return ""
    return out.decode(errors="replace") if isinstance(out, bytes) else out


def _last_case(stdout: str) -> str:
    lines = [line for line in stdout.splitlines() if line.startswith("case ")]
    return lines[-1] if lines else "(before the first case)"


def run_fuzz(examples: int = EXAMPLES, timeout: float = TIMEOUT_S, env: dict | None = None) -> str | None:
    """Runs ``python -m tests.fuzz.child``; returns None when every case passed, else why the fuzz failed (the
    case a dead or hung child was on, or the falsifying case and its error)."""
    cmd = [sys.executable, "-m", "tests.fuzz.child", "--examples", str(examples)]
    try:
        proc = subprocess.run(
            cmd, cwd=ROOT, env={**os.environ, **(env or {})}, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired as e:
        return f"the fuzz hung: no result after {timeout:.0f} s, during {_last_case(_text(e.stdout))}"
    out, err = proc.stdout, proc.stderr
    if proc.returncode < 0:
        name = signal.Signals(-proc.returncode).name
        return f"the fuzz child died with {name} during {_last_case(out)}\n{err[-3000:]}"
    if proc.returncode != 0:
        return f"the fuzz failed (exit status {proc.returncode}) after {_last_case(out)}\n{err[-6000:]}"
    return None


def test_public_api_refuses_bad_input_cleanly_and_computes_the_rest_right():
    failure = run_fuzz()
    assert failure is None, failure


def test_a_crash_in_the_child_fails_naming_the_case_it_was_on():
    failure = run_fuzz(examples=8, env={"MK_FUZZ_ABORT_AT": "5"})
    assert failure is not None and "died with SIGABRT during case 5:" in failure, failure
