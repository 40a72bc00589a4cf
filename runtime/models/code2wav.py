"""The toy Code2Wav decoder and the two decode paths of spec §6 (streaming slice, chunked offline).

Contract kept from Qwen3-Omni's Code2Wav (spec §6, §9):

* input codes are **codebook-major** ``[B, 16, T]`` int64, every value in ``[0, 2048)``;
  codebook q is embedded at offset ``q·2048`` of one shared table and the 16 embeddings of a
  frame are averaged;
* every frame becomes :data:`TOTAL_UPSAMPLE` = 1920 samples at :data:`SAMPLE_RATE` = 24 kHz;
* decoding W frames yields exactly ``W·1920 − 555`` samples: the last :data:`TAIL` samples
  need the *next* frame and are not produced (the causal transposed-conv decoder's right-edge
  deficit);
* a sample of frame f depends on no frame before ``f − 24`` (:data:`RECEPTIVE_FIELD_FRAMES` is
  the exact reach), so a window that starts 25 frames back reproduces the offline samples.

Architecture, frame rate first, then sample rate:

1. averaged codebook embeddings, ``[B, H, T]``;
2. a causal conv over frames (kernel 3, left padding only), then a residual dilated causal conv
   (kernel 4, dilation 6): together they reach 2 + 18 = 20 frames back;
3. a frame-local linear ``H → 1920``: frame f's samples are a function of its conv features only;
4. a causal smoothing conv over samples (kernel 5, left padding only): it reaches 4 samples back,
   which can cross into the previous frame, hence one more frame of reach (21 in all);
5. a *look-ahead* conv with two taps 555 samples apart and no right padding: sample s mixes in
   sample ``s + 555``. This is where the deficit comes from, as in the real decoder, and why the
   streamed slice of spec §6 must re-decode the previous chunk's last 555 samples from context;
6. ``tanh``, so the waveform stays in (−1, 1).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from runtime.models._build import declaring, init_from_seed

log = logging.getLogger(__name__)

NUM_QUANTIZERS = 16
CODEBOOK_SIZE = 2048
#: HF config ``upsample_rates`` and ``upsampling_ratios``; their product is the samples per frame.
UPSAMPLE_RATES = (8, 5, 4, 3)
UPSAMPLING_RATIOS = (2, 2)
TOTAL_UPSAMPLE = 1920
SAMPLE_RATE = 24000
#: Milliseconds of audio per codec frame (12.5 frames per second).
FRAME_MS = 80
#: Right-edge deficit in samples: ``S = W·TOTAL_UPSAMPLE − TAIL`` for a window of W ≥ 1 frames.
TAIL = 555
#: Spec §9 defaults of the non-streaming decode (and the processor's left context).
DEFAULT_CHUNK_SIZE = 300
DEFAULT_LEFT_CONTEXT = 25
DEFAULT_SEED = 2150

_FRAME_KERNEL = 3
_DILATED_KERNEL = 4
_DILATION = 6
_SMOOTH_KERNEL = 5
_FRAME_REACH = (_FRAME_KERNEL - 1) + (_DILATED_KERNEL - 1) * _DILATION
#: How many frames before its own frame a retained output sample can depend on: the frame convs'
#: reach plus one, because the sample smoothing may reach back across one frame boundary.
RECEPTIVE_FIELD_FRAMES = _FRAME_REACH + (1 if _SMOOTH_KERNEL > 1 else 0)

assert TOTAL_UPSAMPLE == 8 * 5 * 4 * 3 * 2 * 2
assert RECEPTIVE_FIELD_FRAMES <= DEFAULT_LEFT_CONTEXT - 1, "left context 25 must cover the receptive field"
assert _SMOOTH_KERNEL - 1 < TOTAL_UPSAMPLE - TAIL, "smoothing must not reach two frames back from a slice start"


class Code2Wav(nn.Module):
    """Codec frames → waveform. ``forward(codes [B,16,W]) -> wav [B,1,W·1920 − 555]``.

    Built from ``seed`` on the CPU (see :mod:`runtime.models._build`) and moved to ``device``.
    ``hidden`` is the frame-feature width; it changes cost, not the contract.
    """

    def __init__(self, *, hidden: int = 32, seed: int = DEFAULT_SEED, device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.hidden = hidden
        with declaring():
            self.codebook_embed = nn.Embedding(NUM_QUANTIZERS * CODEBOOK_SIZE, hidden)
            self.frame_conv = nn.Conv1d(hidden, hidden, _FRAME_KERNEL)
            self.dilated_conv = nn.Conv1d(hidden, hidden, _DILATED_KERNEL, dilation=_DILATION)
            self.to_samples = nn.Linear(hidden, TOTAL_UPSAMPLE)
            self.smooth = nn.Conv1d(1, 1, _SMOOTH_KERNEL)
            self.lookahead = nn.Conv1d(1, 1, 2, dilation=TAIL)
        init_from_seed(self, seed, device)
        # Not a parameter: the fixed per-codebook offsets into the shared embedding table.
        self.register_buffer(
            "codebook_offsets",
            (torch.arange(NUM_QUANTIZERS, device=device) * CODEBOOK_SIZE).view(1, NUM_QUANTIZERS, 1),
            persistent=False,
        )

    @property
    def device(self) -> torch.device:
        # One parameter's (they all move together): walking ``parameters()`` at every step
        # costs twice as much, and a step asks several times.
        return self.codebook_embed.weight.device

    @torch.no_grad()
    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        """Decode a padded window. ``codes``: int64 ``[B, 16, W]`` on any device.

        Returns float32 ``[B, 1, max(0, W·1920 − 555)]`` on the model's device. Raises
        ``ValueError`` on a wrong shape or a code outside ``[0, 2048)``: a stop token (2150) or a
        codec special id reaching the decoder is a pipeline bug and should fail loudly, not
        become noise.
        """
        if codes.dim() != 3 or codes.shape[1] != NUM_QUANTIZERS:
            raise ValueError(f"Code2Wav expects codebook-major codes [B, {NUM_QUANTIZERS}, T]; got {list(codes.shape)}")
        batch, _, frames = codes.shape
        codes = codes.to(device=self.device, dtype=torch.int64)
        if frames == 0:
            return torch.zeros(batch, 1, 0, device=self.device)
        if bool(((codes < 0) | (codes >= CODEBOOK_SIZE)).any()):
            bad = codes[(codes < 0) | (codes >= CODEBOOK_SIZE)][0].item()
            raise ValueError(f"codec value {bad} outside [0, {CODEBOOK_SIZE}) reached Code2Wav")
        feats = self.codebook_embed(codes + self.codebook_offsets).mean(dim=1)  # [B, W, H]
        x = feats.transpose(1, 2)  # [B, H, W]
        # Left padding only: frame f never sees frame f+1 at frame rate.
        x = F.gelu(self.frame_conv(F.pad(x, (_FRAME_KERNEL - 1, 0))))
        x = x + F.gelu(self.dilated_conv(F.pad(x, ((_DILATED_KERNEL - 1) * _DILATION, 0))))
        wav = self.to_samples(x.transpose(1, 2)).reshape(batch, 1, frames * TOTAL_UPSAMPLE)
        wav = self.smooth(F.pad(wav, (_SMOOTH_KERNEL - 1, 0)))
        # No right padding: the last TAIL samples would need the next frame, so they do not exist.
        wav = self.lookahead(wav)
        return torch.tanh(wav)


def frames_to_codes(frames: torch.Tensor) -> torch.Tensor:
    """Talker frames ``[T, 16]`` (frame-major, as emitted) → codebook-major codes ``[1, 16, T]``."""
    if frames.dim() != 2 or frames.shape[1] != NUM_QUANTIZERS:
        raise ValueError(f"expected frames [T, {NUM_QUANTIZERS}]; got {list(frames.shape)}")
    return frames.transpose(0, 1).unsqueeze(0).to(torch.int64)


def unflatten_codes(input_ids: torch.Tensor, seq_token_counts: list[int]) -> torch.Tensor:
    """Rebuild the batch of a Code2Wav step from its flat ids (spec §6, input reconstruction).

    ``input_ids`` is the concatenation of each request's codebook-major flat codes;
    ``seq_token_counts[i]`` is request i's share. Each share is reshaped to ``[16, T_i]`` and the
    rows are zero-padded to the longest. A share whose length is not a multiple of 16 is
    zero-padded to one, with a warning (upstream only expects that during warm-up).
    """
    flat = input_ids.reshape(-1).to(torch.int64)
    if sum(seq_token_counts) != flat.numel():
        raise ValueError(f"seq_token_counts sum to {sum(seq_token_counts)}, input has {flat.numel()} ids")
    rows: list[torch.Tensor] = []
    for share in torch.split(flat, list(seq_token_counts)):
        if share.numel() % NUM_QUANTIZERS:
            log.warning("code2wav: %d ids is not a multiple of %d; zero-padding", share.numel(), NUM_QUANTIZERS)
            share = F.pad(share, (0, NUM_QUANTIZERS - share.numel() % NUM_QUANTIZERS))
        rows.append(share.reshape(NUM_QUANTIZERS, -1))
    width = max((r.shape[1] for r in rows), default=0)
    return torch.stack([F.pad(r, (0, width - r.shape[1])) for r in rows]) if rows else flat.new_zeros(0, 16, 0)


_warned_missing_meta = False


@torch.no_grad()
def stream_slice(left_frames: int, n_frames: int, tail: int) -> tuple[int, int]:
    """The samples a streamed chunk emits (#4706): shifted left by the decoder's right deficit, so
    each chunk first refills the previous chunk's trimmed tail from its re-decoded context."""
    return max(0, left_frames * TOTAL_UPSAMPLE - tail), max(0, n_frames * TOTAL_UPSAMPLE - tail)


def decode_chunks(model: Code2Wav, chunks: list[tuple[list[int], int]]) -> list[torch.Tensor]:
    """Decode a batch of streamed chunks, each ``(codebook-major flat ids, left context frames)``,
    into the samples each one emits (``[1, L]`` float32 tensors)."""
    counts = [len(ids) for ids, _ in chunks]
    flat = torch.tensor([i for ids, _ in chunks for i in ids], dtype=torch.int64)
    codes = unflatten_codes(flat, counts).to(model.device)
    return chunked_decode_streaming(model, codes, [left for _, left in chunks], counts)


def chunked_decode_streaming(
    model: Code2Wav,
    codes: torch.Tensor,
    left_context_size: list[int] | None,
    seq_token_counts: list[int] | None,
) -> list[torch.Tensor]:
    """Decode one streamed chunk per row and return only the samples that row has not emitted (spec §6).

    ``codes`` is the padded window ``[B, 16, W]``; row i holds ``n_i = seq_token_counts[i] // 16``
    real frames, the first ``left_context_size[i]`` of which are context the previous chunk
    already covered. With ``tail = max(0, W·1920 − S)`` (S = decoded length), row i emits
    ``wav[i, :, start_i:end_i]`` where ``start_i = max(0, left_i·1920 − tail)`` and
    ``end_i = max(0, n_i·1920 − tail)``: a first chunk gives ``n·1920 − tail`` samples and every
    later chunk ``(n_i − left_i)·1920``, its first ``tail`` samples re-decoded from the context to
    fill the previous chunk's deficit. Over a stream that sums to ``N·1920 − tail`` samples, equal
    (within float rounding) to the offline decode, provided each left context covers
    :data:`RECEPTIVE_FIELD_FRAMES` or reaches the stream's start.

    Missing or mismatched ``left_context_size`` / ``seq_token_counts`` are replaced by zeros with
    a one-time warning (upstream's cudagraph warm-up path); rows then emit nothing.

    Returns one float32 tensor ``[1, L_i]`` per row, on the model's device.
    """
    global _warned_missing_meta
    batch = codes.shape[0]
    if (
        left_context_size is None
        or seq_token_counts is None
        or len(left_context_size) != len(seq_token_counts)
        or len(seq_token_counts) != batch
    ):
        if not _warned_missing_meta:
            _warned_missing_meta = True
            log.warning("code2wav streaming: left_context_size/seq_token_counts missing or mismatched; using zeros")
        left_context_size = [0] * batch
        seq_token_counts = [0] * batch
    wav = model(codes)
    tail = max(0, codes.shape[-1] * TOTAL_UPSAMPLE - wav.shape[-1])
    out: list[torch.Tensor] = []
    for i in range(batch):
        start, end = stream_slice(left_context_size[i], seq_token_counts[i] // NUM_QUANTIZERS, tail)
        # A copy, not a view: a view would keep (and a serializer might ship) the whole batch's audio.
        out.append(wav[i, :, start:end].clone())
    return out


@torch.no_grad()
def chunked_decode(
    model: Code2Wav,
    codes: torch.Tensor,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    left_context_size: int = DEFAULT_LEFT_CONTEXT,
    seq_token_counts: list[int] | None = None,
) -> list[torch.Tensor]:
    """Non-streaming decode of whole requests in windows of ``chunk_size`` new frames (spec §6).

    Each window carries up to ``left_context_size`` earlier frames as context. ``codes`` is
    ``[B, 16, W]``; row i decodes its first ``seq_token_counts[i] // 16`` frames (all W when the
    counts are absent).

    Decision on the spec's [INFERRED] internal-boundary loss: upstream drops ``context·1920``
    samples from the front of every window, which with a 555-sample deficit loses 555 samples at
    every internal 300-frame boundary. We do **not** reproduce that: every window is cut with the
    streaming slice (``start = max(0, context·1920 − tail)``, ``end = window·1920 − tail``), so a
    window refills its predecessor's deficit from context. The result has exactly
    ``n_i·1920 − 555`` samples and equals the single-shot decode within float rounding (given
    ``left_context_size ≥`` :data:`RECEPTIVE_FIELD_FRAMES`, as the default 25 is).

    Returns one float32 tensor ``[1, L_i]`` per row, on the model's device.
    """
    if chunk_size <= 0 or left_context_size < 0:
        raise ValueError(f"chunk_size must be > 0 and left_context_size ≥ 0; got {chunk_size}, {left_context_size}")
    batch, _, width = codes.shape
    counts = [width * NUM_QUANTIZERS] * batch if seq_token_counts is None else list(seq_token_counts)
    if len(counts) != batch:
        raise ValueError(f"{len(counts)} seq_token_counts for a batch of {batch}")
    out: list[torch.Tensor] = []
    for i in range(batch):
        n_frames = min(width, counts[i] // NUM_QUANTIZERS)
        pieces = [torch.zeros(1, 0, device=model.device)]
        for begin in range(0, n_frames, chunk_size):
            stop = min(begin + chunk_size, n_frames)
            context_begin = max(0, begin - left_context_size)
            window = codes[i : i + 1, :, context_begin:stop]
            (piece,) = chunked_decode_streaming(
                model, window, [begin - context_begin], [(stop - context_begin) * NUM_QUANTIZERS]
            )
            pieces.append(piece)
        out.append(torch.cat(pieces, dim=-1))
    return out
