"""A pipeline configuration: a topology with its deploy section, checked once and then queried.

A :class:`PipelineConfig` cannot exist in an invalid state: construction runs every check, so
``dataclasses.replace`` and :meth:`PipelineConfig.placed_on` are checked too.
"""

from __future__ import annotations

import dataclasses
import os
import stat
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from runtime.config import resolve
from runtime.config.deploy import CodecChunking, DeployConfig, StageDeploy, Transport, check_device, parse_deploy
from runtime.config.fields import ConfigError, Fields
from runtime.config.resolve import Delivery, StageProcessors
from runtime.config.topology import Edge, OutputType, StageSpec, Topology, parse_topology

#: Where the shipped configs live, inside this package.
SHIPPED_DIR = "configs"
#: The largest config file read (the shipped ones are a few KiB).
MAX_CONFIG_BYTES = 1 << 20


@dataclass(frozen=True)
class PipelineConfig:
    """A valid pipeline: what runs (``topology``), how (``deploy``), and where it was read from."""

    topology: Topology
    deploy: DeployConfig
    source: str = "<config>"
    #: The parsed YAML this was built from: a stage process builds its config from it, so it
    #: runs exactly what the head read (a file's pipeline too, not a shipped one of that name).
    raw: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if len(self.deploy.stages) != len(self.topology.stages):
            raise ConfigError(
                f"{self.source}: the deploy section covers {len(self.deploy.stages)} stages, "
                f"the pipeline has {len(self.topology.stages)}"
            )
        try:
            resolve.validate(self.topology, self.deploy)
        except ConfigError as error:
            raise ConfigError(f"{self.source}: {error}") from None

    @property
    def name(self) -> str:
        return self.topology.name

    @property
    def stages(self) -> tuple[StageSpec, ...]:
        return self.topology.stages

    @property
    def edges(self) -> tuple[Edge, ...]:
        return self.topology.edges

    @property
    def chunking(self) -> CodecChunking:
        return self.deploy.chunking

    def stage(self, stage_id: int) -> StageSpec:
        return self.topology.stage(stage_id)

    def stage_deploy(self, stage_id: int) -> StageDeploy:
        return self.deploy.stage(self._known(stage_id))

    def describe(self, edge: Edge | tuple[int, int]) -> str:
        """``"edge 1 -> 2 (talker -> code2wav)"``."""
        return self.topology.describe(Edge(*edge))

    def settings(self) -> dict[str, Any]:
        """What a run of this config reports it ran with: its source, async chunk, each edge's transport."""
        return {
            "pipeline": self.source,
            "async_chunk": "on" if self.deploy.async_chunk else "off",
            "transport": {f"{e.producer}->{e.consumer}": self.deploy.transport_of(*e).value for e in self.edges},
        }

    def resolved_async_chunk(self, stage_id: int) -> bool:
        """The stage's ``async_chunk`` after the spec §1.2 resolution table."""
        return resolve.resolved_async_chunk(self.topology, self.deploy)[self._known(stage_id)]

    def stage_receives_chunks(self, stage_id: int) -> bool:
        """Whether the stage's scheduler waits for chunks (spec §1.4)."""
        return resolve.receiving_stages(self.topology, self.deploy)[self._known(stage_id)]

    def any_stage_async(self) -> bool:
        """The engine-wide async flag (spec §1.7)."""
        return resolve.any_stage_async(resolve.resolved_async_chunk(self.topology, self.deploy))

    def prewarm_stages(self, final_stage_id: int | None = None) -> tuple[int, ...]:
        """Stages that get a placeholder at submission (spec §1.5); default: up to the last stage."""
        final = len(self.stages) - 1 if final_stage_id is None else self._known(final_stage_id)
        return resolve.prewarm_stages(self.topology, self.deploy, final)

    def delivery(self, edge: Edge | tuple[int, int]) -> Delivery:
        """``"chunks"`` or ``"forward"`` for the edge (spec §1.6)."""
        return resolve.delivery(self.topology, self.deploy, Edge(*edge))

    def processors(self, stage_id: int) -> StageProcessors:
        """The processor names this stage runs under its resolved mode (spec §1.2)."""
        return resolve.select_processors(self.topology, self.deploy, stage_id)

    def final_stage_id(self, outputs: Iterable[OutputType | str]) -> int:
        """The last stage a request asking for ``outputs`` must reach."""
        return self.topology.final_stage_id(outputs)

    def _known(self, stage_id: int) -> int:
        """``stage_id``, or a KeyError naming the pipeline (a bare index would accept -1)."""
        return self.topology.stage(stage_id).stage_id

    def with_transport(self, transport: str) -> PipelineConfig:
        """The same pipeline with every edge on ``transport`` (a ``--transport`` override)."""
        try:
            chosen = Transport(transport)
        except ValueError:
            raise ConfigError(
                f"transport: expected one of {', '.join(t.value for t in Transport)}, got {transport!r}"
            ) from None
        return dataclasses.replace(self, deploy=dataclasses.replace(self.deploy, transport=chosen, edges=()))

    def placed_on(self, device: str) -> PipelineConfig:
        """The same pipeline with every stage on ``device`` (a ``--device`` override)."""
        check_device(device, "device")
        stages = tuple(dataclasses.replace(stage, device=device) for stage in self.deploy.stages)
        return dataclasses.replace(self, deploy=dataclasses.replace(self.deploy, stages=stages))


