"""``omnisim pipeline run``: one request through the real pipeline, and what it left behind."""

from __future__ import annotations

import argparse
import dataclasses
import uuid
import wave
from typing import Any

import torch
import trio

from omnisim.world import UsageError, make_store
from runtime.config.pipeline import load_pipeline
from runtime.models.code2wav import SAMPLE_RATE
from runtime.pipeline import Models, build_engine, run_request


def write_wav(path: str, audio: torch.Tensor) -> None:
    pcm = (audio.clamp(-1, 1) * 32767).round().to(torch.int16).numpy().tobytes()
    with wave.open(path, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(SAMPLE_RATE)
        w.writeframes(pcm)


def run_pipeline(args: argparse.Namespace) -> dict[str, Any]:
    modalities = {m.strip() for m in args.modalities.split(",") if m.strip()}
    if not modalities <= {"text", "audio"} or not modalities:
        raise UsageError(f"--modalities takes text and/or audio, got {args.modalities!r}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device here")
    config = load_pipeline("qwen3_omni")
    if args.async_chunk == "off":
        config = dataclasses.replace(config, deploy=dataclasses.replace(config.deploy, async_chunk=False))
    store = make_store(args.store)
    engine = build_engine(config, Models.build(args.device), store)
    request_id = f"req-{uuid.uuid4().hex[:8]}"
    try:
        result = trio.run(
            lambda: run_request(
                engine,
                store,
                args.text,
                modalities=tuple(sorted(modalities)),
                word_timestamps=args.word_timestamps,
                request_id=request_id,
            )
        )
    finally:
        leftovers = store.sweep()
    if result.error is not None:
        raise RuntimeError(f"request {request_id} failed: {result.error}")
    if "text" in modalities:
        print(result.text)
    payload: dict[str, Any] = {
        "text": result.text,
        "request_id": request_id,
        "audio_s": result.audio.numel() / SAMPLE_RATE,
        "samples": result.audio.numel(),
        "time_to_first_audio_s": result.time_to_first_audio_s,
        "total_s": result.total_s,
        "model_s": result.model_s,
        "async_chunk": args.async_chunk,
        "residue": result.residue,
        "swept": leftovers,
    }
    if "audio" in modalities:
        write_wav(args.out, result.audio)
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
