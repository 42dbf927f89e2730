"""``megakernels bench``: the kernel library's microbenchmarks and static cost model (docs/design.md §5, §6).

- ``common``  calibrated timing, the machine and commit, the result row every op produces, tables, JSON
- ``ceilings``  the device's ceilings measured on the spot: copy bandwidth and GEMM FLOP/s per dtype
- ``norms``, ``softmax``, ``bias_gelu``, ``adamw``, ``attention``, ``cross_entropy``, ``moe``  one module per op
  family: shapes, the bytes or FLOPs that must move, the PyTorch baselines (eager, torch.compile) and the optional
  peers (``peers``); ``hf``: a transformers model with and without the integration (the ``hf`` extra)
- ``rope``, ``swiglu``  the same for the Llama-style ops (fused RoPE, fused SwiGLU)
- ``plot``  one PNG per op: speed against size, one line per implementation, the ceiling dashed (the ``bench`` extra)
- ``summary``  scripts/gpu_check.sh's closing table: pass/fail against the §6 targets from the JSON files
- ``static``  the static GPU cost model: every shipped kernel config compiled for sm_90, read from its SASS
- ``cli``  the subcommand (``add_parser``; ``python -m megakernels.bench`` runs it without the trainer)

The trainer adds its modes on top (``--e2e``, ``--plan-check``: megakernels_models/bench/); nothing here imports
megakernels_models. Benchmarks report; they never assert on time. Importing this package imports nothing beyond
``megakernels`` itself; ``summary`` imports nothing but the standard library (gpu_check.sh runs it by path, so it
runs where torch is broken too).
"""
