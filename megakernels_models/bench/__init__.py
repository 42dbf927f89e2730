"""The trainer's part of ``megakernels bench`` (docs/benchmarks.md): what needs the trainer's models. The kernel
microbenchmarks, the device ceilings, plots, the summary and the static cost model are the kernel library's
(``megakernels.bench``); this package adds its modes on top (``modes``, registered by ``add_parser``).

- ``e2e``, ``eager_gpt``  training throughput of the trainer on a layout against a plain PyTorch GPT or Llama
  (``--e2e``)
- ``plan_check``  does ``megakernels plan`` order layouts as this machine runs them (``--plan-check``)
- ``modes``  the two as ``megakernels.bench.cli.Extension``s

Importing this package imports nothing heavy.
"""


def add_parser(sub):
    """Register ``megakernels bench``: the library's subcommand with the trainer's modes."""
    from megakernels.bench import cli
    from megakernels_models.bench.modes import E2E, PlanCheck

    return cli.add_parser(sub, [PlanCheck(), E2E()])
