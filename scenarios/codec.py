"""The Talker → Code2Wav edge with the real codec processor (``talker2code2wav_async_chunk``):
frames stepped out one at a time, chunked 4 / 25 / 25, and checked frame by frame downstream."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Awaitable, Callable, Mapping

import torch

from omnisim.registry import Param, scenario
from omnisim.world import World
from runtime import serving
from runtime.config.deploy import CodecChunking
from runtime.kernel import current_kernel
from runtime.models.aligner import ForcedAligner
from runtime.models.code2wav import SAMPLE_RATE, Code2Wav, decode_chunks, frames_to_codes
from runtime.processors.talker2code2wav import STOP_TOKEN, Talker2Code2WavAsyncChunk
from runtime.request import RequestStatus
from runtime.sched.generation import INPUT_WAIT_TIMEOUT_S, GenerationScheduler, ScheduledChunk, StageOutput
from runtime.serving import (
    EmittedSamplesTrim,
    RequestRejected,
    SamplingParams,
    StageAudio,
)
from scenarios.edge import (
    CODE2WAV,
    TALKER,
    EdgeRequest,
    failure_watch,
    finish_everywhere,
    next_chunk,
    release,
    together,
    watch_code2wav,
)

#: The Qwen3-Omni deploy's chunking (spec §9).
OMNI_CHUNKING = CodecChunking(initial_codec_chunk_frames=4, codec_chunk_frames=25, codec_left_context_frames=25)
PREFILL_STEPS = 2


def codec_world(store_kind: str, chunking: CodecChunking = OMNI_CHUNKING) -> World:
    world = World(store_kind)
    world.add_stage(TALKER, processor=Talker2Code2WavAsyncChunk(chunking), receives=False)
    world.add_stage(CODE2WAV, sends=False)
    watch_code2wav(world)
    return world


def codec_frame(request_index: int, i: int) -> torch.Tensor:
    """Frame i of a request: distinct per request and frame, never all-zero, never a stop frame."""
    return (torch.arange(16) + 16 * i + 1 + 997 * request_index).reshape(1, 16) % 2048


async def talk(
    req: EdgeRequest,
    n_frames: int,
    request_index: int,
    *,
    frame_interval_s: float = 0.0,
    finish: bool = True,
    stop_frame: bool = True,
) -> None:
    """The Talker's steps: all-zero prefill placeholders, ``n_frames`` frames, then the stop frame
    on the finishing step (so the finish call itself brings no new frame; without ``stop_frame``
    the last frame's step finishes, as a length cap ends a request). A step takes
    ``frame_interval_s``; without ``finish`` the Talker dies after its frames (no terminal)."""
    k = current_kernel()
    steps = [torch.zeros(1, 16, dtype=torch.int64)] * PREFILL_STEPS
    steps += [codec_frame(request_index, i) for i in range(n_frames)]
    if finish and stop_frame:
        steps.append(torch.full((1, 16), STOP_TOKEN, dtype=torch.int64))
    for i, step in enumerate(steps):
        if frame_interval_s:
            await k.sleep(frame_interval_s)
        if req.stream.outcome != "open":
            return
        if finish and i == len(steps) - 1:
            req.sender.status = RequestStatus.FINISHED_STOPPED
        req.sender.num_computed_tokens += 1
        if PREFILL_STEPS <= i < PREFILL_STEPS + n_frames:
            req.stream.sent_frames.append(tuple(step.reshape(-1).tolist()))
        await req.talker.adapter.save_async({"codes": {"audio": step}}, req.sender)
    req.stream.frames_sent = n_frames


async def listen(req: EdgeRequest, chunking: CodecChunking = OMNI_CHUNKING) -> None:
    """Code2Wav's side: each chunk is codebook-major ``[16, n]`` with ``left_context_size`` frames
    of context in front (checked against the frames before it); only the frames after it are new."""
    adapter = req.code2wav.adapter
    request = req.receiver
    while await next_chunk(req):
        ids = request.prompt_token_ids
        n = len(ids) // 16
        left = int(((request.additional_information or {}).get("meta") or {}).get("left_context_size", 0)) if n else 0
        codes = torch.tensor(ids, dtype=torch.int64).reshape(16, n) if n else torch.empty(16, 0, dtype=torch.int64)
        frames = [tuple(codes[:, j].tolist()) for j in range(n)]
        if n:
            check_left_context(req.world, request.request_id, frames, left, req.stream.received_frames, chunking)
        new = frames[left:]
        req.stream.received_frames.extend(new)
        finished = adapter.is_done_receiving_chunks(request.request_id)
        req.stream.chunks.append((len(new), finished))
        if finished:
            req.stream.outcome = "finished"
    await adapter.finish_requests([request])


#: Frame counts that hit every branch of the chunker: inside the initial chunk, a remainder after
#: chunk 1, exactly on a boundary (the finish brings no frame: empty terminal), the same boundary
#: reached by the finish call itself (a length cap: its last frame comes with the finish, and no
#: stop frame follows), and a long one.
LENGTHS = {"short": 3, "remainder": 10, "boundary": 29, "capped": 29, "long": 60}
#: The requests of :data:`LENGTHS` that end on their last frame, not on a stop frame.
ENDS_ON_A_FRAME = frozenset({"capped"})


@scenario(
    "codec_chunk_boundaries",
    summary="requests of 3, 10, 29 (ended by a stop frame, and by a length cap on the 29th) and 60 codec frames "
    "through the real 4/25/25 chunker: every frame arrives once, in order, codebook-major, and the terminal "
    "flushes the remainder",
    issue="#5413, codebook-major layout",
    build=codec_world,
    budget_share=0.25,
)
async def codec_chunk_boundaries(world: World) -> None:
    await chunk_requests(world, LENGTHS, ENDS_ON_A_FRAME, OMNI_CHUNKING)


async def chunk_requests(
    world: World, lengths: Mapping[str, int], ends_on_a_frame: frozenset[str], chunking: CodecChunking
) -> None:
    """Talk and listen to one request of each of ``lengths`` at once (those in
    ``ends_on_a_frame`` without a stop frame), check each one's chunks against spec §4.1's plan,
    and release them."""
    reqs = {name: EdgeRequest(world, name) for name in lengths}
    jobs = []
    for index, (name, req) in enumerate(reqs.items()):
        speak = functools.partial(talk, req, lengths[name], index, stop_frame=name not in ends_on_a_frame)
        jobs.append((f"{name}.talk", speak))
        jobs.append((f"{name}.listen", lambda req=req: listen(req, chunking)))
    await together(*jobs)
    for name, req in reqs.items():
        check_chunk_plan(req, lengths[name], chunking, last_frame_finishes=name in ends_on_a_frame)
        await release(req)


def chunk_plan(n_frames: int, chunking: CodecChunking, *, last_frame_finishes: bool) -> list[int]:
    """The new frames of each chunk spec §4.1 cuts from a request of ``n_frames`` valid frames:
    the initial chunk (if any), each full chunk, then the terminal with the remainder — or, when
    the last boundary came before the finishing call, an empty terminal (0); when the finishing
    call brought the boundary's frame itself, that chunk is the terminal."""
    first = chunking.initial_codec_chunk_frames or chunking.codec_chunk_frames
    sizes, sent, boundary = [], 0, first
    while boundary <= n_frames:
        sizes.append(boundary - sent)
        sent, boundary = boundary, boundary + chunking.codec_chunk_frames
    if n_frames > sent:
        sizes.append(n_frames - sent)
    elif not (last_frame_finishes and sizes):
        sizes.append(0)
    return sizes


def check_chunk_plan(req: EdgeRequest, n_frames: int, chunking: CodecChunking, *, last_frame_finishes: bool) -> None:
    """A finished request's chunks came as :func:`chunk_plan` cuts them, only the last one final."""
    if req.stream.outcome != "finished":
        return
    got = [new for new, _ in req.stream.chunks]
    want = chunk_plan(n_frames, chunking, last_frame_finishes=last_frame_finishes)
    finals = [i for i, (_, finished) in enumerate(req.stream.chunks) if finished]
    req.world.probe(
        "merged-as-spec",
        got == want and finals == [len(got) - 1],
        f"{req.ext}'s {n_frames} frames came in chunks of {got} new frames (final: chunk {finals}); "
        f"spec §4.1 cuts {want} with {chunking.initial_codec_chunk_frames}/{chunking.codec_chunk_frames} chunking",
    )


#: A deploy's initial chunk besides Qwen3-Omni's 4: none (the processor's default) and one frame.
INITIAL_CHUNK = Param("initial", ("0", "1"), "initial_codec_chunk_frames of the deploy (chunks of 25, context 25)")
#: Frame counts around each boundary of both chunkings: one and two frames, one chunk, one chunk
#: and one frame, two chunks and one frame, and a request whose finishing call brings a boundary's
#: frame (a length cap) for each.
CHUNKING_LENGTHS = {"one": 1, "two": 2, "chunk": 25, "chunk_and_one": 26, "long": 51, "capped_0": 25, "capped_1": 26}
#: The requests of :data:`CHUNKING_LENGTHS` that end on their last frame (a boundary of one chunking).
CAPPED = frozenset({"capped_0", "capped_1"})


def chunking_of(params: Mapping[str, str]) -> CodecChunking:
    return dataclasses.replace(OMNI_CHUNKING, initial_codec_chunk_frames=int(params["initial"]))


@scenario(
    "codec_chunkings",
    summary="the real chunker with the chunkings a deploy file may give besides 4/25/25 (no initial chunk, a "
    "one-frame one): requests of 1, 2, 25, 26 and 51 frames and two ended by a length cap on a boundary: each "
    "chunk carries the new frames and left context spec §4.1 cuts, every frame arrives once, in order",
    issue="spec §4.1 (initial_codec_chunk_frames); omnisim issue 11 (a blind spot of the mutation score of "
    "runtime/processors: only 4/25/25 was ever cut)",
    build=lambda store_kind, params: codec_world(store_kind, chunking_of(params)),
    budget_share=0.25,
    params=(INITIAL_CHUNK,),
)
async def codec_chunkings(world: World) -> None:
    await chunk_requests(world, CHUNKING_LENGTHS, CAPPED, chunking_of(world.params))


@functools.cache
def code2wav_model() -> Code2Wav:
    """One decoder per process: built from a fixed seed, so every run sees the same weights."""
    return Code2Wav()


def code2wav_scheduler(
    world: World,
    reqs: list[EdgeRequest],
    *,
    input_wait_timeout_s: float = INPUT_WAIT_TIMEOUT_S,
    name: str = "code2wav.scheduler",
) -> GenerationScheduler:
    """Code2Wav's generation scheduler, decoding with the real model; it records, per chunk, the
    frames it was asked to emit (for the frame-level invariant)."""
    model = code2wav_model()
    by_id = {req.receiver.request_id: req for req in reqs}

    def run_model(chunks: list[ScheduledChunk]) -> list[torch.Tensor]:
        for chunk in chunks:
            n = len(chunk.prompt_token_ids) // 16
            codes = torch.tensor(chunk.prompt_token_ids, dtype=torch.int64).reshape(16, n)
            stream = by_id[chunk.request.request_id].stream
            frames = [tuple(codes[:, j].tolist()) for j in range(n)]
            check_left_context(world, chunk.request.request_id, frames, chunk.left_context_size, stream.received_frames)
            stream.received_frames.extend(frames[chunk.left_context_size :])
        return decode_chunks(model, [(c.prompt_token_ids, c.left_context_size) for c in chunks])

    scheduler = GenerationScheduler(world.stages[CODE2WAV].adapter, run_model, input_wait_timeout_s)
    for req in reqs:
        req.scheduler = scheduler
    world.components[name] = scheduler
    return scheduler


def check_left_context(
    world: World,
    request_id: str,
    frames: list[tuple],
    left: int,
    before: list[tuple],
    chunking: CodecChunking = OMNI_CHUNKING,
) -> None:
    """A chunk carries as left context the frames just before its new ones: as many as spec §4.1
    step 6 gives, which with a left context of at most a chunk (4/25/25 here) is every frame
    before it, up to ``codec_left_context_frames`` (a context one frame short decodes audio
    that differs only where the model reaches that far back)."""
    want = min(len(before), chunking.codec_left_context_frames)
    world.probe(
        "merged-as-spec",
        left == want and frames[:left] == before[len(before) - left :],
        f"{request_id}'s chunk after {len(before)} frames carries {left} frames of left context"
        f"{'' if frames[:left] == before[len(before) - left :] else ' that are not the frames before it'}, "
        f"not the {want} before it (spec §4.1)",
    )


async def code2wav_stage(
    world: World,
    scheduler: GenerationScheduler,
    reqs: list[EdgeRequest],
    clients: dict[str, SpeechClient] | None = None,
) -> None:
    """Code2Wav as the pipeline runs it: its generation scheduler decodes each chunk as it is
    committed and streams the audio to the client (through the serving layer, if ``clients``
    are given), until every request ended; then each client's audio is checked against the
    offline decode of its frames."""
    model = code2wav_model()
    by_id = {req.receiver.request_id: req for req in reqs}
    audio: dict[str, list[torch.Tensor]] = {rid: [] for rid in by_id}
    for req in reqs:
        scheduler.add_request(req.receiver)

    def deliver(out: StageOutput) -> None:
        req = by_id[out.request_id]
        if out.data is not None:
            if clients is not None:
                clients[out.request_id].on_chunk(out.data)
            else:
                audio[out.request_id].append(out.data.reshape(-1))
        req.stream.chunks.append((0, out.finished))
        if out.finished and req.stream.outcome == "open":
            req.stream.outcome = "finished" if out.error is None else "failed"

    await scheduler.serve(deliver)
    for rid, req in by_id.items():
        if req.stream.outcome != "finished":
            continue
        got = clients[rid].received if clients is not None else audio[rid]
        streamed = torch.cat([a.reshape(-1) for a in got]) if got else torch.empty(0)
        frames = torch.tensor(req.stream.sent_frames, dtype=torch.int64)  # [N, 16]
        offline = model(frames_to_codes(frames)).reshape(-1)
        world.probe(
            "samples-exactly-once",
            streamed.numel() == offline.numel() and bool(torch.allclose(streamed, offline, atol=1e-5)),
            f"{rid}: the client got {streamed.numel()} samples; the offline decode of its "
            f"{len(frames)} frames has {offline.numel()} (N·1920 − 555)"
            + ("" if streamed.numel() != offline.numel() else ", with different values"),
        )


def note_timestamps(req: str, end_ms: float | None, audio_ms: float) -> None:
    """What a client's word timestamps cover, for ``aligner-complete``: where the last word ends
    (None: no timestamps came), and how long the audio it got lasts."""
    current_kernel().note("client.timestamps", req=req, end_ms=end_ms, audio_ms=audio_ms)


def audio_requests(world: World, lengths: dict[str, int]) -> list[EdgeRequest]:
    """Requests whose audio is checked by content (frames and samples, against the offline
    decode); the frame-count check belongs to codec_chunk_boundaries."""
    reqs = [EdgeRequest(world, name) for name in lengths]
    for req in reqs:
        req.stream.complete_required = False
    return reqs


def talk_jobs(reqs: list[EdgeRequest], lengths: dict[str, int]) -> list[tuple[str, Callable[[], Awaitable[None]]]]:
    """One Talker job per request, each speaking its number of frames."""
    return [(f"{r.name}.talk", lambda r=r, i=i: talk(r, lengths[r.name], i)) for i, r in enumerate(reqs)]


@scenario(
    "code2wav_stream",
    summary="the real Code2Wav generation scheduler decodes 4/25/25 chunks as they arrive: each client's streamed "
    "audio equals the offline decode of all its frames (N·1920 − 555 samples, within 1e-5)",
    issue="#4706, #5413, #3613",
    build=codec_world,
    horizon_s=60.0,
    budget_share=0.25,
)
async def code2wav_stream(world: World) -> None:
    lengths = {"short": 3, "remainder": 10, "long": 60, "gone": 30}
    reqs = audio_requests(world, lengths)
    gone = reqs[-1]
    gone.stream.allowed_outcomes = frozenset({"finished", "aborted"})
    scheduler = code2wav_scheduler(world, reqs)

    async def abort_gone() -> None:
        # The client disconnects at some point: both stages drop the request, Code2Wav possibly
        # while it is parked waiting for a chunk.
        await current_kernel().point("orch.abort.begin", req=gone.ext)
        if gone.stream.outcome == "open":
            gone.stream.outcome = "aborted"
            await finish_everywhere(gone)
        await current_kernel().point("orch.abort.end", req=gone.ext)

    await together(
        *talk_jobs(reqs, lengths),
        ("code2wav", lambda: code2wav_stage(world, scheduler, reqs)),
        ("orch.abort", abort_gone),
        failure_watch(world, reqs),
    )
    for req in reqs:
        await release(req)


class SpeechClient:
    """One streaming speech request at the serving layer: what the client and the aligner get."""

    def __init__(self, req: EdgeRequest, params: list[SamplingParams], word_timestamps: bool) -> None:
        self.req = req
        self.word_timestamps = word_timestamps
        self.stage_audio = StageAudio(params[-1].output_kind)
        self.trim = EmittedSamplesTrim() if word_timestamps else None
        self.received: list[torch.Tensor] = []
        self.final_output: torch.Tensor | None = None

    def on_chunk(self, delta: torch.Tensor) -> None:
        output = self.stage_audio.update(delta)
        self.final_output = output
        sent = self.trim(output) if self.trim is not None else output
        if sent is not None:
            self.received.append(sent)


@scenario(
    "streaming_word_timestamps",
    summary="a streaming request with word timestamps (CUMULATIVE outputs, emitted_samples trim, the aligner gets "
    "the whole waveform) next to a plain streaming one (DELTA): each client gets every sample once",
    issue="#7544",
    build=codec_world,
    horizon_s=60.0,
    budget_share=0.25,
)
async def streaming_word_timestamps(world: World) -> None:
    defaults = [SamplingParams() for _ in range(3)]
    serving.check_http_speech_request(stream=False, word_timestamps=True, has_aligner=True)
    try:
        serving.check_http_speech_request(stream=True, word_timestamps=True, has_aligner=True)
        accepted = True
    except RequestRejected:
        accepted = False
    current_kernel().note("serving.timestamps_over_http", accepted=accepted)
    lengths = {"timed": 33, "plain": 29}
    reqs = audio_requests(world, lengths)
    clients = {}
    for req in reqs:  # submitted in order: the first one's settings must not leak into the second
        timed = req.name == "timed"
        clients[req.receiver.request_id] = SpeechClient(
            req, serving.request_params(defaults, stream=True, word_timestamps=timed), timed
        )
    scheduler = code2wav_scheduler(world, reqs)
    await together(
        *talk_jobs(reqs, lengths),
        ("code2wav", lambda: code2wav_stage(world, scheduler, reqs, clients)),
        failure_watch(world, reqs),
    )
    aligner = ForcedAligner()
    for client in clients.values():
        if client.req.stream.outcome != "finished" or not client.word_timestamps:
            continue
        audio_ms = torch.cat(client.received).numel() / SAMPLE_RATE * 1000
        aligner_input = client.final_output if client.final_output is not None else torch.empty(0)
        stamps = aligner.align(aligner_input, ["hello", "streamed", "world"], SAMPLE_RATE)
        note_timestamps(client.req.name, stamps[-1].end_ms, audio_ms)
    for req in reqs:
        await release(req)
