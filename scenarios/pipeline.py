"""The whole pipeline under the simulator: the same orchestrator, schedulers, adapters and torch
models as ``omnisim pipeline run``, with clients on the public ``generate`` API.

Each client checks what it got against the offline answer of its text — every stage run whole,
one after the other: the text must be the Thinker's answer and the audio the offline decode of
all the Talker's frames (N·1920 − 555 samples, within 1e-5), each delivered once; the stream must
end with exactly one terminal; word timestamps must cover the whole audio.
"""

from __future__ import annotations

import dataclasses
import functools
import random
from collections.abc import Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

import torch

from invariants.observed import Stream, TraceEvent
from omnisim.faults import Fault, FaultPlan
from omnisim.registry import DEFAULT_INVARIANTS, Param, Params, ScenarioBody, scenario
from omnisim.sim_kernel import current_task_name, current_trace
from omnisim.stage_processes import build_process_engine
from omnisim.world import World
from runtime.client import ClientOutput, generate
from runtime.config.pipeline import PipelineConfig, load_pipeline
from runtime.config.topology import OutputType
from runtime.connectors.base import Connector
from runtime.kernel import current_kernel
from runtime.models.code2wav import SAMPLE_RATE, frames_to_codes
from runtime.models.talker import conditioning_from_thinker, is_placeholder_frame, is_stop_frame
from runtime.models.thinker import EOS_ID, answer_token_ids, prompt_token_ids
from runtime.orchestrator import ABORTED, Orchestrator
from runtime.pipeline import Models, build_engine
from runtime.sched.base import StageOutput
from runtime.stages import OnOutput, TextFinish
from scenarios.codec import note_timestamps
from scenarios.edge import together
from scenarios.merge import on_each_get

#: Texts by the frame count they give (see ``frames_for_text``): inside the initial chunk of 4,
#: one chunk plus a remainder (#5413), and exactly on the 4 + 25 boundary (an empty terminal).
SHORT = "ok go"
REMAINDER = "hello there world, and more"
BOUNDARY = "the quick brown fox jumped over the lazy dog and ran away"


@functools.cache
def models() -> Models:
    """One set of models per process: built from fixed seeds, so every run sees the same weights."""
    return Models.build()


@functools.cache
def offline_answer(text: str, max_tokens: int | None = None, stop: tuple[str, ...] = ()) -> tuple[str, torch.Tensor]:
    """The text and audio of ``text`` with every stage run whole, one after the other."""
    m = models()
    thought = m.thinker.generate(text, max_tokens, stop)
    frames = [
        f
        for f in m.talker.generate(conditioning_from_thinker(thought))
        if not is_placeholder_frame(f) and not is_stop_frame(f)
    ]
    audio = m.code2wav(frames_to_codes(torch.stack(frames))).reshape(-1) if frames else torch.empty(0)
    return thought.text, audio


#: What each (unspecialised) client of a pipeline scenario asks for.
MODALITIES = Param("modalities", ("text+audio", "audio", "text"), "what the clients ask for")
#: The same for scenarios whose clients need audio (word timestamps, a failing Talker-bound chunk).
AUDIO_MODALITIES = Param("modalities", ("text+audio", "audio"), "what the clients ask for (audio always)")
#: How stages hand each other their outputs: chunk by chunk, or whole once a stage finished.
ASYNC_CHUNK = Param("async_chunk", ("on", "off"), "the deploy's async_chunk: chunked hand-off or whole payloads")
#: Where the stages run: in the engine's process, or each in a simulated process of its own.
PROCESSES = Param("processes", ("no", "yes"), "the stages in the engine's process, or each in a process of its own")
#: When the engine stops: after every request ended, or at a drawn moment while they run.
SHUTDOWN = Param("shutdown", ("idle", "in_flight"), "the engine shuts down once idle, or while requests run")
PIPELINE_PARAMS = (MODALITIES, ASYNC_CHUNK, SHUTDOWN)
#: The stage the Thinker's chunks go to.
TALKER_STAGE = 1
#: What chunk 0 carries besides the prefill rows (spec §4.2): the Thinker's TTS special embeddings.
TTS_EMBEDS = frozenset({"tts_bos", "tts_eos", "tts_pad"})
#: The stage that decodes audio: an audio answer's final stage.
CODE2WAV_STAGE = 2
#: The most scheduling points an in-flight shutdown waits (a run makes a few thousand).
SHUTDOWN_WITHIN_POINTS = 1500


