"""talker2code2wav_async_chunk against the worked schedule and finish cases of spec §4.1."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from runtime.config.deploy import CodecChunking
from runtime.processors.talker2code2wav import STOP_TOKEN, Talker2Code2WavAsyncChunk, is_valid_frame
from runtime.request import Request
from runtime.transfer.generations import GenerationContext, SenderTables

OMNI = CodecChunking(initial_codec_chunk_frames=4, codec_chunk_frames=25, codec_left_context_frames=25)


def frame(i: int) -> torch.Tensor:
    """Valid frame i: codebook q holds 16*i + q + 1 (never all-zero, never the stop token)."""
    return (torch.arange(16) + 16 * i + 1).reshape(1, 16) % 2048


def run(n_frames: int, *, finish_on_last: bool = True, stop_frame: bool = False) -> list[dict[str, Any]]:
    proc = Talker2Code2WavAsyncChunk(OMNI)
    tables = SenderTables()  # put_req_chunk advances below as if every put succeeded
    context = GenerationContext(tables, "R")
    req = Request("r", "R")
    sent = []
    steps = [frame(i) for i in range(n_frames)] + ([torch.full((1, 16), STOP_TOKEN)] if stop_frame else [])
    for i, f in enumerate(steps):
        last = i == len(steps) - 1
        payload = proc(context, {"codes": {"audio": f}}, req, is_finished=finish_on_last and last)
        if payload is not None:
            sent.append(payload)
            tables.put_req_chunk["R"] = tables.put_req_chunk.get("R", 0) + 1
    return sent


def frames_of(payload: dict[str, Any]) -> int:
    return payload["codes"]["audio"].numel() // 16


def test_worked_schedule_of_the_spec() -> None:
    sent = run(4 + 25 * 3, finish_on_last=False)
    assert [(frames_of(p), p["meta"]["left_context_size"]) for p in sent] == [(4, 0), (29, 4), (50, 25), (50, 25)]


@pytest.mark.parametrize(
    ("n", "last_chunk"),
    [(3, (3, 0)), (10, (10, 4)), (60, (31, 25)), (54, (50, 25))],
    ids=["before_chunk0", "k1_remainder", "k2_remainder", "at_boundary"],
)
def test_finish_flushes_the_remainder(n: int, last_chunk: tuple[int, int]) -> None:
    sent = run(n)
    assert (frames_of(sent[-1]), sent[-1]["meta"]["left_context_size"]) == last_chunk
    assert bool(sent[-1]["meta"]["finished"])
    new_frames = sum(frames_of(p) - p["meta"]["left_context_size"] for p in sent)
    assert new_frames == n


def test_finish_without_a_new_frame_at_a_boundary_sends_nothing() -> None:
    sent = run(29, stop_frame=True)  # the stop frame arrives on the finish call
    assert [frames_of(p) for p in sent] == [4, 29]  # the adapter then sends an empty terminal


def test_wire_layout_is_codebook_major() -> None:
    (chunk0, *_) = run(4, finish_on_last=False)
    codes = chunk0["codes"]["audio"].reshape(16, 4)
    assert torch.equal(codes[:, 2], frame(2).reshape(16))


def test_prefill_placeholders_and_post_stop_frames_are_not_frames() -> None:
    stops = frozenset({STOP_TOKEN})
    assert not is_valid_frame(torch.zeros(1, 16, dtype=torch.int64), stops)
    assert not is_valid_frame(torch.full((1, 16), STOP_TOKEN), stops)
    assert not is_valid_frame(torch.empty(0, 16), stops)
    assert is_valid_frame(frame(0), stops)
