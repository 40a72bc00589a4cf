"""Ownership invariants over the trace: who may remove a segment, who may commit a chunk."""

from __future__ import annotations

from invariants import invariant
from invariants.observed import ObservedWorld

# What each checker reads: the other events (most of a trace) are passed over with one lookup.
_OWNERSHIP_EVENTS = frozenset(
    {
        "kernel.killed",
        "adapter.put",
        "shm.put.created",
        "shm.get.consumed",
        "adapter.cleanup_shm.begin",
        "adapter.release.begin",
        "adapter.cleanup_shm.end",
        "adapter.release.end",
        "shm.cleanup.unlinked",
    }
)
_REGISTRATION_EVENTS = frozenset({"adapter.register", "adapter.unregister", "adapter.commit"})
_CONSUME_EVENTS = frozenset(
    {
        "adapter.register",
        "adapter.unregister",
        "adapter.receive_failed",
        "shm.put.created",
        "adapter.poll",
        "kernel.killed",
        "shm.get.consumed",
    }
)


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
        if ev.name not in _OWNERSHIP_EVENTS:
            continue
        a = ev.attrs
        if ev.name == "kernel.killed":
            last_put.pop(ev.task, None)  # a later task of that name is another process's
            reclaiming.pop(ev.task, None)
        elif ev.name == "adapter.put":
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
        if ev.name not in _REGISTRATION_EVENTS:
            continue
        stage = f"stage {ev.attrs.get('stage')}"
        if ev.name == "adapter.register":
            registered[(stage, str(ev.attrs["req"]))] = ev.attrs["entry"]  # type: ignore[assignment]
        elif ev.name == "adapter.unregister":
            registered[(stage, str(ev.attrs["req"]))] = None
        else:
            req = str(ev.attrs["req"])
            live = registered.get((stage, req))
            if live != ev.attrs["entry"]:
                now = f"registration {live}" if live is not None else "no registration"
                out.append(
                    f"{stage} committed chunk {ev.attrs['chunk']} of {req} into stale registration "
                    f"{ev.attrs['entry']} ({now} is live): a cleaned-up request was resurrected"
                )
    return out


@invariant(
    "no-stale-consume",
    "a get that outlived its registration never consumes a chunk written after that registration ended "
    "(the chunk of a later generation of the same id); a request whose receive failed is not polled again "
    "until it registers anew",
)
def no_stale_consume(world: ObservedWorld) -> list[str]:
    out = []
    live: dict[tuple[object, str], object] = {}  # (stage, request) -> its live registration
    ended: dict[tuple[object, str, object], int] = {}  # (stage, request, entry) -> event index it ended at
    written: dict[str, int] = {}  # key -> event index its current segment was created at
    polling: dict[str, tuple[object, str, object, str]] = {}  # task -> the poll it is running
    # (stage, request) -> event index its receive failed at. A failure is final: the chunk it
    # waited for was consumed or will never come, and a poll after it reads a key that only a
    # later generation of the id can write.
    failed: dict[tuple[object, str], int] = {}
    for ev in world.trace:
        if ev.name not in _CONSUME_EVENTS:
            continue
        a = ev.attrs
        if ev.name == "adapter.register":
            live[(a["stage"], str(a["req"]))] = a["entry"]
            failed.pop((a["stage"], str(a["req"])), None)
            # The same serial again is a new life of the stage (a restarted process numbers anew).
            ended.pop((a["stage"], str(a["req"]), a["entry"]), None)
        elif ev.name == "adapter.receive_failed":
            failed[(a["stage"], str(a["req"]))] = ev.index
        elif ev.name == "adapter.unregister":
            entry = live.pop((a["stage"], str(a["req"])), None)
            if entry is not None:
                ended[(a["stage"], str(a["req"]), entry)] = ev.index
        elif ev.name == "shm.put.created":
            written[str(a["key"])] = ev.index
        elif ev.name == "adapter.poll":
            polling[ev.task] = (a["stage"], str(a["req"]), a["entry"], str(a["key"]))
            failed_at = failed.get((a["stage"], str(a["req"])))
            if failed_at is not None:
                out.append(
                    f"stage {a['stage']} polled {a['key']} for registration {a['entry']} of {a['req']} after its "
                    f"receive failed (event {failed_at}): a failed request kept its place in the receive queue"
                )
        elif ev.name == "kernel.killed":
            polling.pop(ev.task, None)
        elif ev.name == "shm.get.consumed" and ev.task in polling:
            stage, req, entry, key = polling.pop(ev.task)
            end = ended.get((stage, req, entry))
            created = written.get(key)
            if end is not None and created is not None and created > end:
                out.append(
                    f"stage {stage}'s get for registration {entry} of {req} (ended at event {end}) consumed "
                    f"{key}, written at event {created} after it ended: a later generation of the id lost "
                    "that chunk"
                )
    return out
