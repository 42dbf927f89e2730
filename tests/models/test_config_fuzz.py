"""Fuzz of the configuration reader: random, typed-wrong and garbled YAML/JSON files are either accepted (and then
``validate`` accepts them or raises ArgumentError) or refused with an ArgumentError naming the file — never another
exception type. Derandomized: the same cases every run."""

from __future__ import annotations

import dataclasses
import itertools
import json
import typing

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megakernels_models.arguments import ArgumentError, TrainArgs, validate
from megakernels_models.config_file import load
from megakernels_models.models.config import ModelConfig
from megakernels_models.settings import cli_fields

NAMES = [f.name for f in cli_fields(TrainArgs)]
ARCH_NAMES = [f.name for f in dataclasses.fields(ModelConfig)]
WORDS = ["1e-3", "3e2", ".5", "fp8", "none", "gpt-tiny", "llama-tiny", "bert", "x", "", "1,2,3", "-1", "cuda"]

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-2, 600),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=6),
    st.sampled_from(WORDS),
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=5,
)
# values of a field's own type (most of them), so that many files get past the reader into validate
TYPED = {
    int: st.integers(-1, 9) | st.sampled_from([16, 64, 3e2, 2**40]),
    bool: st.booleans(),
    float: st.floats(-1, 2) | st.sampled_from([1e-3, 1e-9, 0.0, float("nan")]),
    str: st.sampled_from(WORDS + ["gpt", "llama", "vlm", "fp32", "bf16", "rmsnorm", "swiglu", "rope", "gelu"]),
}


def _typed(cls, name: str):
    args = typing.get_args(typing.get_type_hints(cls)[name]) or [typing.get_type_hints(cls)[name]]
    kinds = [TYPED[t] for t in args if t in TYPED] + ([st.none()] if type(None) in args else [])
    return st.one_of(*kinds) if kinds else values


@st.composite
def mappings(draw, cls, names: list[str]):
    """Up to six of ``names`` with values of their fields' types, one in forty of another type."""
    keys = draw(st.lists(st.sampled_from(names), max_size=6, unique=True))
    return {k: draw(_typed(cls, k) if draw(st.integers(0, 39)) else values) for k in keys}


typed = st.builds(
    lambda s, a: {**s, **({"architecture": a} if a else {})},
    mappings(TrainArgs, NAMES),
    st.none() | mappings(ModelConfig, ARCH_NAMES),
)
# typed documents three times in five (st.one_of would draw each branch alike)
documents = st.sampled_from(
    [
        typed,
        typed,
        typed,
        values,
        st.dictionaries(st.sampled_from([*NAMES, "global_batch", "architecture"]), values, max_size=5),
    ]
).flatmap(lambda strategy: strategy)


@st.composite
def files(draw):
    """``(suffix, bytes)``: a document as YAML or JSON, sometimes garbled (cut, spliced, or bytes of noise)."""
    doc = draw(documents)
    suffix = draw(st.sampled_from([".yaml", ".json"]))
    text = (json.dumps(doc) if suffix == ".json" else yaml.safe_dump(doc, allow_unicode=True)).encode()
    how = draw(st.sampled_from(["clean", "clean", "clean", "cut", "splice", "noise"]))
    if how == "cut":
        text = text[: draw(st.integers(0, len(text)))]
    elif how == "splice":
        at = draw(st.integers(0, len(text)))
        text = (
            text[:at]
            + draw(st.binary(max_size=6) | st.sampled_from([b": ", b"[", b"{", b"!!", b"\t", b"\n -"]))
            + text[at:]
        )
    elif how == "noise":
        text = draw(st.binary(max_size=40))
    return suffix, text


_count = itertools.count()


@settings(
    derandomize=True,
    max_examples=400,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(case=files())
def test_config_files_are_accepted_or_refused_naming_the_file(tmp_path, monkeypatch, case):
    monkeypatch.chdir(tmp_path)  # a fuzzed --load/--save/--data names paths relative to here
    suffix, content = case
    path = tmp_path / f"job{next(_count)}{suffix}"
    path.write_bytes(content)
    try:
        values = load(str(path))
    except ArgumentError as e:
        assert str(path) in str(e) and "\n" not in str(e), str(e)
        return
    args = TrainArgs(**values)  # every name load returns is a field
    try:
        validate(args, check_memory=False)
    except ArgumentError as e:
        assert "\n" not in str(e), str(e)
