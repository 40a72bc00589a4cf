"""The deploy file: how a pipeline runs (the ``deploy:`` section).

It holds the pipeline-wide ``async_chunk`` switch, each stage's opt-out and placement, how each
edge hands chunks over (``transport``: a ring per edge, or a segment per chunk), and the codec
chunk frame settings the Talker → Code2Wav processor reads. Upstream keeps the frame
settings in the connector's ``extra`` config; there is one codec edge per pipeline here, so they
sit at the top of the deploy section under upstream's key names.

Values are only parsed and type-checked here; what they mean together (the resolution table and
the edge rules) lives in :mod:`runtime.config.resolve`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import StrEnum

from runtime.config.fields import ConfigError, Fields

#: Each edge's ring when the deploy file names no size (upstream's default, 4 MiB).
DEFAULT_RING_BYTES = 4 << 20
#: A ring is at least this big and a multiple of 64 bytes.
MIN_RING_BYTES = 64 << 10
#: ... and at most this big (upstream's range ends there too: a ring is mapped whole, its every
#: page reserved, in each process of its edge).
MAX_RING_BYTES = 64 << 20


class ConnectorRole(StrEnum):
    """A stage's connector role (upstream ``stage_connector_config.extra.role``, spec §1.4)."""

    #: Sends chunks downstream but never receives any, even when its async_chunk resolves on.
    SENDER = "sender"
    RECEIVER = "receiver"


@dataclass(frozen=True)
class CodecChunking:
    """Codec frames per chunk on the Talker → Code2Wav edge (spec §4.1).

    The defaults are the processor's own, used when the deploy file leaves the keys out; the
    Qwen3-Omni deploy sets 4 / 25 / 25 (spec §9).
    """

    #: Frames in chunk 0, for a short time to first audio; 0 disables the initial chunk.
    initial_codec_chunk_frames: int = 0
    codec_chunk_frames: int = 25
    #: Frames re-sent before each chunk so the decoder sees enough left context.
    codec_left_context_frames: int = 25


#: vLLM's ``max_num_seqs`` in the shipped deploy files: every stage's (spec §9).
MAX_NUM_SEQS = 64


@dataclass(frozen=True)
class StageDeploy:
    """One stage's deploy settings."""

    #: None inherits the pipeline-wide value; False opts the stage out; True cannot turn a global
    #: "off" back on (spec §1.2).
    async_chunk: bool | None = None
    #: AR scheduler flavour; the generation scheduler ignores it. Distinct from async_chunk.
    async_scheduling: bool = False
    device: str = "cpu"
    connector_role: ConnectorRole | None = None
    #: How many requests' chunk streams the stage takes up at once (spec §5.2, #5349): the others
    #: wait, in arrival order, for a slot that only the end of a request frees. 0: no limit.
    active_stream_window: int = 0
    #: The most requests one step of the stage runs (vLLM's ``max_num_seqs``; spec §5.2 step 4:
    #: the requests over it wait, the last ones first, for the next steps).
    max_num_seqs: int = MAX_NUM_SEQS


class Transport(StrEnum):
    """How an edge hands its chunks over (see :mod:`runtime.connectors.ring`)."""

    #: Chunks up to a quarter of the edge's ring go on it; larger ones take segments.
    RING = "ring"
    #: Every chunk in a shared-memory segment of its own.
    SEGMENTS = "segments"


@dataclass(frozen=True)
class EdgeDeploy:
    """One edge's deploy settings (``deploy.edges[i]``)."""

    from_stage: int
    to_stage: int
    transport: Transport


@dataclass(frozen=True)
class DeployConfig:
    """The deploy section; ``stages[i]`` belongs to stage ``i`` (absent stages get the defaults)."""

    #: Pipeline-wide switch for incremental inter-stage handoff; upstream's default is on.
    async_chunk: bool = True
    chunking: CodecChunking = field(default_factory=CodecChunking)
    stages: tuple[StageDeploy, ...] = ()
    #: Each stage in an OS process of its own (the head runs the orchestrator).
    processes: bool = False
    #: What happens when a stage process dies: it is restarted (with back-off), or stays down.
    restart: str = "restart"
    #: Every edge's transport unless ``edges`` says otherwise, and the size of each edge's ring.
    transport: Transport = Transport.RING
    ring_bytes: int = DEFAULT_RING_BYTES
    edges: tuple[EdgeDeploy, ...] = ()

    def stage(self, stage_id: int) -> StageDeploy:
        return self.stages[stage_id]

    def transport_of(self, from_stage: int, to_stage: int) -> Transport:
        return next(
            (e.transport for e in self.edges if (e.from_stage, e.to_stage) == (from_stage, to_stage)), self.transport
        )


