"""The async_chunk rules of spec §1: what each stage resolves to, and what that means for each edge.

One resolution (:func:`resolve_stage_async_chunk`) feeds everything else: the engine flag, which
processors run, which stages receive chunks, which get prewarm placeholders, and how each edge
delivers. Upstream's #7505 hang came from two of these disagreeing (the aligner's scheduler
waited for chunks that its producer never sends), so nothing here re-derives the flag on its own.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from runtime.config.deploy import ConnectorRole, DeployConfig
from runtime.config.fields import ConfigError
from runtime.config.topology import Edge, StageSpec, Topology

#: How a consumer gets its input over an edge: chunk by chunk through the connector while the
#: producer runs, or one orchestrator forward when the producer finishes.
Delivery = Literal["chunks", "forward"]


def resolve_stage_async_chunk(pipeline_async_chunk: bool, stage_async_chunk: bool | None) -> bool:
    """Spec §1.2: ``pipeline and stage is not False``.

    ``and``, not ``or``: a stage may opt out of a global "on" (the aligner), but a stage True
    never turns a global "off" back on.
    """
    return bool(pipeline_async_chunk and stage_async_chunk is not False)


def stage_receives_chunks(resolved_async_chunk: bool, connector_role: ConnectorRole | None) -> bool:
    """Spec §1.4: a stage receives chunks iff it resolves on and its connector is not send-only."""
    return resolved_async_chunk and connector_role is not ConnectorRole.SENDER


def any_stage_async(resolved: Iterable[bool]) -> bool:
    """Spec §1.7: the engine-wide async flag is on if any stage resolves on.

    It does not mirror stage 0: with [False, True, True] the Talker → Code2Wav edge still needs
    prewarm and chunk orchestration.
    """
    return any(resolved)


def pipeline_async_chunk(topology: Topology, deploy: DeployConfig) -> bool:
    """The effective pipeline-wide value: a single-stage pipeline has no edge, so it is forced off."""
    return deploy.async_chunk and len(topology.stages) > 1


def resolved_async_chunk(topology: Topology, deploy: DeployConfig) -> tuple[bool, ...]:
    """Every stage's resolved ``async_chunk``, indexed by stage id."""
    pipeline = pipeline_async_chunk(topology, deploy)
    return tuple(resolve_stage_async_chunk(pipeline, deploy.stage(s.stage_id).async_chunk) for s in topology.stages)


def connector_role(topology: Topology, deploy: DeployConfig, stage_id: int) -> ConnectorRole | None:
    """The stage's connector role; a stage without input sources is a sender unless told otherwise.

    [INFERRED] Spec §1.4 leaves stage 0's role to its connector config; the entry stage has no
    producer, so treating it as send-only keeps its scheduler from waiting for chunks.
    """
    role = deploy.stage(stage_id).connector_role
    if role is None and not topology.stage(stage_id).input_sources:
        return ConnectorRole.SENDER
    return role


def receiving_stages(topology: Topology, deploy: DeployConfig) -> tuple[bool, ...]:
    """:func:`stage_receives_chunks` for every stage, indexed by stage id."""
    resolved = resolved_async_chunk(topology, deploy)
    return tuple(
        stage_receives_chunks(resolved[s.stage_id], connector_role(topology, deploy, s.stage_id))
        for s in topology.stages
    )


def streams_chunks(stage: StageSpec, resolved: bool) -> bool:
    """Whether the stage's outputs go downstream chunk by chunk (its async processor runs)."""
    return resolved and stage.async_chunk_processor is not None


