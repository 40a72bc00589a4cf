"""The serving rules of spec §7 (#7544), on their own."""

from __future__ import annotations

import pytest
import torch

from runtime.serving import (
    EmittedSamplesTrim,
    OutputKind,
    RequestRejected,
    SamplingParams,
    StageAudio,
    check_http_speech_request,
    request_params,
)


def test_cumulative_updates_reach_the_client_once_and_the_aligner_whole() -> None:
    stage, trim = StageAudio(OutputKind.CUMULATIVE), EmittedSamplesTrim()
    sent = [trim(stage.update(torch.full((n,), float(i)))) for i, n in enumerate((800, 1200, 400))]
    assert [s.numel() for s in sent if s is not None] == [800, 1200, 400]  # not 800 + 2000 + 2400
    final = stage.update(torch.empty(0))
    assert final.numel() == 2400  # 100 ms at 24 kHz: the aligner's whole waveform
    assert trim(final) is None  # nothing new: no empty chunk, no spurious first-audio mark


def test_delta_outputs_carry_only_the_new_samples() -> None:
    stage = StageAudio(OutputKind.DELTA)
    assert stage.update(torch.ones(800)).numel() == 800
    assert stage.update(torch.ones(1200)).numel() == 1200


def test_streaming_timestamps_clone_the_defaults() -> None:
    defaults = [SamplingParams(), SamplingParams()]
    timed = request_params(defaults, stream=True, word_timestamps=True)
    assert all(p.output_kind is OutputKind.CUMULATIVE for p in timed)
    assert all(p.output_kind is OutputKind.DELTA for p in defaults)  # never mutated
    assert all(p.output_kind is OutputKind.DELTA for p in request_params(defaults, stream=True, word_timestamps=False))


def test_http_streaming_with_timestamps_is_rejected_with_guidance() -> None:
    with pytest.raises(RequestRejected, match="/v1/audio/speech/stream"):
        check_http_speech_request(stream=True, word_timestamps=True, has_aligner=True)
    with pytest.raises(RequestRejected, match="--forced-aligner"):
        check_http_speech_request(stream=False, word_timestamps=True, has_aligner=False)
    check_http_speech_request(stream=False, word_timestamps=True, has_aligner=True)