@functools.cache
def shipped_config() -> PipelineConfig:
    """The shipped pipeline, read once per process: it is frozen, and parsing its YAML again
    took a tenth of every run."""
    return load_pipeline("qwen3_omni")


def with_every_stage(config: PipelineConfig, **settings: object) -> PipelineConfig:
    """``config`` with ``settings`` (fields of :class:`~runtime.config.deploy.StageDeploy`) on
    every stage, as a deploy file sets them stage by stage."""
    stages = tuple(dataclasses.replace(s, **settings) for s in config.deploy.stages)  # type: ignore[arg-type]
    return dataclasses.replace(config, deploy=dataclasses.replace(config.deploy, stages=stages))


def pipeline_world(
    store_kind: str, params: Params, stage_models: Models | None = None, config: PipelineConfig | None = None
) -> World:
    """The engine of ``config`` (default: the shipped pipeline) on the world's store, with the
    process's models unless ``stage_models`` are given; with ``processes=yes``, each stage a
    simulated process of its own, the control plane between it and the engine."""
    config = config or shipped_config()
    if params.get("async_chunk") == "off":
        config = dataclasses.replace(config, deploy=dataclasses.replace(config.deploy, async_chunk=False))
    if params.get("processes") == "yes":
        world = World(store_kind, processes=True)
        engine = build_process_engine(world, config, stage_models or models())
    else:
        world = World(store_kind)
        engine = build_engine(config, stage_models or models(), world.store)
        if config.deploy.async_chunk:
            watch_talker_input(world, engine.stages[TALKER_STAGE].adapter.connector)
    watch_handed_out(engine)
    world.components["engine"] = engine
    world.add_service("engine", engine.run, engine.shutdown)
    return world


def watch_talker_input(world: World, connector: Connector) -> None:
    """Check each Thinker payload the Talker's connector hands out: the one that starts a request
    (its ``embed.prefill``) carries the prompt's rows and at least one generated row, unless the
    Thinker finished without one (spec §4.2: the Talker speaks as soon as chunk 0 arrives, so
    chunk 0 waits for a generated position), the TTS special embeddings, and the request's token
    ids so far."""

    def check(key: str, payload: dict[str, Any]) -> None:
        embed = payload.get("embed") or {}
        prefill = embed.get("prefill")
        if not isinstance(prefill, torch.Tensor):
            return
        missing = sorted(TTS_EMBEDS - set(embed))
        world.probe(
            "merged-as-spec", not missing, f"chunk 0 of {key} lacks embed.{', embed.'.join(missing)} (spec §4.2)"
        )
        ids = payload.get("ids") or {}
        prompt = list(ids.get("prompt") or [])
        finished = bool((payload.get("meta") or {}).get("finished"))
        world.probe(
            "merged-as-spec",
            prefill.shape[0] > len(prompt) or finished,
            f"chunk 0 of {key} carries {prefill.shape[0]} rows for a prompt of {len(prompt)}, and the Thinker "
            "has not finished: no generated row (spec §4.2)",
        )
        # ids.all is the request's token ids so far: the prompt, then every token generated,
        # one for each generated row and the one the last row predicted.
        every = list(ids.get("all") or [])
        world.probe(
            "merged-as-spec",
            every[: len(prompt)] == prompt and len(every) >= max(prefill.shape[0], len(prompt) + 1),
            f"chunk 0 of {key} carries ids.all of {len(every)} tokens for {prefill.shape[0]} rows and a prompt of "
            f"{len(prompt)}: not the prompt and the tokens generated so far (spec §4.2)",
        )

    on_each_get(connector, check)


