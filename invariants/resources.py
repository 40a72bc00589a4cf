"""Resource invariants, checked at quiescence and again after shutdown."""

from __future__ import annotations

from invariants import invariant
from invariants.observed import ObservedWorld


def _store_leftovers(world: ObservedWorld, kind: str) -> list[str]:
    out = []
    for snap in world.snapshots:
        for store, contents in snap.stores.items():
            names = contents.segments if kind == "segment" else contents.lock_files
            out.extend(f"{kind} {name} of the {store} store still exists at {snap.label}" for name in names)
    return out


@invariant("no-orphan-shm", "no segment of the run's namespace exists at quiescence or after shutdown")
def no_orphan_shm(world: ObservedWorld) -> list[str]:
    return _store_leftovers(world, "segment")


@invariant("no-orphan-lock", "no lock file of the run's namespace exists at quiescence or after shutdown")
def no_orphan_lock(world: ObservedWorld) -> list[str]:
    return _store_leftovers(world, "lock file")


@invariant(
    "no-tombstones",
    "every per-request structure of every component is empty at quiescence; nothing grows with finished requests",
)
def no_tombstones(world: ObservedWorld) -> list[str]:
    out = []
    for snap in world.snapshots:
        for component, structures in snap.residue.items():
            for structure, left in structures.items():
                if left:
                    shown = ", ".join(left[:5]) + (f", … ({len(left)} in all)" if len(left) > 5 else "")
                    out.append(f"{component}.{structure} still holds {shown} at {snap.label}")
    return out
