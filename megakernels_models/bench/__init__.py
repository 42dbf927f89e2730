"""``megakernels bench``: kernel microbenchmarks and end-to-end training throughput (docs/design.md §5, §6).

- ``common``  calibrated timing, the machine and commit, the result row every op produces, tables, JSON
- ``ceilings``  the device's ceilings measured on the spot: copy bandwidth and GEMM FLOP/s per dtype
- ``norms``, ``softmax``, ``adamw``, ``attention``, ``cross_entropy``  one module per op family: shapes, the
  bytes or FLOPs that must move, the PyTorch baselines (eager, torch.compile) and the optional peers (``peers``)
- ``rope``, ``swiglu``  the same for the Llama-style ops (fused RoPE, fused SwiGLU)
- ``plot``  one PNG per op: speed against size, one line per implementation, the ceiling dashed
- ``e2e``, ``eager_gpt``  training throughput of the trainer on a layout against a plain PyTorch GPT
- ``summary``  scripts/gpu_check.sh's closing table: pass/fail against the §6 targets from the JSON files
- ``cli``  the subcommand (``add_parser``)

Benchmarks report; they never assert on time. Importing this package imports nothing heavy (``summary`` must run
where torch is broken too).
"""