def watch_handed_out(engine: Orchestrator) -> None:
    """Note (``stream.held``) each audio chunk Code2Wav hands out for a client still listening that
    is not on the client's stream once handed out: only the stage's finished output waits for the
    other stages (the final-output hold); a held chunk turns a streamed answer into one buffered
    answer at the end, whatever order the client then reads it in."""
    code2wav = engine.stages[CODE2WAV_STAGE]
    run = code2wav.run

    async def run_watched(on_output: OnOutput) -> None:
        def handed_out(out: StageOutput) -> None:
            state = engine.requests.get(out.request_id.rpartition("#")[0])
            if state is None or state.closed or state.error is not None:
                on_output(out)  # no client listens for it any more
                return
            before = len(state.stream)
            on_output(out)
            if out.data is not None and not out.finished and len(state.stream) == before:
                current_kernel().note("stream.held", req=out.request_id)

        await run(handed_out)

    code2wav.run = run_watched  # type: ignore[method-assign]


def pipeline_scenario(
    name: str,
    *,
    params: tuple[Param, ...] = PIPELINE_PARAMS,
    build: Callable[[str, Params], World] = pipeline_world,
    **kwargs: Any,
) -> Callable[[ScenarioBody], ScenarioBody]:
    """Register a scenario on the whole pipeline. A run is long (every model step is simulated),
    so it gets half a command's schedule budget and a 60 s horizon. With ``shutdown=in_flight``
    the engine is shut down at a point drawn from the seed while the body's clients run."""

    def register(body: ScenarioBody) -> ScenarioBody:
        async def run(world: World) -> None:
            if world.params.get("shutdown") != "in_flight":
                await body(world)
                await engine_of(world).drain()  # as a user who lets the engine settle before stopping it
                return
            clients_done = [False]

            async def clients() -> None:
                await body(world)
                clients_done[0] = True

            await together(("clients", clients), ("orch.shutdown", lambda: shutdown_in_flight(world, clients_done)))

        # An engine that aborts stops the work: a client gone, a request failed or aborted.
        kwargs["invariants"] = (*kwargs.get("invariants", DEFAULT_INVARIANTS), "abort-stops-work")
        scenario(name, build=build, horizon_s=60.0, budget_share=0.5, params=params, **kwargs)(run)
        return body

    return register


async def shutdown_in_flight(world: World, clients_done: list[bool]) -> None:
    """Shut the engine down after a number of scheduling points drawn from the run's seed (the
    strategy decides what the other tasks do meanwhile), unless every client ended before."""
    k = current_kernel()
    for _ in range(random.Random(world.seed).randrange(SHUTDOWN_WITHIN_POINTS)):
        if clients_done[0]:
            return
        await k.point("scenario.shutdown.wait")
    engine = engine_of(world)
    in_flight = {rid for rid, state in engine.requests.items() if not state.closed}
    engine.shutdown()
    # A shutdown ends every request in flight at once, with its error terminal: none may finish
    # (its stages are only stopped after a grace period, time enough to finish it).
    for rid in in_flight:
        listening = [s for s in world.streams.values() if s.external_req_id == rid and s.outcome == "open"]
        if len(listening) == 1:  # (two: an ended generation's client has not read its terminal yet)
            # (a client that leaves after a few outputs may still read them before the terminal)
            listening[0].allowed_outcomes = frozenset({"shut down"}) | (listening[0].allowed_outcomes & {"left"})


def client_modalities(world: World) -> tuple[str, ...]:
    return tuple(world.params.get("modalities", "text+audio").split("+"))


def engine_of(world: World) -> Orchestrator:
    engine: Orchestrator = world.components["engine"]
    return engine


