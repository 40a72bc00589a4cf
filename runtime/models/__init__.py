"""Toy models of the Qwen3-Omni pipeline: real torch modules, built from a seed, small and deterministic.

* :class:`Thinker` — text → text tokens, plus per-token hidden layers (``thinker``);
* :class:`Talker` — Thinker rows → one ``[1, 16]`` codec frame per step (``talker``);
* :class:`Code2Wav` — codebook-major codes → 24 kHz audio, and the two decode paths of spec §6
  (``code2wav``);
* :class:`ForcedAligner` — complete waveform + words → per-word timestamps (``aligner``).

All compute is plain synchronous torch: a scheduler calls it inline. Each model takes a
``device`` argument (CPU or CUDA); weights are drawn on the CPU from a fixed seed, so they are the
same everywhere, and the same inputs give bit-identical outputs on the CPU.
"""

from runtime.models._build import count_parameters
from runtime.models.aligner import BIN_MS, ForcedAligner, WordTimestamp, segment_words
from runtime.models.code2wav import (
    CODEBOOK_SIZE,
    FRAME_MS,
    NUM_QUANTIZERS,
    RECEPTIVE_FIELD_FRAMES,
    SAMPLE_RATE,
    TAIL,
    TOTAL_UPSAMPLE,
    Code2Wav,
    chunked_decode,
    chunked_decode_streaming,
    frames_to_codes,
    unflatten_codes,
)
from runtime.models.talker import (
    PREFILL_CHUNK_ROWS,
    STOP_TOKEN,
    Talker,
    TalkerConditioning,
    TalkerState,
    conditioning_from_thinker,
    is_placeholder_frame,
    is_stop_frame,
    placeholder_frames_for_prompt,
    steps_for_text,
)
from runtime.models.thinker import (
    ACCEPT_HIDDEN_LAYER,
    Thinker,
    ThinkerOutput,
    ThinkerState,
    ThinkerStep,
    ToyTokenizer,
    frames_for_text,
)

__all__ = [
    "ACCEPT_HIDDEN_LAYER",
    "BIN_MS",
    "CODEBOOK_SIZE",
    "FRAME_MS",
    "NUM_QUANTIZERS",
    "PREFILL_CHUNK_ROWS",
    "RECEPTIVE_FIELD_FRAMES",
    "SAMPLE_RATE",
    "STOP_TOKEN",
    "TAIL",
    "TOTAL_UPSAMPLE",
    "Code2Wav",
    "ForcedAligner",
    "Talker",
    "TalkerConditioning",
    "TalkerState",
    "Thinker",
    "ThinkerOutput",
    "ThinkerState",
    "ThinkerStep",
    "ToyTokenizer",
    "WordTimestamp",
    "chunked_decode",
    "chunked_decode_streaming",
    "conditioning_from_thinker",
    "count_parameters",
    "frames_for_text",
    "frames_to_codes",
    "is_placeholder_frame",
    "is_stop_frame",
    "placeholder_frames_for_prompt",
    "segment_words",
    "steps_for_text",
    "unflatten_codes",
]
