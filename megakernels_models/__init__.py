"""What users run on top of megakernels: the GPT, BERT and Llama families (mixture-of-experts variants included),
the trainer and the ``megakernels`` command.

- ``config``  ``ModelConfig``, presets (tiny CPU models, the Megatron-LM paper sizes, Llama, Mixtral), FLOPs and
  memory model; ``arguments`` / ``settings`` / ``config_file``: the trainer's settings, flags and files
- ``gpt``, ``bert``, ``llama``  the models, one pipeline chunk per instance; ``tasks``: what each family trains on
- ``train``  the training loop (tensor × context × pipeline × data × expert parallel); ``cli``: ``megakernels``
- ``pretrained``  ``load_pretrained``: a checkpoint as a one-process module; ``generate``: decoding with a KV cache
- ``data``, ``checkpoint``, ``convert``, ``evaluate``, ``bench``  data pipeline, checkpoints, HuggingFace
  conversion, evaluation, benchmarks
"""


def load_pretrained(path: str, device: str = "cpu", dtype=None, tokenizer: str | None = None):
    """``megakernels_models.inference.pretrained.load_pretrained`` (imported on first use)."""
    from megakernels_models.inference.pretrained import load_pretrained as load

    return load(path, device, dtype, tokenizer)


__all__ = ["load_pretrained"]
