"""The toy Talker: Thinker rows in, one ``[1, 16]`` codec frame out per step.

Frame rules (the contract ``talker2code2wav_async_chunk`` relies on, spec §4.1):

* **Prefill placeholders.** The prompt rows are consumed in chunks of
  :data:`PREFILL_CHUNK_ROWS` (a chunked prefill); each such step emits an all-zero frame. So a
  request with P prompt rows starts with ``ceil(P / 32)`` placeholder frames
  (:func:`placeholder_frames_for_prompt`).
* **Codec frames.** Then one frame per unit of duration of the generated (non-prompt) rows, in
  row order: a row whose duration channel reads d (see :mod:`runtime.models.thinker`) is spoken
  as d frames. Values are in ``[0, 2048)``, and codebook 0 is never 0, so a real frame can never
  be mistaken for an all-zero placeholder.
* **Stop.** When no duration is left and the upstream said it is finished, the Talker emits one
  frame whose codebook 0 is :data:`STOP_TOKEN` (2150; the rest zero) and the request finishes.

Only prompt rows go through the prefill recurrence; generated rows are only the per-frame text
input. Hence the frames depend on the text alone, not on how the rows were split between the
first payload and later ones: streamed (async chunk) and full-payload conditioning produce
bit-identical frames on the CPU.

The step API is for a scheduler: :meth:`Talker.init_state` with what the first payload carried,
:meth:`Talker.feed` for each later row, :meth:`Talker.ready` to ask whether a step can run
without waiting for upstream, :meth:`Talker.step` to run it.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import torch
from torch import nn

from runtime.models._build import declaring, init_from_seed
from runtime.models.code2wav import CODEBOOK_SIZE, NUM_QUANTIZERS
from runtime.models.thinker import (
    ACCEPT_HIDDEN_LAYER,
    DURATION_CHANNEL,
    THINKER_HIDDEN,
    ThinkerOutput,
    frames_for_text,
    prompt_token_ids,
)

#: Codebook-0 value of the frame that ends a request (Qwen3-Omni's post-EOS codec id).
STOP_TOKEN = 2150
#: Prompt rows per prefill step, i.e. per placeholder frame.
PREFILL_CHUNK_ROWS = 32
TALKER_HIDDEN = 32
DEFAULT_SEED = 42

__all__ = [
    "PREFILL_CHUNK_ROWS",
    "STOP_TOKEN",
    "Talker",
    "TalkerConditioning",
    "TalkerState",
    "conditioning_from_thinker",
    "frames_for_text",
    "is_placeholder_frame",
    "is_stop_frame",
    "placeholder_frames_for_prompt",
    "steps_for_text",
]


def placeholder_frames_for_prompt(num_prompt_rows: int) -> int:
    """All-zero frames the Talker emits for a prompt of this many rows (one per prefill step)."""
    return math.ceil(num_prompt_rows / PREFILL_CHUNK_ROWS)


def steps_for_text(text: str) -> int:
    """Talker steps of a whole request: placeholders, codec frames, and the stop frame."""
    return placeholder_frames_for_prompt(len(prompt_token_ids(text))) + frames_for_text(text) + 1


def is_placeholder_frame(frame: torch.Tensor) -> bool:
    """True for a prefill placeholder (an all-zero frame)."""
    return not bool(frame.any())


def is_stop_frame(frame: torch.Tensor) -> bool:
    """True for the stop frame (codebook 0 of the first row is :data:`STOP_TOKEN`)."""
    return int(frame.reshape(-1)[0]) == STOP_TOKEN


@dataclass
class TalkerConditioning:
    """What the first Thinker→Talker payload carries (spec §4.2, chunk 0).

    ``prefill_embeds`` are layer-0 rows ``[R, THINKER_HIDDEN]``: the ``num_prompt_rows`` prompt
    rows, then the generated rows received so far (any number, zero included).
    ``prefill_hidden`` are the matching rows of the accepted hidden layer (zeros if absent).
    ``finished`` says that no more rows will follow (the full payload, or a Thinker that finished
    inside the first payload). The TTS special embeddings of the payload are not needed by this toy.
    """

    prefill_embeds: torch.Tensor
    num_prompt_rows: int
    prefill_hidden: torch.Tensor | None = None
    finished: bool = False


@dataclass(eq=False)
class TalkerState:
    """One request's Talker state; :meth:`Talker.step` and :meth:`Talker.feed` update it in place."""

    #: Projected prompt inputs ``[P, TALKER_HIDDEN]`` still to prefill, consumed from ``prefill_pos``.
    prefill_inputs: torch.Tensor
    hidden: torch.Tensor
    prev_codes: torch.Tensor
    prefill_pos: int = 0
    #: Generated rows still to speak: (row ``[THINKER_HIDDEN]``, frames left for it).
    pending: deque[tuple[torch.Tensor, int]] = field(default_factory=deque)
    upstream_finished: bool = False
    finished: bool = False
    num_steps: int = 0
    #: Codec frames emitted so far (placeholders and the stop frame excluded).
    num_frames: int = 0


