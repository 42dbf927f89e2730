"""The trainer's layout check: its flags as a ``megakernels.parallel.layout.ParallelLayout``, which holds every
rule (the degrees against the world size, each other, the model's shapes and the batch), checked in the parent
process before any rank starts (``arguments.validate``). Messages name the flags and the sizes.
"""

from __future__ import annotations

import dataclasses
import os

from megakernels.parallel import nodes
from megakernels.parallel.layout import FLAGS, LayoutError, ParallelLayout
from megakernels_models.models.config import ModelConfig
from megakernels_models.settings import ArgumentError


def layout_of(a) -> ParallelLayout:
    """The layout of trainer arguments ``a`` (``TrainArgs``) over its world (torchrun's or ``--nproc``).

    Raises:
        ArgumentError: the degrees break a rule of their own (before the model is considered).
    """
    restarts = a.restart_count() if "WORLD_SIZE" in os.environ else 0
    # After an elastic restart the world is whatever rejoined, not what the command line planned for: say so.
    source = (
        f"torchrun's WORLD_SIZE after elastic restart {restarts}" if restarts else "--nproc or torchrun's WORLD_SIZE"
    )
    try:
        layout = ParallelLayout.build(
            a.world_size(),
            tp=a.tp,
            cp=a.cp,
            pp=a.pp,
            ep=a.ep,
            vpp=a.vpp,
            dp=a.dp,
            sequence_parallel=a.sequence_parallel,
            fsdp=a.fsdp_degree if a.zero_stage() >= 2 else None,
            placement=a.pipeline_placement(),
            source=source,
            names=FLAGS,
        )
    except LayoutError as e:
        raise ArgumentError(str(e)) from None
    if a.zero_stage() >= 2 and layout.fsdp is None:  # FSDP over every data-parallel rank
        layout = dataclasses.replace(layout, fsdp=layout.dp * layout.cp)
    return layout


def validate_layout(a, cfg: ModelConfig) -> None:
    """Check the layout of trainer arguments ``a`` against the world size, the model ``cfg`` and the batch.

    Raises:
        ArgumentError: the first broken rule, naming the flags and the sizes involved.
    """
    layout = layout_of(a)
    try:
        layout.check_model(cfg.layout_shapes())
        layout.check_batch(a.micro_batch_size, a.global_batch_size)
    except LayoutError as e:
        raise ArgumentError(str(e)) from None
    # under torchrun: tensor-parallel groups inside a node, unless asked otherwise (megakernels.parallel.nodes)
    problem = None if a.tp_across_nodes else nodes.tp_problem(layout.tp)
    if problem:
        raise ArgumentError(problem)
