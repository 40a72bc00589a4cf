"""A stage process dies while requests run (omnisim issue 10).

The engine runs every stage as a process of its own (``processes: true``, modelled by
:mod:`omnisim.stage_processes`); one of them is SIGKILLed — or SIGSTOPped for longer than its
supervisor waits — at one phase of a request *V*:

=====================  =============================================================
phase                  where the stage dies
=====================  =============================================================
``before_first_chunk`` before anything of V crossed its edge (the Thinker starts its first
                       put; a receiving stage just registered for V's first chunk)
``mid_stream``         in the middle of V's stream (a put half written; a chunk taken
                       from the segment but not yet handed on)
``terminal_queued``    right after it queued V's terminal chunk, before sending it
``terminal_unsent``    as its save task takes V's terminal up: the Thinker may have told the
                       orchestrator it finished V, and its Talker never gets the terminal
``during_release``     in the middle of V's release sweep, after V finished
``during_abort``       while it reclaims V's chunks for the client's abort
``paused``             stopped (SIGSTOP) half-way through a put for longer than the
                       heartbeat allows: the supervisor must kill it before sweeping
``while_starting``     its first life, as it is about to say it is ready (a model that
                       fails to load): the requests wait for the restart
=====================  =============================================================

Meanwhile a text-only request T runs on the Thinker alone, and once V ended its id is reused.
Only requests bound to the dead stage may fail — each once, with an error naming the stage —
the stage comes back in a new namespace, the reused V is served in full, the dead namespace is
swept, and an operator's ``omnisim sweep`` afterwards touches nothing alive.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from invariants.observed import TraceEvent
from omnisim.faults import Fault, FaultPlan
from omnisim.registry import DEFAULT_INVARIANTS, Param, Params, scenario
from omnisim.sim_kernel import SimKernel, current_trace
from omnisim.stage_processes import build_process_engine
from omnisim.world import World
from runtime.config.pipeline import load_pipeline
from runtime.connectors.keys import external_id_of
from runtime.kernel import Attr, current_kernel
from runtime.orchestrator import SHUT_DOWN, Unavailable
from scenarios.edge import together
from scenarios.pipeline import BOUNDARY, REMAINDER, SHORT, Client, abort_once_submitted, engine_of, models

#: Virtual seconds one model call takes: a surviving stage is still busy when a death is found.
MODEL_STEP_S = 0.02
STAGE_IDS = {"thinker": 0, "talker": 1, "code2wav": 2}

#: (stage, phase) -> (the fault, the point it fires at, the attrs it matches).
CRASHES: dict[tuple[str, str], tuple[str, str, dict[str, str]]] = {
    ("thinker", "before_first_chunk"): ("crash_stage", "shm.put.begin", {"key": "V_0_0"}),
    ("talker", "before_first_chunk"): ("crash_stage", "adapter.load_async", {"req": "V#1"}),
    ("code2wav", "before_first_chunk"): ("crash_stage", "adapter.load_async", {"req": "V#2"}),
    ("thinker", "mid_stream"): ("crash_stage", "shm.put.written", {"key": "V_0_2"}),
    ("talker", "mid_stream"): ("crash_stage", "shm.put.written", {"key": "V_1_1"}),
    ("code2wav", "mid_stream"): ("crash_stage", "shm.get.consumed", {"key": "V_1_1"}),
    ("thinker", "terminal_queued"): ("crash_stage", "adapter.save_async", {"req": "V#0", "finished": "True"}),
    ("talker", "terminal_queued"): ("crash_stage", "adapter.save_async", {"req": "V#1", "finished": "True"}),
    # Later: the Thinker's save task takes V's terminal up (the Thinker finished first, so this is
    # its terminal) — by then the orchestrator may have heard that the Thinker finished V.
    ("thinker", "terminal_unsent"): ("crash_stage", "adapter.send.begin", {"ext": "V", "finished": "True"}),
    ("thinker", "during_release"): ("crash_stage", "adapter.release.begin", {"ext": "V", "stage": "0"}),
    ("talker", "during_release"): ("crash_stage", "adapter.release.begin", {"ext": "V", "stage": "1"}),
    ("thinker", "during_abort"): ("crash_stage", "adapter.cleanup_sender.begin", {"ext": "V", "stage": "0"}),
    ("talker", "during_abort"): ("crash_stage", "adapter.cleanup_sender.begin", {"ext": "V", "stage": "1"}),
    ("talker", "paused"): ("pause_stage", "shm.put.written", {"key": "V_1_1"}),
    ("talker", "while_starting"): ("crash_stage", "stage.ready", {"stage": "1"}),
    ("code2wav", "while_starting"): ("crash_stage", "stage.ready", {"stage": "2"}),
    # Its first two lives die as V, then the reused V, reach them: the second restart backs off longer.
    ("talker", "twice"): ("crash_stage", "adapter.load_async", {"req": "V#1"}),
    # The same, with the reused V sent once the second life has lived past the supervisor's 10 s
    # of stability: its death is restarted after the first back-off again, not a doubled one.
    ("talker", "after_a_stable_life"): ("crash_stage", "adapter.load_async", {"req": "V#1"}),
}
#: How many lives of the stage a crash takes (each at its own hit of the point).
LIVES_TAKEN = {"twice": 2, "after_a_stable_life": 2}
#: How long ``after_a_stable_life`` lets the second life live before the reused V reaches it:
#: past the 10 s after which a life counts as stable.
STABLE_LIFE_S = 12.0
CRASH = Param("crash", tuple(f"{stage}@{phase}" for stage, phase in CRASHES), "which stage dies, and when")
#: How soon after its death a stage must be running again: noticed within a second of silence,
#: restarted after the supervisor's first back-off.
RESTART_WITHIN_S = 1.5
#: The invariants of a stage death, on top of the defaults.
ISOLATION = (
    *DEFAULT_INVARIANTS,
    "fault-isolation",
    "death-noticed",
    "abort-stops-work",
    "no-residue-after-sweep",
    "restarts-back-off",
)
#: How both scenarios of a stage death run: its invariants, and a long run's horizon and budget.
PROCESS_RUN: dict[str, Any] = {"invariants": ISOLATION, "horizon_s": 60.0, "budget_share": 0.5}


def check_failed_after_death(world: World, clients: tuple[Client, ...]) -> None:
    """A request failed after a stage process died is told that the engine is at fault, not the
    request: Unavailable, which a server answers with 503 and Retry-After (the stage is coming
    back) — also when a survivor failed it before the supervisor noticed the death (the dead
    writer's half-written chunk, the chunks that stopped coming): the process is gone all the
    same, as ``waitpid`` tells."""
    # (a stopped process is dead once its silence was noticed)
    deaths = sorted(e.index for e in [*stage_kills(), *events("orch.stage_died")])
    for client in clients:
        failed = first_event("orch.fail", req=client.request_id)
        after_death = deaths and failed is not None and failed.index > deaths[0]
        world.probe(
            "fault-isolation",
            client.stream.outcome != "failed"
            or not after_death
            or isinstance(client.stream.error, Unavailable)
            or struck_by_a_fault(client),
            f"{client.name} failed after a stage process died, with an error that does not say a retry may "
            f"succeed: {client.stream.error!r}",
        )


def struck_by_a_fault(client: Client) -> bool:
    """Whether an injected fault (``--faults sampled``) hit a key of the client's request once the
    engine accepted it: the request may fail of that, whatever else died meanwhile."""
    accepted = client.stream.accepted_at
    return accepted is not None and any(
        e.index > accepted and external_id_of(str(e.attrs["key"])) == client.request_id
        for e in events("fault")
        if "key" in e.attrs
    )


async def text_while_down(world: World, stage: str) -> None:
    """A text-only request submitted while ``stage`` (not the Thinker) is down is accepted at once
    and answered in full: it needs the Thinker alone, so it never waits for the restart."""
    engine = engine_of(world)
    if engine.stages[STAGE_IDS[stage]].health()["alive"] or not engine.stages[0].health()["alive"]:
        # (back already, or never noticed dead; or the Thinker itself is not up — still starting,
        # in a shrunk find's world that asked nothing before: nothing to show)
        return
    meanwhile = Client(world, "T.meanwhile", SHORT, "M", modalities=("text",))
    await meanwhile.run()
    if meanwhile.left_out:
        return  # (a shrunk find's smaller world: it asked nothing)
    asked, accepted = first_event("orch.submit", req="M"), first_event("orch.accepted", req="M")
    assert asked is not None and accepted is not None  # (it ran to its end above)
    world.probe(
        "fault-isolation",
        accepted.time_us == asked.time_us,
        f"a text-only request submitted while {stage} was down waited {(accepted.time_us - asked.time_us) / 1e6:g}s "
        "to be accepted: it needs the Thinker alone",
    )


async def twins_while_down(world: World, stage: str, outcomes: frozenset[str]) -> None:
    """Two requests with one id, submitted together while ``stage`` is down: both wait for it to
    come back, then the one that takes the id first is served and the other waits for its release
    (taking the id is one step with the check that the stages are up: nothing awaits between)."""
    if engine_of(world).stages[STAGE_IDS[stage]].health()["alive"]:
        return  # (back already, or never noticed dead: nothing to show)
    twins = [Client(world, f"D{i}", SHORT, "D", modalities=("audio",)) for i in (1, 2)]
    for twin in twins:
        twin.outcomes = outcomes
    await together(*((twin.name, twin.run) for twin in twins))


def stage_kills() -> list[TraceEvent]:
    """The run's SIGKILLs of a stage process, so far."""
    return [e for e in current_trace() if e.name == "process.killed" and str(e.attrs["process"]).startswith("stage")]


def stage_died_since(index: int | None) -> bool:
    """Whether a stage process was killed after trace event ``index`` (None: never accepted)."""
    return index is not None and any(e.index > index for e in stage_kills())


def events(name: str, **attrs: Attr) -> list[TraceEvent]:
    """The run's trace events ``name`` with ``attrs``, so far."""
    return [e for e in current_trace() if e.name == name and all(e.attrs.get(k) == v for k, v in attrs.items())]


def first_event(name: str, **attrs: Attr) -> TraceEvent | None:
    """The run's first trace event ``name`` with ``attrs``, so far."""
    return next(iter(events(name, **attrs)), None)


def crashed(params: Params) -> tuple[str, str]:
    stage, _, phase = params.get("crash", CRASH.values[0]).partition("@")
    return stage, phase


def build(store_kind: str, params: Params, *, restart: str = "restart") -> World:
    world = World(store_kind, processes=True)
    kernel = current_kernel()
    assert isinstance(kernel, SimKernel)
    kernel.compute_cost_s = MODEL_STEP_S
    config = load_pipeline("qwen3_omni")
    config = dataclasses.replace(config, deploy=dataclasses.replace(config.deploy, processes=True, restart=restart))
    engine = build_process_engine(world, config, models())
    world.components["engine"] = engine
    world.add_service("engine", engine.run, engine.shutdown)
    kind, at, match = CRASHES[crashed(params)]
    lives = LIVES_TAKEN.get(crashed(params)[1], 1)
    world.inject(FaultPlan([Fault(kind, match=match, at=at, nth=n) for n in range(1, lives + 1)]))
    return world


@scenario(
    "stage_crash",
    summary="a stage process dies (or stops) at one phase of a request while another runs: only the requests "
    "bound to it fail, once, naming it; it restarts in a new namespace and serves the reused id; nothing is left",
    issue="issue 10; upstream fault isolation",
    build=build,
    **PROCESS_RUN,
    params=(CRASH,),
)
async def stage_crash(world: World) -> None:
    stage, phase = crashed(world.params)
    victim = Client(world, "V", BOUNDARY, "V")
    # Stopped half-way through its stream, the Talker cannot finish V: the head must give up on it.
    victim.outcomes = frozenset(
        {
            "during_abort": {"aborted"},
            "during_release": {"finished"},
            "paused": {"failed"},
        }.get(phase, {"finished", "failed"})
    )
    # A request on the Thinker alone: only the Thinker's death may take it down.
    text_only = Client(world, "T", REMAINDER, "T", modalities=("text",))
    if stage == "thinker":
        text_only.outcomes = frozenset({"finished", "failed"})
    again = Client(world, "V.again", SHORT, "V")
    if phase in ("twice", "after_a_stable_life"):
        again.outcomes = frozenset({"finished", "failed"})

    async def victim_then_reuse() -> None:
        if phase == "during_abort":
            await together(("V.first", victim.run), ("V.abort", lambda: abort_once_submitted(victim, after_points=40)))
        else:
            await victim.run()
        if stage != "thinker":
            await together(
                ("T.meanwhile", lambda: text_while_down(world, stage)),
                ("D", lambda: twins_while_down(world, stage, again.outcomes)),
            )
        if phase == "after_a_stable_life":
            await current_kernel().sleep(STABLE_LIFE_S)
        await again.run()  # the same id once V ended: served by whatever lives now
        if stage_died_since(again.stream.accepted_at):
            # (an injected fault failed V before the death it was meant for, which came later)
            again.outcomes |= {"failed"}

    await together(("V", victim_then_reuse), ("T", text_only.run))
    check_failed_after_death(world, (victim, text_only))
    # An operator's sweep after the crash: what is dead is gone already, what lives stays.
    await world.sweep_dead()
    engine = engine_of(world)
    sid = STAGE_IDS[stage]
    # The requests may all have ended (an injected fault failed them) before the supervisor
    # even noticed the death: it has a second to notice and its first back-off to restart.
    k = current_kernel()
    deadline = k.now() + RESTART_WITHIN_S
    while world.deaths and engine.stages[sid].health()["restarts"] < 1 and k.now() < deadline:
        await k.sleep(0.05)
    restarts = engine.stages[sid].health()["restarts"]
    world.probe("fault-isolation", not world.deaths or restarts >= 1, f"{stage} died but was never restarted")
    lives = len(events("stage.life", stage=sid))
    # (no life at all: nothing asked for the stage, in a shrunk find's world without requests)
    world.probe(
        "health-counts-true", restarts == max(lives - 1, 0), f"{stage} reports {restarts} restarts after {lives} lives"
    )


#: Where a stage dies in ``stage_crash_no_restart``: each stage, in the middle of V's stream.
NO_RESTART_CRASH = Param(
    "crash", tuple(f"{stage}@mid_stream" for stage in STAGE_IDS), "which stage dies, in the middle of V's stream"
)


@scenario(
    "stage_crash_no_restart",
    summary="with `restart: fail` a stage process that dies takes the engine down: the requests bound to it fail, "
    "naming it; every other request ends with the engine's shutdown, which names the death; a request submitted "
    "afterwards is refused as shut down; the dead stage is not restarted and nothing is left",
    issue="issue 10; upstream fault isolation (a stage that must not restart)",
    build=functools.partial(build, restart="fail"),
    **PROCESS_RUN,
    params=(NO_RESTART_CRASH,),
)
async def stage_crash_no_restart(world: World) -> None:
    stage, _ = crashed(world.params)
    victim = Client(world, "V", BOUNDARY, "V")
    victim.outcomes = frozenset({"finished", "failed", "shut down"})
    text_only = Client(world, "T", REMAINDER, "T", modalities=("text",))
    # On the Thinker alone: the Thinker's death fails it, any other ends it with the engine.
    text_only.outcomes = frozenset({"finished", "shut down"} | ({"failed"} if stage == "thinker" else set()))
    await together(("V", victim.run), ("T", text_only.run))
    check_failed_after_death(world, (victim, text_only))
    engine = engine_of(world)
    again = Client(world, "V.again", SHORT, "V")
    await again.run()
    # (Judged once it ended: the stage may die under it, when an injected fault ended V early.)
    again.outcomes = frozenset({"shut down", "failed"} if world.deaths else {"finished"})
    k = current_kernel()
    deadline = k.now() + RESTART_WITHIN_S
    while world.deaths and engine.shutdown_error == SHUT_DOWN and k.now() < deadline:
        await k.sleep(0.05)  # the supervisor has a second to notice the death
    if world.deaths:
        died = f"stage {stage} died"
        world.probe(
            "fault-isolation",
            isinstance(engine.shutdown_error, Unavailable) and died in engine.shutdown_error,
            f"{stage} died, which `restart: fail` makes the engine's end; the engine says {engine.shutdown_error!r}",
        )
    world.probe(
        "fault-isolation",
        engine.stages[STAGE_IDS[stage]].health()["restarts"] == 0,
        f"{stage} was restarted though its restart policy is fail",
    )
