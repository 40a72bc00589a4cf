"""Chunks large enough to take the data plane's big-payload paths (omnisim issue 13).

Every other scenario sends chunks of a few kilobytes, so the code that only large chunks run was
guarded by nothing: a put that checksums its bytes beside copying them (from
:data:`runtime.connectors.shm.PARALLEL_CHECKSUM_BYTES`), and a decoder that reads a very large
buffer into memory of its own that may take huge pages (from
:data:`runtime.connectors.wire.HUGE_PAGE_BYTES`). Here two requests stream at once, each
chunk carrying, beside its codec frames, the model's hidden states past one of those sizes; each
must arrive byte for byte (``no-corrupt-accept``), once, with nothing left behind.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from omnisim.registry import scenario
from omnisim.sim_kernel import MAIN_PROCESS
from omnisim.world import World
from runtime.connectors.shm import PARALLEL_CHECKSUM_BYTES
from runtime.connectors.wire import HUGE_PAGE_BYTES
from runtime.request import Request
from scenarios.crash import DATA_PLANE, in_process, receive, send
from scenarios.edge import EdgeRequest, edge_world, synthetic_codec_chunk

#: Request -> how many float32 hidden states its terminal chunk carries: just past each size
#: where a path of its own begins.
HIDDEN = {"R": PARALLEL_CHECKSUM_BYTES // 4 + 1, "S": HUGE_PAGE_BYTES // 4 + 1}
#: Each request's one chunk, its terminal: a second would double a run's copying for no new path.
CHUNKS = [10]


@functools.cache
def hidden_states(values: int) -> torch.Tensor:
    """``values`` float32s, each distinct from its neighbours (cached: nothing mutates them)."""
    return torch.arange(values, dtype=torch.float32)


def codes_and_hidden(
    transfer_manager: Any, multimodal_output: dict[str, Any], request: Request, is_finished: bool
) -> dict[str, Any] | None:
    """The processor: a chunk of codec frames, with the hidden states when the model has some."""
    chunk = synthetic_codec_chunk(transfer_manager, multimodal_output, request, is_finished)
    if chunk is not None and "hidden" in multimodal_output:
        chunk["hidden"] = multimodal_output["hidden"]
    return chunk


def large_world(store_kind: str) -> World:
    return edge_world(store_kind, codes_and_hidden)


@scenario(
    "large_chunks",
    summary="two requests stream at once, each chunk carrying hidden states past the size where a put "
    "checksums beside its copy, or past the size where a get reads into memory that may take huge pages: each "
    "arrives byte for byte, once, and nothing is left behind",
    issue="omnisim issue 13 (the large-payload paths of put and get)",
    build=large_world,
    invariants=DATA_PLANE,
    budget_share=0.2,  # (two requests, few interleavings: a run costs what a hundred small ones do)
)
async def large_chunks(world: World) -> None:
    requests = {ext: EdgeRequest(world, ext) for ext in HIDDEN}
    jobs = []
    for ext, req in requests.items():
        output = {"hidden": hidden_states(HIDDEN[ext])}
        jobs.append((MAIN_PROCESS, f"{ext}.consume", functools.partial(receive, req)))
        jobs.append((MAIN_PROCESS, f"{ext}.produce", functools.partial(send, req, CHUNKS, output=output)))
    await in_process(jobs)
    for ext, req in requests.items():
        if req.stream.outcome == "finished":
            got = (req.receiver.additional_information or {}).get("hidden")
            world.probe(
                "no-corrupt-accept",
                isinstance(got, torch.Tensor) and torch.equal(got, hidden_states(HIDDEN[ext])),
                f"{ext} finished, its hidden states not as they were sent",
            )
        await req.talker.adapter.finish_requests([req.sender])
        await req.talker.adapter.release_shm_resources(req.ext)
