"""The stages of the Qwen3-Omni pipeline, assembled from a :class:`PipelineConfig`: each one a
connector, a :class:`ChunkTransferAdapter` and a scheduler driving its model.

* **Thinker** (stage 0, AR): text in, one token per step; its rows go to the Talker chunk by
  chunk (``thinker2talker_async_chunk``), or whole when it finishes (``async_chunk`` off).
* **Talker** (stage 1, AR): one codec frame per step; chunk-fed from the Thinker, or fed the
  forwarded full payload; its frames go to Code2Wav through ``talker2code2wav_async_chunk``.
* **Code2Wav** (stage 2, generation): decodes each committed chunk (or the forwarded frames) to
  24 kHz audio.

Every stage boundary is a connector and a scheduler with its own request ids, so a stage can move
into its own process without the others noticing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import torch

from runtime.config.deploy import Transport
from runtime.config.pipeline import PipelineConfig
from runtime.config.topology import Edge, OutputType, StageKind, StageSpec
from runtime.connectors.ring import RingSettings
from runtime.connectors.shm import ShmConnector
from runtime.connectors.stores import Store
from runtime.connectors.wakeup import LocalWakeups
from runtime.kernel import current_kernel
from runtime.models.aligner import ForcedAligner
from runtime.models.code2wav import Code2Wav, chunked_decode, decode_chunks, unflatten_codes
from runtime.models.talker import Talker, TalkerState
from runtime.models.thinker import Thinker, ThinkerState, ThinkerSteps
from runtime.processors.talker2code2wav import (
    STOP_TOKEN,
    Talker2Code2WavAsyncChunk,
    is_valid_frame,
    talker2code2wav_full_payload,
)
from runtime.processors.thinker2talker import talker_input, thinker2talker_async_chunk, thinker2talker_full_payload
from runtime.request import Request
from runtime.sched.ar import ARScheduler, ARStep
from runtime.sched.base import INPUT_WAIT_TIMEOUT_S, StageOutput, StageScheduler
from runtime.sched.generation import GenerationScheduler, ScheduledChunk
from runtime.transfer.adapter import ChunkTransferAdapter, Processor

T = TypeVar("T")


@dataclass
class Models:
    thinker: Thinker
    talker: Talker
    code2wav: Code2Wav
    aligner: ForcedAligner

    @classmethod
    def build(cls, device: str = "cpu") -> Models:
        return cls(Thinker(device=device), Talker(device=device), Code2Wav(device=device), ForcedAligner(device=device))


@dataclass
class ComputeMeter:
    """Adds up the kernel time spent in model compute (for the transport-overhead figure)."""

    total_s: float = 0.0

    def timed(self, fn: Callable[..., T], *args: Any) -> T:
        k = current_kernel()
        start = k.now()
        try:
            return fn(*args)
        finally:
            self.total_s += k.now() - start


@dataclass(frozen=True)
class TextFinish:
    """How a request's answer ended (what vLLM's ``RequestOutput`` tells a server for its
    ``finish_reason`` and ``usage``)."""

    #: ``"stop"``: the Thinker said EOS (at the end of its answer, or before a stop string);
    #: ``"length"``: ``max_tokens`` ran out first.
    reason: str
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class ThinkerDelta:
    """What one Thinker step gives the orchestrator: the new text; on the last step how the
    answer ended, and for a request whose Talker is fed by forwarding, that Talker's complete
    input."""

    text: str
    full_payload: dict[str, Any] | None = None
    finish: TextFinish | None = None


@dataclass(frozen=True)
class TalkerFrame:
    """One Talker frame ``[1, 16]``; on the last step of a forwarding Talker, all valid frames."""

    frame: torch.Tensor
    full_payload: dict[str, Any] | None = None


class ThinkerWorker:
    """The Thinker's model side. ``collect`` keeps every row for a forwarded hand-off."""

    def __init__(self, model: Thinker, meter: ComputeMeter, *, collect: bool) -> None:
        self.model = model
        self.meter = meter
        self.collect = collect
        self.states: dict[str, ThinkerState] = {}
        self.collected: dict[str, ThinkerSteps] = {}
        #: The TTS special embeddings depend on the weights alone: computed once.
        self.tts_embeds = model.tts_embeds()

    def apply(self, request: Request, payload: dict[str, Any], *, finished: bool) -> None:
        state = self.model.init_state(payload["text"], payload.get("max_tokens"), payload.get("stop"))
        self.states[request.request_id] = state
        request.prompt_token_ids = list(state.prompt_token_ids)
        if self.collect:
            self.collected[request.request_id] = ThinkerSteps()

    def ready(self, request: Request) -> bool:
        state = self.states.get(request.request_id)
        return state is not None and not state.finished

    def step(self, request: Request) -> ARStep:
        rid = request.request_id
        state = self.states[rid]
        prefill = state.hidden is None
        out = self.meter.timed(self.model.step, state)
        request.output_token_ids.append(out.token_id)
        multimodal_output: dict[str, Any] = {"hidden_states": {"layers": out.layers}}
        if prefill:
            multimodal_output["embed"] = self.tts_embeds
        full_payload = finish = None
        steps = self.collected.get(rid)
        if steps is not None:
            steps.append(out)
            if out.finished:
                del self.collected[rid]
                full_payload = thinker2talker_full_payload(steps.output(state, self.tts_embeds))
        if state.finish_reason is not None:
            finish = TextFinish(state.finish_reason, len(state.prompt_token_ids), len(state.output_token_ids))
        return ARStep(ThinkerDelta(out.text_delta, full_payload, finish), multimodal_output, out.finished)

    def release(self, request_id: str) -> None:
        self.states.pop(request_id, None)
        self.collected.pop(request_id, None)

    def residue(self) -> dict[str, list[str]]:
        return {name: list(d) for name, d in (("states", self.states), ("collected", self.collected)) if d}


