"""Integrations with other libraries. Each submodule imports its library lazily (on first use), so importing
``megakernels`` never needs them: ``megakernels.integrations.transformers`` (HuggingFace transformers, and PEFT
models on them) and ``megakernels.integrations.trl`` (TRL's trainers' fused LM head)."""
