"""A simulated world: stage processes over one store, their client streams, and what is observed.

A stage "process" owns its own connector and adapter and runs its loops as tasks; a world owns
the store (in memory, or real /dev/shm under a fresh namespace) and sweeps it afterwards.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from invariants.observed import ObservedWorld, Snapshot, StoreSnapshot, Stream
from omnisim.base import STORES, UsageError
from omnisim.sim_kernel import SimOutcome
from runtime.connectors.posix_store import PosixStore
from runtime.connectors.shm import ShmConnector
from runtime.connectors.stores import MemoryStore, Store
from runtime.connectors.wakeup import LocalWakeups
from runtime.kernel import current_kernel
from runtime.transfer.adapter import ChunkTransferAdapter, Processor

#: Virtual seconds of idle time before the quiescence snapshot: two idle save passes (0.1 s
#: each), so up to 64 consumed keys have been reaped (spec §10.3: ⌈n/64⌉ + 1 passes).
QUIESCE_S = 0.25


def make_store(kind: str) -> Store:
    if kind == "memory":
        return MemoryStore()
    if kind == "posix":
        return PosixStore()
    raise UsageError(f"unknown store {kind!r}; choose one of: {', '.join(STORES)}")


@dataclass
class Stage:
    stage_id: int
    connector: ShmConnector
    adapter: ChunkTransferAdapter


class World:
    """The stages of one run and the client streams they serve."""

    def __init__(self, store_kind: str) -> None:
        self.store = make_store(store_kind)
        self.store_kind = store_kind
        self.wakeups = LocalWakeups()
        self.stages: dict[int, Stage] = {}
        self.streams: dict[str, Stream] = {}
        self.snapshots: list[Snapshot] = []
        #: The scenario's request objects, for the orchestrator-side helpers.
        self.requests: list[Any] = []
        self.probe_failures: dict[str, list[str]] = {}
        #: Further components whose residue() the snapshots include (e.g. a scheduler).
        self.components: dict[str, Any] = {}
        #: What runs for the whole run, by name: ``(run, shutdown)`` (every stage's adapter loops).
        self.services: dict[str, tuple[Callable[[], Awaitable[None]], Callable[[], None]]] = {}
        #: The scenario configuration this run explores (see ``omnisim.registry.Param``).
        self.params: dict[str, str] = {}
        #: The run's seed, for workload choices a scenario draws (e.g. when to shut down).
        self.seed = 0

    def probe(self, invariant: str, ok: bool, message: str) -> None:
        """Record a violation of ``invariant`` seen by the scenario itself during the run."""
        if not ok:
            self.probe_failures.setdefault(invariant, []).append(message)

    def add_stage(
        self, stage_id: int, *, processor: Processor | None = None, receives: bool = True, sends: bool = True
    ) -> Stage:
        connector = ShmConnector(self.store, stage_id=stage_id, wakeups=self.wakeups)
        adapter = ChunkTransferAdapter(
            connector, processor=processor, receives_chunks=receives, sends_chunks=sends, name=f"stage{stage_id}"
        )
        stage = self.stages[stage_id] = Stage(stage_id, connector, adapter)
        self.services[f"stage{stage_id}"] = (adapter.run, adapter.shutdown)
        return stage

    def stream(self, request_id: str, external_req_id: str) -> Stream:
        stream = self.streams[request_id] = Stream(request_id, external_req_id)
        return stream

    def snapshot(self, label: str) -> None:
        residue = {}
        for sid, stage in self.stages.items():
            residue[f"stage{sid}.adapter"] = stage.adapter.residue()
            residue[f"stage{sid}.connector"] = stage.connector.residue()
        for name, component in self.components.items():
            residue[name] = component.residue()
        store = StoreSnapshot(self.store.segments(), self.store.lock_files())
        self.snapshots.append(Snapshot(label, {self.store_kind: store}, residue))

    async def run(self, body: Callable[[World], Awaitable[None]]) -> None:
        """Start every service, run the workload, let the world go idle, snapshot, shut down."""
        k = current_kernel()
        async with k.task_group() as tasks:
            for name, (run, _) in self.services.items():
                tasks.start_soon(run, name=name)
            await body(self)
            await k.sleep(QUIESCE_S)
            self.snapshot("quiescence")
            for _, shutdown in self.services.values():
                shutdown()
        self.snapshot("shutdown")

    def observed(self, outcome: SimOutcome) -> ObservedWorld:
        return ObservedWorld(
            trace=outcome.trace,
            snapshots=self.snapshots,
            streams=self.streams,
            stop_reason=outcome.stop_reason,
            stop_detail=outcome.detail,
            stopped_tasks=outcome.stopped_tasks,
            crashes=outcome.crashes,
            probe_failures=self.probe_failures,
        )

    def sweep(self) -> list[str]:
        """Remove whatever the run left in its namespace (after the checks saw it)."""
        return self.store.sweep()