class TalkerWorker:
    """The Talker's model side. ``collect`` keeps every valid frame for a forwarded hand-off."""

    def __init__(self, model: Talker, meter: ComputeMeter, *, collect: bool) -> None:
        self.model = model
        self.meter = meter
        self.collect = collect
        self.states: dict[str, TalkerState] = {}
        self.frames: dict[str, list[torch.Tensor]] = {}

    def apply(self, request: Request, payload: dict[str, Any], *, finished: bool) -> None:
        rid = request.request_id
        given = talker_input(payload, finished=finished)
        state = self.states.get(rid)
        if state is None:
            if given.conditioning is None:
                raise ValueError(f"{rid}: the Talker's first input carries no prefill rows")
            self.states[rid] = self.meter.timed(self.model.init_state, given.conditioning)
            if self.collect:
                self.frames[rid] = []
        else:
            self.model.feed(state, given.rows, finished=finished)

    def ready(self, request: Request) -> bool:
        state = self.states.get(request.request_id)
        return state is not None and self.model.ready(state)

    def step(self, request: Request) -> ARStep:
        rid = request.request_id
        frame, _, stopped = self.meter.timed(self.model.step, self.states[rid])
        full_payload = None
        if rid in self.frames:
            if is_valid_frame(frame, frozenset({STOP_TOKEN})):
                self.frames[rid].append(frame)
            if stopped:
                full_payload = talker2code2wav_full_payload(self.frames.pop(rid))
        return ARStep(TalkerFrame(frame, full_payload), {"codes": {"audio": frame}}, stopped)

    def release(self, request_id: str) -> None:
        self.states.pop(request_id, None)
        self.frames.pop(request_id, None)

    def residue(self) -> dict[str, list[str]]:
        return {name: list(d) for name, d in (("states", self.states), ("frames", self.frames)) if d}


