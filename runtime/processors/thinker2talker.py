"""``thinker2talker_async_chunk``: the Thinker's rows, streamed to the Talker (spec §4.2).

Each Thinker step hands over the rows of the positions it ran: every prompt position on the
prefill step, then one row per generated token. The Talker conditions on two layers of those
rows — layer 0 (the embedding output) and the accepted hidden layer — never on re-tokenised text.

* **Chunk 0** carries the prefill: the prompt rows *and* at least one generated row, so the
  Talker can start speaking as soon as it arrives. Until a generated row exists the rows are
  cached in the generation's context and nothing is sent (a Thinker that finishes first
  sends what it has).
* **Every later chunk** carries one decode row (``embed.decode``).

On the receiving side, :func:`talker_input` turns a committed payload into what the Talker's
model takes: the conditioning of its first chunk, or the rows of a later one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from runtime.models.talker import TalkerConditioning
from runtime.models.thinker import ACCEPT_HIDDEN_LAYER, THINKER_HIDDEN, ThinkerOutput
from runtime.request import Request
from runtime.transfer.generations import GenerationContext

log = logging.getLogger(__name__)


def _layer(layers: dict[Any, torch.Tensor], index: int) -> torch.Tensor | None:
    """A layer by index; its key may travel as an int or a str."""
    found = layers.get(index)
    return found if found is not None else layers.get(str(index))


def _tts_embeds(embed: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The TTS special embeddings (``tts_bos``, ``tts_eos``, ``tts_pad``) among ``embed``'s."""
    return {name: row for name, row in embed.items() if name.startswith("tts_")}


def thinker2talker_async_chunk(
    context: GenerationContext,
    multimodal_output: dict[str, Any],
    request: Request,
    is_finished: bool,
    accept_hidden_layer: int = ACCEPT_HIDDEN_LAYER,
) -> dict[str, Any] | None:
    """The processor (spec §4.2, a non-resumable request): the chunk to send, or None."""
    layers = (multimodal_output.get("hidden_states") or {}).get("layers") or {}
    emb, hid = _layer(layers, 0), _layer(layers, accept_hidden_layer)
    if emb is None or hid is None:
        return None
    finished = torch.tensor(is_finished)
    if context.chunk_id > 0:
        if emb.shape[0] > 1:
            log.warning(
                "thinker2talker: %d rows after the prefill chunk of %s; dropped", emb.shape[0], request.external_req_id
            )
            return None
        return {"embed": {"decode": emb}, "meta": {"finished": finished}}

    tts = _tts_embeds(multimodal_output.get("embed") or {})
    cached = context.take_cached_payload()
    if cached is not None:
        emb = torch.cat([cached["embed"]["prefill"], emb])
        hid = torch.cat([cached["hidden_states"]["output"], hid])
        # The Thinker hands its TTS embeddings over with the prefill step only: the chunk 0 that
        # waited for a generated row carries the cached ones.
        tts = {**_tts_embeds(cached["embed"]), **tts}
    payload = {
        "embed": {"prefill": emb, **tts},
        "hidden_states": {"output": hid},
        "ids": {"all": request.all_token_ids, "prompt": list(request.prompt_token_ids)},
        "meta": {"finished": finished},
    }
    # Wait until a generated position exists beyond the prompt: the Talker has nothing to say before.
    if not is_finished and (cached is None or emb.shape[0] <= len(request.prompt_token_ids)):
        context.cache_payload(payload)
        return None
    return payload


def thinker2talker_full_payload(
    output: ThinkerOutput, accept_hidden_layer: int = ACCEPT_HIDDEN_LAYER
) -> dict[str, Any]:
    """``async_chunk`` off: the finished Thinker output, forwarded whole by the orchestrator, in
    the same layout as chunk 0 (so the Talker has one way to read it)."""
    return {
        "embed": {"prefill": output.layers[0], **output.tts_embeds},
        "hidden_states": {"output": output.layers[accept_hidden_layer]},
        "ids": {"all": [*output.prompt_token_ids, *output.output_token_ids], "prompt": list(output.prompt_token_ids)},
        "meta": {"finished": torch.tensor(True)},
    }


@dataclass(frozen=True)
class TalkerInput:
    """One committed Thinker payload, as the Talker takes it."""

    #: The first payload: what :meth:`Talker.init_state` needs. None for a later one.
    conditioning: TalkerConditioning | None
    #: A later payload's generated rows ``[k, THINKER_HIDDEN]`` (k may be 0).
    rows: torch.Tensor
    finished: bool


def talker_input(payload: dict[str, Any], *, finished: bool) -> TalkerInput:
    """Read a committed payload; ``finished`` is the receiver's verdict (upstream exhausted)."""
    embed = payload.get("embed") or {}
    prefill = embed.get("prefill")
    if prefill is not None:
        ids = payload.get("ids") or {}
        conditioning = TalkerConditioning(
            prefill_embeds=prefill,
            num_prompt_rows=len(ids.get("prompt") or []),
            prefill_hidden=(payload.get("hidden_states") or {}).get("output"),
            finished=finished,
        )
        return TalkerInput(conditioning, torch.empty(0, THINKER_HIDDEN), finished)
    rows = embed.get("decode")
    return TalkerInput(None, rows if rows is not None else torch.empty(0, THINKER_HIDDEN), finished)