DEPLOY_KEYS = (
    "async_chunk",
    "initial_codec_chunk_frames",
    "codec_chunk_frames",
    "codec_left_context_frames",
    "stages",
    "processes",
    "restart",
    "transport",
    "ring_bytes",
    "edges",
)
EDGE_KEYS = ("from_stage", "to_stage", "transport")
RESTART_POLICIES = ("restart", "fail")
STAGE_KEYS = (
    "stage_id",
    "async_chunk",
    "async_scheduling",
    "device",
    "connector_role",
    "active_stream_window",
    "max_num_seqs",
)
DEVICE = re.compile(r"cpu|cuda(:\d+)?")


def check_device(device: str, path: str) -> str:
    if not DEVICE.fullmatch(device):
        raise ConfigError(f"{path}: expected 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    return device


def parse_deploy(raw: object, num_stages: int, path: str = "deploy") -> DeployConfig:
    """Read and check the deploy section of a pipeline with ``num_stages`` stages.

    ``raw`` None (no deploy section) gives every default.
    """
    fields = Fields({} if raw is None else raw, path, DEPLOY_KEYS)
    defaults = CodecChunking()
    chunking = CodecChunking(
        initial_codec_chunk_frames=fields.get_int(
            "initial_codec_chunk_frames", defaults.initial_codec_chunk_frames, minimum=0
        ),
        codec_chunk_frames=fields.get_int("codec_chunk_frames", defaults.codec_chunk_frames, minimum=1),
        codec_left_context_frames=fields.get_int(
            "codec_left_context_frames", defaults.codec_left_context_frames, minimum=0
        ),
    )
    stages = [StageDeploy()] * num_stages
    seen: set[int] = set()
    for i, entry in enumerate(fields.get_list("stages")):
        at = f"{fields.at('stages')}[{i}]"
        stage_fields = Fields(entry, at, STAGE_KEYS)
        stage_id = stage_fields.get_int("stage_id", minimum=0)
        if stage_id >= num_stages:
            raise ConfigError(f"{stage_fields.at('stage_id')}: the pipeline has no stage {stage_id}")
        if stage_id in seen:
            raise ConfigError(f"{stage_fields.at('stage_id')}: stage {stage_id} is configured twice")
        seen.add(stage_id)
        stages[stage_id] = StageDeploy(
            async_chunk=stage_fields.get_optional_bool("async_chunk"),
            async_scheduling=stage_fields.get_bool("async_scheduling", False),
            device=check_device(stage_fields.get_str("device", "cpu"), stage_fields.at("device")),
            connector_role=stage_fields.get_optional_enum("connector_role", ConnectorRole),
            active_stream_window=stage_fields.get_int("active_stream_window", 0, minimum=0),
            max_num_seqs=stage_fields.get_int("max_num_seqs", MAX_NUM_SEQS, minimum=1),
        )
    restart = fields.get_str("restart", "restart")
    if restart not in RESTART_POLICIES:
        raise ConfigError(f"{fields.at('restart')}: expected one of {', '.join(RESTART_POLICIES)}, got {restart!r}")
    ring_bytes = fields.get_int("ring_bytes", DEFAULT_RING_BYTES, minimum=MIN_RING_BYTES)
    if ring_bytes % 64 or ring_bytes > MAX_RING_BYTES:
        raise ConfigError(
            f"{fields.at('ring_bytes')}: expected a multiple of 64 bytes, at most {MAX_RING_BYTES}, got {ring_bytes}"
        )
    edges = []
    for i, entry in enumerate(fields.get_list("edges")):
        edge_fields = Fields(entry, f"{fields.at('edges')}[{i}]", EDGE_KEYS)
        edge = EdgeDeploy(
            edge_fields.get_int("from_stage", minimum=0),
            edge_fields.get_int("to_stage", minimum=0),
            edge_fields.get_enum("transport", Transport),
        )
        if any((e.from_stage, e.to_stage) == (edge.from_stage, edge.to_stage) for e in edges):
            raise ConfigError(
                f"{edge_fields.at('from_stage')}: the edge {edge.from_stage} -> {edge.to_stage} is configured twice"
            )
        edges.append(edge)
    return DeployConfig(
        async_chunk=fields.get_bool("async_chunk", True),
        chunking=chunking,
        stages=tuple(stages),
        processes=fields.get_bool("processes", False),
        restart=restart,
        transport=fields.get_optional_enum("transport", Transport) or Transport.RING,
        ring_bytes=ring_bytes,
        edges=tuple(edges),
    )
