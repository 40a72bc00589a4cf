"""``omnisim pipeline run``: one request through the real pipeline, and what it left behind."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import time
import uuid
import wave
from typing import TYPE_CHECKING, Any

from omnisim.base import CommandFailed, UsageError, writable_file
from runtime.connectors.stores import StoreError

if TYPE_CHECKING:
    from runtime.config.pipeline import PipelineConfig
    from runtime.connectors.stores import Store

log = logging.getLogger(__name__)

#: A text longer than this gets a progress bar (on a terminal): it takes more than a few seconds.
PROGRESS_FROM_CHARS = 200


def write_wav(path: str, audio: Any, sample_rate: int) -> None:
    import torch

    pcm = (audio.clamp(-1, 1) * 32767).round().to(torch.int16).numpy().tobytes()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with wave.open(path, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(sample_rate)
        w.writeframes(pcm)


def _modalities(text: str) -> tuple[str, ...]:
    modalities = {m.strip() for m in text.split(",") if m.strip()}
    if not modalities or not modalities <= {"text", "audio"}:
        raise UsageError(f"--modalities takes text and/or audio, got {text!r}")
    return tuple(sorted(modalities))


def reclaim_dead_namespaces() -> None:
    """What an engine does at start-up: sweep what dead omnisim processes left in /dev/shm."""
    import trio

    from runtime.connectors.namespaces import ProcTable, ShmDirectory, sweep

    report = trio.run(lambda: sweep(ShmDirectory(time.time), ProcTable()))
    if report.removed:
        log.warning("start-up sweep: removed %d name(s) dead processes left in /dev/shm", len(report.removed))


def check_arguments(args: argparse.Namespace) -> tuple[str, ...]:
    """Everything that can be wrong with the command line, found before a model is built."""
    from runtime.serving import RequestRejected, check_input_text

    try:
        check_input_text(args.text)
    except RequestRejected as e:
        raise UsageError(f"--text: {e}") from None
    if args.processes and args.store != "posix":
        raise UsageError("--processes needs --store posix: stage processes share /dev/shm")
    modalities = _modalities(args.modalities)
    if args.word_timestamps and "audio" not in modalities:
        raise UsageError("--word-timestamps needs the audio modality")
    if "audio" in modalities:
        writable_file(args.out)
    return modalities


class _StageProgress:
    """A bar over the Thinker's tokens for a long text, with the audio produced so far."""

    def __init__(self, text: str, live: bool) -> None:
        self._bar = None
        if live and len(text) >= PROGRESS_FROM_CHARS:
            from tqdm import tqdm

            from runtime.models.thinker import answer_token_ids

            self._bar = tqdm(total=len(answer_token_ids(text)), unit="tok", desc="thinker", file=sys.stderr)
        self._audio_s = 0.0

    def update(self, kind: str, data: Any, sample_rate: int) -> None:
        if self._bar is None or data is None:
            return
        if kind == "text":
            self._bar.update(max(1, (len(data.encode()) + 1) // 2))
        elif kind == "audio":
            self._audio_s += data.numel() / sample_rate
            self._bar.set_postfix({"audio": f"{self._audio_s:.1f}s"}, refresh=False)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def pipeline_config(args: argparse.Namespace) -> PipelineConfig:
    """The config of ``--pipeline`` with ``--async-chunk`` and ``--transport`` applied, checked
    for the shape this runtime runs."""
    import torch

    from runtime.config.pipeline import ConfigError, load_pipeline
    from runtime.stages import check_shape

    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device here")
    try:
        config = load_pipeline(args.pipeline)
        check_shape(config)
    except (ConfigError, ValueError) as e:
        raise UsageError(str(e)) from None
    if args.async_chunk is not None:
        async_chunk = args.async_chunk == "on"
        config = dataclasses.replace(config, deploy=dataclasses.replace(config.deploy, async_chunk=async_chunk))
    if args.transport is not None:
        config = config.with_transport(args.transport)
    return config


def engine_parts(args: argparse.Namespace) -> tuple[PipelineConfig, Store]:
    """What an engine of the command line is built from: :func:`pipeline_config`, and a fresh
    store of ``--store`` (after the start-up sweep of what dead processes left in /dev/shm)."""
    from omnisim.world import make_store
    from runtime.connectors.stores import SPARE_MIN_BYTES

    config = pipeline_config(args)
    if config.deploy.processes and args.store != "posix":
        raise UsageError(f"{config.source} runs its stages as processes (processes: true): that needs --store posix")
    if args.store == "posix":
        reclaim_dead_namespaces()
    try:
        return config, make_store(args.store, spare_min_bytes=SPARE_MIN_BYTES)
    except StoreError as e:
        raise CommandFailed(f"cannot use /dev/shm: {e}") from None


def run_pipeline(args: argparse.Namespace) -> dict[str, Any]:
    modalities = check_arguments(args)
    import trio

    from runtime.models.code2wav import SAMPLE_RATE
    from runtime.pipeline import Models, build_engine, run_request

    config, store = engine_parts(args)
    request_id = f"req-{uuid.uuid4().hex[:8]}"
    progress = _StageProgress(args.text, live=not args.json and sys.stderr.isatty())
    try:
        engine = build_engine(config, Models.build(args.device), store, processes=args.processes or None)
        result = trio.run(
            lambda: run_request(
                engine,
                store,
                args.text,
                modalities=modalities,
                word_timestamps=args.word_timestamps,
                request_id=request_id,
                max_tokens=args.max_tokens,
                stop=args.stop,
                on_output=lambda kind, data: progress.update(kind, data, SAMPLE_RATE),
            )
        )
    finally:
        progress.close()
        leftovers = store.sweep()
    if result.error is not None:
        raise CommandFailed(f"request {request_id} failed: {result.error}")
    if "text" in modalities:
        print(result.text)
    if result.text_finish is not None and result.text_finish.reason == "length":
        print(f"(cut short at --max-tokens {args.max_tokens})")
    where = "as processes" if args.processes or config.deploy.processes else "in process"
    print(f"stages ready in {result.startup_s:.2f} s ({where})")
    payload: dict[str, Any] = {
        "text": result.text,
        "request_id": request_id,
        "audio_s": result.audio.numel() / SAMPLE_RATE,
        "samples": result.audio.numel(),
        "time_to_first_audio_s": result.time_to_first_audio_s,
        "total_s": result.total_s,
        "model_s": result.model_s,
        "startup_s": result.startup_s,
        "finish_reason": result.text_finish.reason if result.text_finish else None,
        **config.settings(),
        "residue": result.residue,
        "swept": leftovers,
    }
    if "audio" in modalities:
        write_wav(args.out, result.audio, SAMPLE_RATE)
        payload["wav"] = args.out
        ttfa = result.time_to_first_audio_s
        print(f"audio: {payload['audio_s']:.2f} s at {SAMPLE_RATE} Hz -> {args.out}")
        print(
            f"time to first audio {ttfa * 1000:.1f} ms; total {result.total_s * 1000:.1f} ms; "
            f"model compute {result.model_s * 1000:.1f} ms"
            if ttfa is not None
            else "no audio"
        )
    if args.word_timestamps:
        payload["timestamps"] = [list(t) for t in result.timestamps]
        for t in result.timestamps:
            print(f"  {t.word:<20} {t.start_ms:>8.0f} – {t.end_ms:>8.0f} ms")
    print(
        "residue: none (no segment, lock file or per-request state left)"
        if not result.residue
        else f"residue: {result.residue}"
    )
    return payload
