"""The public-API fuzz, run as a child process (``python -m tests.fuzz.child --examples N``) so that a crash in a
kernel (a segfault, an abort) kills only this process and the parent test can name the case it died on.

Every case is announced on stdout (``case N: ...``, flushed) before it runs. A case takes one good call of an entry
(tests/fuzz/entries.py) and applies at most one mutation; the contract it checks:

- good input (``none``, a ``noncontiguous`` view of a tensor argument) is accepted and equals the fp64 reference
  within the dtype's tolerance;
- every tensor argument on meta (``all_meta``) gives meta results of the shapes the real call gives;
- a tensor argument moved alone to ``meta``, made ``sparse`` or passed as a ``list``, and an invalid ``scalar``
  option, are refused with TypeError/ValueError/RuntimeError/NotImplementedError whose message names the argument;
- a wrong ``dtype`` or a wrong last dimension is either refused with a message naming an argument of the call, or
  accepted with the reference's result on that input (when the reference itself accepts it).

Hypothesis is derandomized: the same cases run every time. The first failure (shrunk) exits with status 1 and the
falsifying case; ``fuzz: N cases passed`` ends a clean run. ``MK_FUZZ_ABORT_AT=N`` aborts the process in case N
(how the parent's crash reporting is tested).
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import os
import sys

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import megakernels
from tests.fuzz.entries import ENTRIES, Entry, names_argument
from tests.helpers import TOLERANCE

CLEAN_ERRORS = (TypeError, ValueError, RuntimeError, NotImplementedError)
MUST_REFUSE = ("meta", "sparse", "list", "scalar")


@dataclasses.dataclass
class Case:
    entry: Entry
    backend: str
    dtype: torch.dtype
    kwargs: dict
    mutation: str = "none"
    arg: str | None = None
    value: object = None  # the invalid scalar

    def __str__(self) -> str:
        shapes = {k: tuple(v.shape) for k, v in self.kwargs.items() if isinstance(v, torch.Tensor)}
        what = f" {self.arg}={self.value!r}" if self.mutation == "scalar" else (f" {self.arg}" if self.arg else "")
        return f"{self.entry.name} [{self.mutation}{what}] backend={self.backend} dtype={self.dtype} shapes={shapes}"


@st.composite
def cases(draw) -> Case:
    entry = draw(st.sampled_from(ENTRIES))
    dtype = draw(st.sampled_from(entry.dtypes))
    case = Case(entry, draw(st.sampled_from(entry.backends)), dtype, entry.build(draw, dtype))
    kinds = ["none"]
    if entry.tensors:
        kinds += ["noncontiguous", "meta", "sparse", "list", "dtype", "shape"]
    if entry.tensors and entry.meta_ok and case.backend == "auto":
        kinds.append("all_meta")
    if entry.scalars:
        kinds += ["scalar"] * 3  # most entries' options are where users go wrong
    case.mutation = draw(st.sampled_from(kinds))
    if case.mutation == "scalar":
        case.arg = draw(st.sampled_from(sorted(entry.scalars)))
        case.value = draw(st.sampled_from(entry.scalars[case.arg]))
    elif case.mutation not in ("none", "all_meta"):
        case.arg = draw(st.sampled_from(entry.tensors))
    return case


def _mutated(t: torch.Tensor, how: str, bad_dtype: torch.dtype):
    if how == "meta":
        return t.to("meta")
    if how == "sparse":
        return t.to_sparse()
    if how == "list":
        return t.tolist()
    if how == "dtype":
        return t.to(bad_dtype)
    if how == "shape":  # a wrong last dimension
        return t[..., :-1] if t.shape[-1] > 1 else torch.cat([t, t], -1)
    if how == "noncontiguous":  # the same values through a last-dim stride of 2
        return torch.stack([t, torch.zeros_like(t)], -1)[..., 0]
    raise AssertionError(how)


def apply(case: Case) -> dict:
    kw = dict(case.kwargs)
    if case.mutation == "scalar":
        kw[case.arg] = case.value
    elif case.mutation == "all_meta":
        kw = {k: _to_meta(v) for k, v in kw.items()}
    elif case.arg is not None:
        bad = case.entry.bad_dtype.get(case.arg, torch.int64)
        value = kw[case.arg]
        if isinstance(value, list):  # a tensor list: the last element goes wrong
            kw[case.arg] = [*value[:-1], _mutated(value[-1], case.mutation, bad)]
        else:
            kw[case.arg] = _mutated(value, case.mutation, bad)
    return kw


def _to_meta(v):
    if isinstance(v, torch.Tensor):
        return v.to("meta")
    if isinstance(v, list):
        return [_to_meta(u) for u in v]
    return v


def _flat(out) -> list[torch.Tensor]:
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _tensors(v) -> list[torch.Tensor]:
    if isinstance(v, torch.Tensor):
        return [v]
    if isinstance(v, (list, tuple)):
        return [t for u in v for t in _tensors(u)]
    return []


def check(case: Case) -> None:
    """Runs one case; raises AssertionError (with the case) where the contract is broken."""
    kw = apply(case)
    call = case.entry.call
    if (
        case.mutation == "meta"
        and case.entry.meta_ok
        and case.backend == "auto"
        and all(t.device.type == "meta" for t in _tensors(list(kw.values())))
    ):
        case.mutation = "all_meta"  # the only tensor argument went to meta: shapes must trace
    try:
        with megakernels.backend(case.backend):
            out = call(**kw)
    except CLEAN_ERRORS as e:
        msg = str(e)
        assert case.mutation in MUST_REFUSE + ("dtype", "shape"), f"{case}: refused good input: {e!r}"
        names = [case.arg] if case.mutation in MUST_REFUSE else list(kw)
        assert any(names_argument(msg, n) for n in names), f"{case}: the error does not name {names}: {e!r}"
        return
    except Exception as e:  # noqa: BLE001 - any other exception type is itself the defect
        raise AssertionError(f"{case}: {type(e).__name__} is not a clean argument error: {e!r}") from e
    assert case.mutation not in MUST_REFUSE, f"{case}: accepted (returned {type(out).__name__})"
    if case.mutation == "all_meta":
        with megakernels.backend(case.backend):
            real = _flat(call(**case.kwargs))
        got = _flat(out)
        assert [t.device.type for t in got] == ["meta"] * len(real), f"{case}: results not on meta"
        assert [t.shape for t in got] == [t.shape for t in real], f"{case}: meta shapes differ from the real call's"
        return
    try:
        expected = _flat(case.entry.reference(**kw))
    except Exception as e:  # noqa: BLE001
        raise AssertionError(f"{case}: accepted input that the reference refuses ({e!r})") from e
    got = _flat(out)
    assert len(got) == len(expected), f"{case}: {len(got)} results, expected {len(expected)}"
    tol = TOLERANCE[case.dtype] * 2
    for i, (a, e) in enumerate(zip(got, expected)):
        a, e = a.detach().double(), e.detach().double()
        assert a.shape == e.shape, f"{case}: result {i} has shape {tuple(a.shape)}, expected {tuple(e.shape)}"
        assert torch.equal(torch.isnan(a), torch.isnan(e)), f"{case}: result {i}: NaN where the reference has none"
        scale = max(1.0, e.abs().nan_to_num(0.0).max().item()) if e.numel() else 1.0
        err = (a - e).nan_to_num(0.0).abs().max().item() if e.numel() else 0.0
        assert err <= tol * scale, f"{case}: result {i} is off by {err:.3g} (tolerance {tol * scale:.3g})"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--examples", type=int, default=300)
    args = p.parse_args(argv)
    faulthandler.enable()  # a crash also dumps the Python stack to stderr
    abort_at = int(os.environ.get("MK_FUZZ_ABORT_AT", "-1"))
    count = 0

    @settings(
        max_examples=args.examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
        print_blob=False,
    )
    @given(case=cases())
    def fuzz(case: Case) -> None:
        nonlocal count
        count += 1
        print(f"case {count}: {case}", flush=True)
        if count == abort_at:
            os.abort()
        check(case)

    fuzz()
    print(f"fuzz: {count} cases passed", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
