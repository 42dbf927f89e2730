"""``megakernels bench``: the kernel library's microbenchmarks (docs/benchmarks.md).

- ``common``  calibrated timing, the machine and commit, the result row every op produces, tables, JSON, and
  ``Request``: what the command asks of one op family (each family module's ``run(request) -> rows``)
- ``ceilings``  the device's ceilings measured on the spot: copy bandwidth and GEMM FLOP/s per dtype
- ``norms``, ``softmax``, ``bias_gelu``, ``adamw``, ``attention``, ``cross_entropy``, ``moe``, ``fp8``  one module per
  op family: shapes, the bytes or FLOPs that must move, the PyTorch baselines (eager, torch.compile) and the optional
  peers (``peers``); ``hf``: a transformers model with and without the integration (the ``hf`` extra)
- ``rope``, ``swiglu``  the same for the Llama-style ops (fused RoPE, fused SwiGLU)
- ``plot``  one PNG per op: speed against size, one line per implementation, the ceiling dashed (the ``bench`` extra)
- ``cli``  the subcommand (``add_parser``; ``python -m megakernels.bench`` runs it without the trainer)

The trainer adds its modes on top (``--e2e``, ``--plan-check``: megakernels_models/bench/), the tools beside the package
theirs through the entry-point group ``cli.PLUGINS``; nothing here imports either. Benchmarks report; they never
assert on time. Importing this package imports nothing beyond ``megakernels`` itself.
"""
