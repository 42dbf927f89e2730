"""What users run on top of megakernels: GPT and BERT, the trainer and the ``megakernels`` command.

- ``config``  ``ModelConfig``, presets (tiny CPU models and the Megatron-LM paper sizes), FLOPs and memory model
- ``gpt``, ``bert``  the models, one pipeline chunk per instance
- ``train``  the training loop (tensor × pipeline × data parallel); ``cli``: ``megakernels train|...``
"""
