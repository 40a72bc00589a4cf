"""An engine whose stages are simulated processes: the simulator's model of ``processes: true``.

The head's side is production's own: each stage is a :class:`~runtime.process_stage.ProcessStage`
that starts its lives with ``start_process``, supervises them (heartbeats, death, burial, sweep,
restart in a new namespace, the next stage re-pointed) and talks to them over the control plane
(:mod:`runtime.control`). The simulated kernel runs ``python -m runtime.stage_process`` as a
process of the world (see :mod:`omnisim.sim_spawn`): production's
:class:`~runtime.stage_process.StageServer` serving a stage built as a stage process builds its
own — its model, a namespace it claims, its own handles on the stores it reads and writes (what it
holds there goes when it dies) — on the world's stores instead of /dev/shm's.
"""

from __future__ import annotations

import itertools
import json

from omnisim.sim_kernel import SimKernel
from omnisim.sim_spawn import Spawned
from omnisim.world import World
from runtime.config.pipeline import PipelineConfig
from runtime.connectors.shm import ShmConnector
from runtime.control import Channel
from runtime.kernel import KStream, current_kernel
from runtime.orchestrator import Orchestrator
from runtime.process_stage import ProcessStage, StageLaunch
from runtime.sched.base import INPUT_WAIT_TIMEOUT_S
from runtime.stage_process import StageServer
from runtime.stages import ComputeMeter, Models, StageHandle, build_stage, check_shape


def build_process_engine(
    world: World,
    config: PipelineConfig,
    models: Models,
    *,
    input_wait_timeout_s: float = INPUT_WAIT_TIMEOUT_S,
) -> Orchestrator:
    """The engine of ``config`` with every stage a simulated process of ``world`` (restart
    policy: the deploy file's); the world settles by asking each stage process what it holds."""
    check_shape(config)
    kernel = current_kernel()
    assert isinstance(kernel, SimKernel)
    kernel.programs["runtime.stage_process"] = _StageProgram(world, config, models).start
    handles: dict[int, StageHandle] = {}
    engine = Orchestrator(config, handles, aligner=models.aligner)
    launch = StageLaunch(
        pipeline=None,  # (the program builds from the world's config: see _StageProgram)
        source="<simulated>",
        async_chunk=config.deploy.async_chunk,
        wake_namespace="",
        input_wait_timeout_s=input_wait_timeout_s,
        restart=config.deploy.restart,
    )
    upstream: ProcessStage | None = None
    for spec in config.stages:
        upstream = ProcessStage(
            spec,
            launch,
            upstream=upstream,
            on_death=engine.stage_died,
            new_namespace=world.new_namespace,
            sweep=world.sweep_namespace,
        )
        handles[spec.stage_id] = upstream

    async def settle() -> None:
        await engine.residue_now()  # what each stage process holds now, not at its last heartbeat

    world.settle = settle
    return engine


class _StageProgram:
    """``python -m runtime.stage_process '<description>'`` in ``world``: each start is a process
    of its own, ``stage0.thinker.0``, then ``stage0.thinker.1`` after a restart, …"""

    def __init__(self, world: World, config: PipelineConfig, models: Models) -> None:
        self.world = world
        self.config = config
        self.models = models
        self._serials: dict[int, itertools.count[int]] = {}

    def start(self, argv: list[str]) -> Spawned:
        world = self.world
        description = json.loads(argv[3])
        spec = self.config.stage(description["stage_id"])
        serial = next(self._serials.setdefault(spec.stage_id, itertools.count()))
        process = f"stage{spec.stage_id}.{spec.name}.{serial}"
        owner = world.spawn(process)

        async def main(control: KStream) -> None:
            namespace = description["namespace"]
            try:
                await self._serve(process, description, control)
            finally:
                # As a stage process does on its way out, however it leaves — unless it was
                # killed: a task of a killed process is only unwound, and does nothing more.
                if world.alive(process):
                    world.sweep_own(namespace)

        def kill() -> None:
            if world.alive(process):
                world.crash(process)

        return Spawned(process, owner.pid, main, kill, lambda: world.exit(process))

    async def _serve(self, process: str, description: dict[str, object], control: KStream) -> None:
        """What :func:`runtime.stage_process.serve` does, on the world's stores."""
        world = self.world
        spec = self.config.stage(int(str(description["stage_id"])))
        namespace = str(description["namespace"])
        upstream = description["upstream"]
        producer = [str(upstream) if upstream is not None else None]
        store = world.handle(process, world.claim(namespace, process))

        def producer_alive() -> bool:
            """As a stage process judges: a producer that has not claimed its namespace yet is
            starting, not dead."""
            owner = world.namespaces[producer[0]][1] if producer[0] is not None else ""
            return not owner or world.alive(owner)

        connector = ShmConnector(
            store,
            stage_id=spec.stage_id,
            wakeups=world.wakeups_of(process),
            **world.transport(),
            upstream=world.handle(process, world.store_of(producer[0])) if producer[0] is not None else None,
            upstream_alive=producer_alive if producer[0] is not None else None,
        )
        meter = ComputeMeter()
        stage = build_stage(
            self.config,
            spec,
            getattr(self.models, spec.model),
            connector,
            meter,
            input_wait_timeout_s=float(str(description["input_wait_timeout_s"])),
        )

        def point_upstream(moved_to: str) -> None:
            producer[0] = moved_to
            connector.upstream = world.handle(process, world.store_of(moved_to))
            stage.adapter.producer_moved()

        channel = Channel(control, f"stage{spec.stage_id}")
        await StageServer(stage, namespace, channel, meter, point_upstream).serve()
