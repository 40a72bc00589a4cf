"""Delivery and progress invariants: streams end properly, aborts never wait, nothing hangs."""

from __future__ import annotations

import os
import re
import sysconfig

import runtime
from invariants import RAISED_OUTSIDE_THE_RUNTIME, invariant
from invariants.observed import ObservedWorld


@invariant(
    "terminal-delivered",
    "every non-aborted stream delivers exactly one terminal chunk, last, and every frame sent",
)
def terminal_delivered(world: ObservedWorld) -> list[str]:
    out = []
    for s in world.streams.values():
        if s.outcome == "open":
            continue  # reported by liveness
        allowed = world.allowed_outcomes(s)
        if s.outcome not in allowed:
            out.append(f"request {s.request_id} ended {s.outcome}; expected {' or '.join(sorted(allowed))}")
            continue
        if s.outcome != "finished":
            continue
        terminals = [i for i, (_, finished) in enumerate(s.chunks) if finished]
        if len(terminals) != 1 or terminals[0] != len(s.chunks) - 1:
            out.append(f"request {s.request_id} received terminal flags at chunks {terminals} of {len(s.chunks)}")
        if s.frames_received > s.frames_sent or (s.complete_required and s.frames_received != s.frames_sent):
            out.append(f"request {s.request_id} received {s.frames_received} codec frames of {s.frames_sent} sent")
    return out


ABORT_PATH = {"orch.abort.begin": "orch.abort.end", "adapter.cleanup_sender.begin": "adapter.cleanup_sender.end"}


@invariant(
    "abort-non-blocking",
    "an abort returns without waiting, and does no connector I/O on the caller's task",
)
def abort_non_blocking(world: ObservedWorld) -> list[str]:
    out = []
    inside: dict[str, list[str]] = {}  # task -> abort-path calls it is in, innermost last
    for ev in world.trace:
        calls = inside.setdefault(ev.task, [])
        if ev.name == "kernel.killed":
            calls.clear()  # its process died inside the abort path; a later task of that name is new
        elif ev.name in ABORT_PATH:
            calls.append(f"{ev.name.removesuffix('.begin')}({', '.join(map(str, ev.attrs.values()))})")
        elif ev.name in ABORT_PATH.values() and calls:
            calls.pop()
        elif calls and ev.name in ("kernel.block", "kernel.wait"):
            out.append(f"{calls[-1]} in task {ev.task} waited on {ev.attrs.get('on')}")
            calls.clear()
        elif calls and ev.name.startswith("shm."):
            out.append(f"{calls[-1]} in task {ev.task} did connector I/O itself ({ev.name} {ev.attrs.get('key')})")
            calls.clear()
    return out


@invariant(
    "liveness",
    "every non-aborted request reaches its final output; a wait that can never end is a hang",
)
def liveness(world: ObservedWorld) -> list[str]:
    out = []
    if world.stop_reason in ("deadlock", "horizon", "step-limit"):
        waiting = "; ".join(str(t) for t in world.stopped_tasks)
        out.append(f"hang ({world.stop_reason}: {world.stop_detail}); tasks: {waiting}")
    open_streams = [s.request_id for s in world.streams.values() if s.outcome == "open"]
    if open_streams and not out:
        out.append(f"requests never ended: {', '.join(open_streams)}")
    return out


@invariant(
    "one-generation-per-id",
    "the engine accepts a request id only while no earlier generation of it holds the id: a reuse waits until "
    "the earlier one was released (two generations at once share their chunks' keys and overwrite each other)",
)
def one_generation_per_id(world: ObservedWorld) -> list[str]:
    out = []
    holding: dict[object, int] = {}  # request id -> where the generation that holds it was accepted
    for ev in world.trace:
        req = ev.attrs.get("req")
        if ev.name == "orch.accepted":
            if req in holding:
                out.append(
                    f"{req} was accepted (event {ev.index}) while its generation accepted at event "
                    f"{holding[req]} still held the id"
                )
            holding[req] = ev.index
        elif ev.name == "orch.released":
            holding.pop(req, None)
    return out


