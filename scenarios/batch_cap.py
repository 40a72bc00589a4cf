"""``max_num_seqs`` (spec §5.2 step 4): one step of a stage runs at most that many requests.

Code2Wav's scheduler preempts: while more requests run than ``max_num_seqs``, the last one goes
back to the front of the waiting queue, keeping what it holds — a committed chunk not yet run —
for a later step. The AR stages decode the first ``max_num_seqs`` requests that can, in arrival
order. Every request must still get its exact text and audio: a preempted request that lost its
chunk would miss audio, or hang waiting for a terminal it already had.
"""

from __future__ import annotations

import dataclasses

from omnisim.registry import DEFAULT_INVARIANTS, Param, Params
from omnisim.sim_kernel import SimKernel
from omnisim.world import World
from runtime.kernel import current_kernel
from scenarios.edge import together
from scenarios.pipeline import (
    ASYNC_CHUNK,
    BOUNDARY,
    CODE2WAV_STAGE,
    SHORT,
    Client,
    pipeline_scenario,
    pipeline_world,
    shipped_config,
    with_every_stage,
)

MAX_NUM_SEQS = Param("max_num_seqs", ("1", "2"), "how many requests one step of a capped stage runs at most")
CAPPED = Param(
    "capped",
    ("code2wav", "every_stage"),
    "which stages are capped (Code2Wav alone gets its chunks from requests the Talker runs at once)",
)


#: Virtual seconds one model call takes: chunks of several requests commit while Code2Wav runs
#: one, so more of them are ready at a step than it may run.
MODEL_STEP_S = 0.02


def capped_world(store_kind: str, params: Params) -> World:
    """The shipped pipeline with ``max_num_seqs`` set on every stage, as a deploy file sets it."""
    shipped, cap = shipped_config(), int(params["max_num_seqs"])
    if params["capped"] == "every_stage":
        config = with_every_stage(shipped, max_num_seqs=cap)
    else:
        stages = list(shipped.deploy.stages)
        stages[CODE2WAV_STAGE] = dataclasses.replace(stages[CODE2WAV_STAGE], max_num_seqs=cap)
        config = dataclasses.replace(shipped, deploy=dataclasses.replace(shipped.deploy, stages=tuple(stages)))
    world = pipeline_world(store_kind, params, config=config)
    kernel = current_kernel()
    assert isinstance(kernel, SimKernel)
    kernel.compute_cost_s = MODEL_STEP_S
    return world


@pipeline_scenario(
    "max_num_seqs",
    summary="four requests at once through a pipeline whose stages run one or two requests a step: the others "
    "wait (Code2Wav preempts the last running ones, which keep their chunks), and each request gets its exact "
    "text and audio",
    issue="spec §5.2 step 4 (vLLM's max_num_seqs)",
    params=(MAX_NUM_SEQS, CAPPED, ASYNC_CHUNK),
    build=capped_world,
    invariants=(*DEFAULT_INVARIANTS, "max-num-seqs-kept"),
)
async def max_num_seqs(world: World) -> None:
    clients = [
        Client(world, "first", BOUNDARY, "A", modalities=("text", "audio")),
        Client(world, "second", BOUNDARY, "B", modalities=("audio",)),
        Client(world, "third", SHORT, "C", modalities=("text", "audio")),
        Client(world, "fourth", BOUNDARY, "D", modalities=("audio",)),
    ]
    await together(*((c.name, c.run) for c in clients))
