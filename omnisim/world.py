"""A simulated world: stage processes over stores, their client streams, and what is observed.

A stage "process" owns its own connector and adapter and runs its loops as tasks. By default the
stages share the world's own process and its store (in memory, or real /dev/shm under a fresh
namespace), as the stages of one engine process do. A stage added with ``own_process=True`` is a
process of its own, as a stage of a multi-process deployment is: it writes into a namespace it
owns, the stage after it reads from there, and :meth:`World.crash` kills it like SIGKILL (see
:mod:`omnisim.processes`). In a world made with ``processes=True`` on a POSIX store, each process
also has the FIFO wakeups a stage process has (spec §2.9), real FIFOs in /dev/shm. Whatever a run
made there is removed afterwards (see :mod:`omnisim.devshm`).
"""

from __future__ import annotations

import itertools
import math
import mmap
import os
import stat
from collections import Counter
from collections.abc import Awaitable, Callable, Hashable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from invariants.dataplane import ring_frames_held, ring_max_payload, ring_room, ring_unread_keys
from invariants.observed import ObservedWorld, Snapshot, StoreSnapshot, Stream
from omnisim import devshm, tmpfs
from omnisim.answers import Answers
from omnisim.base import STORES, Misuse, UsageError
from omnisim.faults import Fault, FaultPlan
from omnisim.payloads import as_carried, fingerprint, watch_payloads
from omnisim.processes import (
    FORGERIES,
    ProcessStore,
    SimProcesses,
    corrupt_segment,
    forge_segment,
    intact_forgery,
)
from omnisim.ring_locks import RingLocks
from omnisim.sim_kernel import MAIN_PROCESS, SimKernel, SimOutcome, SimTask
from runtime.connectors import namespaces, posix_store
from runtime.connectors.base import PutResult
from runtime.connectors.namespaces import Entry, Owner, SweepReport
from runtime.connectors.posix_store import PosixStore
from runtime.connectors.ring import unread_frames
from runtime.connectors.shm import ShmConnector
from runtime.connectors.stores import MemoryStore, RingMemory, Store, StoreError
from runtime.connectors.wakeup import FifoWakeups, LocalWakeups, Wakeups
from runtime.kernel import Attr, current_kernel
from runtime.stages import StageTransport
from runtime.transfer.adapter import ChunkTransferAdapter, Processor

T = TypeVar("T")

#: How a stage of a world on the ``ring`` store hands chunks over: on rings so small that a few
#: chunks fill one and the scenarios wrap around it, find it full and fall back to segments.
SIM_RING_BYTES = 16 << 10
SIM_RING = StageTransport(send_ring_bytes=SIM_RING_BYTES, receive_ring=True)

#: Virtual seconds of idle time before the quiescence snapshot: two idle save passes (0.1 s
#: each), so up to 64 consumed keys have been reaped (spec §10.3: ⌈n/64⌉ + 1 passes).
QUIESCE_S = 0.25


@dataclass(frozen=True)
class Room:
    """How much a store holds, as a tmpfs's size and inode count do: ``bytes`` (in whole pages,
    the owner record's page included) and ``names`` (besides the owner record's); and from what
    size on it keeps a consumed segment as a spare (see ``make_store``)."""

    bytes: int
    names: int
    spare_min_bytes: int = 0


def make_store(
    kind: str,
    owner: Owner | None = None,
    *,
    spare_min_bytes: int = 0,
    room: Room | None = None,
    directory: str = namespaces.SHM_DIR,
) -> Store:
    """A fresh namespace of the given kind; ``owner`` is the simulated process that owns it (a
    POSIX store records the real process, so a real ``omnisim sweep`` leaves a live run alone).
    ``spare_min_bytes``: 0 in a simulated world, where every consumed segment is kept as a spare
    (as a large one is in production), so every scenario runs the spares' hand-back and reuse.
    ``room``: what a store in memory holds, counted in pages as a tmpfs counts it (a POSIX one
    holds what its ``directory`` does)."""
    if kind == "memory":
        name = f"n{owner.pid}" if owner is not None else "mem"
        # (+1: the owner record, which ``room.names`` leaves out, as the tmpfs's inode count does)
        bounds = {"capacity": room.bytes, "max_names": room.names + 1, "page": mmap.PAGESIZE} if room else {}
        return MemoryStore(name, owner=owner, spare_min_bytes=spare_min_bytes, **bounds)
    if kind in ("posix", "ring"):
        namespace = posix_store.new_namespace()
        devshm.made(namespace, directory)
        return PosixStore(namespace, claim=True, spare_min_bytes=spare_min_bytes, directory=directory)
    raise UsageError(f"unknown store {kind!r}; choose one of: {', '.join(STORES)}")


@dataclass
class Stage:
    stage_id: int
    connector: ShmConnector
    adapter: ChunkTransferAdapter
    #: The simulated process the stage runs in.
    process: str = MAIN_PROCESS


#: How long a ``pause_stage`` fault stops a process (SIGSTOP … SIGCONT): longer than a
#: supervisor waits for a heartbeat.
PAUSE_S = 3.0