def build_pipeline(raw: object, source: str = "<config>") -> PipelineConfig:
    """A :class:`PipelineConfig` from parsed YAML (``{"pipeline": ..., "deploy": ...}``)."""
    try:
        fields = Fields(raw, "config", ("pipeline", "deploy"))
        topology = parse_topology(fields.get_required("pipeline"))
        deploy = parse_deploy(fields.get("deploy"), len(topology.stages))
    except ConfigError as error:
        raise ConfigError(f"{source}: {error}") from None
    return PipelineConfig(topology, deploy, source, raw)


def shipped_pipelines() -> tuple[str, ...]:
    """Names of the configs shipped with the runtime, for :func:`load_pipeline`."""
    folder = resources.files("runtime.config") / SHIPPED_DIR
    return tuple(sorted(entry.name.removesuffix(".yaml") for entry in folder.iterdir() if entry.name.endswith(".yaml")))


def load_pipeline(name_or_path: str | Path, *, deploy: str | Path | None = None) -> PipelineConfig:
    """Load a shipped config by name (``"qwen3_omni"``) or any YAML file by path.

    ``deploy`` names a YAML file holding only a deploy section; it replaces the config's own.
    Every problem, a missing file included, is a :class:`ConfigError`.
    """
    source, text = _read(name_or_path)
    raw = _parse_yaml(source, text)
    if deploy is not None:
        deploy_source, deploy_text = _read(Path(deploy))
        if not isinstance(raw, dict):
            raise ConfigError(f"{source}: expected a mapping, got {raw!r}")
        raw = {**raw, "deploy": _parse_yaml(deploy_source, deploy_text)}
        source = f"{source} with {deploy_source}"
    return build_pipeline(raw, source)


def _read(name_or_path: str | Path) -> tuple[str, str]:
    """(a short source name for messages, the file's text)."""
    if isinstance(name_or_path, str) and "/" not in name_or_path and not name_or_path.endswith((".yaml", ".yml")):
        shipped = shipped_pipelines()
        if name_or_path not in shipped:
            raise ConfigError(f"no shipped pipeline named {name_or_path!r} (shipped: {', '.join(shipped)})")
        resource = resources.files("runtime.config") / SHIPPED_DIR / f"{name_or_path}.yaml"
        return f"{name_or_path}.yaml", resource.read_text(encoding="utf-8")
    path = Path(name_or_path)
    try:
        # (opened without blocking: a FIFO at the path must not hang the start-up)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as file:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise ConfigError(f"{path}: a config must be a regular file")
            data = file.read(MAX_CONFIG_BYTES + 1)
    except OSError as error:
        raise ConfigError(f"{path}: cannot read the config: {error.strerror}") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{path}: larger than the {MAX_CONFIG_BYTES >> 10} KiB a config may be")
    try:
        return str(path), data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ConfigError(f"{path}: not UTF-8 text (byte {error.start})") from None


class _StrictLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (plain YAML keeps the
    last one, and a second ``deploy:`` would silently drop the first)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[object, object]:
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, Hashable) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"the key {key!r} is given twice in one mapping", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _parse_yaml(source: str, text: str) -> object:
    try:
        return yaml.load(text, Loader=_StrictLoader)  # (a safe loader: plain data only)
    except yaml.YAMLError as error:
        raise ConfigError(f"{source}: not valid YAML: {error}") from None
    except RecursionError:
        raise ConfigError(f"{source}: nested too deeply") from None
