"""Ownership invariants over the trace: who may remove a segment, who may commit a chunk."""

from __future__ import annotations

from invariants import invariant
from invariants.observed import ObservedWorld


@invariant(
    "exact-key-ownership",
    "a cleanup never removes a segment its generation did not create (sibling IDs, reused IDs)",
)
def exact_key_ownership(world: ObservedWorld) -> list[str]:
    out = []
    last_put: dict[str, tuple[str, int]] = {}  # task -> (ext, generation) of its put in progress
    creator: dict[str, tuple[str, int]] = {}  # key -> (ext, generation) that created its segment
    reclaiming: dict[str, tuple[str, object]] = {}  # task -> ("gen", n) or ("ext", ext) it reclaims for
    for ev in world.trace:
        a = ev.attrs
        if ev.name == "adapter.put":
            last_put[ev.task] = (str(a["ext"]), int(a["gen"]))  # type: ignore[arg-type]
        elif ev.name == "shm.put.created" and ev.task in last_put:
            creator[str(a["key"])] = last_put[ev.task]
        elif ev.name == "shm.get.consumed":
            creator.pop(str(a["key"]), None)
        elif ev.name == "adapter.cleanup_shm.begin":
            reclaiming[ev.task] = ("gen", a["gen"])
        elif ev.name == "adapter.release.begin":
            reclaiming[ev.task] = ("ext", a["ext"])
        elif ev.name in ("adapter.cleanup_shm.end", "adapter.release.end"):
            reclaiming.pop(ev.task, None)
        elif ev.name == "shm.cleanup.unlinked":
            key = str(a["key"])
            owner = creator.pop(key, None)
            context = reclaiming.get(ev.task)
            if owner is None or context is None:
                continue
            kind, value = context
            if kind == "gen" and owner[1] != value:
                out.append(
                    f"the reclaim of generation {value} removed segment {key}, "
                    f"which generation {owner[1]} of request {owner[0]} created"
                )
            elif kind == "ext" and owner[0] != value:
                out.append(f"the final sweep of request {value} removed segment {key} of request {owner[0]}")
    return out


@invariant(
    "no-stale-commit",
    "a receiver never commits a chunk into a registration other than the one that issued the get",
)
def no_stale_commit(world: ObservedWorld) -> list[str]:
    out = []
    registered: dict[tuple[str, str], int | None] = {}  # (stage, request) -> live entry
    for ev in world.trace:
        stage = f"stage {ev.attrs.get('stage')}"
        if ev.name == "adapter.register":
            registered[(stage, str(ev.attrs["req"]))] = ev.attrs["entry"]  # type: ignore[assignment]
        elif ev.name == "adapter.unregister":
            registered[(stage, str(ev.attrs["req"]))] = None
        elif ev.name == "adapter.commit":
            req = str(ev.attrs["req"])
            live = registered.get((stage, req))
            if live != ev.attrs["entry"]:
                now = f"registration {live}" if live is not None else "no registration"
                out.append(
                    f"{stage} committed chunk {ev.attrs['chunk']} of {req} into stale registration "
                    f"{ev.attrs['entry']} ({now} is live): a cleaned-up request was resurrected"
                )
    return out
