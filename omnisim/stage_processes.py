"""An engine whose stages are simulated processes: the simulator's model of ``processes: true``.

Each stage is a :class:`~runtime.supervisor.LocalStage`, supervised exactly as a
:class:`~runtime.process_stage.ProcessStage` is (heartbeat, death, burial, sweep, restart in a new
namespace, the next stage re-pointed), and each of its lives is a process of the world: its own
tasks, a namespace it claims, its own handles on the stores it reads and writes (what it holds
there goes when it dies). The orchestrator and the supervisors run in the world's own process,
as they run in the head process of a real deployment.
"""

from __future__ import annotations

import itertools
from contextlib import AbstractContextManager

from omnisim.sim_kernel import SimKernel
from omnisim.world import World
from runtime.config.pipeline import PipelineConfig
from runtime.config.topology import StageSpec
from runtime.connectors.shm import ShmConnector
from runtime.kernel import current_kernel
from runtime.orchestrator import Orchestrator
from runtime.sched.base import INPUT_WAIT_TIMEOUT_S
from runtime.stages import ComputeMeter, Models, StageHandle, build_stage, check_shape
from runtime.supervisor import Life, LocalStage


def build_process_engine(
    world: World,
    config: PipelineConfig,
    models: Models,
    *,
    input_wait_timeout_s: float = INPUT_WAIT_TIMEOUT_S,
) -> Orchestrator:
    """The engine of ``config`` with every stage a simulated process of ``world`` (restart
    policy: the deploy file's)."""
    check_shape(config)
    handles: dict[int, StageHandle] = {}
    engine = Orchestrator(config, handles, aligner=models.aligner)
    upstream: LocalStage | None = None
    for spec in config.stages:
        lives = _Lives(world, config, models, spec, input_wait_timeout_s)
        upstream = LocalStage(
            spec,
            lives.make,
            world.new_namespace,
            world.sweep_namespace,
            restart=config.deploy.restart,
            upstream=upstream,
            on_death=engine.stage_died,
        )
        handles[spec.stage_id] = upstream
    return engine


class _Lives:
    """Makes each life of one stage, a process each: ``stage0.thinker.0``, then
    ``stage0.thinker.1`` after a restart, …"""

    def __init__(
        self, world: World, config: PipelineConfig, models: Models, spec: StageSpec, input_wait_timeout_s: float
    ) -> None:
        self.world = world
        self.config = config
        self.models = models
        self.spec = spec
        self.input_wait_timeout_s = input_wait_timeout_s
        self._serial = itertools.count()

    def make(self, namespace: str, upstream: str | None) -> Life:
        world = self.world
        process = f"stage{self.spec.stage_id}.{self.spec.name}.{next(self._serial)}"
        world.spawn(process)
        store = world.handle(process, world.claim(namespace, process))
        producer = [upstream]

        def producer_alive() -> bool:
            """As a stage process judges: a producer that has not claimed its namespace yet is
            starting, not dead."""
            owner = world.namespaces[producer[0]][1] if producer[0] is not None else ""
            return not owner or world.alive(owner)

        connector = ShmConnector(
            store,
            stage_id=self.spec.stage_id,
            wakeups=world.wakeups_of(process),
            **world.transport(),
            upstream=world.handle(process, world.store_of(upstream)) if upstream is not None else None,
            upstream_alive=producer_alive if upstream is not None else None,
        )
        stage = build_stage(
            self.config,
            self.spec,
            getattr(self.models, self.spec.model),
            connector,
            ComputeMeter(),
            input_wait_timeout_s=self.input_wait_timeout_s,
        )

        def point_upstream(namespace: str) -> None:
            producer[0] = namespace
            connector.upstream = world.handle(process, world.store_of(namespace))
            stage.adapter.producer_moved()

        def kill() -> None:
            if world.alive(process):
                world.crash(process)

        return Life(
            stage,
            process=lambda: _as_process(process),
            kill=kill,
            exited=lambda: not world.alive(process),
            point_upstream=point_upstream,
        )


def _as_process(process: str) -> AbstractContextManager[None]:
    kernel = current_kernel()
    assert isinstance(kernel, SimKernel)
    return kernel.as_process(process)
