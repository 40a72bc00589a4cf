"""Pipeline configuration (spec §1): topology, deploy file, and the async_chunk rules.

Load a shipped config or a YAML file; the result is frozen, typed and already validated::

    config = load_pipeline("qwen3_omni")
    config.resolved_async_chunk(2)      # True
    config.delivery((1, 2))             # "chunks"
    config.prewarm_stages()             # (1, 2)

An invalid configuration raises :class:`ConfigError` at load time, naming the field path or edge.
"""

from runtime.config.deploy import CodecChunking, ConnectorRole, DeployConfig, StageDeploy
from runtime.config.fields import ConfigError
from runtime.config.pipeline import PipelineConfig, build_pipeline, load_pipeline, shipped_pipelines
from runtime.config.resolve import Delivery, StageProcessors, resolve_stage_async_chunk
from runtime.config.topology import Edge, OutputType, StageKind, StageSpec, Topology

__all__ = [
    "CodecChunking",
    "ConfigError",
    "ConnectorRole",
    "Delivery",
    "DeployConfig",
    "Edge",
    "OutputType",
    "PipelineConfig",
    "StageDeploy",
    "StageKind",
    "StageProcessors",
    "StageSpec",
    "Topology",
    "build_pipeline",
    "load_pipeline",
    "resolve_stage_async_chunk",
    "shipped_pipelines",
]
