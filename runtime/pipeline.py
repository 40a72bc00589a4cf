"""An engine — a config's stages over one store, driven by an :class:`Orchestrator` — and one
request through it, measured: what ``omnisim pipeline run`` does.

Everything runs as kernel tasks, so the same code runs on the real kernel (real /dev/shm, wall
clock) or under the simulator.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from runtime.client import generate
from runtime.config.pipeline import PipelineConfig
from runtime.config.topology import OutputType
from runtime.connectors.ring import unread_frames
from runtime.connectors.stores import Store
from runtime.kernel import current_kernel
from runtime.models.aligner import WordTimestamp
from runtime.orchestrator import Orchestrator
from runtime.process_stage import ProcessStage, StageLaunch
from runtime.sched.base import INPUT_WAIT_TIMEOUT_S
from runtime.stages import ComputeMeter, Models, StageHandle, StageTransport, TextFinish, build_stages, check_shape

__all__ = ["Models", "PipelineResult", "build_engine", "run_request"]


def build_engine(
    config: PipelineConfig,
    models: Models,
    store: Store,
    *,
    input_wait_timeout_s: float = INPUT_WAIT_TIMEOUT_S,
    processes: bool | None = None,
) -> Orchestrator:
    """The engine of ``config``: its stages in this process over ``store`` (whose models are
    ``models``), or — with ``processes`` (default: the deploy file's ``processes``) — each stage
    in an OS process of its own that builds its own model, on the device of the corresponding
    model in ``models`` (``store``'s namespace is then the one the stages' cross-process wakeups
    live in)."""
    meter = ComputeMeter()
    if not (config.deploy.processes if processes is None else processes):
        stages = build_stages(config, models, store, input_wait_timeout_s=input_wait_timeout_s)
        return Orchestrator(config, stages, aligner=models.aligner, meter=meter)
    check_shape(config)
    handles: dict[int, StageHandle] = {}
    engine = Orchestrator(config, handles, aligner=models.aligner, meter=meter)
    launch = StageLaunch(
        pipeline=config.raw,
        source=config.source,
        async_chunk=config.deploy.async_chunk,
        wake_namespace=store.namespace,
        input_wait_timeout_s=input_wait_timeout_s,
        restart=config.deploy.restart,
    )
    upstream: ProcessStage | None = None
    for spec in config.stages:
        device = str(getattr(models, spec.model).device)
        stage_launch = replace(launch, device=device, transport=StageTransport.of(config, spec.stage_id))
        upstream = ProcessStage(spec, stage_launch, upstream=upstream, on_death=engine.stage_died)
        handles[spec.stage_id] = upstream
    return engine


@dataclass
class PipelineResult:
    text: str
    audio: torch.Tensor
    timestamps: list[WordTimestamp]
    time_to_first_audio_s: float | None
    total_s: float
    model_s: float
    #: From starting the engine until every stage was ready (models loaded; processes spawned).
    startup_s: float = 0.0
    error: str | None = None
    residue: dict[str, list[str]] = field(default_factory=dict)
    #: How the text ended (``"length"``: cut short by ``max_tokens``), and its token counts.
    text_finish: TextFinish | None = None


async def run_request(
    engine: Orchestrator,
    store: Store,
    text: str,
    *,
    modalities: tuple[str, ...] = ("text", "audio"),
    word_timestamps: bool = False,
    request_id: str | None = None,
    on_output: Callable[[str, Any], None] | None = None,
    max_tokens: int | None = None,
    stop: list[str] | None = None,
) -> PipelineResult:
    """Start ``engine`` (whose stages use ``store``), stream one request through it, wait for its
    release sweep, report what is left anywhere (store and every table), and stop the engine.
    ``on_output(kind, data)`` sees every output as it arrives (a progress display)."""
    k = current_kernel()
    pieces: list[str] = []
    audio: list[torch.Tensor] = []
    stamps: list[WordTimestamp] = []
    first_audio: float | None = None
    error: str | None = None
    finish: TextFinish | None = None
    async with k.task_group() as tasks:
        launched = k.now()
        tasks.start_soon(engine.run, name="engine")
        await engine.wait_ready()
        start = k.now()
        answer = generate(
            engine,
            text,
            modalities,
            word_timestamps=word_timestamps,
            request_id=request_id,
            max_tokens=max_tokens,
            stop=stop,
        )
        async for out in answer:
            if on_output is not None:
                on_output(out.kind.value, out.data)
            if out.kind is OutputType.TEXT and out.data is not None:
                pieces.append(out.data)
            elif out.kind is OutputType.AUDIO and out.data is not None:
                first_audio = k.now() - start if first_audio is None else first_audio
                audio.append(out.data.reshape(-1).cpu())
            elif out.kind is OutputType.TIMESTAMPS and out.data is not None:
                stamps = out.data
            if out.finished:
                error, finish = out.error, out.text_finish
        total = k.now() - start
        await engine.drain()  # the release sweep runs after the terminal
        residue = {
            **await engine.residue_now(),
            "segments": store.segments(),
            "lock_files": store.lock_files(),
            "ring_frames": unread_frames(store),
        }
        engine.shutdown()
    return PipelineResult(
        text="".join(pieces),
        audio=torch.cat(audio) if audio else torch.empty(0),
        timestamps=stamps,
        time_to_first_audio_s=first_audio,
        total_s=total,
        model_s=engine.model_seconds(),
        startup_s=start - launched,
        error=error,
        residue={name: items for name, items in residue.items() if items},
        text_finish=finish,
    )
