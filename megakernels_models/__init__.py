"""What users run on top of megakernels: the model families (GPT, BERT, Llama, vision-language; mixture-of-experts
decoders), the trainer and the ``megakernels`` command.

- ``models``  the family registry (``models.registry``), ``ModelConfig`` and presets (``models.config``), the shared
  layers and tasks, one folder per family
- ``training``  the training loop (tensor × context × pipeline × data × expert parallel), checkpoints, preemption,
  logs, timers, MFU
- ``planning``  the step-time and memory model, ``--dry-run``, ``megakernels plan``
- ``inference``  ``load_pretrained`` (a checkpoint as a one-process module), decoding, ``megakernels eval``
- ``data``, ``convert``, ``bench``  data pipeline, HuggingFace conversion, the trainer's benchmarks
- ``arguments`` / ``settings`` / ``config_file``: the trainer's settings, flags and files; ``cli``: ``megakernels``
"""


def load_pretrained(path: str, device: str = "cpu", dtype=None, tokenizer: str | None = None):
    """``megakernels_models.inference.pretrained.load_pretrained`` (imported on first use)."""
    from megakernels_models.inference.pretrained import load_pretrained as load

    return load(path, device, dtype, tokenizer)


__all__ = ["load_pretrained"]
