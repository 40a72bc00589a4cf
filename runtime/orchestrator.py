"""The orchestrator: a request's life across the stages, from submission to the final sweep.

* **Submission** (spec §1.5): the request enters the Thinker; with async chunking every later
  stage up to the request's final stage that *receives chunks* gets a prewarm placeholder at
  once, under the same external id, so it is parked waiting for its first chunk.
* **Routing** (spec §1.6): an output of a final-output stage goes to the client; a finished
  output of a stage whose next edge is a forward (``async_chunk`` off) becomes the next stage's
  whole input. Chunk edges are never forwarded.
* **Final-output hold**: the finished output of the request's final stage is held until every
  submitted stage finished, and only then published, as the request's last output.
* **Abort** (#7006): ``abort`` returns at once; every stage drops the request between two of its
  steps, and the client gets a terminal built for the request's *final* stage, never stage 0.
* **Errors**: a stage error (the input-wait deadline, #4855 R1.1) or a send give-up reported
  through an adapter's failure channel (R1.2) fails the whole request: the other stages drop it
  and the client gets an error terminal.
* **Release** (spec §2.11): once no stage needs the request, every sending stage sweeps its
  unread chunks (``release_shm_resources``). A request id is only reused after that sweep, so a
  new receiver can never read an old generation's chunk.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from runtime.config.pipeline import PipelineConfig
from runtime.config.topology import OutputType
from runtime.connectors.keys import validate_request_id
from runtime.kernel import current_kernel
from runtime.models.aligner import ForcedAligner, WordTimestamp
from runtime.models.code2wav import SAMPLE_RATE
from runtime.processors.code2wav2aligner import code2wav2aligner
from runtime.request import Request
from runtime.sched.base import IDLE_WAIT_S, StageOutput
from runtime.serving import OutputKind, SamplingParams, StageAudio, check_input_text
from runtime.stages import ComputeMeter, StageHandle, TalkerFrame, TextFinish, ThinkerDelta

log = logging.getLogger(__name__)


class Unavailable(str):
    """A request's error that is the engine's state, not the request's fault: the engine stopped,
    or a stage it needs died (and may be coming back). Retrying later may succeed, so a server
    answers it with 503 and ``Retry-After``. It is a ``str``, equal to its message."""

    __slots__ = ()


ABORTED = "aborted"
SHUT_DOWN = Unavailable("the engine shut down")
#: How long a shutdown waits for the requests in flight to be aborted and released.
SHUTDOWN_GRACE_S = 5.0
#: How long a new request waits for a stage that is being restarted.
RESTART_WAIT_S = 60.0


class EngineStopped(RuntimeError):
    """The engine is shutting down and takes no new request."""


class StagesDown(RuntimeError):
    """Stages a request needs stayed down for the whole wait (a dead one whose new life did not
    come up in time, or one still starting): the request fails, as unavailable; the engine runs
    on."""


@dataclass(frozen=True)
class EngineOutput:
    """One output of a request, as the engine hands it to the serving layer.

    ``finished`` says the *stage's* output is finished; ``request_finished`` marks the request's
    last output (after it, nothing more comes).
    """

    request_id: str
    stage_id: int
    output_type: OutputType
    data: Any
    finished: bool
    request_finished: bool = False
    error: str | None = None
    #: On the last output of a request answered in full: how its text ended.
    text_finish: TextFinish | None = None


class OutputStream:
    """A request's outputs, in order, for one consumer."""

    def __init__(self, request_id: str) -> None:
        self._items: deque[EngineOutput] = deque()
        self._arrived = current_kernel().signal(f"client.{request_id}")

    def __len__(self) -> int:
        """How many outputs wait to be taken."""
        return len(self._items)

    def put(self, item: EngineOutput) -> None:
        self._items.append(item)
        self._arrived.notify()

    async def get(self) -> EngineOutput:
        while not self._items:
            await self._arrived.wait(IDLE_WAIT_S, ready=lambda: bool(self._items))
        return self._items.popleft()


@dataclass(eq=False)
class RequestState:
    request_id: str
    text: str
    outputs: frozenset[OutputType]
    final_stage_id: int
    stream: OutputStream
    audio: StageAudio
    word_timestamps: bool
    #: How the Thinker's answer ended, once it did.
    text_finish: TextFinish | None = None
    #: Stage id -> that stage's request; kept until the release sweep ran.
    stage_requests: dict[int, Request] = field(default_factory=dict)
    finished_stages: set[int] = field(default_factory=set)
    #: The final stage's finished outputs, held until every submitted stage finished.
    pending_final: list[EngineOutput] = field(default_factory=list)
    error: str | None = None
    #: A stage that held the request died meanwhile: its failure, whichever stage reports it
    #: (one that waited for the dead stage's chunks, say), is :class:`Unavailable`.
    outlived_a_stage: bool = False
    #: The client got its terminal: nothing more is published.
    closed: bool = False
    #: It ended as a whole answer (not aborted, not failed): every chunk it put was read.
    answered: bool = False


