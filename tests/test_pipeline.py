"""One request through the real pipeline on the real kernel: the streamed audio is the offline
decode of the Talker's frames, the aligner covers it, nothing is left behind."""

from __future__ import annotations

import wave
from pathlib import Path

import pytest
import torch
import trio

from omnisim.cli import main
from runtime.config.pipeline import load_pipeline
from runtime.connectors.posix_store import PosixStore
from runtime.connectors.stores import MemoryStore, Store
from runtime.models.code2wav import SAMPLE_RATE, TAIL, TOTAL_UPSAMPLE, frames_to_codes
from runtime.models.talker import conditioning_from_thinker, is_placeholder_frame, is_stop_frame
from runtime.pipeline import FULL_PAYLOAD, Models, OnePipeline

MODELS = Models.build()


@pytest.mark.parametrize("store_kind", ["memory", "posix"])
@pytest.mark.parametrize("async_chunk", [True, False])
def test_streamed_audio_equals_the_offline_decode(store_kind: str, async_chunk: bool) -> None:
    text = "hello world, this is a streamed answer"
    store: Store = MemoryStore() if store_kind == "memory" else PosixStore()
    chunking = load_pipeline("qwen3_omni").chunking if async_chunk else FULL_PAYLOAD
    try:
        result = trio.run(lambda: OnePipeline(MODELS, store, chunking).generate(text, "R", word_timestamps=True))
    finally:
        store.sweep()
    frames = [
        f
        for f in MODELS.talker.generate(conditioning_from_thinker(MODELS.thinker.generate(text)))
        if not is_placeholder_frame(f) and not is_stop_frame(f)
    ]
    offline = MODELS.code2wav(frames_to_codes(torch.stack(frames))).reshape(-1)
    assert result.audio.numel() == len(frames) * TOTAL_UPSAMPLE - TAIL == offline.numel()
    assert torch.allclose(result.audio, offline, atol=1e-5)
    assert result.residue == {}
    assert result.timestamps[0].start_ms == 0
    assert result.timestamps[-1].end_ms == pytest.approx(result.audio.numel() / SAMPLE_RATE * 1000, abs=1)


def test_cli_writes_a_playable_wav(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out.wav"
    assert main(["pipeline", "run", "--text", "hello world", "--out", str(out), "--word-timestamps"]) == 0
    printed = capsys.readouterr().out
    assert "residue: none" in printed and "hello" in printed
    with wave.open(str(out)) as w:
        assert w.getframerate() == SAMPLE_RATE and w.getnchannels() == 1 and w.getnframes() > 0