def code2wav_runner(model: Code2Wav, meter: ComputeMeter) -> Callable[[list[ScheduledChunk]], list[torch.Tensor]]:
    """Streamed chunks go through the tail-compensated streaming decode; a forwarded whole input
    through the non-streaming chunked decode (spec §6)."""

    def decode_whole(chunk: ScheduledChunk) -> torch.Tensor:
        codes = unflatten_codes(torch.tensor(chunk.prompt_token_ids), [len(chunk.prompt_token_ids)])
        return chunked_decode(model, codes.to(model.device))[0]

    def run_model(chunks: list[ScheduledChunk]) -> list[torch.Tensor]:
        streamed = [(c.prompt_token_ids, c.left_context_size) for c in chunks if not c.whole]
        batch = iter(meter.timed(decode_chunks, model, streamed) if streamed else [])  # one forward pass
        return [meter.timed(decode_whole, c) if c.whole else next(batch) for c in chunks]

    return run_model


#: Receives a stage's outputs, one by one, as the stage produces them.
OnOutput = Callable[[StageOutput], None]


class StageHandle(Protocol):
    """How the orchestrator reaches a stage — and the only way: submit, abort, release an id's
    resources, run (outputs flow to a callback), failures, residue, health. Two kinds exist: a
    :class:`Stage` runs in the engine's own process; a :class:`~runtime.process_stage.ProcessStage`
    runs the same code in an OS process of its own."""

    spec: StageSpec

    @property
    def compute_s(self) -> float:
        """Seconds of model compute so far."""
        ...

    def submit(self, request: Request, payload: dict[str, Any] | None, *, sends: bool) -> None:
        """Add a request: with its whole input, or (``payload`` None) as a prewarm placeholder
        fed by chunks. ``sends=False``: its outputs stop here (the request's last stage)."""
        ...

    def abort(self, request_id: str) -> None:
        """Drop a request between two steps; returns at once (the stage reports it finished)."""
        ...

    async def release(self, ext: str) -> int:
        """Reclaim the unread chunks this stage sent for external id ``ext`` (spec §2.11)."""
        ...

    def collect_failures(self) -> list[tuple[str, str]]:
        """Requests (stage request id, reason) a send or a receive failed for, since last asked."""
        ...

    async def run(self, on_output: OnOutput) -> None:
        """Run the stage until :meth:`shutdown`, handing every output to ``on_output``."""
        ...

    def shutdown(self) -> None: ...

    def residue(self) -> dict[str, list[str]]: ...

    async def residue_now(self) -> dict[str, list[str]]:
        """The residue as of now (for a stage elsewhere, asked for and awaited)."""
        ...

    def health(self) -> dict[str, Any]:
        """At least ``{"alive": bool}``."""
        ...


