"""Spec §3.3–§3.4 between a scheduler and its processor: what a processor is handed, and what the
sender makes of what it returns.

A chunk is queued by ``save_async`` and made by the processor later, on the save task, while the
scheduler goes on changing the live request (more tokens, a grown prompt, a changed nested entry
of ``additional_information``). So the processor must be handed the request as it was when the
chunk was queued, with the ``new_token_ids`` that save passed and ``is_finished`` set on a
segment end or a terminal. What it returns then gets its finish flags from the sender: ``finished``
is the scheduler's, unless the processor set it together with ``codec_streaming`` (a codec that
ends its stream early, Qwen3-TTS), and such an early end retires nothing; ``is_segment_finished``
is the processor's if it set one, the scheduler's otherwise.

No shipped processor reads a field the scheduler changes while its chunk is queued, or sets
``codec_streaming``, so these rules ran unchecked. Here a probe processor notes what it was
handed next to what was queued (``processor.view``), and once the request ends every chunk
Code2Wav took is compared with the flags the spec gives it (``processor.flags``); both feed the
``sender-contract`` invariant.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import torch

from omnisim.registry import scenario
from omnisim.world import World
from runtime.kernel import current_kernel
from runtime.request import Request, RequestStatus
from scenarios.edge import TAKEN, EdgeRequest, codec_frames, consume, edge_world, release, together

AS_SPEC = "as spec §3.4 step 5 flags it"


class Save(NamedTuple):
    """One save of the scenario's Talker: the meta its processor returns, and the save's flags."""

    meta: dict[str, Any]
    segment_end: bool = False
    terminal: bool = False
    #: Whether Code2Wav reads it (not after an early end: the release sweep takes it).
    read: bool = True

    def flags(self) -> tuple[bool, bool]:
        """(``finished``, ``is_segment_finished``) of the chunk, by spec §3.4 step 5."""
        early = bool(self.meta.get("finished")) and bool(self.meta.get("codec_streaming"))
        finished = bool(self.meta["finished"]) if early else self.terminal
        segment_end = self.meta.get("is_segment_finished")
        return finished, bool(segment_end) if segment_end is not None else self.segment_end


#: Two requests: each request's saves in the order its scheduler makes them.
SAVES: dict[str, tuple[Save, ...]] = {
    "P": (
        Save({}),
        Save({"is_segment_finished": True}),  # the processor marks a segment end itself
        Save({}, segment_end=True),  # the scheduler's segment end, the processor silent
        Save({"is_segment_finished": False}, segment_end=True),  # the processor's word wins
        Save({"codec_streaming": True}, terminal=True),  # codec_streaming alone: still a terminal
    ),
    "E": (
        Save({}),
        # The codec ends the stream early: Code2Wav is done, but the generation is not retired
        # (its scheduler's terminal is still to come, and reclaiming would take this chunk away).
        Save({"finished": True, "codec_streaming": True}),
        Save({}, terminal=True, read=False),
    ),
}


def view(request: Request, new_token_ids: list[int] | tuple[int, ...] | None, is_finished: bool) -> str:
    """What a processor reads of a request, as one comparable string."""
    info = request.additional_information or {}
    nested = {name: dict(value) if isinstance(value, dict) else value for name, value in sorted(info.items())}
    ids = list(new_token_ids) if new_token_ids is not None else None
    return (
        f"prompt={request.prompt_token_ids} output={request.output_token_ids} info={nested} "
        f"new_token_ids={ids} is_finished={is_finished}"
    )


def probe_processor(
    context: Any,
    multimodal_output: dict[str, Any],
    request: Request,
    is_finished: bool,
    new_token_ids: tuple[int, ...] | None = None,
) -> dict[str, Any]:
    """Note what it was handed against what was queued; return the save's frames and meta."""
    got = view(request, new_token_ids, is_finished)
    current_kernel().note("processor.view", req=request.request_id, got=got, want=multimodal_output["queued"])
    return {
        "codes": {"audio": multimodal_output["frames"]},
        "meta": dict(multimodal_output["meta"]),
        "num_frames": int(multimodal_output["frames"].shape[1]),
    }


def _flag(value: object) -> bool:
    if isinstance(value, torch.Tensor):
        return value.numel() == 1 and bool(value.item())
    return bool(value)


async def produce(req: EdgeRequest, saves: tuple[Save, ...]) -> None:
    """The Talker's scheduler: save, then go on changing the request as a scheduler does."""
    request = req.sender
    request.prompt_token_ids = [11, 12]
    request.additional_information = {"speaker": {"turn": 0}, "language": "en"}
    offset = 0
    for i, save in enumerate(saves):
        if save.terminal:
            request.resumable = False
            request.status = RequestStatus.FINISHED_STOPPED
        new_ids = [100 + i, 200 + i]
        request.output_token_ids.extend(new_ids)
        request.num_computed_tokens += len(new_ids)
        frames = codec_frames(2, offset)
        offset += 2
        queued = view(request, new_ids, save.segment_end or save.terminal)
        output = {"frames": frames, "meta": save.meta, "queued": queued}
        if save.read:
            req.stream.sent_frames.extend(tuple(frames[:, j].tolist()) for j in range(2))
            req.stream.frames_sent += 2
        adapter = req.talker.adapter
        if not await adapter.save_async(output, request, is_segment_finished=save.segment_end, new_token_ids=new_ids):
            return
        # The scheduler goes on while the chunk waits in the save queue.
        request.output_token_ids.append(900 + i)
        request.prompt_token_ids.append(50 + i)
        request.additional_information["speaker"]["turn"] = i + 1


def check_flags(req: EdgeRequest, saves: tuple[Save, ...]) -> None:
    """Note, for every chunk Code2Wav took, whether its flags are the ones spec §3.4 gives it."""
    k = current_kernel()
    taken = req.world.observers[TAKEN].since(req.ext, 0)
    for i, (payload, save) in enumerate(zip(taken, saves, strict=False)):
        meta = payload.get("meta") or {}
        got = (_flag(meta.get("finished")), _flag(meta.get("is_segment_finished")))
        want = save.flags()
        k.note(
            "processor.flags",
            req=req.ext,
            chunk=i,
            got=AS_SPEC if got == want else f"chunk {i} flagged finished={got[0]} segment_end={got[1]}",
            want=AS_SPEC,
        )


@scenario(
    "processor_contract",
    summary="spec §3.3–§3.4: a processor is handed the request as it was queued (not as the scheduler changed it "
    "since), with its save's new token ids; the sender flags each chunk as step 5 says (a processor's own segment "
    "end, codec_streaming alone, an early codec end that retires nothing)",
    issue="spec §3.4 steps 3–5 and 10; omnisim issue 11 (a blind spot of the mutation score)",
    build=functools.partial(edge_world, processor=probe_processor),
)
async def processor_contract(world: World) -> None:
    reqs = {ext: EdgeRequest(world, ext) for ext in SAVES}
    for req in reqs.values():
        req.sender.resumable = True  # a streaming session: segment ends do not end it

    await together(
        *((f"{ext}.consume", functools.partial(consume, req)) for ext, req in reqs.items()),
        *((f"{ext}.produce", functools.partial(produce, req, SAVES[ext])) for ext, req in reqs.items()),
    )
    for ext, req in reqs.items():
        check_flags(req, SAVES[ext])
        await release(req)
