"""Fault-isolation invariants: a dead stage takes only its own requests down, and a request that
ended early stops costing work."""

from __future__ import annotations

import re

from invariants import invariant
from invariants.observed import ObservedWorld

#: How a stage process is named in the trace: ``stage1.talker.0`` is the Talker's first life.
_LIFE = re.compile(r"stage(?P<id>\d+)\.(?P<name>\w+)\.\d+")


@invariant(
    "fault-isolation",
    "when a stage process dies, only requests bound to it fail — each once, with an error naming the stage; a "
    "stage is given up on only once its process died or stopped",
)
def fault_isolation(world: ObservedWorld) -> list[str]:
    return _deaths_unexplained(world) + _failures_beyond_the_dead(world)


def _deaths_unexplained(world: ObservedWorld) -> list[str]:
    """A supervisor that takes a live, answering stage process for dead (its messages misread, a
    heartbeat lost) fails its requests for nothing: each ``stage.died`` follows a kill or a stop of
    that stage's process since its life began."""
    out = []
    struck: dict[str, bool] = {}  # stage id -> its current life's process was killed or stopped
    for ev in world.trace:
        if ev.name == "stage.life":
            struck[str(ev.attrs["stage"])] = False
        elif ev.name in ("process.killed", "process.paused"):
            match = _LIFE.fullmatch(str(ev.attrs["process"]))
            if match:
                struck[match.group("id")] = True
        elif ev.name == "stage.died" and not struck.get(str(ev.attrs["stage"]), False):
            out.append(
                f"stage {ev.attrs['stage']} was given up on ({ev.attrs['reason']}) though its process neither died "
                "nor stopped"
            )
    return out


def _failures_beyond_the_dead(world: ObservedWorld) -> list[str]:
    # A failure may name the stage (its Code2Wav found "the chunk … from stage 1" corrupt).
    dead = {
        name
        for ev in world.trace
        if ev.name == "process.killed" and (match := _LIFE.fullmatch(str(ev.attrs["process"])))
        for name in (f"stage {match.group('name')}", f"stage {match.group('id')}")
    }
    if not dead:
        return []
    out = []
    for s in world.streams.values():
        if s.outcome != "failed":
            continue
        if "failed" not in world.allowed_outcomes(s):
            out.append(f"request {s.request_id} failed ({s.error}) though it was not bound to a stage that died")
        elif world.faulted(s):
            continue  # an injected fault hit it: it may fail of that, naming no stage
        elif s.terminals != 1:
            out.append(f"request {s.request_id} got {s.terminals} error terminals")
        elif not any(re.search(rf"{stage}\b", s.error or "") for stage in dead):
            out.append(
                f"request {s.request_id} failed with {s.error!r}, which names no stage that died ({sorted(dead)})"
            )
    return out


@invariant(
    "abort-stops-work",
    "once a request failed or was aborted, or its client stopped listening, each stage sends at most one more "
    "chunk of it (the step in flight) once it was told (a stage process is told by a message, which takes its "
    "time; a stage never told is held to it from the end on)",
)
def abort_stops_work(world: ObservedWorld) -> list[str]:
    out = []
    told = _told_to_stop(world)
    stopped: dict[str, dict[str, int]] = {}  # ext -> stage request -> chunks queued since
    ended: dict[str, int] = {}  # ext -> where its request ended
    for ev in world.trace:
        if ev.name in ("orch.fail", "orch.abort.begin", "client.left"):
            stopped.setdefault(str(ev.attrs["req"]), {})
            ended.setdefault(str(ev.attrs["req"]), ev.index)
        elif ev.name == "orch.accepted":
            stopped.pop(str(ev.attrs["req"]), None)  # a new generation of the id
            ended.pop(str(ev.attrs["req"]), None)
        elif ev.name == "adapter.save_async" and (since := stopped.get(str(ev.attrs["ext"]))) is not None:
            req = str(ev.attrs["req"])
            if ev.index < next((i for i in told.get(req, []) if i > ended[str(ev.attrs["ext"])]), -1):
                continue  # (before its stage was told)
            since[req] = since.get(req, 0) + 1
            if since[req] == 2:
                out.append(
                    f"{ev.task} kept working on {req} after its request ended (a second chunk at event {ev.index})"
                )
    return out