def validate(topology: Topology, deploy: DeployConfig) -> None:
    """Reject, at start-up, a deploy whose stages would disagree about how an edge delivers.

    Spec §1.2 and §1.3 (upstream's checks), plus two that upstream lacks: a chunk edge must end
    at a stage that receives chunks, and a stage that receives chunks must have a source that
    streams them. Both configurations hang at run time: chunks nobody reads, or a consumer parked
    in WAITING_FOR_CHUNK for a stream that never exists (#7505).
    """
    for i, edge in enumerate(deploy.edges):
        if Edge(edge.from_stage, edge.to_stage) not in topology.edges:
            raise ConfigError(
                f"deploy.edges[{i}]: the pipeline has no edge {edge.from_stage} -> {edge.to_stage} "
                f"(its edges: {', '.join(f'{e.producer} -> {e.consumer}' for e in topology.edges)})"
            )
    resolved = resolved_async_chunk(topology, deploy)
    receives = receiving_stages(topology, deploy)
    stages = topology.stages
    if pipeline_async_chunk(topology, deploy) and not any(s.async_chunk_processor for s in stages):
        raise ConfigError(
            "deploy.async_chunk: true, but no stage declares an async_chunk_processor; "
            "set deploy.async_chunk: false for this pipeline"
        )
    for edge in topology.edges:
        producer, consumer = stages[edge.producer], stages[edge.consumer]
        if producer.async_chunk_processor is None:
            continue  # a full-handoff edge: mixed modes are legal (Code2Wav -> aligner)
        if resolved[edge.producer] != resolved[edge.consumer]:
            raise ConfigError(
                f"{topology.describe(edge)}: incompatible async_chunk settings: {producer.name} resolves "
                f"{resolved[edge.producer]} and {consumer.name} resolves {resolved[edge.consumer]}; "
                f"{producer.name} declares {producer.async_chunk_processor}, so both ends must agree"
            )
        if resolved[edge.producer] and not receives[edge.consumer]:
            raise ConfigError(
                f"{topology.describe(edge)}: {producer.name} streams chunks but {consumer.name} has "
                f"connector_role '{ConnectorRole.SENDER}' and would never read them"
            )
    for stage in stages:
        sources = [stages[s] for s in stage.input_sources]
        if receives[stage.stage_id] and not any(streams_chunks(s, resolved[s.stage_id]) for s in sources):
            raise ConfigError(
                f"stage {stage.label}: its async_chunk resolves True, so it would wait for chunks, but no "
                f"input source streams them (sources: {[s.label for s in sources]}); "
                f"set async_chunk: false for stage {stage.stage_id} in the deploy section"
            )


def prewarm_stages(topology: Topology, deploy: DeployConfig, final_stage_id: int) -> tuple[int, ...]:
    """Spec §1.5: the stages that get a placeholder request when a request enters stage 0.

    Only stages that receive chunks: any other stage (the aligner) gets its real input later by
    forwarding, and pre-submitting it would park it waiting for chunks that never come.
    """
    if not (any_stage_async(resolved_async_chunk(topology, deploy)) and final_stage_id > 0):
        return ()
    receives = receiving_stages(topology, deploy)
    return tuple(s for s in range(1, final_stage_id + 1) if receives[s])


def delivery(topology: Topology, deploy: DeployConfig, edge: Edge) -> Delivery:
    """Spec §1.6: the orchestrator forwards unless the engine is async and the consumer receives chunks."""
    if edge not in topology.edges:
        raise KeyError(f"pipeline {topology.name!r} has no edge {edge.producer} -> {edge.consumer}")
    engine_async = any_stage_async(resolved_async_chunk(topology, deploy))
    return "chunks" if engine_async and receiving_stages(topology, deploy)[edge.consumer] else "forward"


@dataclass(frozen=True)
class StageProcessors:
    """The processors a stage runs, by name (None: the stage has none on that side)."""

    #: Turns this stage's outputs into the next stage's input.
    next_stage: str | None
    #: Turns this stage's sources' outputs into its own input on a forward.
    input: str | None


def select_processors(topology: Topology, deploy: DeployConfig, stage_id: int) -> StageProcessors:
    """Spec §1.2 processor selection, from the same resolution as everything else.

    The sync input processor is chosen when the stage does not receive chunks, which is upstream's
    "resolves off" except for a send-only stage; such a stage is fed by forwarding, so it needs it.
    """
    stage = topology.stage(stage_id)
    resolved = resolved_async_chunk(topology, deploy)[stage_id]
    receives = receiving_stages(topology, deploy)[stage_id]
    next_stage = stage.async_chunk_processor if streams_chunks(stage, resolved) else stage.full_payload_processor
    sync = not receives and stage.sync_input_processor is not None
    return StageProcessors(next_stage=next_stage, input=stage.sync_input_processor if sync else stage.input_processor)
