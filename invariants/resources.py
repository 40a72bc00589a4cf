"""Resource invariants, checked at quiescence and again after shutdown."""

from __future__ import annotations

from invariants import invariant
from invariants.observed import ObservedWorld
from runtime.connectors.namespaces import SPARES_KEPT


def _store_leftovers(world: ObservedWorld, kind: str) -> list[str]:
    out = []
    for snap in world.snapshots:
        if not snap.settled:
            continue
        for store, contents in snap.stores.items():
            names = contents.segments if kind == "segment" else contents.lock_files
            out.extend(f"{kind} {name} of the {store} store still exists at {snap.label}" for name in names)
    return out


@invariant(
    "no-orphan-shm",
    "no segment of the run's namespace, and no ring frame holding a chunk nobody takes or space nobody gives back "
    "(a write a cleanup aborted, never cancelled), exists at quiescence or "
    f"after shutdown; a namespace keeps at most {SPARES_KEPT} spare segments; no ring, no spare and no live "
    "receiver's wakeup FIFO outlives its connector",
)
def no_orphan_shm(world: ObservedWorld) -> list[str]:
    out = _store_leftovers(world, "segment")
    for snap in world.snapshots:
        if not snap.settled:
            continue
        for store, contents in snap.stores.items():
            out.extend(
                f"ring frame {name} of the {store} store still exists at {snap.label}" for name in contents.ring_frames
            )
            if len(contents.spares) > SPARES_KEPT:
                kept = len(contents.spares)
                out.append(f"the {store} store keeps {kept} spares at {snap.label} (at most {SPARES_KEPT})")
            if snap.label == "shutdown":
                out.extend(f"ring {name} of the {store} store still exists at shutdown" for name in contents.rings)
                out.extend(f"spare {name} of the {store} store still exists at shutdown" for name in contents.spares)
                out.extend(f"{name} of the {store} store still exists at shutdown" for name in contents.wakeup_fifos)
    return out


@invariant(
    "no-leaked-handle",
    "every segment and lock file the runtime opened is closed again by quiescence, and every ring by shutdown: a "
    "handle left open keeps a file descriptor, and a removed segment's memory, for as long as the process lives "
    "(a process that died closed its own); and once every process exited, no descriptor the run opened is open",
)
def no_leaked_handle(world: ObservedWorld) -> list[str]:
    # A ring is mapped for as long as its connector lives: only shutdown must find it closed.
    out = [
        f"{handle} of the {store} store is still open at {snap.label}"
        for snap in world.snapshots
        if snap.settled
        for store, contents in snap.stores.items()
        for handle in contents.open_handles
        if snap.label == "shutdown" or not handle.startswith("ring ")
    ]
    for snap in world.snapshots:
        out.extend(f"a descriptor on {what} is still open {snap.label}" for what in snap.open_descriptors)
    return out


@invariant(
    "no-orphan-lock",
    "no lock file of the run's namespace exists at quiescence or after shutdown, and a reader that consumed a "
    "chunk removes its lock file itself, decoded or not (#8082 i)",
)
def no_orphan_lock(world: ObservedWorld) -> list[str]:
    out = _store_leftovers(world, "lock file")
    consumed: dict[str, str] = {}  # task -> key it consumed and still owes the lock file of
    for ev in world.trace:
        if ev.name == "shm.get.consumed":
            consumed[ev.task] = str(ev.attrs["key"])
        elif ev.name in ("shm.get.unlocked", "kernel.killed"):  # a killed reader owes nothing
            consumed.pop(ev.task, None)
        elif ev.name == "fault.os":
            # Nor one whose removal the OS refused: the file is the producer's to reap now, and
            # what is left of it at quiescence is judged above.
            consumed.pop(ev.task, None)
        elif ev.name in ("shm.get.begin", "shm.put.begin") and ev.task in consumed:
            out.append(f"{ev.task} consumed {consumed.pop(ev.task)} and left its lock file (someone else must reap it)")
    out.extend(
        f"{task} consumed {key} and left its lock file (someone else must reap it)" for task, key in consumed.items()
    )
    return out


@invariant(
    "no-tombstones",
    "every per-request structure of every component is empty at quiescence; nothing grows with finished requests",
)
def no_tombstones(world: ObservedWorld) -> list[str]:
    out = []
    for snap in world.snapshots:
        if not snap.settled:
            continue
        for component, structures in snap.residue.items():
            for structure, left in structures.items():
                if left:
                    shown = ", ".join(left[:5]) + (f", … ({len(left)} in all)" if len(left) > 5 else "")
                    out.append(f"{component}.{structure} still holds {shown} at {snap.label}")
    return out


@invariant(
    "health-counts-true",
    "a stage's health report (its connector's counters) counts what the connector did: every put that succeeded, "
    "the bytes of each, those of them that went on a ring, every get that took a chunk, every put that gave up on "
    "a full ring",
)
def health_counts_true(world: ObservedWorld) -> list[str]:
    return [
        f"{stage} reports {counter} = {reported} at {snap.label}, but {counted} happened"
        for snap in world.snapshots
        for stage, counters in snap.health.items()
        for counter, (reported, counted) in counters.items()
        if reported != counted
    ]


@invariant(
    "answered-leaves-nothing-unread",
    "a request answered whole left no unread chunk for its release sweep to reclaim: every chunk it put was read, "
    "and nothing was put for a stage that never asks for it (#7245's orphans)",
)
def answered_leaves_nothing_unread(world: ObservedWorld) -> list[str]:
    return [
        f"request {ev.attrs['req']} was answered whole, yet its release sweep reclaimed {ev.attrs['reclaimed']} "
        "unread chunk(s)"
        for ev in world.trace
        if ev.name == "orch.released" and ev.attrs.get("answered") and ev.attrs.get("reclaimed")
    ]
