"""The model-family registry: every family the trainer, data pipeline, planner, converter, evaluation and generation
know is a ``FamilySpec`` registered here, and nothing outside ``megakernels_models/models/`` names a family.

A family is one folder under ``megakernels_models/models/`` whose ``__init__`` builds its spec and calls
``register``; ``megakernels_models/models/__init__.py`` imports each folder (one line per family). See
docs/design.md §1 for how to add one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

DATA_KINDS = ("tokens", "sentences", "captions")


@dataclasses.dataclass(frozen=True)
class FamilySpec:
    """What the rest of the package needs to know about one model family.

    Attributes:
        name: ``--model NAME`` and ``ModelConfig.model``.
        title: how messages name it (``"vision-language model"``).
        config_class: its ``ModelConfig`` subclass: the family's own fields and defaults, its rules, its FLOPs and
            activation-memory formulas and the shapes the parallel layout checks.
        model: returns the ``torch.nn.Module`` class of one pipeline chunk (imported on first use).
        task: ``task(config, model_class) -> models.tasks.Task``: how a chunk is built and a micro-batch becomes
            a loss (``task_for``).
        data: the kind of training data it reads (``data.build``): ``"tokens"`` (documents cut into samples of
            ``seq_length + 1`` tokens), ``"sentences"`` (sentence pairs with masked tokens) or ``"captions"``
            (images and their captions).
        presets: named configurations of this family (``--preset``), the first being its tiny CPU one.
        causal: a causal language model (eval's perplexity, next-token scoring).
        text_generation: a text-only causal language model (``load_pretrained``, ``generate``; a vision-language
            model's language model).
        hf: ``hf(config)`` -> the ``megakernels_models.convert`` module writing it as a HuggingFace family, or None.
        settings: a dataclass of ``megakernels train`` flags only this family takes (``settings.setting`` fields,
            named as its config's fields), or None; its ``check(args)``, if it has one, validates them, naming the
            flags.
    """

    name: str
    title: str
    config_class: type
    model: Callable[[], type]
    task: Callable
    data: str
    presets: dict = dataclasses.field(default_factory=dict)
    causal: bool = True
    text_generation: bool = True
    hf: Callable | None = None
    settings: type | None = None

    def __post_init__(self):
        if self.data not in DATA_KINDS:
            raise ValueError(f"FamilySpec {self.name}: data must be one of {DATA_KINDS}, got {self.data!r}")
        if getattr(self.config_class, "family", None) != self.name:
            raise ValueError(f"FamilySpec {self.name}: its config_class's family is not {self.name!r}")

    @property
    def tiny_preset(self) -> str:
        """The preset ``--model NAME`` alone trains (the first one registered)."""
        return next(iter(self.presets))


_FAMILIES: dict[str, FamilySpec] = {}
PRESETS: dict = {}  # every family's presets by name (filled by ``register``)
DEFAULT = "gpt"  # the family of ``ModelConfig()`` and of ``megakernels train`` without --model or --preset


def register(spec: FamilySpec) -> FamilySpec:
    """Add ``spec`` (and its presets) to the registry; returns it.

    Raises:
        ValueError: a family or preset of that name is already registered.
    """
    if spec.name in _FAMILIES:
        raise ValueError(f"register: a family named {spec.name!r} is already registered")
    clash = sorted(set(spec.presets) & set(PRESETS))
    if clash:
        raise ValueError(f"register: presets {clash} of {spec.name!r} are already registered")
    _FAMILIES[spec.name] = spec
    PRESETS.update(spec.presets)
    return spec


def names() -> tuple[str, ...]:
    """Every registered family's name, in registration order."""
    return tuple(_FAMILIES)


def families() -> tuple[FamilySpec, ...]:
    return tuple(_FAMILIES.values())


def family(name_or_config) -> FamilySpec:
    """The spec of a family name or of a configuration (its ``model``).

    Raises:
        ValueError: an unknown family (listing the known ones).
    """
    name = getattr(name_or_config, "model", name_or_config)
    if name not in _FAMILIES:
        raise ValueError(f"model must be one of {names()}, got {name!r}")
    return _FAMILIES[name]


def task_for(config):
    """The task of ``config``'s family, building its model class (``FamilySpec.task`` and ``.model``)."""
    spec = family(config)
    return spec.task(config, spec.model())


def titles(which: Callable[[FamilySpec], bool]) -> str:
    """``"GPT, Llama"``: the titles of the families ``which`` selects (for messages)."""
    return ", ".join(s.title for s in families() if which(s))