@invariant(
    "no-register-after-terminal",
    "a stage never registers a request for another chunk once it committed that request's terminal chunk: "
    "upstream sends nothing more (spec §5.2: a request whose upstream is exhausted is kept, not loaded)",
)
def no_register_after_terminal(world: ObservedWorld) -> list[str]:
    out = []
    ended: dict[tuple[object, object], int] = {}  # (stage, req) -> where its terminal was committed
    for ev in world.trace:
        key = (ev.attrs.get("stage"), ev.attrs.get("req"))
        if ev.name == "adapter.commit" and ev.attrs.get("finished"):
            ended[key] = ev.index
        elif ev.name == "adapter.register" and key in ended:
            out.append(
                f"stage {key[0]} registered {key[1]} for another chunk (event {ev.index}) after committing its "
                f"terminal (event {ended[key]}): it polls for a chunk that never comes"
            )
        elif ev.name == "adapter.unregister" and ev.attrs.get("why") == "cleanup":
            ended.pop(key, None)  # (the id may start again)
        elif ev.name == "stage.life":  # a stage process's new life starts with no receiver state
            ended = {k: i for k, i in ended.items() if k[0] != ev.attrs["stage"]}
    return out


@invariant(
    "stream-window-kept",
    "a stage with an active-stream window takes up at most that many requests' chunk streams at once, first come "
    "first served, and keeps each until the request ends there (#5349: not until its upstream finished)",
)
def stream_window_kept(world: ObservedWorld) -> list[str]:
    out = []
    active: dict[object, dict[object, None]] = {}  # stage -> its active streams, in admission order
    arrived: dict[object, list[object]] = {}  # stage -> requests, in the order they registered there
    for ev in world.trace:
        stage, req = ev.attrs.get("stage"), ev.attrs.get("req")
        if ev.name == "sched.add":
            arrived.setdefault(stage, []).append(req)
        elif ev.name == "adapter.stream.admitted":
            streams = active.setdefault(stage, {})
            if req in streams:
                out.append(f"stage {stage} took up {req}'s stream again: it let it go before the request ended there")
            streams[req] = None
            window = ev.attrs["window"]
            if len(streams) > window:  # type: ignore[operator]
                out.append(
                    f"stage {stage} took up {len(streams)} streams at once ({', '.join(map(str, streams))}); "
                    f"its window is {window}"
                )
            order = arrived.get(stage, [])
            earlier = [r for r in order[: order.index(req)] if r not in streams] if req in order else []
            if earlier:
                out.append(f"stage {stage} took up {req}'s stream before {earlier[0]}'s, which came first")
        elif ev.name == "adapter.unregister" and ev.attrs.get("why") == "cleanup":
            active.get(stage, {}).pop(req, None)
            if req in arrived.get(stage, []):
                arrived[stage].remove(req)
        elif ev.name == "stage.life":  # a stage process's new life starts with an empty window
            active.pop(stage, None)
            arrived.pop(stage, None)
    return out


@invariant(
    "max-num-seqs-kept",
    "one step of a stage runs model work for at most max_num_seqs requests (spec §5.2 step 4: the others wait)",
)
def max_num_seqs_kept(world: ObservedWorld) -> list[str]:
    return [
        f"a step of stage {ev.attrs['stage']} ran {ev.attrs['size']} requests; its max_num_seqs is {ev.attrs['max']}"
        for ev in world.trace
        if ev.name == "sched.batch" and ev.attrs["size"] > ev.attrs["max"]  # type: ignore[operator]
    ]


@invariant(
    "streamed-as-made",
    "a streamed answer reaches its client as it is made: each audio chunk the final stage decodes is on the "
    "client's stream once the stage hands it out; only the stage's finished output waits for the other stages",
)
def streamed_as_made(world: ObservedWorld) -> list[str]:
    # Noted where a scenario watches the final stage's hand-outs (every in-process pipeline world).
    return [
        f"an audio chunk of {ev.attrs['req']} was held back from its client when Code2Wav handed it out "
        f"(event {ev.index}): the client hears nothing until the whole answer is made"
        for ev in world.trace
        if ev.name == "stream.held"
    ]