def _told_to_stop(world: ObservedWorld) -> dict[str, list[int]]:
    """Stage request -> where its stage's scheduler was asked to abort it, in order."""
    told: dict[str, list[int]] = {}
    for ev in world.trace:
        if ev.name == "sched.abort":
            told.setdefault(str(ev.attrs["req"]), []).append(ev.index)
    return told


#: How soon a request bound to a stage that died or stopped must end: the supervisor's
#: 1 s of silence, its 0.2 s watch period, and the surviving stages' next step.
NOTICE_US = 1_500_000


@invariant(
    "death-noticed",
    "a stage process that dies or stops is given up on within 1.5 s: the requests it held end by then "
    "(and one that cannot finish without it fails)",
)
def death_noticed(world: ObservedWorld) -> list[str]:
    out = []
    for ev in world.trace:
        if ev.name not in ("process.killed", "process.paused") or not _LIFE.fullmatch(str(ev.attrs["process"])):
            continue
        for s in world.streams.values():
            held = s.outcome == "failed" or s.allowed_outcomes == {"failed"}
            if not held or (s.ended_us is not None and s.ended_us < ev.time_us):
                continue
            if s.accepted_at is not None and s.accepted_at > ev.index:
                continue  # (accepted after this death: a later life, or a later death, holds it)
            late = (s.ended_us if s.ended_us is not None else world.end_time_us) - ev.time_us
            if late > NOTICE_US:
                out.append(
                    f"request {s.request_id} ended {s.outcome} {late / 1e6:g}s after {ev.attrs['process']} "
                    f"{'died' if ev.name == 'process.killed' else 'stopped'}; it must end within {NOTICE_US / 1e6:g}s"
                )
    return out


#: The supervisor's restart back-off, restated (a runtime that backs off less must not set the
#: bar it is checked against): 0.1 s, doubling up to 5 s, back to 0.1 s after a life of 10 s.
FIRST_BACKOFF_S, MAX_BACKOFF_S, STABLE_AFTER_S = 0.1, 5.0, 10.0


@invariant(
    "restarts-back-off",
    "a stage restarted after a death starts its new life in a namespace none of its lives wrote into, and only "
    "once its back-off has passed since the dead life was buried: 0.1 s, doubling with each death up to 5 s, "
    "back to 0.1 s after a life of 10 s or more (a stage that dies as it starts is not restarted in a hot loop)",
)
def restarts_back_off(world: ObservedWorld) -> list[str]:
    out = []
    for stage in sorted({str(ev.attrs["stage"]) for ev in world.trace if ev.name == "stage.life"}):
        used: set[str] = set()
        born_us = buried_us = 0
        backoff = next_backoff = FIRST_BACKOFF_S
        for ev in world.trace:
            if ev.name not in ("stage.life", "stage.died", "stage.buried") or str(ev.attrs["stage"]) != stage:
                continue
            if ev.name == "stage.died":
                lived = (ev.time_us - born_us) / 1e6
                backoff = FIRST_BACKOFF_S if lived >= STABLE_AFTER_S else next_backoff
                next_backoff = min(backoff * 2, MAX_BACKOFF_S)
            elif ev.name == "stage.buried":
                buried_us = ev.time_us
            else:
                ns = str(ev.attrs["ns"])
                if ns in used:
                    out.append(f"stage {stage} started a new life in {ns}, where an earlier life wrote")
                waited = (ev.time_us - buried_us) / 1e6
                if used and round(waited, 6) != round(backoff, 6):
                    out.append(f"stage {stage} restarted {waited:g}s after its dead life's burial, not {backoff:g}s")
                used.add(ns)
                born_us = ev.time_us
    return out
