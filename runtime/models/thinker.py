"""The toy Thinker: text in → text tokens out, plus per-token hidden layers for the Talker.

Obviously a toy, on purpose:

* **Tokenizer** (:class:`ToyTokenizer`): reversible byte pairs. The UTF-8 bytes of the text are
  cut into pieces of two bytes (a last odd byte is a piece of its own); a pair ``(a, b)`` is id
  ``PAIR_BASE + 256·a + b`` and a single byte ``b`` is ``SINGLE_BASE + b``. Ids below
  :data:`NUM_SPECIAL` are special tokens. No vocabulary file, nothing downloaded, and ``decode``
  is exact.
* **Answer**: the Thinker *echoes* its input with whitespace normalised
  (:meth:`ToyTokenizer.normalize`), followed by EOS — or, as vLLM's ``max_tokens`` does, only its
  first ``max_tokens`` tokens, without the EOS it did not reach. With ``stop`` strings the echo
  ends where the first of them begins (:func:`before_stop`), and EOS follows: the model "decides"
  to stop there, so the stop string is in no output, as with vLLM's default
  ``include_stop_str_in_output=False``. The tokens are teacher-forced, not sampled;
  the model compute is real (an embedding and a stack of GRU layers run over every position) and
  produces the hidden states the Talker conditions on.
* **Duration hint**: channel :data:`DURATION_CHANNEL` of the embedding output (layer 0) is not
  learned; it holds the number of codec frames the Talker speaks for that token, an exact small
  integer: 1 for a piece with any non-whitespace byte, 0 for whitespace-only pieces and special
  tokens. This makes the audio length a function of the text (:func:`frames_for_text`) that no
  float rounding on any device can change. With two bytes a piece, that is about 2–3 frames per
  word; a 10 s utterance (125 frames) is roughly 250 characters.

Step semantics mirror a vLLM model runner: step 0 (prefill) runs every prompt position and
returns their layer rows; step k ≥ 1 runs the token generated at step k − 1 and returns its row.
So the rows of a request arrive as ``P`` prompt rows, then one row per generated token, and the
row of the final EOS is never produced (its duration is 0 anyway; an answer cut short by
``max_tokens`` loses its last token's row, and that token's frame, as a real Thinker's Talker
never gets the hidden state of a token no step ran).
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from runtime.models._build import declaring, init_from_seed

PAD_ID = 0
BOS_ID = 1
EOS_ID = 2
TTS_BOS_ID = 3
TTS_EOS_ID = 4
TTS_PAD_ID = 5
#: Ids below this are special tokens (some reserved and unused).
NUM_SPECIAL = 8
PAIR_BASE = NUM_SPECIAL
SINGLE_BASE = PAIR_BASE + 256 * 256
VOCAB_SIZE = SINGLE_BASE + 256
#: Rows of the hashed embedding table; ids share rows modulo this prime (a toy needs no 65k table).
EMBED_BUCKETS = 4093

THINKER_HIDDEN = 64
NUM_LAYERS = 3
#: The layer the Talker accepts (upstream ``talker_config.accept_hidden_layer``); layer 0 is the
#: embedding output.
ACCEPT_HIDDEN_LAYER = 2
#: Embedding channel that carries the per-token frame count (see the module docstring).
DURATION_CHANNEL = 0
DEFAULT_SEED = 7


class ToyTokenizer:
    """Reversible byte-pair tokenizer (see the module docstring). Stateless; all methods are pure."""

    @staticmethod
    def normalize(text: str) -> str:
        """The Thinker's answer to ``text``: its words joined by single spaces."""
        return " ".join(text.split())

    @staticmethod
    def encode(text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens added)."""
        data = text.encode("utf-8")
        ids = [PAIR_BASE + 256 * data[i] + data[i + 1] for i in range(0, len(data) - 1, 2)]
        if len(data) % 2:
            ids.append(SINGLE_BASE + data[-1])
        return ids

    @staticmethod
    def piece_bytes(token_id: int) -> bytes:
        """The bytes a token stands for; empty for special tokens."""
        if not 0 <= token_id < VOCAB_SIZE:
            raise ValueError(f"token id {token_id} outside [0, {VOCAB_SIZE})")
        if token_id < PAIR_BASE:
            return b""
        if token_id < SINGLE_BASE:
            return bytes(divmod(token_id - PAIR_BASE, 256))
        return bytes([token_id - SINGLE_BASE])

    @classmethod
    def decode(cls, ids: list[int]) -> str:
        """Text of ``ids``, special tokens skipped; invalid UTF-8 (a cut character) is replaced."""
        return b"".join(cls.piece_bytes(i) for i in ids).decode("utf-8", errors="replace")

    @classmethod
    def duration(cls, token_id: int) -> int:
        """Codec frames the Talker speaks for this token: 1 if it has a non-whitespace byte, else 0."""
        return 1 if cls.piece_bytes(token_id).strip() else 0


def before_stop(answer: str, stop: Sequence[str]) -> str:
    """``answer`` up to where the first of the ``stop`` strings in it begins (all of it if none is
    in it), as vLLM cuts its output without ``include_stop_str_in_output``.

    vLLM looks for the stop strings in the text as it is generated, so the first one *completed*
    wins: the one that ends first (of ``"world"`` and ``"or"`` in ``"hello world"``, ``"or"``,
    leaving ``"hello w"``); of several that end at the same character, the one listed first, as
    vLLM checks them in their order. A stop string at the start leaves nothing. An empty one is
    refused, as vLLM refuses it (it would be found before every character).
    """
    if "" in stop:
        raise ValueError("stop cannot contain an empty string")
    found = [(at + len(s), order, at) for order, s in enumerate(stop) if (at := answer.find(s)) >= 0]
    return answer[: min(found)[2]] if found else answer


def answer_token_ids(text: str, max_tokens: int | None = None, stop: Sequence[str] | None = None) -> list[int]:
    """The Thinker's output tokens for ``text``: the normalised echo up to its first ``stop``
    string (:func:`before_stop`), then EOS; at most ``max_tokens`` of them (so a cap reached
    before the stop string ends the answer with ``"length"``)."""
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
    answer = before_stop(ToyTokenizer.normalize(text), stop or ())
    return [*ToyTokenizer.encode(answer), EOS_ID][:max_tokens]


def prompt_token_ids(text: str) -> list[int]:
    """The Thinker's prompt for ``text``: BOS, then the text's tokens."""
    return [BOS_ID, *ToyTokenizer.encode(text)]


def frames_for_text(text: str) -> int:
    """Valid codec frames the Talker emits for a request with this text (no placeholders, no stop).

    Roughly one frame per two characters: ``frames_for_text("hello world") == 6``, ``"hi"`` gives
    1, and about 250 characters give the 125 frames of a 10 s utterance.
    """
    return sum(ToyTokenizer.duration(t) for t in answer_token_ids(text))


@dataclass(eq=False)
class ThinkerState:
    """One request's decoding state. Owned by the caller; :meth:`Thinker.step` updates it in place."""

    prompt_token_ids: list[int]
    #: The whole answer (echo up to a stop string + EOS, or its first ``max_tokens``), fixed at
    #: ``init_state``; ``output_token_ids`` is its prefix so far.
    target_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    #: Per-layer GRU state ``[1, THINKER_HIDDEN]``; None until the prefill ran.
    hidden: list[torch.Tensor] | None = None
    finished: bool = False
    _utf8: codecs.IncrementalDecoder = field(default_factory=lambda: codecs.getincrementaldecoder("utf-8")("replace"))

    @property
    def finish_reason(self) -> str | None:
        """vLLM's: ``"stop"`` once the answer ended with EOS (by itself or before a stop string),
        ``"length"`` once it ran out of ``max_tokens`` first; None while it runs."""
        if not self.finished:
            return None
        return "stop" if self.output_token_ids[-1] == EOS_ID else "length"