@dataclass
class Client:
    """One ``generate`` call and what it received."""

    world: World
    name: str
    text: str
    request_id: str
    #: Default: the scenario's ``modalities`` parameter.
    modalities: tuple[str, ...] | None = None
    word_timestamps: bool = False
    sample_rate: int = SAMPLE_RATE
    #: The most tokens the answer may have (vLLM's ``max_tokens``).
    max_tokens: int | None = None
    #: The strings the answer ends before (vLLM's ``stop``).
    stop: tuple[str, ...] = ()
    #: Stop listening after this many outputs (a disconnect: ``generate`` is closed early).
    leave_after: int | None = None
    #: False: the whole answer at once, one output per kind (a non-streamed chat or speech request).
    streamed: bool = True
    #: Let go of the stream at its terminal, as a client that stops at ``finished`` does, instead
    #: of reading it to its end: the engine must not take that for a client gone.
    breaks_at_terminal: bool = False
    outputs: list[ClientOutput] = field(default_factory=list)
    stream: Stream = field(init=False)

    def __post_init__(self) -> None:
        self.world.clients.append(self.name)
        #: Left out of this run (a shrunk find's smaller world): it submits nothing, and its
        #: stream is nobody's to check.
        self.left_out = self.name in self.world.left_out
        self.stream = (
            Stream(self.name, self.request_id) if self.left_out else self.world.stream(self.name, self.request_id)
        )
        self.stream.complete_required = False  # checked by content below, not by frame counts
        if self.modalities is None:
            self.modalities = client_modalities(self.world)
        self.outcomes = self.stream.allowed_outcomes

    @property
    def outcomes(self) -> frozenset[str]:
        return self.stream.allowed_outcomes

    @outcomes.setter
    def outcomes(self, allowed: frozenset[str]) -> None:
        """What this client may end with; an engine shut down in flight may end anyone."""
        shut_down = {"shut down"} if self.world.params.get("shutdown") == "in_flight" else set()
        self.stream.allowed_outcomes = frozenset(allowed) | shut_down

    async def run(self) -> None:
        if self.left_out:
            return
        submitted = len(current_trace())
        try:
            await self._listen()
        finally:
            self.stream.accepted_at = self._accepted_since(submitted)

    def _accepted_since(self, index: int) -> int | None:
        """Where the engine accepted this client's request (its ``orch.accepted`` note, on this
        task, from ``index`` on): where its generation of the id starts."""
        accepted = [e for e in self._mine_since(index, "orch.accepted") if e.attrs["req"] == self.request_id]
        return accepted[0].index if accepted else None

    @staticmethod
    def _mine_since(index: int, name: str) -> list[TraceEvent]:
        """The trace events ``name`` from ``index`` on that this client's own task made."""
        me = current_task_name()
        return [e for e in current_trace()[index:] if e.name == name and e.task == me]

    async def _listen(self) -> None:
        answer = generate(
            engine_of(self.world),
            self.text,
            self.modalities,
            word_timestamps=self.word_timestamps,
            request_id=self.request_id,
            sample_rate=self.sample_rate,
            stream=self.streamed,
            max_tokens=self.max_tokens,
            stop=list(self.stop) or None,
        )
        terminal_at: int | None = None  # (where it got its terminal, if it let go there)
        async with aclosing(answer):
            async for out in answer:
                self.outputs.append(out)
                self.stream.chunks.append((0, out.finished))
                if out.finished:
                    self.stream.terminals += 1
                    self.stream.ended_us = round(current_kernel().now() * 1e6)
                    self.stream.error = out.error
                    self.stream.outcome = self.outcome_of(out.error)
                    if self.breaks_at_terminal:
                        terminal_at = len(current_trace())
                        break
                elif len(self.outputs) == self.leave_after:
                    self.stream.outcome = "left"
                    # What abort-stops-work holds the engine to: a client gone is an abort.
                    current_kernel().note("client.left", req=self.request_id)
                    return
        if terminal_at is not None:
            aborted = [e.index for e in self._mine_since(terminal_at, "orch.abort.begin")]
            self.world.probe(
                "terminal-delivered",
                not aborted,
                f"{self.name} let go of its stream at the terminal, and the engine was told to abort its request "
                f"(event {aborted[0] if aborted else ''}): a reuse of the id would have been aborted",
            )
        self.check()

    def outcome_of(self, error: str | None) -> str:
        """How a request ended, by its terminal's error (the engine's shutdown names its reason)."""
        if error is None or error == ABORTED:
            return "finished" if error is None else "aborted"
        return "shut down" if error == engine_of(self.world).shutdown_error else "failed"

    def check(self) -> None:
        probe = self.world.probe
        if not any(out.finished for out in self.outputs):
            probe("terminal-delivered", False, f"{self.name}: generate() ended without a terminal output")
            self.stream.outcome = "no terminal"
            return
        # A client routes a terminal by its kind (#7006): an audio request's ends its audio, or,
        # answered in full with word timestamps, those (they cover the whole audio: they come last).
        kind = self.outputs[-1].kind
        want_kind = OutputType.AUDIO if "audio" in (self.modalities or ()) else OutputType.TEXT
        if self.word_timestamps and self.stream.outcome == "finished":
            want_kind = OutputType.TIMESTAMPS
        probe(
            "terminal-delivered",
            kind is want_kind,
            f"{self.name}: the terminal of a request for {'+'.join(self.modalities or ())} is a {kind.value} output",
        )
        if self.stream.outcome != "finished":
            return
        if not self.streamed:
            kinds = [o.kind.value for o in self.outputs if not o.finished]
            probe(
                "samples-exactly-once",
                len(kinds) == len(set(kinds)),
                f"{self.name}: a whole answer came as {', '.join(kinds)}, not one output per kind",
            )
        said = answer_token_ids(self.text, self.max_tokens, self.stop)
        want = TextFinish("stop" if said[-1] == EOS_ID else "length", len(prompt_token_ids(self.text)), len(said))
        finish = self.outputs[-1].text_finish
        probe(
            "terminal-delivered",
            finish == want,
            f"{self.name}: the terminal says the answer ended {finish}; want {want}",
        )
        want_text, want_audio = offline_answer(self.text, self.max_tokens, self.stop)
        if "text" in self.modalities:
            text = "".join(o.data for o in self.outputs if o.kind is OutputType.TEXT and o.data is not None)
            probe("samples-exactly-once", text == want_text, f"{self.name}: got text {text!r}, want {want_text!r}")
        if "audio" in self.modalities:
            empty = [
                i
                for i, o in enumerate(self.outputs)
                if o.kind is OutputType.AUDIO and o.data is not None and not o.data.numel()
            ]
            probe(
                "samples-exactly-once",
                not empty,
                f"{self.name}: empty audio outputs at {empty} (a spurious WAV header and first-audio mark)",
            )
            audio = self.audio()
            if self.sample_rate == SAMPLE_RATE:
                same = audio.numel() == want_audio.numel() and bool(torch.allclose(audio, want_audio, atol=1e-5))
                expected = f"{want_audio.numel()}"
            else:
                # Chunks are resampled one by one: each may round its length by one sample.
                want = want_audio.numel() * self.sample_rate / SAMPLE_RATE
                same = abs(audio.numel() - want) <= len(self.outputs)
                expected = f"{want:.0f} at {self.sample_rate} Hz"
            probe(
                "samples-exactly-once",
                same,
                f"{self.name}: the client got {audio.numel()} samples; the offline decode has {expected}"
                + ("" if audio.numel() != want_audio.numel() else ", with different values"),
            )
        if self.word_timestamps:
            stamps = [o.data for o in self.outputs if o.kind is OutputType.TIMESTAMPS and o.data is not None]
            audio_ms = want_audio.numel() / SAMPLE_RATE * 1000
            note_timestamps(self.name, stamps[-1][-1].end_ms if stamps and stamps[-1] else None, audio_ms)

    def audio(self) -> torch.Tensor:
        pieces = [o.data.reshape(-1) for o in self.outputs if o.kind is OutputType.AUDIO and o.data is not None]
        return torch.cat(pieces) if pieces else torch.empty(0)


