"""The model families and what they share: ``config`` (``ModelConfig``, presets, costs), ``transformer`` (the
layers every family stacks), ``tasks`` (how a micro-batch becomes a loss) and ``registry`` (``FamilySpec``).

Each family is a folder here registering one spec; this module imports them, one line each, in the order
``megakernels train --help`` lists them (a vision-language model's language models first).
"""

from megakernels_models.models import bert, gpt, llama, vlm  # noqa: F401  (each registers its FamilySpec)