@dataclass(frozen=True)
class ThinkerStep:
    """What one Thinker step produced.

    ``layers`` maps a layer index to ``[rows, THINKER_HIDDEN]`` float32 rows for the positions this
    step ran (all prompt positions on step 0, then one): 0 is the embedding output (with the
    duration channel), 1..NUM_LAYERS the GRU layers; the Talker reads 0 and
    :data:`ACCEPT_HIDDEN_LAYER`. ``text_delta`` is the new text (possibly empty while a multi-byte
    character is incomplete, and for EOS).
    """

    token_id: int
    text_delta: str
    layers: dict[int, torch.Tensor]
    finished: bool


@dataclass(frozen=True)
class ThinkerOutput:
    """A whole request's Thinker output (:meth:`Thinker.generate`): ``layers`` rows cover the
    prompt positions, then one per generated token except the last."""

    prompt_token_ids: list[int]
    output_token_ids: list[int]
    text: str
    layers: dict[int, torch.Tensor]
    #: ``tts_bos``, ``tts_eos``, ``tts_pad``: layer-0 rows ``[1, THINKER_HIDDEN]`` of the TTS specials.
    tts_embeds: dict[str, torch.Tensor]


@dataclass
class ThinkerSteps:
    """The steps of one request gathered into a :class:`ThinkerOutput` (the full-payload view)."""

    pieces: list[str] = field(default_factory=list)
    rows: dict[int, list[torch.Tensor]] = field(default_factory=lambda: {i: [] for i in range(NUM_LAYERS + 1)})

    def append(self, step: ThinkerStep) -> None:
        self.pieces.append(step.text_delta)
        for index, rows in step.layers.items():
            self.rows[index].append(rows)

    def output(self, state: ThinkerState, tts_embeds: dict[str, torch.Tensor]) -> ThinkerOutput:
        return ThinkerOutput(
            prompt_token_ids=list(state.prompt_token_ids),
            output_token_ids=list(state.output_token_ids),
            text="".join(self.pieces),
            layers={i: torch.cat(rows) for i, rows in self.rows.items()},
            tts_embeds=tts_embeds,
        )