class Orchestrator:
    """Runs the stages of one engine and the requests through them."""

    def __init__(
        self,
        config: PipelineConfig,
        stages: Mapping[int, StageHandle],
        *,
        aligner: ForcedAligner | None = None,
        meter: ComputeMeter | None = None,
    ) -> None:
        k = current_kernel()
        self.config = config
        self.stages = stages
        self.aligner = aligner
        self.meter = meter if meter is not None else ComputeMeter()
        self.async_chunk = config.any_stage_async()
        #: The per-stage defaults every request starts from (shared: a request changes clones).
        self.default_sampling_params = [SamplingParams() for _ in config.stages]
        #: Live requests by id, from submission until their release sweep ran.
        self.requests: dict[str, RequestState] = {}
        #: (stage id, stage request id) -> request; kept until the release sweep ran.
        self._by_stage_request: dict[tuple[int, str], RequestState] = {}
        self._to_release: deque[RequestState] = deque()
        self._release_needed = k.signal("orch.release")
        self._released = k.signal("orch.released")
        self._stopping = False
        #: What a request that the shutdown ends, or that comes after it, is told.
        self.shutdown_error = SHUT_DOWN

    # -- running ----------------------------------------------------------------------------------

    async def run(self) -> None:
        """Run every stage, and the release sweeps, until :meth:`shutdown`."""
        k = current_kernel()
        async with k.task_group() as tasks:
            for sid, stage in self.stages.items():
                tasks.start_soon(
                    lambda sid=sid, stage=stage: stage.run(lambda out, sid=sid: self._on_output(sid, out)),
                    name=stage.spec.name,
                )
            tasks.start_soon(self._release_loop, name="orch.release")

    async def wait_ready(self, timeout_s: float = 120.0, *, stages: Iterable[int] | None = None) -> None:
        """Wait until every stage (of ``stages``) is up: a stage process loads its model first,
        and a dead one is being restarted."""
        k = current_kernel()
        wanted = [self.stages[sid] for sid in (stages if stages is not None else self.stages)]
        ends = k.now() + timeout_s
        while not all(stage.health()["alive"] for stage in wanted):
            if self._stopping:
                raise EngineStopped("the engine is shutting down")
            if k.now() >= ends:
                down = [s.spec.name for s in wanted if not s.health()["alive"]]
                raise StagesDown(f"{', '.join(f'stage {name} is down' for name in down)}: not up after {timeout_s:g} s")
            await k.sleep(0.05)

    def stage_died(self, stage_id: int, reason: str, restarting: bool) -> None:
        """A stage's process died: every request bound to it fails, once, naming the stage; the
        other stages drop those requests (their release sweeps follow as usual). A stage that
        is not restarted (``restart: fail``) takes the engine down with it."""
        name = self.stages[stage_id].spec.name
        log.warning("stage %s died: %s", name, reason)
        current_kernel().note("orch.stage_died", stage=stage_id, reason=reason)
        for state in list(self.requests.values()):
            if stage_id not in state.stage_requests:
                continue
            state.outlived_a_stage = True
            if stage_id not in state.finished_stages:
                state.finished_stages.add(stage_id)  # it will report nothing more
                self._fail(state, f"stage {name} died: {reason}")
                self._maybe_complete(state)
        if not restarting:
            self.shutdown(f"stage {name} died: {reason}")

    def health(self) -> dict[str, dict[str, Any]]:
        """Each stage's health, by name (``alive`` first)."""
        return {stage.spec.name: stage.health() for stage in self.stages.values()}

    def model_seconds(self) -> float:
        """Model compute so far: this process's, and what stage processes reported."""
        return self.meter.total_s + sum(stage.compute_s for stage in self.stages.values())

    async def drain(self) -> None:
        """Wait until every request ended and its release sweep ran."""
        while self.requests:
            await self._released.wait(IDLE_WAIT_S, ready=lambda: not self.requests)

    def shutdown(self, reason: str | None = None) -> None:
        """Stop, gracefully: requests in flight end at once with an error terminal (saying
        ``reason``, if given) and are aborted on every stage; once their release sweeps ran (or
        :data:`SHUTDOWN_GRACE_S` passed) the stages stop and each connector removes what it still
        tracks. Idempotent: the first reason stays."""
        if self._stopping:
            return
        self._stopping = True
        if reason is not None:
            self.shutdown_error = Unavailable(f"{SHUT_DOWN}: {reason}")
        for state in self.requests.values():
            if not state.closed:
                self._abort_stages(state)
                self._close(state, self._terminal(state, self.shutdown_error))
        self._release_needed.notify()
        self._released.notify()  # a submit waiting for its id to be released gives up at once

    def _stop_stages(self) -> None:
        for stage in self.stages.values():
            stage.shutdown()

    # -- submission -------------------------------------------------------------------------------

    async def submit(
        self,
        request_id: str,
        text: str,
        *,
        outputs: frozenset[OutputType] = frozenset({OutputType.TEXT, OutputType.AUDIO}),
        output_kind: OutputKind = OutputKind.DELTA,
        word_timestamps: bool = False,
        max_tokens: int | None = None,
        stop: list[str] | None = None,
    ) -> OutputStream:
        """Start a request whose answer has at most ``max_tokens`` tokens and ends before the
        first of the ``stop`` strings in it, as vLLM's does; its outputs arrive on the returned
        stream. A request id still in use (not yet released) is waited for: the old generation's
        sweep must run first."""
        k = current_kernel()
        validate_request_id(request_id)
        check_input_text(text)
        if max_tokens is not None and (type(max_tokens) is not int or max_tokens < 1):  # (not a bool either)
            raise ValueError(f"max_tokens must be an integer of at least 1, got {max_tokens!r}")
        # (a bare string is refused, not read as its characters; an empty one would match
        # anywhere, and vLLM refuses it too)
        if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) and s for s in stop)):
            raise ValueError(f"stop must be a list of non-empty strings, got {stop!r}")
        if word_timestamps and self.aligner is None:
            raise ValueError("word_timestamps needs an engine built with a forced aligner")
        final = self.config.final_stage_id(outputs)
        await k.point("orch.submit", req=request_id)
        await self._wait_until_free_and_up(request_id, range(final + 1))
        state = RequestState(
            request_id=request_id,
            text=text,
            outputs=outputs,
            final_stage_id=final,
            stream=OutputStream(request_id),
            audio=StageAudio(output_kind),
            word_timestamps=word_timestamps,
        )
        self.requests[request_id] = state
        k.note("orch.accepted", req=request_id)
        self._submit_stage(state, 0, {"text": text, "max_tokens": max_tokens, "stop": stop})
        if self.async_chunk:
            for sid in self.config.prewarm_stages(final):
                if state.error is None:  # (a failed request is not prewarmed further)
                    self._submit_stage(state, sid, None)
        self._maybe_complete(state)  # only if a stage was found down or refused the request
        return state.stream

    async def _wait_until_free_and_up(self, request_id: str, stages: range) -> None:
        """Wait until ``request_id`` is free (its old generation's sweep ran) and every one of
        ``stages`` is up (one coming back after its process died is waited for, not failed at) —
        both at once: the caller takes the id with nothing awaited after this returns."""
        while True:
            if self._stopping:
                raise EngineStopped(f"request {request_id!r} was submitted after the engine began to shut down")
            await self.wait_ready(RESTART_WAIT_S, stages=stages)
            if request_id not in self.requests:
                return
            await self._released.wait(IDLE_WAIT_S, ready=lambda: request_id not in self.requests or self._stopping)

    def _submit_stage(self, state: RequestState, stage_id: int, payload: dict[str, Any] | None) -> None:
        """Add the request to one stage: with its whole input, or as a placeholder (``None``)."""
        request = Request(f"{state.request_id}#{stage_id}", state.request_id)
        if payload is None:
            # Never executed: the first committed chunk replaces it (spec §1.5).
            prompt_len = max(1, len(state.stage_requests[0].prompt_token_ids))
            request.prompt_token_ids = [0] * prompt_len
        state.stage_requests[stage_id] = request
        self._by_stage_request[(stage_id, request.request_id)] = state
        stage = self.stages[stage_id]
        # A stage that is down, or that refuses the request, never answers for it: it counts as
        # finished, and the request fails (the caller completes it once the others stopped).
        if not stage.health()["alive"]:
            state.finished_stages.add(stage_id)
            state.outlived_a_stage = True
            self._fail(state, f"stage {stage.spec.name} is down (its process died)")
            return
        try:
            stage.submit(request, payload, sends=stage_id < state.final_stage_id)
        except Exception as e:
            log.exception("stage %s refused request %s", stage.spec.name, state.request_id)
            state.finished_stages.add(stage_id)
            self._fail(state, f"stage {stage.spec.name} refused the request: {type(e).__name__}: {e}")

    # -- routing ----------------------------------------------------------------------------------

    def _on_output(self, stage_id: int, out: StageOutput) -> None:
        state = self._by_stage_request.get((stage_id, out.request_id))
        if state is None or stage_id in state.finished_stages:
            return
        if out.finished:
            state.finished_stages.add(stage_id)
        if out.error is not None:
            if out.error != ABORTED:
                self._fail(state, f"stage {self.stages[stage_id].spec.name}: {out.error}")
        elif not state.closed and state.error is None:
            self._route(state, stage_id, out)
        self._maybe_complete(state)

    def _route(self, state: RequestState, stage_id: int, out: StageOutput) -> None:
        if isinstance(out.data, ThinkerDelta):
            if out.finished:
                state.text_finish = out.data.finish
            if OutputType.TEXT in state.outputs and (out.data.text or out.finished):
                self._publish(state, stage_id, OutputType.TEXT, out.data.text, out.finished)
            self._forward(state, stage_id, out, out.data.full_payload)
        elif isinstance(out.data, TalkerFrame):
            self._forward(state, stage_id, out, out.data.full_payload)
        else:  # Code2Wav: decoded samples, or None when it finished without a model pass
            audio = state.audio.update(out.data) if out.data is not None else state.audio.finish()
            if audio is not None or out.finished:
                self._publish(state, stage_id, OutputType.AUDIO, audio, out.finished)
            if out.finished and state.word_timestamps:
                self._publish(state, stage_id, OutputType.TIMESTAMPS, self._align(state, audio), True)

    def _forward(self, state: RequestState, stage_id: int, out: StageOutput, payload: dict[str, Any] | None) -> None:
        """A finished output becomes the next stage's whole input, on a forward edge only."""
        nxt = stage_id + 1
        if not out.finished or stage_id >= state.final_stage_id or nxt in state.stage_requests:
            return
        if self.config.delivery((stage_id, nxt)) != "forward" or payload is None:
            return
        self._submit_stage(state, nxt, payload)

    def _align(self, state: RequestState, final_audio: torch.Tensor | None) -> list[WordTimestamp]:
        """Word timestamps from the final stage's *finished* output (the aligner's full hand-off,
        spec §4.4). Only a CUMULATIVE output carries the whole waveform there (#7544)."""
        assert self.aligner is not None  # checked at submission
        aligner_input = code2wav2aligner(final_audio, state.text, sample_rate=SAMPLE_RATE)
        if aligner_input is None:
            return []
        return self.meter.timed(self.aligner.align, aligner_input.wav, aligner_input.words, SAMPLE_RATE)

    def _publish(self, state: RequestState, stage_id: int, kind: OutputType, data: Any, finished: bool) -> None:
        item = EngineOutput(state.request_id, stage_id, kind, data, finished)
        if finished and stage_id == state.final_stage_id:
            state.pending_final.append(item)  # held until every submitted stage finished
        else:
            state.stream.put(item)

    # -- ending -----------------------------------------------------------------------------------

    def _fail(self, state: RequestState, reason: str) -> None:
        """Fail the request, once. If one of its stages is dead, that death is the cause, whichever
        stage failed it first (the chunks it waited for stopped coming, or came half-written)."""
        if state.error is None and not state.closed:
            dead = [self.stages[s].spec.name for s in state.stage_requests if not self.stages[s].health()["alive"]]
            if dead and not state.outlived_a_stage:
                state.outlived_a_stage = True
                reason = f"stage {dead[0]} died ({reason})"
            log.warning("request %s failed: %s", state.request_id, reason)
            current_kernel().note("orch.fail", req=state.request_id, reason=reason)
            state.error = Unavailable(reason) if state.outlived_a_stage else reason
            self._abort_stages(state)

    def _abort_stages(self, state: RequestState) -> None:
        for sid, request in state.stage_requests.items():
            if sid not in state.finished_stages:
                self.stages[sid].abort(request.request_id)

    async def abort(self, request_id: str) -> None:
        """The client is gone: every stage drops the request, and the client's stream ends with
        an abort terminal. Returns at once (no waiting, no connector I/O on the caller's task)."""
        k = current_kernel()
        await k.point("orch.abort.begin", req=request_id)
        state = self.requests.get(request_id)
        if state is not None and not state.closed:
            self._abort_stages(state)
            # No stage produced an abort output yet: synthesize the client's terminal now.
            self._close(state, self._terminal(state, ABORTED))
        await k.point("orch.abort.end", req=request_id)

    def _terminal(self, state: RequestState, error: str) -> EngineOutput:
        """An error terminal, built for the request's *final* stage and that stage's output type,
        so the client accepts it (#7006: a stage-0 text terminal is dropped by an audio client)."""
        stage = self.stages[state.final_stage_id].spec
        kind = stage.final_output or OutputType.TEXT
        return EngineOutput(
            state.request_id, state.final_stage_id, kind, None, finished=True, request_finished=True, error=error
        )

    def _maybe_complete(self, state: RequestState) -> None:
        if not set(state.stage_requests) <= state.finished_stages:
            return
        if not state.closed:
            if state.error is not None:
                self._close(state, self._terminal(state, state.error))
            else:
                *held, last = state.pending_final  # the final stage always ends with an output
                for item in held:
                    state.stream.put(item)
                self._close(state, dataclasses.replace(last, request_finished=True, text_finish=state.text_finish))
                state.answered = True
        self._to_release.append(state)
        self._release_needed.notify()

    def _close(self, state: RequestState, terminal: EngineOutput) -> None:
        state.closed = True
        state.pending_final.clear()
        state.stream.put(terminal)

    async def _release_loop(self) -> None:
        """Start each request's release sweep as it ends — each on a task of its own, so a
        reused id waits for its own sweep only, never behind other requests' — and, once shutting
        down, stop the stages when every request is released or the grace period is over."""
        k = current_kernel()
        grace_ends: float | None = None
        async with k.task_group() as sweeps:
            while True:
                self._check_failures()
                while self._to_release:
                    state = self._to_release.popleft()
                    sweeps.start_soon(lambda state=state: self._release(state), name=f"orch.release.{state.request_id}")
                if self._stopping:
                    grace_ends = k.now() + SHUTDOWN_GRACE_S if grace_ends is None else grace_ends
                    if not self.requests or k.now() >= grace_ends:
                        if self.requests:
                            log.warning("shutdown: %d request(s) not released in time", len(self.requests))
                        self._stop_stages()
                        return
                await self._release_needed.wait(
                    IDLE_WAIT_S, ready=lambda: bool(self._to_release) or (self._stopping and not self.requests)
                )

    async def _release(self, state: RequestState) -> None:
        """The request-level sweep (spec §2.11), then the id is free for reuse."""
        reclaimed = 0
        for stage in self.stages.values():
            reclaimed += await stage.release(state.request_id)
        if reclaimed and state.answered:
            # Its final output came after every stage finished it, so its chunks were all read:
            # one sent to a stage that never asks for it (#7245's orphans) is a bug of ours.
            log.warning("request %s was answered, yet %d of its chunks were never read", state.request_id, reclaimed)
        current_kernel().note("orch.released", req=state.request_id, answered=state.answered, reclaimed=reclaimed)
        self._forget(state)

    def _forget(self, state: RequestState) -> None:
        """Free the request's id for reuse."""
        # A give-up of this generation may have been recorded after the request ended, before its
        # sweep ran (same save FIFO): read it now, while the stage request ids still name this
        # generation and not a reuse of the id.
        self._check_failures()
        for sid, request in state.stage_requests.items():
            self._by_stage_request.pop((sid, request.request_id), None)
        if self.requests.get(state.request_id) is state:
            del self.requests[state.request_id]
        self._released.notify()
        if self._stopping and not self.requests:
            self._release_needed.notify()  # the release loop stops the stages once all are released

    def _check_failures(self) -> None:
        """A stage that gave up sending a chunk (#4855 R1.2), or received one that was corrupt,
        names the stage request: fail its request."""
        for sid, stage in self.stages.items():
            for request_id, reason in stage.collect_failures():
                state = self._by_stage_request.get((sid, request_id))
                if state is None:
                    log.warning("failure of unknown request %s: %s", request_id, reason)
                    current_kernel().note("orch.failure_unclaimed", stage=sid, req=request_id, reason=reason)
                    continue
                self._fail(state, f"stage {stage.spec.name} {reason}")

    # -- introspection ----------------------------------------------------------------------------

    async def residue_now(self) -> dict[str, list[str]]:
        """:meth:`residue`, with every stage asked for what it holds now."""
        for stage in self.stages.values():
            await stage.residue_now()
        return self.residue()

    def residue(self) -> dict[str, list[str]]:
        """Everything the engine still holds: its own tables, then each stage's, by name."""
        held = {"requests": list(self.requests), "by_stage_request": [f"{s}:{r}" for s, r in self._by_stage_request]}
        for stage in self.stages.values():
            held.update({f"{stage.spec.name}.{name}": items for name, items in stage.residue().items()})
        return {name: items for name, items in held.items() if items}