@invariant(
    "failures-claimed",
    "every failure a stage reports (a chunk it gave up sending, or could not receive) is read while the request "
    "it names is still known: one read after the request's id was freed is lost, or fails the id's next generation",
)
def failures_claimed(world: ObservedWorld) -> list[str]:
    return [
        f"stage {ev.attrs['stage']} failed {ev.attrs['req']} ({ev.attrs['reason']}), read after its request was "
        f"released (event {ev.index}): no request heard of it"
        for ev in world.trace
        if ev.name == "orch.failure_unclaimed"
    ]


@invariant("no-crash", "no runtime task dies with an exception")
def no_crash(world: ObservedWorld) -> list[str]:
    return [f"task {task} crashed: {_last_line(tb)}{_not_the_runtimes(tb)}" for task, tb in world.crashes]


_RAISED_AT = re.compile(r'File "([^"]+)", line (\d+)')


def _not_the_runtimes(traceback: str) -> str:
    """Where the exception was raised, if not in the runtime: a slip of the scenario's own code
    (or of a test's) reads as one at a glance."""
    # (the innermost frame of code of the runtime's, the harness's or a user's: not of a library
    # one of them called)
    places = [(path, line) for path, line in _RAISED_AT.findall(traceback) if not _in_a_library(path)]
    if not places or places[-1][0].startswith(_RUNTIME):
        return ""
    return f" ({RAISED_OUTSIDE_THE_RUNTIME}, at {places[-1][0]}:{places[-1][1]})"