@dataclass
class Stage:
    """One stage in the engine's own process: what it is, its adapter, its scheduler."""

    spec: StageSpec
    adapter: ChunkTransferAdapter
    scheduler: StageScheduler
    #: The AR stages' model side (its per-request state counts as residue); None for Code2Wav.
    worker: ThinkerWorker | TalkerWorker | None = None
    #: This stage's model compute (one meter per stage, so each stage's time is its own even
    #: when stages compute at once, in threads or processes of their own).
    meter: ComputeMeter = field(default_factory=ComputeMeter)

    @property
    def stage_id(self) -> int:
        return self.spec.stage_id

    @property
    def compute_s(self) -> float:
        return self.meter.total_s

    def submit(self, request: Request, payload: dict[str, Any] | None, *, sends: bool) -> None:
        if isinstance(self.scheduler, GenerationScheduler):
            codes = None if payload is None else payload["codes"]["audio"].tolist()
            self.scheduler.add_request(request, codes)
        elif isinstance(self.scheduler, ARScheduler):
            self.scheduler.add_request(request, payload, sends=sends)

    def abort(self, request_id: str) -> None:
        self.scheduler.request_abort(request_id)

    async def release(self, ext: str) -> int:
        return await self.adapter.release_shm_resources(ext) if self.adapter.sends_chunks else 0

    def collect_failures(self) -> list[tuple[str, str]]:
        sent = self.adapter.collect_failed_send_request_ids()
        received = self.adapter.collect_failed_receive_request_ids()
        return [(rid, f"gave up sending: {why}") for rid, why in sent.items()] + [
            (rid, f"could not receive: {why}") for rid, why in received.items()
        ]

    async def run(self, on_output: OnOutput) -> None:
        k = current_kernel()
        async with k.task_group() as tasks:
            tasks.start_soon(self.adapter.run, name=f"{self.spec.name}.adapter")
            tasks.start_soon(lambda: self.scheduler.serve(on_output, forever=True), name=f"{self.spec.name}.scheduler")

    def shutdown(self) -> None:
        self.scheduler.shutdown()
        self.adapter.shutdown()

    def residue(self) -> dict[str, list[str]]:
        """Everything the stage still holds, by component and structure."""
        parts = {
            "adapter": self.adapter.residue(),
            "connector": self.adapter.connector.residue(),
            "scheduler": self.scheduler.residue(),
        }
        if self.worker is not None:
            parts["worker"] = self.worker.residue()
        return {f"{part}.{name}": items for part, held in parts.items() for name, items in held.items() if items}

    async def residue_now(self) -> dict[str, list[str]]:
        return self.residue()

    def health(self) -> dict[str, Any]:
        return {"alive": True, **self.adapter.connector.health()}


def processor_for(name: str | None, config: PipelineConfig, spec: StageSpec) -> Processor | None:
    """The chunk processor a config names for ``spec``'s outgoing edge."""
    if name == "thinker2talker_async_chunk":
        return thinker2talker_async_chunk
    if name == "talker2code2wav_async_chunk":
        return Talker2Code2WavAsyncChunk(config.chunking, frozenset(spec.stop_token_ids) or frozenset({STOP_TOKEN}))
    raise ValueError(f"{config.source}: stage {spec.label} names no known chunk processor ({name!r})")


MODELS = ("thinker", "talker", "code2wav")


def build_stage(
    config: PipelineConfig,
    spec: StageSpec,
    model: Thinker | Talker | Code2Wav,
    connector: ShmConnector,
    meter: ComputeMeter,
    *,
    input_wait_timeout_s: float = INPUT_WAIT_TIMEOUT_S,
) -> Stage:
    """Stage ``spec`` of ``config``, running ``model`` and sending/receiving through ``connector``."""
    sid = spec.stage_id
    sends = sid < len(config.stages) - 1 and config.delivery((sid, sid + 1)) == "chunks"
    adapter = ChunkTransferAdapter(
        connector,
        processor=processor_for(config.processors(sid).next_stage, config, spec) if sends else None,
        receives_chunks=config.stage_receives_chunks(sid),
        sends_chunks=sends,
        worker_type="ar" if spec.kind is StageKind.LLM_AR else "generation",
        name=spec.name,
        active_stream_window=config.deploy.stage(sid).active_stream_window,
    )
    max_num_seqs = config.deploy.stage(sid).max_num_seqs
    if isinstance(model, Code2Wav):
        runner = code2wav_runner(model, meter)
        scheduler = GenerationScheduler(adapter, runner, input_wait_timeout_s, max_num_seqs=max_num_seqs)
        return Stage(spec, adapter, scheduler, meter=meter)
    worker = (
        ThinkerWorker(model, meter, collect=not sends)
        if isinstance(model, Thinker)
        else TalkerWorker(model, meter, collect=not sends)
    )
    scheduler = ARScheduler(adapter, worker, input_wait_timeout_s, max_num_seqs=max_num_seqs)
    return Stage(spec, adapter, scheduler, worker, meter)


