"""Which attention and experts implementation a patched model runs, and who chose it.

transformers picks a model's attention and experts implementation by name (``config._attn_implementation``,
``config._experts_implementation``) through its ``AttentionInterface`` / ``AttentionMaskInterface`` /
``ExpertsInterface``. Where the caller did not choose one, transformers resolves its default, ``"sdpa"`` and
``"grouped_mm"``; a patched model keeps those names (code that tests for them, transformers' own included, sees
what it expects) and its calls under them run megakernels' FlashAttention / grouped GEMM, which compute the same
function. Three pieces make that exact:

- the interfaces' ``"sdpa"`` and ``"grouped_mm"`` entries become dispatchers: a module of a patched model (marked on
  the module, or through its config) runs megakernels' function, every other module the entry that was there;
- :func:`note_request` (called by the class patch while transformers builds a model) records what the caller asked
  for before transformers resolves it (with :func:`asked`, what ``from_pretrained`` / ``from_config`` were given),
  so :func:`chosen_by_default` can tell an explicit ``"sdpa"`` from the default;
- :func:`accelerate` records the configs of patched models (by identity, never on the config: it would be saved
  into ``config.json``), which the mask dispatcher needs (masks are made from the config, not a module).

An explicit choice always wins: ``"eager"``, ``"flex_attention"``, ``"batched_mm"``, ... are never dispatched here,
and ``set_attn_implementation`` / ``set_experts_implementation`` afterwards work as in transformers (the
dispatchers only see calls made under the default names).
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from dataclasses import dataclass, field

ATTENTION, EXPERTS = "attention", "experts"
# transformers' default implementation of each kind (what it resolves a request of None to) and the config attribute
# holding the implementation before and after that resolution
DEFAULT = {ATTENTION: "sdpa", EXPERTS: "grouped_mm"}
_INTERNAL = {ATTENTION: "_attn_implementation_internal", EXPERTS: "_experts_implementation_internal"}
MARK = {ATTENTION: "_megakernels_attention", EXPERTS: "_megakernels_experts"}  # set on the modules of a patched model


@dataclass
class _Record:
    ref: weakref.ref
    explicit: dict = field(default_factory=dict)  # kind -> the implementation the caller asked for
    accelerated: set = field(default_factory=set)  # kinds whose default-named calls run megakernels' function


_RECORDS: dict[int, _Record] = {}  # id(config) -> its record (configs are unhashable: they define __eq__)
# the implementations a from_pretrained / from_config call was given as arguments, while it builds its model
_ASKED: contextvars.ContextVar[dict | None] = contextvars.ContextVar("megakernels_asked", default=None)


def _record(config, create: bool = False) -> _Record | None:
    if config is None:
        return None
    key = id(config)
    rec = _RECORDS.get(key)
    if rec is not None and rec.ref() is config:
        return rec
    if not create:
        return None
    rec = _Record(weakref.ref(config, lambda _, key=key: _RECORDS.pop(key, None)))
    _RECORDS[key] = rec
    return rec


def requested(config) -> dict:
    """What ``config`` holds for each kind before transformers resolves it (None: nothing chosen)."""
    return {kind: getattr(config, attr, None) for kind, attr in _INTERNAL.items()}


@contextlib.contextmanager
def asked(kwargs: dict):
    """While a ``from_pretrained`` / ``from_config`` call given ``kwargs`` builds its model: the implementations it
    was asked for by argument (an explicit ``attn_implementation="sdpa"`` looks like the default on the config)."""
    given = {kind: kwargs[arg] for kind, arg in _ARGUMENT.items() if isinstance(kwargs.get(arg), str)}
    token = _ASKED.set(given)
    try:
        yield
    finally:
        _ASKED.reset(token)


_ARGUMENT = {ATTENTION: "attn_implementation", EXPERTS: "experts_implementation"}


def note_request(config, before: dict, attention_default: str | None = None) -> None:
    """Record which implementations of ``config`` (``before``: its values before transformers resolved them) the
    caller chose: any but the default's name (``attention_default``: the attention's, where the model's classes
    resolve to another than ``DEFAULT``), and the default's name when given as an argument (:func:`asked`). A
    config that arrives with the default's name otherwise (one another model resolved before) is left as it is."""
    given = _ASKED.get() or {}
    defaults = {**DEFAULT, **({ATTENTION: attention_default} if attention_default else {})}
    for kind, value in before.items():
        if value is None:
            rec = _record(config)
            if rec is not None:
                rec.explicit.pop(kind, None)
        elif value != defaults[kind] or given.get(kind) == value:
            _record(config, create=True).explicit[kind] = value


def chosen_by_default(config, kind: str, default: str | None = None) -> bool:
    """Whether ``config``'s current implementation of ``kind`` is transformers' default (``default``, else
    ``DEFAULT``: what transformers resolves an unchosen implementation to for the model's classes) and not the
    caller's choice: never where :func:`note_request` recorded it as chosen (models built under a class patch);
    otherwise (transformers keeps no record) whether it is the default's name."""
    now = getattr(config, _INTERNAL[kind], None)
    rec = _record(config)
    if rec is not None and rec.explicit.get(kind) == now:
        return False
    return now == (default or DEFAULT[kind])


def accelerate(config, kind: str) -> None:
    """Calls under ``kind``'s default name with ``config`` run megakernels' function from now on."""
    _record(config, create=True).accelerated.add(kind)


def accelerated(config, kind: str) -> bool:
    rec = _record(config)
    return rec is not None and kind in rec.accelerated


def _dispatcher(kind: str, previous, ours):
    """An interface entry: ``ours`` for the modules of a patched model, ``previous`` for every other module."""
    mark = MARK[kind]

    def dispatch(module, *args, **kwargs):
        if getattr(module, mark, False) or accelerated(getattr(module, "config", None), kind):
            return ours(module, *args, **kwargs)
        return previous(module, *args, **kwargs)

    dispatch.megakernels = True
    dispatch.previous = previous
    dispatch.__doc__ = f"megakernels' {kind} for patched models, {getattr(previous, '__name__', previous)} otherwise."
    return dispatch


def _mask_dispatcher(previous, ours):
    """The mask entry: masks are made from the config, so it is the config that says whether ``ours`` applies."""

    def dispatch(*args, **kwargs):
        if accelerated(kwargs.get("config"), ATTENTION):
            return ours(*args, **kwargs)
        return previous(*args, **kwargs)

    dispatch.megakernels = True
    dispatch.previous = previous
    return dispatch


def install(attention, attention_mask, experts) -> None:
    """Put the dispatchers under transformers' default names (idempotent; an entry someone else registered since
    is wrapped in turn, so it keeps serving the models that are not patched)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    entries = [
        (AttentionInterface, DEFAULT[ATTENTION], lambda current: _dispatcher(ATTENTION, current, attention)),
        (AttentionMaskInterface, DEFAULT[ATTENTION], lambda current: _mask_dispatcher(current, attention_mask)),
    ]
    experts_interface = experts_interface_class()
    if experts_interface is not None:
        entries.append((experts_interface, DEFAULT[EXPERTS], lambda current: _dispatcher(EXPERTS, current, experts)))
    for interface, name, make in entries:
        current = interface._global_mapping.get(name)
        if current is not None and not getattr(current, "megakernels", False):
            interface.register(name, make(current))


def experts_interface_class():
    """transformers' ``ExpertsInterface`` (None in a transformers without one: its expert banks loop in Python)."""
    try:
        from transformers.integrations.moe import ExpertsInterface
    except ImportError:
        return None
    return ExpertsInterface