class Thinker(nn.Module):
    """Toy Thinker: hashed embedding + ``NUM_LAYERS`` GRU layers.

    Like an LLM's prefill, a step runs all of its positions through each layer in one call, so a
    long prompt costs far less than as many decode steps."""

    def __init__(
        self, *, hidden: int = THINKER_HIDDEN, seed: int = DEFAULT_SEED, device: torch.device | str = "cpu"
    ) -> None:
        super().__init__()
        self.hidden = hidden
        with declaring():
            self.embed = nn.Embedding(EMBED_BUCKETS, hidden)
            self.layers = nn.ModuleList(nn.GRU(hidden, hidden) for _ in range(NUM_LAYERS))
        init_from_seed(self, seed, device)

    @property
    def device(self) -> torch.device:
        # One parameter's (they all move together): walking ``parameters()`` at every step
        # costs twice as much, and a step asks several times.
        return self.embed.weight.device

    @torch.no_grad()
    def embed_tokens(self, token_ids: list[int]) -> torch.Tensor:
        """Layer-0 rows ``[len(ids), hidden]``: the hashed embedding, channel 0 set to the duration."""
        ids = torch.tensor([t % EMBED_BUCKETS for t in token_ids], dtype=torch.int64, device=self.device)
        rows = self.embed(ids)
        durations = torch.tensor(
            [float(ToyTokenizer.duration(t)) for t in token_ids], dtype=rows.dtype, device=self.device
        )
        rows[:, DURATION_CHANNEL] = durations
        return rows

    def tts_embeds(self) -> dict[str, torch.Tensor]:
        """Layer-0 rows of the TTS special tokens (upstream ``embed.tts_bos/eos/pad``)."""
        rows = self.embed_tokens([TTS_BOS_ID, TTS_EOS_ID, TTS_PAD_ID])
        return {"tts_bos": rows[0:1], "tts_eos": rows[1:2], "tts_pad": rows[2:3]}

    def init_state(self, text: str, max_tokens: int | None = None, stop: Sequence[str] | None = None) -> ThinkerState:
        """A fresh request for ``text`` that generates at most ``max_tokens`` and stops before the
        first ``stop`` string (:func:`answer_token_ids`); nothing is computed until the first
        :meth:`step`."""
        return ThinkerState(
            prompt_token_ids=prompt_token_ids(text), target_token_ids=answer_token_ids(text, max_tokens, stop)
        )

    @torch.no_grad()
    def step(self, state: ThinkerState) -> ThinkerStep:
        """Run one forward pass (the prefill on the first call) and emit the next token.

        Raises ``RuntimeError`` once the request has finished (after EOS, or its last token).
        """
        if state.finished:
            raise RuntimeError("Thinker.step on a finished request")
        if state.hidden is None:
            positions = state.prompt_token_ids
            state.hidden = [torch.zeros(1, self.hidden, device=self.device) for _ in range(NUM_LAYERS)]
        else:
            positions = state.output_token_ids[-1:]
        layers = self._run(positions, state.hidden)
        token = state.target_token_ids[len(state.output_token_ids)]
        state.output_token_ids.append(token)
        state.finished = len(state.output_token_ids) == len(state.target_token_ids)
        delta = state._utf8.decode(ToyTokenizer.piece_bytes(token), final=state.finished)
        return ThinkerStep(token_id=token, text_delta=delta, layers=layers, finished=state.finished)

    def _run(self, token_ids: list[int], hidden: list[torch.Tensor]) -> dict[int, torch.Tensor]:
        """Advance the GRU stack over ``token_ids`` (updating ``hidden``); every layer's rows."""
        x = self.embed_tokens(token_ids)
        layers = {0: x}
        for index, layer in enumerate(self.layers):
            out, h = layer(x.unsqueeze(1), hidden[index].unsqueeze(0))
            hidden[index] = h[0]
            x = layers[index + 1] = out[:, 0]
        return layers

    def generate(self, text: str, max_tokens: int | None = None, stop: Sequence[str] | None = None) -> ThinkerOutput:
        """Run a whole request through :meth:`step` and gather every row (the full-payload view)."""
        state = self.init_state(text, max_tokens, stop)
        steps = ThinkerSteps()
        while not state.finished:
            steps.append(self.step(state))
        return steps.output(state, self.tts_embeds())