class World:
    """The stages of one run and the client streams they serve."""

    def __init__(self, store_kind: str, *, processes: bool = False, room: Room | None = None) -> None:
        """``room``: a store that holds only that much, every namespace of the run together; on
        POSIX stores, a private tmpfs of that size and inode count plays /dev/shm, so it fills up
        with the kernel's own ENOSPC (see :mod:`omnisim.tmpfs`)."""
        self.store_kind = store_kind
        self.processes = SimProcesses()
        #: Process name -> its identity, its store, and its handle on that store.
        self.owners: dict[str, Owner] = {MAIN_PROCESS: self.processes.spawn()}
        self.room = room
        #: The folder that plays /dev/shm for the run's POSIX stores.
        self.shm_dir = namespaces.SHM_DIR
        #: Every ring's head and tail, checked against its lock (see make_store).
        self.ring_locks = RingLocks()
        #: A world in memory's private /dev/shm, once a scenario asks for one (private_shm_dir).
        self._private_dir: str | None = None
        if room is not None and store_kind != "memory":
            # (+2: its root folder, and the owner record)
            self.shm_dir = devshm.mounted(tmpfs.mount(room.bytes, room.names + 2))
        self.store = self.make_store(self.owners[MAIN_PROCESS])
        #: Every namespace of the run, by a name of the world's own ("ns0", "ns1", … in the order
        #: they were made, so traces are the same in every run; a POSIX one is really named at
        #: random): -> (its store, the process that owns it).
        self.namespaces: dict[str, tuple[Store, str]] = {}
        self._names = itertools.count()
        self.add_namespace(self.store, MAIN_PROCESS)
        #: Each simulated process's handles on stores (its own, and the one it reads from).
        self.handles: dict[str, list[ProcessStore]] = {}
        #: The wakeups of stages that share a process (and of every stage on a store in memory).
        self.wakeups = LocalWakeups()
        #: Stages in processes of their own on a POSIX store: each process's FIFO wakeups.
        self._fifo_wakeups = processes and isinstance(self.store, PosixStore)
        self._buses: dict[str, FifoWakeups] = {}
        #: The FIFOs dead processes left, and what the scenario planted: none of it is residue.
        self._dead_fifos: set[str] = set()
        self._planted_here: set[str] = set()
        #: This process's descriptors before the run (a world in memory opens none: not read).
        self._descriptors_at_start = devshm.descriptors() if isinstance(self.store, PosixStore) else None
        #: What each stage's connector did, counted from outside (see :func:`count_transfers`).
        self._counted: dict[int, dict[str, int]] = {}
        #: Task -> what was seen of its put in flight, on a counted connector.
        self._puts_seen: dict[str, PutSeen] = {}
        #: An edge stage's save task -> its adapter, and the generation each one puts for now.
        self._save_tasks: dict[str, ChunkTransferAdapter] = {}
        self._sending: dict[str, tuple[str, int, str]] = {}
        #: Each chunk key's payloads that a put was asked to send (see :func:`watch_payloads`).
        self._offered: dict[str, Counter[Hashable]] = {}
        #: What the connectors answer their callers, checked (see :mod:`omnisim.answers`).
        self.answers = Answers(self._raw, self._planted_at, ring_views)
        self.stages: dict[int, Stage] = {}
        self.streams: dict[str, Stream] = {}
        self.snapshots: list[Snapshot] = []
        #: The scenario's request objects, for the orchestrator-side helpers.
        self.requests: list[Any] = []
        #: Further components whose residue() the snapshots include (e.g. a scheduler).
        self.components: dict[str, Any] = {}
        #: What the scenario watches the runtime through, by name (e.g. a recorder of the chunks
        #: a connector handed out): never part of a snapshot.
        self.observers: dict[str, Any] = {}
        #: What runs for the whole run, by name: ``(run, shutdown, process)`` (every stage's loops).
        self.services: dict[str, tuple[Callable[[], Awaitable[None]], Callable[[], None], str]] = {}
        #: The scenario configuration this run explores (see ``omnisim.registry.Param``).
        self.params: dict[str, str] = {}
        #: The run's seed, for workload choices a scenario draws (e.g. when to shut down).
        self.seed = 0
        #: The clients the scenario made, by name, in order: each is a whole request that a
        #: shrinker may leave out (see :mod:`omnisim.shrink`).
        self.clients: list[str] = []
        #: The clients this run leaves out: they submit nothing, and nothing checks them.
        self.left_out: frozenset[str] = frozenset()
        #: The namespaces whose owner record an operator's sweep removed (in a world, the records
        #: are the world's: see ``_WorldDirectory``).
        self.owner_records_removed: set[str] = set()
        #: Virtual time each process died at.
        self.deaths: dict[str, float] = {}
        #: A task hangs for good (a ``stall`` fault fired).
        self.stalled = False
        #: How a ``forged_frame`` fault's frame lies (see :data:`omnisim.processes.FORGERIES`).
        self.forgery = next(iter(FORGERIES))
        #: What the orchestrator would have done by quiescence that the scenario's own pieces
        #: may not have (a world without one: drain the stages' failure channels).
        self.settle: Callable[[], Awaitable[None]] | None = None

    def probe(self, invariant: str, ok: bool, message: str) -> None:
        """Record a violation of ``invariant`` seen by the scenario itself (a client comparing
        its audio with the offline decode, say), as a ``probe.failed`` event of the trace."""
        if not ok:
            current_kernel().note("probe.failed", invariant=invariant, message=message)

    # -- stages and processes --------------------------------------------------------------------

    def add_stage(
        self,
        stage_id: int,
        *,
        processor: Processor | None = None,
        receives: bool = True,
        sends: bool = True,
        own_process: bool = False,
    ) -> Stage:
        process = MAIN_PROCESS
        store: Store = self.store
        if own_process:
            process = f"stage{stage_id}"
            raw = self.make_store(self.spawn(process))
            self.add_namespace(raw, process)
            store = self.handle(process, raw)
        upstream = self.stages.get(stage_id - 1)
        producer = upstream.process if upstream is not None else MAIN_PROCESS
        connector = ShmConnector(
            store,
            stage_id=stage_id,
            wakeups=self.wakeups_of(process),
            **self.transport(),
            # This stage reads the producer's namespace through its own process's handle: what
            # it holds there goes when this process dies, not when the producer does.
            upstream=self.handle(process, self._raw(upstream.connector.store)) if upstream is not None else None,
            upstream_alive=lambda: self.processes.alive(self.owners[producer]),
        )
        adapter = ChunkTransferAdapter(
            connector, processor=processor, receives_chunks=receives, sends_chunks=sends, name=f"stage{stage_id}"
        )
        self._counted[stage_id] = count_transfers(connector, self._puts_seen)
        self._save_tasks[f"{adapter.name}.save"] = adapter
        self.watch_connector(connector)
        stage = self.stages[stage_id] = Stage(stage_id, connector, adapter, process)
        self.add_service(f"stage{stage_id}", adapter.run, adapter.shutdown, process)
        return stage

    def watch_connector(self, connector: ShmConnector) -> None:
        """Check every payload ``connector`` hands out against what the world's puts were asked
        to send (``no-corrupt-accept``), and every answer it gives (``answers-true``); a stage's
        connector is watched from the start."""
        watch_payloads(connector, self._offered, lambda message: self.probe("no-corrupt-accept", False, message))
        self.answers.watch(connector)

    def wakeups_of(self, process: str) -> Wakeups:
        """The arrival wakeups of a stage in ``process``: the world's one bus, as the stages of one
        engine process share one; in a world of stage processes on a POSIX store, a FIFO bus of
        ``process``'s own in the world's namespace, as each stage process makes
        (:mod:`runtime.stage_process`)."""
        if not self._fifo_wakeups:
            return self.wakeups
        bus = self._buses.get(process)
        if bus is None:
            assert isinstance(self.store, PosixStore)
            bus = self._buses[process] = FifoWakeups(self.store.namespace, shm_dir=self.shm_dir)
            devshm.opened(bus)
        return bus

    def plant(self, name: str) -> str:
        """The path of ``omnisim-{namespace}-{name}`` in /dev/shm (the world's own namespace), for
        the scenario to make something there the runtime did not make and must leave alone, as a
        hostile or careless user would; removed with the namespace at the end of the run."""
        assert isinstance(self.store, PosixStore), "only a POSIX store has names to plant next to"
        path = os.path.join(self.shm_dir, f"omnisim-{self.store.namespace}-{name}")
        self._planted_here.add(path)
        return path

    def _wake_folder(self) -> str:
        assert isinstance(self.store, PosixStore)
        return os.path.join(self.shm_dir, f"omnisim-{self.store.namespace}-wake")

    def private_shm_dir(self) -> str:
        """A folder that plays /dev/shm for this run alone, of the world's room: the world's own
        tmpfs on a POSIX store, else one mounted for the run (see :mod:`omnisim.tmpfs`)."""
        assert self.room is not None, "only a world with a room has a private /dev/shm"
        if self.shm_dir != namespaces.SHM_DIR:
            return self.shm_dir
        if self._private_dir is None:
            self._private_dir = devshm.mounted(tmpfs.mount(self.room.bytes, self.room.names + 2))
        return self._private_dir

    def _planted_at(self, store: Store, name: str) -> bool:
        """Whether the scenario planted ``omnisim-{namespace}-{name}`` of ``store``'s namespace."""
        return isinstance(store, PosixStore) and (
            os.path.join(self.shm_dir, f"omnisim-{store.namespace}-{name}") in self._planted_here
        )

    def _live_fifos(self) -> list[str]:
        """The live receivers' FIFOs in the world's wakeup folder (see ``wakeup_fifos``)."""
        if not self._fifo_wakeups:
            return []
        return devshm.receivers_fifos(self._wake_folder(), self._dead_fifos | self._planted_here)

    def _check_owner_records(self) -> None:
        """Every POSIX namespace of the run records this process as its owner (the simulated
        processes are threads of it): an operator's sweep judges a namespace by its record."""
        posix = [
            (namespace, store)
            for namespace, (store, _) in self.namespaces.items()
            if isinstance(store, PosixStore) and namespace not in self.owner_records_removed  # (swept)
        ]
        me = devshm.this_process() if posix else None
        for namespace, store in posix:
            recorded = store.owner()
            self.probe(
                "no-residue-after-sweep",
                recorded == me,
                # (no pid in the message: the same run must say the same in every process)
                f"the owner record of namespace {namespace} reads {'another process' if recorded else 'nothing'}, "
                "not the process that made it",
            )

    def _check_wakeups_available(self) -> None:
        """On a wakeup folder that is ours, every live stage that receives listens on a FIFO of its
        own by quiescence (its receive loop asked for its wakeups on its first pass): without one,
        every put to it goes unheard and it only polls."""
        if not self._fifo_wakeups:
            return
        try:
            st = os.lstat(self._wake_folder())
        except FileNotFoundError:
            st = None
        if st is not None and not (stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700):
            return  # a scenario planted a folder that is not ours: wakeups are rightly unavailable
        listening = set(self._live_fifos())
        for stage in self.stages.values():
            if stage.adapter.receives_chunks and self.alive(stage.process):
                self.probe(
                    "no-lost-wakeup",
                    f"the wakeup FIFO of stage {stage.stage_id}" in listening,
                    f"stage {stage.stage_id} has no wakeup FIFO at quiescence, though the wakeup folder is ours: "
                    "every put to it goes unheard, and it only polls",
                )

    def transport(self) -> dict[str, Any]:
        """How a stage's connector sends and receives on this world's store."""
        return (SIM_RING if self.store_kind == "ring" else StageTransport()).connector_options()

    def _raw(self, store: Store) -> Store:
        return store.store if isinstance(store, ProcessStore) else store

    def handle(self, process: str, store: Store) -> Store:
        """``process``'s handle on ``store`` (the store itself for the world's own process)."""
        if process == MAIN_PROCESS:
            return store
        owner = self.owners[process]
        handle = ProcessStore(store, owner)
        self.handles.setdefault(process, []).append(handle)
        return handle

    def add_service(
        self, name: str, run: Callable[[], Awaitable[None]], shutdown: Callable[[], None], process: str = MAIN_PROCESS
    ) -> None:
        """Something that runs for the whole run (in ``process``) and is shut down at its end."""
        self.services[name] = (run, shutdown, process)

    def inject(self, faults: FaultPlan | None) -> None:
        """Faults of a scenario that depend on its configuration, tried before the run's others
        (``--fault``, ``--faults sampled``), which stay: replacing the plan dropped them."""
        kernel = current_kernel()
        assert isinstance(kernel, SimKernel)
        if faults is None:
            return
        if kernel.faults is None:
            kernel.faults = faults
        else:
            kernel.faults.faults[:0] = faults.faults

    @staticmethod
    def fired_faults() -> list[Fault]:
        """The faults that fired so far in this run, in order (the scenario's own and any
        ``--fault``, ``--faults sampled`` on top of them)."""
        kernel = current_kernel()
        assert isinstance(kernel, SimKernel)
        return list(kernel.faults.fired) if kernel.faults is not None else []

    def spawn(self, process: str) -> Owner:
        """A new simulated process, named ``process`` in this world."""
        owner = self.owners[process] = self.processes.spawn()
        return owner

    def add_namespace(self, store: Store, process: str) -> str:
        """Track ``store``, owned by ``process``; the world's name for it."""
        name = f"ns{next(self._names)}"
        self.namespaces[name] = (store, process)
        return name

    def new_namespace(self) -> str:
        """A name for a namespace that the process which claims it will make (see :meth:`claim`)."""
        return f"ns{next(self._names)}"

    def claim(self, namespace: str, process: str) -> Store:
        """``process`` owns ``namespace`` from now on, as a stage process that records itself as
        its namespace's owner; the namespace is made if it is new. Its raw store."""
        store = self.store_of(namespace)
        if self.namespaces[namespace][1]:
            current_kernel().note("world.owner_claimed", ns=namespace)
        self.namespaces[namespace] = (store, process)
        return store

    def make_store(self, owner: Owner | None = None) -> Store:
        """A fresh namespace of the world's kind, owned by ``owner``, in the world's room, its
        rings' locks watched (see :mod:`omnisim.ring_locks`)."""
        spare_min_bytes = self.room.spare_min_bytes if self.room is not None else 0
        store = make_store(
            self.store_kind, owner, spare_min_bytes=spare_min_bytes, room=self.room, directory=self.shm_dir
        )
        self.ring_locks.watch(store)
        return store

    def alive(self, process: str) -> bool:
        return self.processes.alive(self.owners[process])

    def store_of(self, namespace: str) -> Store:
        """The store of ``namespace``; one no process claimed yet is made, owned by nobody (as a
        reader attaches to the namespace of a stage process that is still starting)."""
        if namespace not in self.namespaces:
            self.namespaces[namespace] = (self.make_store(), "")
        return self.namespaces[namespace][0]

    def sweep_namespace(self, namespace: str) -> None:
        """What a supervisor does once it buried a stage's life: remove every name of that life's
        namespace. Records a snapshot right after, for ``no-residue-after-sweep``."""
        k = current_kernel()
        store = self.store_of(namespace)
        for key in store.segments():
            store.unlink_segment(key)
            k.note("sweep.removed", ns=namespace, name=f"seg-{key}")
        for key in store.lock_files():
            store.remove_lock(key)
            k.note("sweep.removed", ns=namespace, name=f"lock-{key}")
        for edge in store.rings():
            store.unlink_ring(edge)
            k.note("sweep.removed", ns=namespace, name=f"ring-{edge}")
        for name in store.spares():
            store.remove_spare(name)
            k.note("sweep.removed", ns=namespace, name=f"spare-{name}")
        self.owner_records_removed.add(namespace)
        k.note("sweep.removed", ns=namespace, name=namespaces.OWNER_SUFFIX)
        self.snapshot("after sweep")

    def crash(self, process: str) -> None:
        """SIGKILL ``process``: its tasks stop for good, the locks it held are released, what it
        wrote stays; its memory (adapter, connector state) is gone from the snapshots."""
        if process == MAIN_PROCESS or process not in self.owners:
            raise Misuse(f"cannot crash process {process!r}: only a stage with its own process can die")
        kernel = current_kernel()
        assert isinstance(kernel, SimKernel)
        self._gone(process)
        bus = self._buses.pop(process, None)
        if bus is not None:
            self._dead_fifos |= devshm.lose_descriptors(bus)
        self.deaths[process] = kernel.now()
        kernel.kill_process(process)

    def sweep_own(self, namespace: str) -> None:
        """What a stage process does on its way out: it sweeps its own namespace, its owner record
        last (see :func:`runtime.stage_process.serve`)."""
        self.store_of(namespace).sweep()
        self.owner_records_removed.add(namespace)

    def exit(self, process: str) -> None:
        """``process`` ended by itself (its stage shut down as asked): it is no longer alive, and
        what it held open is closed, as the kernel closes an exiting process's descriptors."""
        self._gone(process)
        bus = self._buses.pop(process, None)
        if bus is not None:
            devshm.lose_descriptors(bus)  # (a FIFO its stage did not remove is left, and is residue)

    def _gone(self, process: str) -> None:
        self.processes.kill(self.owners[process])
        for handle in self.handles.get(process, []):
            handle.die()
        for namespace, (_, owner) in self.namespaces.items():
            if owner == process:
                current_kernel().note("world.owner_died", ns=namespace)

    def death_time(self, process: str) -> float | None:
        return self.deaths.get(process)

    def leave_dead_namespace(self, keys: list[str], *, reuse_pid_of: str) -> None:
        """A namespace an engine that died earlier left behind (segments and lock files of
        ``keys``), whose pid the live process ``reuse_pid_of`` has now: only its start time
        tells the two apart."""
        gone = Owner(self.owners[reuse_pid_of].pid, 0, self.owners[reuse_pid_of].pid_namespace)
        self.owners["dead-engine"] = gone
        store = self.make_store(gone)
        current_kernel().note("world.owner_died", ns=self.add_namespace(store, "dead-engine"))
        for key in keys:
            segment = store.create_segment(key)
            segment.reserve(64)
            segment.close()
            lock = store.open_lock(key, create=True)
            if lock is not None:
                lock.close()

    def apply_fault(self, fault: Fault, task: SimTask, attrs: dict[str, Attr]) -> None:
        """Carry out a fault that acts on the world (see :mod:`omnisim.faults`)."""
        key = str(attrs.get("key"))
        if fault.kind in ("crash_writer", "crash_reader", "crash_stage"):
            self.crash(task.process)
        elif fault.kind == "pause_stage":
            kernel = current_kernel()
            assert isinstance(kernel, SimKernel)
            kernel.pause_process(task.process, PAUSE_S)
        elif fault.kind == "stall":
            self.stalled = True
            kernel = current_kernel()
            assert isinstance(kernel, SimKernel)
            kernel.freeze(task)
        elif fault.kind == "corrupt_bytes":
            for store, _ in self.namespaces.values():
                corrupt_segment(store, key)
        elif fault.kind == "forged_frame":
            for store, _ in self.namespaces.values():
                forge_segment(store, key, self.forgery)
            intact = intact_forgery(self.forgery)
            if intact is not None:  # as if a peer put it: the get may hand it out, the receiver must refuse it
                self._offered.setdefault(key, Counter())[fingerprint(as_carried(intact))] += 1
        else:
            raise UsageError(f"fault {fault.kind!r} is not one the world acts out")

    async def sweep_dead(self) -> SweepReport:
        """What an operator's ``omnisim sweep`` does, on this world's namespaces: remove every one
        whose owner is dead. Records a snapshot right after, for ``no-residue-after-sweep``."""
        directory = _WorldDirectory(self)
        report = await namespaces.sweep(directory, self.processes)
        self.probe(
            "no-residue-after-sweep",
            report.removed == directory.removed,
            f"the sweep reports it removed {report.removed}, but it removed {directory.removed}",
        )
        self.snapshot("after sweep")
        return report

    # -- observing -------------------------------------------------------------------------------

    def stream(self, request_id: str, external_req_id: str) -> Stream:
        stream = self.streams[request_id] = Stream(request_id, external_req_id)
        return stream

    def snapshot(self, label: str) -> None:
        residue = {}
        dead = {name for name, owner in self.owners.items() if not self.processes.alive(owner)}
        for sid, stage in self.stages.items():
            if stage.process in dead:
                continue  # a dead process holds nothing in memory
            residue[f"stage{sid}.adapter"] = stage.adapter.residue()
            residue[f"stage{sid}.connector"] = stage.connector.residue()
        for name, component in self.components.items():
            residue[name] = component.residue()
        stores = {
            f"{self.store_kind} {namespace}" + (" (owner dead)" if process in dead else ""): StoreSnapshot(
                [key for key in store.segments() if not self._planted_at(store, f"seg-{key}")],
                [key for key in store.lock_files() if not self._planted_at(store, f"lock-{key}")],
                owner_dead=process in dead,
                open_handles=store.open_handles(),
                rings=[edge for edge in store.rings() if not self._planted_at(store, f"ring-{edge}")],
                ring_frames=self._held_ring_frames(store),
                spares=store.spares(),
                wakeup_fifos=self._live_fifos() if store is self.store else [],
                owner_record=namespace not in self.owner_records_removed,
            )
            for namespace, (store, process) in self.namespaces.items()
        }
        health = {
            f"stage{sid}": {name: (int(reported[name]), n) for name, n in self._counted[sid].items()}
            for sid, stage in self.stages.items()
            if stage.process not in dead and label == "shutdown"
            for reported in [stage.connector.health()]
        }
        self.snapshots.append(Snapshot(label, stores, residue, health=health))

    def chunks_held(self) -> set[str]:
        """The keys whose chunks the run's namespaces hold, in a segment or unread on a ring, read
        with the harness's own code."""
        held: set[str] = set()
        for store, _ in self.namespaces.values():
            held.update(store.segments())
            held.update(key.split(":", 1)[1] for key in _unread_on_rings(store))
        return held

    def check_unread_frames_report(self) -> None:
        """What the runtime reports unread on each namespace's rings (a pipeline run's residue)
        must be what the harness reads there (``answers-true``); done at quiescence, and where a
        scenario leaves chunks unread on purpose."""
        for name, (store, _) in self.namespaces.items():
            reported = sorted(set(unread_frames(store)))
            seen = sorted(_unread_on_rings(store))
            if reported != seen:
                what = f"the frames unread on the rings of {name}, as the runtime reports them"
                current_kernel().note("connector.answer", what=what, got=str(reported), want=str(seen))

    def _held_ring_frames(self, store: Store) -> list[str]:
        """``EDGE:KEY (why)`` for every frame on the store's rings that holds its space (see
        :func:`invariants.dataplane.ring_frames_held`), read from the shared bytes with the
        harness's own code, as another process sees them."""
        return [f"{edge}:{frame}" for edge, view in ring_views(store) for frame in ring_frames_held(view)]

    async def run(self, body: Callable[[World], Awaitable[None]]) -> None:
        """Start every service, run the workload, let the world go idle, snapshot, shut down."""
        k = current_kernel()
        assert isinstance(k, SimKernel)
        k.fault_action = self.apply_fault
        k.watch("shm.cleanup.begin", self.answers.at_cleanup_begin)
        k.watch("ring.full", self._at_ring_full)
        k.watch("shm.put.created", self._at_put_created)
        k.watch("adapter.put", self._at_adapter_put)
        k.watch("shm.put.end", self._at_put_end)
        if self.store_kind == "ring":
            k.watch("ring.room_wait_timed_out", self._check_room_wait)
        async with k.task_group() as tasks:
            for name, (run, _, process) in self.services.items():
                with k.as_process(process):
                    tasks.start_soon(run, name=name)
            await body(self)
            await k.sleep(QUIESCE_S)
            if self.settle is not None:
                await self.settle()
            self.ring_locks.check_idle([store for store, _ in self.namespaces.values()])
            self.check_unread_frames_report()
            self.snapshot("quiescence")
            self._check_wakeups_available()
            self._check_owner_records()
            for _, shutdown, _ in self.services.values():
                shutdown()
        self.snapshot("shutdown")
        self._sweep_at_exit()

    def _sweep_at_exit(self) -> None:
        """What each live process does as it exits (a stage process, the head, see
        :mod:`runtime.stage_process`): it sweeps its own namespace. Snapshot ``at exit``: what is
        left of those namespaces (a dead process's waits for an operator's sweep)."""
        left = {}
        foreign = sorted(path for path in self._planted_here if devshm.not_ours(path))
        for namespace, (store, process) in self.namespaces.items():
            if process and self.alive(process):
                store.sweep()
                left[f"{self.store_kind} {namespace}"] = StoreSnapshot([], [], names=self._names_of(store))
        for path in foreign:
            self.probe(
                "foreign-names-untouched",
                os.path.lexists(path),
                f"the sweep of a process's own namespace as it exits removed {os.path.basename(path)}, not ours",
            )
        before = self._descriptors_at_start
        opened = [] if self.deaths or before is None else devshm.opened_since(before)
        self.snapshots.append(Snapshot("at exit", left, {}, opened))

    def _names_of(self, store: Store) -> list[str]:
        """Every name ``store``'s namespace holds, but what the scenario planted."""
        if isinstance(store, PosixStore):
            stem = f"omnisim-{store.namespace}-"
            return sorted(
                name
                for name in os.listdir(self.shm_dir)
                if name.startswith(stem) and os.path.join(self.shm_dir, name) not in self._planted_here
            )
        names = [f"segment {k}" for k in store.segments()] + [f"lock {k}" for k in store.lock_files()]
        names += [f"ring {k}" for k in store.rings()] + [f"spare {k}" for k in store.spares()]
        return names + (["owner"] if store.owner() is not None else [])

    def observed(self, outcome: SimOutcome) -> ObservedWorld:
        return ObservedWorld(
            trace=outcome.trace,
            snapshots=self.snapshots,
            streams=self.streams,
            stop_reason=outcome.stop_reason,
            stop_detail=outcome.detail,
            stopped_tasks=outcome.stopped_tasks,
            crashes=outcome.crashes,
            end_time_us=round(outcome.virtual_time_s * 1e6),
            ring_max_payload=ring_max_payload(SIM_RING_BYTES) if self.store_kind == "ring" else None,
        )

    def _at_put_created(self, task: SimTask, attrs: dict[str, Attr]) -> None:
        """A put chose where its payload goes: its connector counts a ring put if it succeeds."""
        self.answers.at_put_created(attrs)
        if task.name in self._puts_seen:
            self._puts_seen[task.name].via = str(attrs["via"])

    def _at_adapter_put(self, task: SimTask, attrs: dict[str, Attr]) -> None:
        if task.name in self._save_tasks:
            self._sending[task.name] = (str(attrs["ext"]), int(attrs["gen"]), str(attrs["key"]))

    def _at_put_end(self, task: SimTask, attrs: dict[str, Attr]) -> None:
        """A generation owns its id until its put in flight ends (spec §3.5: an abort meanwhile
        only marks it cancelled — the id drains, new work for it is refused — and the put
        retires it): whatever ran during the put, the id is still the put's generation's."""
        sending = self._sending.pop(task.name, None)
        if sending is None:
            return
        ext, gen, key = sending
        token = self._save_tasks[task.name].sender.tables.sender_tokens.get(ext)
        self.probe(
            "exact-key-ownership",
            token is not None and token.serial == gen,
            f"generation {gen} of {ext} no longer owns it as its put of {key} ends: it was retired with the put in "
            "flight, and new work for the id was no longer refused (spec §3.5)",
        )

    def _at_ring_full(self, task: SimTask, attrs: dict[str, Attr]) -> None:
        """A put gave up on its edge's ring as full: its connector counts a fallback, and (on the
        ring store, whose rings the harness reads) the ring must really have had no room."""
        if task.name in self._puts_seen:
            self._puts_seen[task.name].ring_fallbacks += 1
        if self.store_kind == "ring":
            self._check_ring_full(task, attrs)

    def _check_ring_full(self, task: SimTask, attrs: dict[str, Attr]) -> None:
        if attrs["held"]:
            # Room or not, the put could not look, if someone held the ring's lock as it last
            # tried (nothing runs between that try and the note).
            for held in self._on_ring(task, attrs, self.ring_locks.held):
                self.probe(
                    "ring-before-segments",
                    held,
                    f"{task.name} put {attrs['key']} in a segment as the {attrs['edge']} ring's lock stayed held, but "
                    "nobody held it",
                )
            return
        for free, needed in self._ring_room(task, attrs):
            self.probe(
                "ring-before-segments",
                free < needed,
                f"{task.name} put {attrs['key']} in a segment as the {attrs['edge']} ring was full, but the ring had "
                f"{free} bytes free once its finished frames were released, and the frame needed {needed}",
            )

    def _check_room_wait(self, task: SimTask, attrs: dict[str, Attr]) -> None:
        """A put sat out its wait for room on its edge's ring: no reader may have freed that room
        meanwhile, since a reader that frees room wakes the producer waiting for it."""
        for free, needed in self._ring_room(task, attrs):
            self.probe(
                "no-lost-wakeup",
                free < needed,
                f"{task.name} sat out its wait for room on the {attrs['edge']} ring for {attrs['key']}, though "
                f"{free} bytes were free once its finished frames were released, and the frame needed {needed}",
            )

    def _ring_room(self, task: SimTask, attrs: dict[str, Attr]) -> list[tuple[int, int]]:
        """``(free, needed)`` (see :func:`invariants.dataplane.ring_room`) for the put of ``attrs``
        on the ring of ``attrs["edge"]`` in the namespaces of ``task``'s process, read from the
        ring's bytes now: nothing runs between a note and its watcher."""
        key, nbytes = str(attrs["key"]), int(attrs["bytes"])  # type: ignore[arg-type]
        return self._on_ring(task, attrs, lambda memory: ring_room(memory.view, key, nbytes))

    def _on_ring(self, task: SimTask, attrs: dict[str, Attr], look: Callable[[RingMemory], T]) -> list[T]:
        """What ``look`` sees of the ring of ``attrs["edge"]`` in each namespace of ``task``'s process."""
        out = []
        for store, process in self.namespaces.values():
            memory = store.open_ring(str(attrs["edge"])) if process == task.process else None
            if memory is None:
                continue
            try:
                out.append(look(memory))
            finally:
                memory.close()
        return out


