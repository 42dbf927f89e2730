"""Integrations with other libraries. Each submodule imports its library lazily (on first use), so importing
``megakernels`` never needs them: ``megakernels.integrations.transformers`` (HuggingFace transformers)."""