#: What each stage of the one shape this runtime runs must say: its kind, what it may return to
#: the client, and the chunk processor of its outgoing edge (None: it sends none).
SHAPE = (
    (StageKind.LLM_AR, (OutputType.TEXT, None), "thinker2talker_async_chunk"),
    (StageKind.LLM_AR, (None,), "talker2code2wav_async_chunk"),
    (StageKind.LLM_GENERATION, (OutputType.AUDIO,), None),
)


def check_shape(config: PipelineConfig) -> None:
    """Refuse, at start-up, a config this runtime cannot run as it says: a stage's model, kind,
    final output or chunk processor that differs from the one shape it runs, or Talker stop ids
    that leave out its codec's stop token."""
    if tuple(s.model for s in config.stages) != MODELS:
        raise ValueError(f"{config.source}: this runtime runs a {' -> '.join(MODELS)} pipeline")
    for spec, (kind, outputs, processor) in zip(config.stages, SHAPE, strict=True):
        at = f"{config.source}: pipeline.stages[{spec.stage_id}]"
        if spec.kind is not kind:
            raise ValueError(f"{at}.kind: the {spec.model} stage runs as {kind.value}, got {spec.kind.value}")
        if spec.final_output not in outputs:
            can = " or ".join("none" if o is None else o.value for o in outputs)
            raise ValueError(f"{at}.final_output: the {spec.model} stage returns {can}, got {spec.final_output}")
        if spec.async_chunk_processor not in (processor, None):
            got = spec.async_chunk_processor
            raise ValueError(f"{at}.async_chunk_processor: the {spec.model} stage's is {processor!r}, got {got!r}")
    talker = config.stages[1]
    if talker.stop_token_ids and STOP_TOKEN not in talker.stop_token_ids:
        # The Talker ends a request with this frame whatever the config says; a stop list
        # without it would hand the stop frame to Code2Wav as codes, and fail the request.
        raise ValueError(
            f"{config.source}: pipeline.stages[1].stop_token_ids: the talker's codec stops with "
            f"{STOP_TOKEN}, which {list(talker.stop_token_ids)} leaves out"
        )


@dataclass(frozen=True)
class StageTransport:
    """How one stage's connector hands chunks over, from the deploy file's edge transports: on a
    ring of ``send_ring_bytes`` for the edge it sends on (None: by segments), and whether it looks
    for the chunks it gets on its producer's ring."""

    send_ring_bytes: int | None = None
    receive_ring: bool = False

    @classmethod
    def of(cls, config: PipelineConfig, stage_id: int) -> StageTransport:
        def on_ring(from_stage: int, to_stage: int) -> bool:
            edge = Edge(from_stage, to_stage)
            return edge in config.edges and config.deploy.transport_of(*edge) is Transport.RING

        sends = on_ring(stage_id, stage_id + 1)
        return cls(config.deploy.ring_bytes if sends else None, on_ring(stage_id - 1, stage_id))

    def connector_options(self) -> dict[str, Any]:
        """The :class:`ShmConnector` keyword arguments that say so."""
        ring = RingSettings(capacity=self.send_ring_bytes) if self.send_ring_bytes is not None else None
        return {"send_ring": ring, "receive_ring": self.receive_ring}


def build_stages(
    config: PipelineConfig,
    models: Models,
    store: Store,
    *,
    wakeups: LocalWakeups | None = None,
    input_wait_timeout_s: float = INPUT_WAIT_TIMEOUT_S,
) -> dict[int, Stage]:
    """The three stages of a Qwen3-Omni-shaped ``config`` over ``store``, in this process, each
    with a compute meter of its own."""
    check_shape(config)
    wakeups = wakeups if wakeups is not None else LocalWakeups()
    return {
        spec.stage_id: build_stage(
            config,
            spec,
            getattr(models, spec.model),
            ShmConnector(
                store,
                stage_id=spec.stage_id,
                wakeups=wakeups,
                **StageTransport.of(config, spec.stage_id).connector_options(),
            ),
            ComputeMeter(),
            input_wait_timeout_s=input_wait_timeout_s,
        )
        for spec in config.stages
    }
