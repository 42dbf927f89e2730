"""The model families and what they share: ``config`` (``ModelConfig``, presets, costs), ``transformer`` (the
layers every family stacks), ``tasks`` (how a micro-batch becomes a loss) and ``registry`` (``FamilySpec``).

Each family is a folder here registering one spec when imported; the import line below is the registration (a new
family adds its name to it).
"""

from megakernels_models.models import bert, deepseek, gemma, gpt, gpt_oss, llama, qwen, vlm  # noqa: F401  (each registers its FamilySpec)
