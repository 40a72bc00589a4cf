"""thinker2talker_async_chunk (spec §4.2) and the Talker's reading of its payloads: the first chunk
waits for a generated row, later chunks carry one decode row, and streamed conditioning drives the
Talker to the same frames as the full payload."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from runtime.models.talker import Talker, conditioning_from_thinker
from runtime.models.thinker import ACCEPT_HIDDEN_LAYER, THINKER_HIDDEN, Thinker
from runtime.processors.thinker2talker import talker_input, thinker2talker_async_chunk, thinker2talker_full_payload
from runtime.request import Request
from runtime.transfer.generations import GenerationContext, SenderTables

THINKER = Thinker()
TALKER = Talker()


class FakeTransfer(SenderTables):
    """The sender's tables, as if every put succeeded."""

    def send(self, request: Request, output: dict[str, Any], finished: bool) -> dict[str, Any] | None:
        ext = request.external_req_id
        payload = thinker2talker_async_chunk(GenerationContext(self, ext), output, request, finished)
        if payload is not None:
            self.put_req_chunk[ext] = self.put_req_chunk.get(ext, 0) + 1
        return payload


def rows(n: int) -> dict[str, Any]:
    layer = torch.randn(n, THINKER_HIDDEN)
    return {"hidden_states": {"layers": {0: layer, ACCEPT_HIDDEN_LAYER: layer + 1}}}


def stream(text: str) -> list[dict[str, Any]]:
    """Every chunk the Thinker's steps for ``text`` produce."""
    state = THINKER.init_state(text)
    request = Request("t", "R", prompt_token_ids=list(state.prompt_token_ids))
    tm = FakeTransfer()
    sent = []
    while not state.finished:
        out = THINKER.step(state)
        request.output_token_ids.append(out.token_id)
        payload = tm.send(request, {"hidden_states": {"layers": out.layers}}, out.finished)
        if payload is not None:
            sent.append(payload)
    assert tm.request_payload == {}, "nothing may stay cached after the finish"
    return sent


def test_chunk_zero_waits_for_a_generated_row() -> None:
    request = Request("t", "R", prompt_token_ids=[1, 2, 3])
    tm = FakeTransfer()
    assert tm.send(request, rows(3), False) is None  # the prefill alone: cached
    first = tm.send(request, rows(1), False)
    assert first is not None and first["embed"]["prefill"].shape[0] == 4
    assert first["hidden_states"]["output"].shape[0] == 4 and first["ids"]["prompt"] == [1, 2, 3]
    later = tm.send(request, rows(1), False)
    assert later is not None and later["embed"]["decode"].shape[0] == 1 and "prefill" not in later["embed"]


def test_chunk_zero_that_waited_keeps_the_prefill_steps_tts_embeddings() -> None:
    """The Thinker hands its TTS special embeddings over with the prefill step only (spec §4.2:
    chunk 0 carries them): the chunk 0 sent a step later must still carry them."""
    request = Request("t", "R", prompt_token_ids=[1, 2, 3])
    tm = FakeTransfer()
    tts = THINKER.tts_embeds()
    assert tm.send(request, {**rows(3), "embed": tts}, False) is None
    first = tm.send(request, rows(1), False)
    assert first is not None and {"tts_bos", "tts_eos", "tts_pad"} <= set(first["embed"])
    assert all(torch.equal(first["embed"][name], row) for name, row in tts.items())


def test_a_thinker_finishing_in_its_prefill_sends_what_it_has() -> None:
    request = Request("t", "R", prompt_token_ids=[1, 2])
    payload = FakeTransfer().send(request, rows(2), True)
    assert payload is not None and payload["embed"]["prefill"].shape[0] == 2 and bool(payload["meta"]["finished"])


def test_missing_layers_and_multi_row_decode_chunks_send_nothing(caplog: pytest.LogCaptureFixture) -> None:
    request = Request("t", "R", prompt_token_ids=[1])
    tm = FakeTransfer()
    assert tm.send(request, {"hidden_states": {"layers": {0: torch.randn(1, THINKER_HIDDEN)}}}, False) is None
    assert tm.send(request, {}, False) is None
    tm.put_req_chunk["R"] = 1
    with caplog.at_level(logging.WARNING, logger="runtime.processors.thinker2talker"):
        assert tm.send(request, rows(2), False) is None
    assert "dropped" in caplog.text


def test_layer_keys_may_be_strings() -> None:
    request = Request("t", "R", prompt_token_ids=[1])
    layer = torch.randn(2, THINKER_HIDDEN)
    payload = FakeTransfer().send(
        request, {"hidden_states": {"layers": {"0": layer, str(ACCEPT_HIDDEN_LAYER): layer}}}, True
    )
    assert payload is not None and torch.equal(payload["embed"]["prefill"], layer)


@pytest.mark.parametrize("text", ["hi", "hello world", "a somewhat longer answer, with a comma"])
def test_streamed_conditioning_gives_the_full_payload_frames(text: str) -> None:
    chunks = stream(text)
    assert "prefill" in chunks[0]["embed"] and all("decode" in c["embed"] for c in chunks[1:])
    first = talker_input(chunks[0], finished=len(chunks) == 1)
    assert first.conditioning is not None
    state = TALKER.init_state(first.conditioning)
    frames = []
    fed = 1
    while True:
        while not TALKER.ready(state):
            given = talker_input(chunks[fed], finished=fed == len(chunks) - 1)
            TALKER.feed(state, given.rows, finished=given.finished)
            fed += 1
        frame, state, finished = TALKER.step(state)
        frames.append(frame)
        if finished:
            break
    full = thinker2talker_full_payload(THINKER.generate(text))
    offline = TALKER.generate(conditioning_from_thinker(THINKER.generate(text)))
    assert torch.equal(torch.cat(frames), offline)
    assert talker_input(full, finished=True).conditioning is not None