async def abort_once_submitted(client: Client, *, after_points: int = 0) -> None:
    """The client disconnects once its request is in the engine (or over), after ``after_points``
    scheduling points — each one a decision of the strategy, so it picks where the abort lands."""
    if client.left_out:
        return
    k = current_kernel()
    engine = engine_of(client.world)
    while client.request_id not in engine.requests and client.stream.outcome == "open":
        await k.sleep(0.001)
    for _ in range(after_points):
        await k.point("scenario.client.wait", req=client.request_id)
    await engine.abort(client.request_id)


@pipeline_scenario(
    "pipeline_requests",
    summary="four concurrent requests through Thinker → Talker → Code2Wav: one inside the initial "
    "chunk, one with a remainder, one on the 4+25 boundary (empty terminal), one whose max_tokens of 1 ends the "
    "Thinker at its prefill, one whose stop string begins its answer (EOS alone: no text, no audio); each gets its "
    "exact text and audio, and a terminal that says how its answer ended",
    issue="#5413, #5383, spec §1.5–1.6, §4.1–4.2",
)
async def pipeline_requests(world: World) -> None:
    clients = [
        Client(world, "short", SHORT, "short"),
        Client(world, "remainder", REMAINDER, "remainder"),
        Client(world, "boundary", BOUNDARY, "boundary"),
        # Its one token comes from the prefill step, which then ends the Thinker: chunk 0 goes
        # out finished, with the prompt's rows and no generated one.
        Client(world, "capped", REMAINDER, "capped", max_tokens=1),
        # Its answer would begin with the stop string: EOS alone, at the prefill, and nothing said.
        Client(world, "stopped", REMAINDER, "stopped", stop=("hello",)),
    ]
    await together(*((c.name, c.run) for c in clients))


