"""Every case of spec §3.8's generation-mode commit, sent across the Talker → Code2Wav edge.

The edge's other scenarios send codec frames only (a ``[16, n]`` tensor per chunk), so most of
what a Code2Wav receiver makes of a chunk — a 1-D or list prompt, a chunk that is not ready, a
segment end with no codes, a chunk that replaces what was merged before — was never exercised.
Here the Talker's processor hands on payloads crafted one per case, and the ``merged-as-spec``
check (:mod:`scenarios.merge`) compares each commit with what the spec makes of it.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from omnisim.registry import scenario
from omnisim.world import World
from runtime.request import Request, RequestStatus
from scenarios.edge import EdgeRequest, codec_frames, edge_world, next_chunk, release, together

#: (payload, is_segment_finished) in the order the Talker sends them; the last is the terminal.
CASES: tuple[tuple[dict[str, Any], bool], ...] = (
    ({"codes": {"audio": codec_frames(3)}, "meta": {"left_context_size": 0}, "num_frames": 3}, False),
    ({"codes": {"audio": torch.tensor([5, 6, 7])}, "meta": {"left_context_size": 2}}, False),  # 1-D: the prompt
    ({"codes": {"audio": [8, 9]}, "speaker": "a"}, False),  # a list: the prompt as it is
    ({"meta": {"note": 1}}, False),  # no codes, no end: not ready, the next chunk is polled
    ({"codes": {"audio": codec_frames(0)}}, True),  # a segment end with no codes: the prompt [0]
    ({"codes": {"audio": codec_frames(2)}, "meta": {"replace_runtime_additional_information": True}}, False),
    ({"num_frames": 0}, False),  # the terminal: ready because it ends the request
)


def crafted_chunk(
    transfer_manager: Any, multimodal_output: dict[str, Any], request: Request, is_finished: bool
) -> dict[str, Any]:
    """The processor: the payload the scenario crafted for this chunk."""
    return multimodal_output["payload"]


@scenario(
    "generation_merge",
    summary="spec §3.8: a Talker sends Code2Wav one chunk per case of the generation-mode commit (codes of two "
    "dimensions, one, a list, none; a chunk that is not ready; a segment end; a replacing chunk; the terminal): "
    "each commit merges and prompts as the spec says, and only ready chunks are published",
    issue="spec §3.8; omnisim issue 11 (a blind spot of the mutation score: only 2-D codes ever crossed the edge)",
    build=functools.partial(edge_world, processor=crafted_chunk),
)
async def generation_merge(world: World) -> None:
    req = EdgeRequest(world, "M")
    req.receiver.resumable = True  # until its terminal arrives (spec §3.8 step 1)

    async def produce() -> None:
        for i, (payload, segment_end) in enumerate(CASES):
            if i == len(CASES) - 1:
                req.sender.status = RequestStatus.FINISHED_STOPPED
            # A fresh copy each run: the sender adds its flags to the payload's ``meta``.
            fresh = {name: dict(value) if isinstance(value, dict) else value for name, value in payload.items()}
            if not await req.talker.adapter.save_async({"payload": fresh}, req.sender, is_segment_finished=segment_end):
                return

    async def consume() -> None:
        adapter = req.code2wav.adapter
        while await next_chunk(req):
            req.receiver.num_computed_tokens = req.receiver.num_prompt_tokens  # its one-shot prefill ran
            finished = adapter.is_done_receiving_chunks(req.receiver.request_id)
            req.stream.chunks.append((0, finished))
            if finished:
                req.stream.outcome = "finished"
        await adapter.finish_requests([req.receiver])

    await together(("M.consume", consume), ("M.produce", produce))
    await release(req)
