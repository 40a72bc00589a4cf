"""The pipeline topology: which stages exist, what feeds each one, and which ones answer the client.

This is the part of a pipeline that belongs to the model (upstream's ``pipeline.py``), as opposed
to the deploy file, which says how it runs. Stages are listed in run order and numbered from 0:
requests enter at stage 0, and the orchestrator forwards stage ``s`` to ``s + 1`` (spec §1.6), so
an input source is always an earlier stage.

Processors are named, not imported, so this module stays free of model code; the stage-input
processor registry maps the names to functions.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import NamedTuple

from runtime.config.fields import ConfigError, Fields


class StageKind(StrEnum):
    """How a stage executes (spec §1.1); it selects the scheduler."""

    #: Autoregressive: the AR scheduler (sync or async flavour per ``async_scheduling``).
    LLM_AR = "LLM_AR"
    #: Non-autoregressive generation (Code2Wav): always the generation scheduler.
    LLM_GENERATION = "LLM_GENERATION"


class OutputType(StrEnum):
    """What a final stage hands to the client."""

    TEXT = "text"
    AUDIO = "audio"
    TIMESTAMPS = "timestamps"


class Edge(NamedTuple):
    """A connector edge: ``producer`` is one of ``consumer``'s input sources."""

    producer: int
    consumer: int


@dataclass(frozen=True)
class StageSpec:
    """One stage of the topology."""

    stage_id: int
    #: Upstream's ``model_stage`` ("thinker", "talker", ...); used in every message about the stage.
    name: str
    kind: StageKind
    #: The model this stage runs.
    model: str
    input_sources: tuple[int, ...]
    #: What this stage returns to the client, or None for an intermediate stage (the Talker).
    final_output: OutputType | None
    #: Builds the next stage's input chunk by chunk when async chunking is on
    #: (``async_chunk_process_next_stage_input_func``). Declaring one makes every outgoing edge a
    #: chunk edge that the edge validator checks (spec §1.3).
    async_chunk_processor: str | None = None
    #: Builds the next stage's complete input when async chunking is off.
    full_payload_processor: str | None = None
    #: Builds this stage's input from its sources' outputs (``custom_process_input_func``).
    input_processor: str | None = None
    #: Replaces ``input_processor`` when this stage resolves ``async_chunk`` off
    #: (``sync_process_input_func``).
    sync_input_processor: str | None = None
    #: Sampling stop ids; for the Talker, a first-codebook value that marks a post-EOS frame.
    stop_token_ids: tuple[int, ...] = ()

    @property
    def is_final(self) -> bool:
        return self.final_output is not None

    @property
    def label(self) -> str:
        """``"1 (talker)"``: how messages name this stage."""
        return f"{self.stage_id} ({self.name})"


@dataclass(frozen=True)
class Topology:
    """The stages of a pipeline, in run order; ``stages[i].stage_id == i``."""

    name: str
    stages: tuple[StageSpec, ...]

    def stage(self, stage_id: int) -> StageSpec:
        if not 0 <= stage_id < len(self.stages):
            raise KeyError(f"pipeline {self.name!r} has no stage {stage_id}")
        return self.stages[stage_id]

    @property
    def edges(self) -> tuple[Edge, ...]:
        """Every (source, consumer) pair, ordered by consumer, then by the consumer's source list."""
        return tuple(Edge(source, stage.stage_id) for stage in self.stages for source in stage.input_sources)

    def describe(self, edge: Edge) -> str:
        """``"edge 1 -> 2 (talker -> code2wav)"``: how messages name an edge."""
        producer, consumer = self.stage(edge.producer), self.stage(edge.consumer)
        return f"edge {edge.producer} -> {edge.consumer} ({producer.name} -> {consumer.name})"

    def final_stage_id(self, outputs: Iterable[OutputType | str]) -> int:
        """The last stage a request asking for ``outputs`` must reach (text only: the Thinker)."""
        wanted = {OutputType(output) for output in outputs}
        ids = [stage.stage_id for stage in self.stages if stage.final_output in wanted]
        if not ids:
            raise ValueError(f"pipeline {self.name!r} produces none of {sorted(wanted)}")
        return max(ids)