class Talker(nn.Module):
    """Toy autoregressive codec LM: a GRU cell over (previous frame, text row, position) → 16 heads."""

    def __init__(
        self,
        *,
        hidden: int = TALKER_HIDDEN,
        text_dim: int = THINKER_HIDDEN,
        seed: int = DEFAULT_SEED,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        self.hidden = hidden
        self.text_dim = text_dim
        with declaring():
            self.prompt_proj = nn.Linear(2 * text_dim, hidden)
            self.text_proj = nn.Linear(text_dim, hidden)
            self.codec_embed = nn.Embedding(NUM_QUANTIZERS * CODEBOOK_SIZE, hidden)
            self.rnn = nn.GRU(hidden, hidden)
            self.head = nn.Linear(hidden, NUM_QUANTIZERS * CODEBOOK_SIZE)
        init_from_seed(self, seed, device)
        self.register_buffer(
            "codebook_offsets", torch.arange(NUM_QUANTIZERS, device=device) * CODEBOOK_SIZE, persistent=False
        )
        # Sinusoid frequencies for the frame-position input, so a constant text row still gives
        # varying frames.
        self.register_buffer(
            "position_freqs", torch.exp(torch.linspace(0.0, -6.0, hidden, device=device)), persistent=False
        )

    @property
    def device(self) -> torch.device:
        # One parameter's (they all move together): walking ``parameters()`` at every step
        # costs twice as much, and a step asks several times.
        return self.codec_embed.weight.device

    @torch.no_grad()
    def init_state(self, conditioning: TalkerConditioning) -> TalkerState:
        """A new request from the first payload. Cheap: the prefill itself runs in :meth:`step`."""
        embeds = conditioning.prefill_embeds.to(self.device, torch.float32)
        if embeds.dim() != 2 or embeds.shape[1] != self.text_dim:
            raise ValueError(f"prefill_embeds must be [rows, {self.text_dim}]; got {list(embeds.shape)}")
        prompt = conditioning.num_prompt_rows
        if not 0 <= prompt <= embeds.shape[0]:
            raise ValueError(f"num_prompt_rows={prompt} but the payload has {embeds.shape[0]} rows")
        hidden_rows = conditioning.prefill_hidden
        hidden_rows = torch.zeros_like(embeds) if hidden_rows is None else hidden_rows.to(self.device, torch.float32)
        if hidden_rows.dim() != 2 or hidden_rows.shape[0] < prompt or hidden_rows.shape[1] != self.text_dim:
            raise ValueError(f"prefill_hidden must be [≥{prompt}, {self.text_dim}]; got {list(hidden_rows.shape)}")
        state = TalkerState(
            prefill_inputs=self.prompt_proj(torch.cat([embeds[:prompt], hidden_rows[:prompt]], dim=1)),
            hidden=torch.zeros(1, self.hidden, device=self.device),
            prev_codes=torch.zeros(NUM_QUANTIZERS, dtype=torch.int64, device=self.device),
        )
        self.feed(state, embeds[prompt:], finished=conditioning.finished)
        return state

    def feed(self, state: TalkerState, embeds: torch.Tensor, *, finished: bool = False) -> None:
        """Queue generated layer-0 rows ``[k, THINKER_HIDDEN]`` (k may be 0) that arrived later.

        ``finished`` marks the end of the upstream stream; it is sticky.
        """
        if state.upstream_finished and embeds.shape[0]:
            raise RuntimeError("Talker.feed: rows after the upstream finished")
        embeds = embeds.to(self.device, torch.float32).reshape(-1, self.text_dim)
        durations = embeds[:, DURATION_CHANNEL].round().to(torch.int64).tolist()
        for row, duration in zip(embeds, durations, strict=True):
            if duration > 0:
                state.pending.append((row, duration))
        state.upstream_finished = state.upstream_finished or finished

    @staticmethod
    def ready(state: TalkerState) -> bool:
        """True if :meth:`step` can run now; False when finished or waiting for upstream rows."""
        if state.finished:
            return False
        return state.prefill_pos < state.prefill_inputs.shape[0] or bool(state.pending) or state.upstream_finished

    @torch.no_grad()
    def step(self, state: TalkerState) -> tuple[torch.Tensor, TalkerState, bool]:
        """One decoding step: ``(frame, state, finished)``; the frame is an int64 CPU tensor ``[1, 16]``.

        Raises ``RuntimeError`` if not :meth:`ready` (finished, or starved of upstream rows).
        """
        if not self.ready(state):
            why = "finished" if state.finished else "waiting for upstream rows"
            raise RuntimeError(f"Talker.step on a request that is {why}")
        state.num_steps += 1
        if state.prefill_pos < state.prefill_inputs.shape[0]:
            end = min(state.prefill_pos + PREFILL_CHUNK_ROWS, state.prefill_inputs.shape[0])
            state.hidden = self._advance(state.prefill_inputs[state.prefill_pos : end], state.hidden)
            state.prefill_pos = end
            return torch.zeros(1, NUM_QUANTIZERS, dtype=torch.int64), state, False
        if not state.pending:
            state.finished = True
            frame = torch.zeros(1, NUM_QUANTIZERS, dtype=torch.int64)
            frame[0, 0] = STOP_TOKEN
            return frame, state, True
        row, left = state.pending[0]
        if left == 1:
            state.pending.popleft()
        else:
            state.pending[0] = (row, left - 1)
        position = torch.sin(float(state.num_frames + 1) * self.position_freqs).unsqueeze(0)
        previous = self.codec_embed(state.prev_codes + self.codebook_offsets).mean(dim=0, keepdim=True)
        x = previous + self.text_proj(row.unsqueeze(0)) + position
        state.hidden = self._advance(x, state.hidden)
        logits = self.head(state.hidden).view(NUM_QUANTIZERS, CODEBOOK_SIZE)
        codes = logits.argmax(dim=-1)
        # Codebook 0 avoids 0 so that no real frame is ever all-zero (a placeholder).
        codes[0] = logits[0, 1:].argmax() + 1
        state.prev_codes = codes
        state.num_frames += 1
        return codes.view(1, NUM_QUANTIZERS).cpu(), state, False

    def _advance(self, inputs: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Run the recurrence over ``inputs`` ``[T, hidden]`` (one call for a whole prefill chunk)."""
        _, h = self.rnn(inputs.unsqueeze(1), hidden.unsqueeze(0))
        return h[0]

    def generate(self, conditioning: TalkerConditioning) -> torch.Tensor:
        """Every frame of a fully conditioned request, placeholders and stop frame included: ``[steps, 16]``."""
        if not conditioning.finished:
            raise ValueError("Talker.generate needs the full payload (conditioning.finished=True)")
        state = self.init_state(conditioning)
        frames = []
        finished = False
        while not finished:
            frame, state, finished = self.step(state)
            frames.append(frame)
        return torch.cat(frames)


def conditioning_from_thinker(output: ThinkerOutput, accept_layer: int | None = None) -> TalkerConditioning:
    """The full-payload conditioning (``async_chunk`` off) of a finished Thinker output."""
    layer = ACCEPT_HIDDEN_LAYER if accept_layer is None else accept_layer
    return TalkerConditioning(
        prefill_embeds=output.layers[0],
        num_prompt_rows=len(output.prompt_token_ids),
        prefill_hidden=output.layers[layer],
        finished=True,
    )