def _unread_on_rings(store: Store) -> set[str]:
    """``EDGE:KEY`` of every chunk unread (or being written) on the store's rings of ours, read
    with the harness's own code."""
    return {f"{edge}:{key}" for edge, view in ring_views(store) for key in ring_unread_keys(view)}


def ring_views(store: Store) -> Iterator[tuple[str, memoryview]]:
    """Each ring of ours on ``store``, by edge, with its bytes, mapped while the caller looks."""
    for edge in store.rings():
        try:
            memory = store.open_ring(edge)
        except StoreError:
            continue  # a name a scenario planted there, which is no ring of ours
        if memory is not None:
            try:
                yield edge, memory.view
            finally:
                memory.close()


@dataclass
class PutSeen:
    """What the world saw of one put in flight: where it placed its payload, and how often it
    gave up on a full ring."""

    via: str | None = None
    ring_fallbacks: int = 0


def count_transfers(connector: ShmConnector, seen: dict[str, PutSeen]) -> dict[str, int]:
    """Count, from outside, what ``connector`` reports in its health: the puts that succeeded,
    their bytes and how many of them went on a ring, the puts that gave up on a full ring, the
    gets that took a chunk (``seen``: what the world saw of each task's put in flight, see
    :meth:`World._at_put_created`). The counts, kept up to date."""
    counted = {"puts": 0, "bytes_transferred": 0, "ring_puts": 0, "gets": 0, "ring_fallbacks": 0}
    put, get = connector.put, connector.get

    async def counted_put(*args: Any, **kwargs: Any) -> PutResult:
        k = current_kernel()
        assert isinstance(k, SimKernel) and k.current is not None
        task = k.current.name
        seen[task] = PutSeen()
        try:
            result = await put(*args, **kwargs)
        finally:
            put_seen = seen.pop(task)
            counted["ring_fallbacks"] += put_seen.ring_fallbacks
        if result.ok:
            counted["puts"] += 1
            counted["bytes_transferred"] += result.size
            counted["ring_puts"] += put_seen.via == "ring"
        return result

    async def counted_get(*args: Any, **kwargs: Any) -> tuple[Any, int] | None:
        result = await get(*args, **kwargs)
        counted["gets"] += result is not None
        return result

    connector.put = counted_put  # type: ignore[method-assign]
    connector.get = counted_get  # type: ignore[method-assign]
    return counted