@pipeline_scenario(
    "pipeline_word_timestamps",
    params=(AUDIO_MODALITIES, ASYNC_CHUNK, SHUTDOWN),
    summary="streaming requests with word timestamps (one resampled to 16 kHz) next to a plain one: CUMULATIVE "
    "stage outputs trimmed to each sample once before resampling, and the aligner gets the complete waveform",
    issue="#7544",
)
async def pipeline_word_timestamps(world: World) -> None:
    # On the chunk boundary: the last update brings no samples, so the trim has nothing to send.
    timed = Client(world, "timed", BOUNDARY, "timed", word_timestamps=True)
    plain = Client(world, "plain", REMAINDER, "plain")
    # Resampled for the client: the trim counts model samples, so it must come first.
    resampled = Client(world, "timed.16k", REMAINDER, "timed16k", word_timestamps=True, sample_rate=16000)
    await together(*((c.name, c.run) for c in (timed, plain, resampled)))


@pipeline_scenario(
    "pipeline_not_streamed",
    params=(AUDIO_MODALITIES, SHUTDOWN),
    summary="clients that ask for the whole answer at once (a non-streamed chat or speech request): each gets one "
    "output per kind — its exact text, its exact audio, word timestamps over all of it — then its terminal, while "
    "a streamed request runs beside them",
    issue="#7544 (the non-streamed path of the serving layer)",
)
async def pipeline_not_streamed(world: World) -> None:
    whole = Client(world, "whole", REMAINDER, "W", streamed=False)
    timed = Client(world, "whole.timed", BOUNDARY, "T", modalities=("audio",), word_timestamps=True, streamed=False)
    streamed = Client(world, "streamed", SHORT, "S")
    await together(*((c.name, c.run) for c in (whole, timed, streamed)))