STAGE_KEYS = (
    "stage_id",
    "name",
    "kind",
    "model",
    "input_sources",
    "final_output",
    "async_chunk_processor",
    "full_payload_processor",
    "input_processor",
    "sync_input_processor",
    "stop_token_ids",
)


def parse_topology(raw: object, path: str = "pipeline") -> Topology:
    """Read and check the ``pipeline:`` section; raise :class:`ConfigError` naming the bad field."""
    fields = Fields(raw, path, ("name", "stages"))
    name = fields.get_str("name")
    entries = fields.get_list("stages")
    if not entries:
        raise ConfigError(f"{fields.at('stages')}: a pipeline needs at least one stage")
    stages = tuple(_parse_stage(entry, f"{fields.at('stages')}[{i}]", i) for i, entry in enumerate(entries))
    topology = Topology(name, stages)
    _check_graph(topology, fields.at("stages"))
    return topology


def _parse_stage(raw: object, path: str, index: int) -> StageSpec:
    fields = Fields(raw, path, STAGE_KEYS)
    stage_id = fields.get_int("stage_id", minimum=0)
    if stage_id != index:
        # Run order is list order: stage 0 is the entry and the orchestrator forwards s -> s + 1.
        raise ConfigError(
            f"{fields.at('stage_id')}: expected {index} (stages are listed in run order, numbered from 0), "
            f"got {stage_id}"
        )
    return StageSpec(
        stage_id=stage_id,
        name=fields.get_str("name"),
        kind=fields.get_enum("kind", StageKind),
        model=fields.get_str("model"),
        input_sources=fields.get_int_list("input_sources", minimum=0),
        final_output=fields.get_optional_enum("final_output", OutputType),
        async_chunk_processor=fields.get_optional_str("async_chunk_processor"),
        full_payload_processor=fields.get_optional_str("full_payload_processor"),
        input_processor=fields.get_optional_str("input_processor"),
        sync_input_processor=fields.get_optional_str("sync_input_processor"),
        stop_token_ids=fields.get_int_list("stop_token_ids", minimum=0),
    )


def _check_graph(topology: Topology, path: str) -> None:
    """Sources exist, form no cycle, run earlier; one entry stage; the pipeline ends in a final stage."""
    stages = topology.stages
    for stage in stages:
        at = f"{path}[{stage.stage_id}].input_sources"
        for source in stage.input_sources:
            if source >= len(stages):
                raise ConfigError(f"{at}: stage {stage.label} takes input from unknown stage {source}")
        if len(set(stage.input_sources)) != len(stage.input_sources):
            raise ConfigError(f"{at}: duplicate source in {list(stage.input_sources)}")
    cycle = _find_cycle(topology)
    if cycle:
        feeds = " -> ".join(stages[i].label for i in reversed(cycle))
        raise ConfigError(f"{path}: input_sources form a cycle (producer -> consumer): {feeds}")
    for stage in stages:
        at = f"{path}[{stage.stage_id}].input_sources"
        later = [source for source in stage.input_sources if source >= stage.stage_id]
        if later:
            raise ConfigError(f"{at}: stage {stage.label} takes input from later stage {later[0]}; sources run first")
        if stage.stage_id > 0 and not stage.input_sources:
            raise ConfigError(f"{at}: stage {stage.label} has no input source; only stage 0 takes client input")
    if not stages[-1].is_final:
        raise ConfigError(
            f"{path}[{len(stages) - 1}].final_output: missing final stage: the last stage "
            f"{stages[-1].label} must have a final_output (text, audio or timestamps)"
        )


def _find_cycle(topology: Topology) -> list[int]:
    """A cycle as ``[a, b, ..., a]``, each stage taking input from the next; ``[]`` when there is none."""
    done: set[int] = set()

    def visit(stage_id: int, trail: list[int]) -> list[int]:
        if stage_id in trail:
            return [*trail[trail.index(stage_id) :], stage_id]
        if stage_id in done:
            return []
        for source in topology.stages[stage_id].input_sources:
            cycle = visit(source, [*trail, stage_id])
            if cycle:
                return cycle
        done.add(stage_id)
        return []

    for stage in topology.stages:
        cycle = visit(stage.stage_id, [])
        if cycle:
            return cycle
    return []