_RUNTIME = os.path.dirname(runtime.__file__) + os.sep
_LIBRARIES = (sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"], "<frozen ")


def _in_a_library(path: str) -> bool:
    return path.startswith(_LIBRARIES) and not path.startswith(_RUNTIME)  # (an installed runtime is no library)


def _last_line(traceback: str) -> str:
    """The exception line of a traceback (of an exception group's last exception, drawn boxed)."""
    lines = [line.strip(" |+-") for line in traceback.splitlines()]
    return next((line for line in reversed(lines) if line), traceback)


@invariant(
    "samples-exactly-once",
    "a finished stream delivers every codec frame its producer made, once each, in order",
)
def samples_exactly_once(world: ObservedWorld) -> list[str]:
    out = []
    for s in world.streams.values():
        if s.outcome != "finished" or not s.sent_frames or s.vetoable:
            continue  # (where chunks may be vetoed, no-corrupt-accept checks what did arrive)
        if s.received_frames != s.sent_frames:
            first = next(
                (i for i, (a, b) in enumerate(zip(s.sent_frames, s.received_frames, strict=False)) if a != b),
                min(len(s.sent_frames), len(s.received_frames)),
            )
            out.append(
                f"request {s.request_id} received {len(s.received_frames)} frames for {len(s.sent_frames)} sent; "
                f"first difference at frame {first}"
            )
    return out


@invariant(
    "config-contract",
    "async-chunk resolution, edge validation and prewarm follow spec §1 (checked by the config scenario)",
)
def config_contract(world: ObservedWorld) -> list[str]:
    # The evidence is the configuration, not a schedule: what resolving, validating and planning
    # a config gave, next to what spec §1 says it must give (``config.fact``).
    return world.missed_cases("config.fact", "{fact}: got {got}, spec §1 says {want}")


@invariant(
    "merged-as-spec",
    "what a Code2Wav receiver merges into a request's input after each chunk is what spec §3.8 makes of the "
    "chunks it took (checked where a scenario consumes at the edge); each chunk carries what spec §4 cuts: a codec "
    "chunk its new frames and left context, the Thinker's chunk 0 the prompt and a generated row",
)
def merged_as_spec(world: ObservedWorld) -> list[str]:
    return world.missed_cases("merge.case", "{req} after a commit: {got}")


@invariant(
    "sender-contract",
    "the sender keeps spec §3.3–§3.4's word to its scheduler and processor: save_async answers whether it queued "
    "the chunk; a processor is handed the request as it was when its chunk was queued, with that save's new token "
    "ids; each chunk carries the finish flags step 5 gives it (checked where a scenario probes them)",
)
def sender_contract(world: ObservedWorld) -> list[str]:
    return [
        *world.missed_cases("sender.answer", "save_async for {req} answered {got}; spec §3.3 says {want}"),
        *world.missed_cases("processor.view", "the processor of {req} was handed {got}; queued was {want}"),
        *world.missed_cases("processor.flags", "{req}: {got}"),
    ]


#: How far (ms) the last word may end from the end of the audio.
ALIGN_TOLERANCE_MS = 1


@invariant("aligner-complete", "the aligner sees the complete waveform; timestamps cover the whole audio")
def aligner_complete(world: ObservedWorld) -> list[str]:
    out = []
    for e in world.trace:
        if e.name == "serving.timestamps_over_http" and e.attrs["accepted"]:
            out.append("HTTP streaming with word timestamps was accepted (it must be refused: use the WebSocket)")
        elif e.name == "client.timestamps":
            end, audio = e.attrs["end_ms"], e.attrs["audio_ms"]
            if not isinstance(end, int | float) or not isinstance(audio, int | float):
                out.append(f"{e.attrs['req']}: no timestamps for {audio} ms of audio")
            elif abs(end - audio) > ALIGN_TOLERANCE_MS:
                out.append(
                    f"{e.attrs['req']}: the timestamps end at {end:.0f} ms but the audio lasts {audio:.0f} ms: "
                    "the aligner did not see the whole waveform"
                )
    return out


@invariant(
    "no-lost-wakeup",
    "no task sits out its wait's timeout while what it waits for is there: a wait whose caller says what it waits "
    "for never times out with that already true (a notify was missed); a receiver waiting for its stage's wakeup "
    "is woken by every put to that stage made while it waits; and a put waiting for room on a full ring is woken "
    "by the reader that frees it (checked from the ring's bytes when the wait ends)",
)
def no_lost_wakeup(world: ObservedWorld) -> list[str]:
    out = []
    waiting: dict[str, str] = {}  # task -> the stage whose wakeup it waits for
    missed: dict[str, str] = {}  # task -> the key of a put that should have woken it
    for ev in world.trace:
        if ev.name == "kernel.timeout" and ev.attrs.get("missed"):
            out.append(
                f"{ev.task} sat out its wait on {str(ev.attrs['on']).split(':', 1)[-1]} "
                "though what it waited for was already there: nothing notified it"
            )
        if ev.name == "kernel.wait" and (stage := _stage_woken_by(str(ev.attrs.get("on", "")))) is not None:
            waiting[ev.task] = stage
            missed.pop(ev.task, None)
        elif ev.name == "shm.put.wake":
            for task, stage in waiting.items():
                if stage == str(ev.attrs["to"]):
                    missed.setdefault(task, str(ev.attrs["key"]))
        elif ev.task in waiting:
            del waiting[ev.task]
            key = missed.pop(ev.task, None)
            if key is not None and ev.name == "kernel.timeout":
                out.append(
                    f"{ev.task} sat out its wait for stage {_stage_woken_by(str(ev.attrs.get('on', '')))}'s "
                    f"wakeup though {key} was put for that stage while it waited"
                )
    return out


def _stage_woken_by(on: str) -> str | None:
    """The stage whose arrival wakeup a wait ``on`` that is waits for: a signal of the wakeups of
    one process, or a FIFO of the wakeups across processes; None for any other wait."""
    for prefix in ("signal:wakeup.", "readable:wakeup."):
        if on.startswith(prefix):
            return on.removeprefix(prefix)
    return None
