"""One request through Thinker → Talker → Code2Wav (→ forced aligner) in one process.

The Talker → Code2Wav edge is the real one: the Talker's codec frames go through
``talker2code2wav_async_chunk`` and a :class:`ShmConnector` on a store (real /dev/shm in
production), and Code2Wav's :class:`GenerationScheduler` decodes each chunk as it arrives, so
audio streams while the Talker still speaks. Thinker → Talker is a full-payload hand-off in
process, and the aligner gets the complete waveform (its ``async_chunk: false`` contract).

Everything runs as kernel tasks, so the same code runs on the real kernel or under the simulator.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from runtime.config.deploy import CodecChunking
from runtime.connectors.shm import ShmConnector
from runtime.connectors.stores import Store
from runtime.connectors.wakeup import LocalWakeups
from runtime.kernel import current_kernel
from runtime.models.aligner import ForcedAligner, WordTimestamp, segment_words
from runtime.models.code2wav import SAMPLE_RATE, Code2Wav, decode_chunks
from runtime.models.talker import Talker, conditioning_from_thinker
from runtime.models.thinker import Thinker, ThinkerOutput
from runtime.processors.talker2code2wav import Talker2Code2WavAsyncChunk
from runtime.request import Request, RequestStatus
from runtime.sched.generation import GenerationScheduler, ScheduledChunk, StageOutput
from runtime.transfer.adapter import ChunkTransferAdapter

T = TypeVar("T")

TALKER_STAGE = 1
CODE2WAV_STAGE = 2
#: async_chunk off: one payload with every frame, sent when the Talker finishes.
FULL_PAYLOAD = CodecChunking(initial_codec_chunk_frames=0, codec_chunk_frames=1 << 30, codec_left_context_frames=0)


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
class PipelineResult:
    text: str
    audio: torch.Tensor
    timestamps: list[WordTimestamp]
    time_to_first_audio_s: float | None
    total_s: float
    model_s: float
    residue: dict[str, list[str]] = field(default_factory=dict)


class OnePipeline:
    """The stages of one pipeline process over a store."""

    def __init__(self, models: Models, store: Store, chunking: CodecChunking) -> None:
        wakeups = LocalWakeups()
        self.models = models
        self.store = store
        self.talker_adapter = ChunkTransferAdapter(
            ShmConnector(store, stage_id=TALKER_STAGE, wakeups=wakeups),
            processor=Talker2Code2WavAsyncChunk(chunking),
            receives_chunks=False,
            name="talker",
        )
        self.code2wav_adapter = ChunkTransferAdapter(
            ShmConnector(store, stage_id=CODE2WAV_STAGE, wakeups=wakeups), sends_chunks=False, name="code2wav"
        )
        self.model_s = 0.0

    def _timed(self, fn: Callable[..., T], *args: Any) -> T:
        """Run model compute, adding its time to :attr:`model_s`."""
        k = current_kernel()
        start = k.now()
        try:
            return fn(*args)
        finally:
            self.model_s += k.now() - start

    async def generate(self, text: str, request_id: str, *, word_timestamps: bool = False) -> PipelineResult:
        k = current_kernel()
        start = k.now()
        thinker_out = self._timed(self.models.thinker.generate, text)
        audio: list[torch.Tensor] = []
        first_audio: list[float] = []

        async with k.task_group() as tasks:
            tasks.start_soon(self.talker_adapter.run, name="talker.adapter")
            tasks.start_soon(self.code2wav_adapter.run, name="code2wav.adapter")
            async with k.task_group() as stages:
                stages.start_soon(lambda: self._talk(thinker_out, request_id), name="talker")
                stages.start_soon(lambda: self._decode(request_id, audio, first_audio, start), name="code2wav")
            await self.talker_adapter.release_shm_resources(request_id)
            residue = {
                "segments": self.store.segments(),
                "lock_files": self.store.lock_files(),
                **{f"talker.{n}": v for n, v in self.talker_adapter.residue().items()},
                **{f"code2wav.{n}": v for n, v in self.code2wav_adapter.residue().items()},
            }
            self.talker_adapter.shutdown()
            self.code2wav_adapter.shutdown()
        wav = torch.cat(audio) if audio else torch.empty(0)
        timestamps = (
            self._timed(self.models.aligner.align, wav, segment_words(thinker_out.text), SAMPLE_RATE)
            if word_timestamps
            else []
        )
        total = k.now() - start
        return PipelineResult(
            text=thinker_out.text,
            audio=wav,
            timestamps=timestamps,
            time_to_first_audio_s=first_audio[0] if first_audio else None,
            total_s=total,
            model_s=self.model_s,
            residue={name: items for name, items in residue.items() if items},
        )

    async def _talk(self, thinker_out: ThinkerOutput, request_id: str) -> None:
        """The Talker's AR loop: one frame per step, each handed to the adapter (never blocking on I/O)."""
        k = current_kernel()
        request = Request(f"{request_id}-talker", request_id, status=RequestStatus.RUNNING)
        state = self._timed(self.models.talker.init_state, conditioning_from_thinker(thinker_out))
        finished = False
        while not finished:
            frame, state, finished = self._timed(self.models.talker.step, state)
            request.num_computed_tokens += 1
            if finished:
                request.status = RequestStatus.FINISHED_STOPPED
            await self.talker_adapter.save_async({"codes": {"audio": frame}}, request)
            await k.sleep(0)  # let the other stages run between steps

    async def _decode(self, request_id: str, audio: list[torch.Tensor], first_audio: list[float], start: float) -> None:
        k = current_kernel()

        def run_model(chunks: list[ScheduledChunk]) -> list[torch.Tensor]:
            pairs = [(c.prompt_token_ids, c.left_context_size) for c in chunks]
            return self._timed(decode_chunks, self.models.code2wav, pairs)

        scheduler = GenerationScheduler(self.code2wav_adapter, run_model)
        scheduler.add_request(Request(f"{request_id}-code2wav", request_id))

        def deliver(out: StageOutput) -> None:
            if out.error is not None:
                raise RuntimeError(f"Code2Wav failed: {out.error}")
            if out.data is not None and out.data.numel():
                if not first_audio:
                    first_audio.append(k.now() - start)
                audio.append(out.data.reshape(-1).cpu())

        await scheduler.serve(deliver)