class _WorldDirectory:
    """A world's namespaces as :func:`runtime.connectors.namespaces.sweep` sees a /dev/shm: each
    owned by the simulated process that made it."""

    def __init__(self, world: World) -> None:
        self._world = world
        #: Every name removed through it, in order: what a sweep's report must list.
        self.removed: list[str] = []

    def entries(self) -> list[Entry]:
        out = []
        for namespace, (store, process) in sorted(self._world.namespaces.items()):
            names = [f"seg-{k}" for k in store.segments()] + [f"lock-{k}" for k in store.lock_files()]
            names += [f"ring-{k}" for k in store.rings()] + [f"spare-{k}" for k in store.spares()]
            # A namespace no process claimed yet (a reader attached to a stage still starting) has
            # no owner record, and what it holds was just made: its owner is writing the record.
            claimed = bool(process)
            if claimed and namespace not in self._world.owner_records_removed:
                names.append(namespaces.OWNER_SUFFIX)
            age_s = math.inf if claimed else 0.0
            out.extend(Entry(f"omnisim-{namespace}-{n}", namespace, True, age_s) for n in names)
        return out

    def read_owner(self, namespace: str) -> Owner | None:
        found = self._world.namespaces.get(namespace)
        if found is None or namespace in self._world.owner_records_removed:
            return None
        return self._world.owners.get(found[1])

    def remove(self, name: str) -> None:
        match = namespaces.NAME.fullmatch(name)
        assert match is not None, name
        self.removed.append(name)
        store, _ = self._world.namespaces[match.group(1)]
        kind, _, key = match.group(2).partition("-")
        if kind == "seg":
            store.unlink_segment(key)
        elif kind == "lock":
            store.remove_lock(key)
        elif kind == "ring":
            store.unlink_ring(key)
        elif kind == "spare":
            store.remove_spare(key)
        elif kind == namespaces.OWNER_SUFFIX:
            self._world.owner_records_removed.add(match.group(1))