@pipeline_scenario(
    "pipeline_abort_before_output",
    summary="a client aborts right after submitting, before any engine output: its stream still ends with exactly "
    "one terminal, built for the final stage (an audio-only client included)",
    issue="#7006",
)
async def pipeline_abort_before_output(world: World) -> None:
    audio_only = Client(world, "audio_only", REMAINDER, "A", modalities=("audio",))
    both = Client(world, "both", SHORT, "B")
    for client in (audio_only, both):
        client.outcomes = frozenset({"aborted", "finished"})

    await together(
        ("A", audio_only.run),
        ("A.abort", lambda: abort_once_submitted(audio_only)),
        ("B", both.run),
        ("B.abort", lambda: abort_once_submitted(both)),
    )


@pipeline_scenario(
    "pipeline_concurrent_chaos",
    summary="concurrent requests while clients abort at random points, one stops listening, and an id is reused "
    "at once: every client gets one terminal, finished ones their exact answer, and nothing is left behind",
    issue="#8082, #6670, #7006, spec §2.11",
    params=(*PIPELINE_PARAMS, PROCESSES),
)
async def pipeline_concurrent_chaos(world: World) -> None:
    steady = Client(world, "steady", REMAINDER, "S", breaks_at_terminal=True)
    flaky = Client(world, "flaky", BOUNDARY, "F")
    reused = Client(world, "reused", SHORT, "R", breaks_at_terminal=True)
    again = Client(world, "reused.again", REMAINDER, "R")
    leaver = Client(world, "leaver", REMAINDER, "L", leave_after=3)
    leaver.outcomes = frozenset({"left", "finished"})
    for client in (flaky, reused):
        client.outcomes = frozenset({"aborted", "finished"})

    async def reuse() -> None:
        await together(("R.first", reused.run), ("R.abort", lambda: abort_once_submitted(reused, after_points=3)))
        await again.run()  # the same id at once: the engine waits out the old generation's sweep

    await together(
        ("S", steady.run),
        ("F", flaky.run),
        ("F.abort", lambda: abort_once_submitted(flaky, after_points=8)),
        ("R", reuse),
        ("L", leaver.run),
    )


@pipeline_scenario(
    "pipeline_send_failure",
    summary="the Thinker's put of one chunk of a request fails: the orchestrator reads the sender's give-up and "
    "fails that request with an error terminal at once (no wait for the input deadline); its neighbour finishes",
    issue="#4855 R1.2",
    # The failing put is a Thinker chunk: it needs chunked hand-off and a request that reaches the Talker.
    params=(AUDIO_MODALITIES, SHUTDOWN),
    faults=lambda seed: FaultPlan([Fault("put_fail", match={"key": "F_0_3"})], seed),
)
async def pipeline_send_failure(world: World) -> None:
    failing = Client(world, "failing", REMAINDER, "F")
    failing.outcomes = frozenset({"failed"})
    healthy = Client(world, "healthy", SHORT, "H")
    await together(("F", failing.run), ("H", healthy.run))


@pipeline_scenario(
    "pipeline_send_failure_reused",
    summary="a request's client goes away while the Thinker's put of its terminal chunk fails, and the id is "
    "reused at once: the give-up is the old generation's, read before its id is free, and never fails the new one",
    issue="#4855 R1.2, spec §2.11",
    params=(AUDIO_MODALITIES, SHUTDOWN, PROCESSES),
    faults=lambda seed: FaultPlan([Fault("put_fail", match={"key": "F_0_2"})], seed),
)
async def pipeline_send_failure_reused(world: World) -> None:
    # It leaves about when its Thinker puts its terminal (chunk 2): before the put, while it is
    # queued, or after it failed. A terminal still goes out once the client left (fenced), so its
    # give-up may be recorded after the request ended, even after its sweep started.
    failing = Client(world, "failing", SHORT, "F", leave_after=2)
    failing.outcomes = frozenset({"left", "failed"})
    await failing.run()
    again = Client(world, "failing.again", SHORT, "F")
    await again.run()  # the same id at once: a fault of the first generation licenses no failure of it
