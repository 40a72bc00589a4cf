"""The toy models keep the contracts the pipeline relies on (spec §4.1, §4.2, §6, §7, §9)."""

from __future__ import annotations

import itertools
import logging
import random

import pytest
import torch

from runtime.models import (
    ACCEPT_HIDDEN_LAYER,
    BIN_MS,
    CODEBOOK_SIZE,
    NUM_QUANTIZERS,
    RECEPTIVE_FIELD_FRAMES,
    SAMPLE_RATE,
    STOP_TOKEN,
    TAIL,
    TOTAL_UPSAMPLE,
    Code2Wav,
    ForcedAligner,
    Talker,
    TalkerConditioning,
    Thinker,
    ToyTokenizer,
    chunked_decode,
    chunked_decode_streaming,
    conditioning_from_thinker,
    frames_for_text,
    frames_to_codes,
    is_placeholder_frame,
    is_stop_frame,
    placeholder_frames_for_prompt,
    segment_words,
    steps_for_text,
    unflatten_codes,
)
from runtime.models import code2wav as code2wav_module
from runtime.models.thinker import DURATION_CHANNEL, EOS_ID, answer_token_ids, before_stop

U = TOTAL_UPSAMPLE
#: The Qwen3-Omni deploy settings of ``talker2code2wav_async_chunk`` (spec §9).
INITIAL, CHUNK, LEFT = 4, 25, 25
#: About 250 characters: a ~10 s utterance.
LONG_TEXT = (
    "The quick brown fox jumps over the lazy dog while the five boxing wizards jump quickly. "
    "Pack my box with five dozen liquor jugs, then sphinx of black quartz judge my vow. "
    "How vexingly quick daft zebras jump when the wind blows over the hills at dawn today."
)


@pytest.fixture(scope="module")
def code2wav() -> Code2Wav:
    return Code2Wav()


@pytest.fixture(scope="module")
def thinker() -> Thinker:
    return Thinker()


@pytest.fixture(scope="module")
def talker() -> Talker:
    return Talker()


def random_codes(frames: int, seed: int = 0, batch: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, CODEBOOK_SIZE, (batch, NUM_QUANTIZERS, frames), generator=generator)


# --- the async-chunk schedule of talker2code2wav_async_chunk (spec §4.1), as Code2Wav sees it ---


def processor_windows(total: int, *, stop_frame_finishes: bool) -> list[tuple[int, int, int]]:
    """The (first frame, left context, frames on the wire) of each chunk of a ``total``-frame stream.

    Frames arrive one per call; the request finishes either on the call that brings the last frame
    or (``stop_frame_finishes``) on one more call that brings only the stop frame.
    """
    windows: list[tuple[int, int, int]] = []
    calls = [(n, n == total and not stop_frame_finishes, True) for n in range(1, total + 1)]
    if stop_frame_finishes or total == 0:
        calls.append((total, True, False))
    for length, finished, appended in calls:
        if length <= 0:
            continue
        chunk_id = len(windows)
        size = INITIAL if chunk_id == 0 else CHUNK
        if chunk_id > 0:
            length -= INITIAL
        remainder = length % size
        if remainder and not finished:
            continue
        if finished and not appended and remainder == 0:
            continue  # the adapter sends an empty terminal
        context = remainder or size
        if chunk_id == 1:
            left, end = INITIAL, length + INITIAL
        else:
            left = max(0, min(length - context, LEFT))
            end = min(length, left + context)
        absolute_end = length + (INITIAL if chunk_id > 0 else 0)
        windows.append((absolute_end - end, left, end))
    return windows


def streamed_decode(model: Code2Wav, codes: torch.Tensor, *, stop_frame_finishes: bool = False) -> torch.Tensor:
    """Decode ``codes [1,16,N]`` chunk by chunk as the async pipeline does; the concatenated audio."""
    pieces: list[torch.Tensor] = []
    for first, left, frames in processor_windows(codes.shape[-1], stop_frame_finishes=stop_frame_finishes):
        window = codes[:, :, first : first + frames]
        (piece,) = chunked_decode_streaming(model, window, [left], [frames * NUM_QUANTIZERS])
        pieces.append(piece)
    return torch.cat(pieces, dim=-1) if pieces else torch.zeros(1, 0)


def test_processor_schedule_matches_the_worked_example() -> None:
    assert processor_windows(60, stop_frame_finishes=False) == [(0, 0, 4), (0, 4, 29), (4, 25, 50), (29, 25, 31)]
    assert processor_windows(3, stop_frame_finishes=True) == [(0, 0, 3)]
    assert processor_windows(10, stop_frame_finishes=True) == [(0, 0, 4), (0, 4, 10)]
    # Finish on the stop frame exactly at a boundary: nothing more to send (empty terminal).
    assert processor_windows(29, stop_frame_finishes=True) == [(0, 0, 4), (0, 4, 29)]


# --- Code2Wav ---


def test_code2wav_length_is_frames_times_1920_minus_the_tail(code2wav: Code2Wav) -> None:
    assert (TOTAL_UPSAMPLE, TAIL, SAMPLE_RATE) == (1920, 555, 24000)
    for frames in (1, 2, 3, 30):
        wav = code2wav(random_codes(frames, batch=2))
        assert wav.shape == (2, 1, frames * U - TAIL)
        assert wav.dtype == torch.float32
        assert float(wav.abs().max()) < 1.0
    assert code2wav(random_codes(0)).shape == (1, 1, 0)


def test_code2wav_is_deterministic_and_seeded(code2wav: Code2Wav) -> None:
    codes = random_codes(12, seed=3)
    first = code2wav(codes)
    assert torch.equal(first, code2wav(codes))
    assert torch.equal(first, Code2Wav()(codes))
    assert not torch.equal(first, Code2Wav(seed=1)(codes))


def test_building_models_leaves_the_global_random_state_alone() -> None:
    before = torch.get_rng_state()
    Thinker(), Talker(), Code2Wav(), ForcedAligner()
    assert torch.equal(before, torch.get_rng_state())


def test_code2wav_rejects_codes_outside_the_codebook(code2wav: Code2Wav) -> None:
    codes = random_codes(5)
    codes[0, 0, 2] = STOP_TOKEN
    with pytest.raises(ValueError, match="2150"):
        code2wav(codes)
    with pytest.raises(ValueError, match="codebook-major"):
        code2wav(random_codes(5)[0].T.unsqueeze(0))  # frame-major: the missing transpose


def test_receptive_field_is_as_declared_and_inside_the_left_context(code2wav: Code2Wav) -> None:
    assert RECEPTIVE_FIELD_FRAMES <= LEFT - 1
    codes = random_codes(60, seed=5)
    j = 20
    changed = codes.clone()
    changed[0, :, j] = (changed[0, :, j] + 1000) % CODEBOOK_SIZE
    diff = (code2wav(codes) - code2wav(changed)).abs()[0, 0]
    # Causal apart from the 555-sample look-ahead that is the right-edge deficit.
    assert float(diff[: j * U - TAIL].max()) == 0.0
    assert float(diff[j * U - TAIL : (j + 1) * U].max()) > 0.0
    # Reach: frame j + RECEPTIVE_FIELD_FRAMES still feels frame j, the next one does not.
    reach = j + RECEPTIVE_FIELD_FRAMES
    assert float(diff[reach * U : (reach + 1) * U].max()) > 0.0
    assert float(diff[(reach + 1) * U :].max()) == 0.0


@pytest.mark.parametrize("stop_frame_finishes", [False, True])
@pytest.mark.parametrize("total", [1, 2, 3, 4, 5, 10, 28, 29, 30, 33, 54, 55, 60, 4 + 25 + 25 + 13, 104, 130])
def test_streamed_decode_equals_offline_decode(code2wav: Code2Wav, total: int, stop_frame_finishes: bool) -> None:
    codes = random_codes(total, seed=total)
    offline = code2wav(codes)[0]
    streamed = streamed_decode(code2wav, codes, stop_frame_finishes=stop_frame_finishes)
    assert streamed.shape == (1, total * U - TAIL)
    assert torch.allclose(streamed, offline, atol=1e-5, rtol=0)


def test_pre_4706_slice_loses_the_tail_at_every_boundary(code2wav: Code2Wav) -> None:
    """The regression the streaming formula fixes: slicing ``[left·U : n·U]`` drops samples."""
    codes = random_codes(67, seed=1)
    windows = processor_windows(67, stop_frame_finishes=False)
    total = 0
    for first, left, frames in windows:
        wav = code2wav(codes[:, :, first : first + frames])
        total += wav[0, :, left * U : frames * U].shape[-1]
    assert total == 67 * U - len(windows) * TAIL


def test_streaming_rows_of_a_padded_batch_match_their_single_decodes(code2wav: Code2Wav) -> None:
    codes = random_codes(80, seed=9)
    late = codes[:, :, 30:80]  # chunk k ≥ 2: 25 frames of context + 25 new
    early = codes[:, :, 0:29]  # chunk 1: the initial 4 as context + 25 new
    batch = torch.zeros(2, NUM_QUANTIZERS, 50, dtype=torch.int64)
    batch[0] = late[0]
    batch[1, :, :29] = early[0]
    rows = chunked_decode_streaming(code2wav, batch, [25, 4], [50 * 16, 29 * 16])
    (alone_late,) = chunked_decode_streaming(code2wav, late, [25], [50 * 16])
    (alone_early,) = chunked_decode_streaming(code2wav, early, [4], [29 * 16])
    assert rows[0].shape == (1, 25 * U) and rows[1].shape == (1, 25 * U)
    assert torch.allclose(rows[0], alone_late, atol=1e-5, rtol=0)
    assert torch.allclose(rows[1], alone_early, atol=1e-5, rtol=0)


def test_streaming_without_metadata_warns_once_and_emits_nothing(
    code2wav: Code2Wav, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(code2wav_module, "_warned_missing_meta", False)
    with caplog.at_level(logging.WARNING, logger="runtime.models.code2wav"):
        first = chunked_decode_streaming(code2wav, random_codes(6, batch=2), None, None)
        second = chunked_decode_streaming(code2wav, random_codes(6), [0, 0], [96])
    assert [w.shape for w in first + second] == [(1, 0)] * 3
    assert len([r for r in caplog.records if "missing or mismatched" in r.message]) == 1


@pytest.mark.parametrize(("total", "chunk_size"), [(0, 7), (1, 7), (7, 7), (30, 7), (61, 7), (64, 32), (301, 300)])
def test_chunked_decode_is_exact(code2wav: Code2Wav, total: int, chunk_size: int) -> None:
    codes = random_codes(total, seed=total)
    (wav,) = chunked_decode(code2wav, codes, chunk_size=chunk_size)
    assert wav.shape == (1, max(0, total * U - TAIL))
    assert torch.allclose(wav, code2wav(codes)[0], atol=1e-5, rtol=0)


def test_chunked_decode_honours_seq_token_counts(code2wav: Code2Wav) -> None:
    codes = random_codes(20, seed=4, batch=2)
    short, full = chunked_decode(code2wav, codes, chunk_size=8, seq_token_counts=[12 * 16, 20 * 16])
    assert short.shape == (1, 12 * U - TAIL) and full.shape == (1, 20 * U - TAIL)
    assert torch.allclose(short, code2wav(codes[0:1, :, :12])[0], atol=1e-5, rtol=0)


def test_unflatten_codes_reads_the_codebook_major_wire_layout() -> None:
    a, b = random_codes(5, seed=1)[0], random_codes(3, seed=2)[0]
    flat = torch.cat([a.reshape(-1), b.reshape(-1)])  # codebook 0's frames first, then codebook 1's …
    codes = unflatten_codes(flat, [a.numel(), b.numel()])
    assert codes.shape == (2, NUM_QUANTIZERS, 5)
    assert torch.equal(codes[0], a) and torch.equal(codes[1, :, :3], b)
    assert int(codes[1, :, 3:].abs().sum()) == 0
    frames = a.T  # what the Talker emits, frame by frame
    assert torch.equal(frames_to_codes(frames)[0], a)
    assert torch.equal(frames.T.reshape(-1), a.reshape(-1))


# --- Thinker ---


def test_tokenizer_is_reversible() -> None:
    for text in ("hello world", "héllo wörld ✓", "a", "", "odd!"):
        assert ToyTokenizer.decode(ToyTokenizer.encode(text)) == text


def test_frames_for_text_scales_with_the_text() -> None:
    assert frames_for_text("hi") == 1
    assert frames_for_text("hello world") == 6
    assert frames_for_text("  hello   world ") == 6
    assert frames_for_text("") == 0
    assert 115 <= frames_for_text(LONG_TEXT) <= 135  # ≈ 10 s at 12.5 frames/s


def test_thinker_steps_echo_the_text_and_emit_rows_per_position(thinker: Thinker) -> None:
    state = thinker.init_state("héllo  wörld")
    steps = []
    while not state.finished:
        steps.append(thinker.step(state))
    assert "".join(s.text_delta for s in steps) == "héllo wörld"
    assert steps[-1].token_id == EOS_ID and steps[-1].finished
    assert steps[0].layers[0].shape == (len(state.prompt_token_ids), thinker.hidden)
    assert all(s.layers[ACCEPT_HIDDEN_LAYER].shape == (1, thinker.hidden) for s in steps[1:])
    # Row k ≥ 1 is the position of the token produced by step k − 1; its duration channel says so.
    for previous, current in itertools.pairwise(steps):
        assert current.layers[0][0, DURATION_CHANNEL] == ToyTokenizer.duration(previous.token_id)
    with pytest.raises(RuntimeError):
        thinker.step(state)


def test_thinker_generate_is_deterministic(thinker: Thinker) -> None:
    out = thinker.generate("hello world")
    again = Thinker().generate("hello world")
    assert out.text == "hello world"
    assert out.output_token_ids == again.output_token_ids
    rows = len(out.prompt_token_ids) + len(out.output_token_ids) - 1  # no row for the final EOS
    for index, layer in out.layers.items():
        assert layer.shape == (rows, thinker.hidden)
        assert torch.equal(layer, again.layers[index])
    assert set(out.tts_embeds) == {"tts_bos", "tts_eos", "tts_pad"}


def test_a_stop_string_ends_the_answer_just_before_it_with_eos() -> None:
    """As vLLM's ``stop`` without ``include_stop_str_in_output``: the echo ends where the stop
    string begins, the stop string is not said, and EOS follows (the answer ended by itself)."""
    said = answer_token_ids("hello   world", stop=["o w"])  # (found in the answer: spaces normalised)
    assert said == [*ToyTokenizer.encode("hell"), EOS_ID]
    assert ToyTokenizer.decode(said) == "hell"
    assert answer_token_ids("hello world", stop=["xyz"]) == answer_token_ids("hello world")
    assert answer_token_ids("hello world", stop=[]) == answer_token_ids("hello world")
    # At the very start: nothing is said, EOS alone.
    assert answer_token_ids("hello world", stop=["hello"]) == [EOS_ID]
    # The one completed first wins, as vLLM finds it while the text is generated; at the same
    # character, the one listed first.
    assert before_stop("hello world", ["world", "or"]) == "hello w"
    assert before_stop("hello world", ["or", "world"]) == "hello w"
    assert before_stop("abc", ["c", "bc"]) == "ab"
    assert before_stop("abc", ["bc", "c"]) == "a"
    assert before_stop("abcabc", ["ca"]) == "ab"  # its first occurrence


def test_max_tokens_cuts_an_answer_that_stops_as_it_cuts_any_other() -> None:
    before = [*ToyTokenizer.encode("hello "), EOS_ID]  # three pieces and EOS
    assert answer_token_ids("hello world", 2, ["world"]) == before[:2]  # "length": no EOS
    assert answer_token_ids("hello world", 4, ["world"]) == before
    assert answer_token_ids("hello world", 99, ["world"]) == before


@pytest.mark.parametrize("stop", [[""], ["world", ""]])
def test_an_empty_stop_string_is_refused_as_vllm_refuses_it(thinker: Thinker, stop: list[str]) -> None:
    with pytest.raises(ValueError, match="stop cannot contain an empty string"):
        thinker.init_state("hello world", stop=stop)


@pytest.mark.parametrize(
    ("stop", "max_tokens", "text", "reason"),
    [
        (["wor"], None, "hello ", "stop"),
        (["hello"], None, "", "stop"),
        (["wor"], 2, "hell", "length"),
    ],
)
def test_thinker_steps_end_before_the_stop_string(
    thinker: Thinker, stop: list[str], max_tokens: int | None, text: str, reason: str
) -> None:
    state = thinker.init_state("hello world", max_tokens, stop)
    steps = []
    while not state.finished:
        steps.append(thinker.step(state))
    assert "".join(s.text_delta for s in steps) == text
    assert state.finish_reason == reason
    assert state.output_token_ids == answer_token_ids("hello world", max_tokens, stop)
    # A stop string at the start ends the request at its prefill, which said EOS.
    assert steps[0].finished == (text == "")
    out = thinker.generate("hello world", max_tokens, stop)
    assert out.text == text and out.output_token_ids == state.output_token_ids


# --- Talker ---


def valid_frames(frames: torch.Tensor) -> torch.Tensor:
    return torch.stack([f for f in frames if not is_placeholder_frame(f) and not is_stop_frame(f)])


@pytest.mark.parametrize("text", ["hi", "hello world", LONG_TEXT])
def test_talker_frames_placeholders_codes_stop(thinker: Thinker, talker: Talker, text: str) -> None:
    out = thinker.generate(text)
    frames = talker.generate(conditioning_from_thinker(out))
    placeholders = placeholder_frames_for_prompt(len(out.prompt_token_ids))
    assert placeholders >= 1
    assert frames.shape == (steps_for_text(text), NUM_QUANTIZERS) and frames.dtype == torch.int64
    assert all(is_placeholder_frame(f) for f in frames[:placeholders])
    codes = frames[placeholders:-1]
    assert codes.shape[0] == frames_for_text(text)
    assert bool(((codes >= 0) & (codes < CODEBOOK_SIZE)).all()) and bool((codes[:, 0] > 0).all())
    assert frames[-1, 0] == STOP_TOKEN and is_stop_frame(frames[-1])
    assert len({tuple(c.tolist()) for c in codes}) > codes.shape[0] // 2  # not one repeated frame


def test_talker_is_deterministic_and_seeded(thinker: Thinker, talker: Talker) -> None:
    conditioning = conditioning_from_thinker(thinker.generate("hello world"))
    frames = talker.generate(conditioning)
    assert torch.equal(frames, Talker().generate(conditioning))
    assert not torch.equal(frames, Talker(seed=1).generate(conditioning))


@pytest.mark.parametrize("seed", range(3))
def test_streamed_conditioning_gives_the_same_frames(thinker: Thinker, talker: Talker, seed: int) -> None:
    """Thinker and Talker interleaved as the async pipeline runs them (spec §4.2's chunk-0 rule)."""
    text = "hello there, general kenobi"
    full = talker.generate(conditioning_from_thinker(thinker.generate(text)))
    rng = random.Random(seed)
    state = thinker.init_state(text)
    cached: list[torch.Tensor] = []
    cached_hidden: list[torch.Tensor] = []
    talker_state = None
    frames: list[torch.Tensor] = []
    finished = False
    while not finished:
        run_thinker = not state.finished and (
            talker_state is None or not talker.ready(talker_state) or rng.random() < 0.5
        )
        if run_thinker:
            step = thinker.step(state)
            if talker_state is None:
                cached.append(step.layers[0])
                cached_hidden.append(step.layers[ACCEPT_HIDDEN_LAYER])
                rows = torch.cat(cached)
                # Chunk 0 waits for one generated position beyond the prompt (or the finish).
                if rows.shape[0] > len(state.prompt_token_ids) or step.finished:
                    talker_state = talker.init_state(
                        TalkerConditioning(rows, len(state.prompt_token_ids), torch.cat(cached_hidden), step.finished)
                    )
            else:
                talker.feed(talker_state, step.layers[0], finished=step.finished)
        else:
            assert talker_state is not None
            frame, talker_state, finished = talker.step(talker_state)
            frames.append(frame)
    assert torch.equal(torch.cat(frames), full)


def test_talker_refuses_to_step_when_starved_or_finished(thinker: Thinker, talker: Talker) -> None:
    out = thinker.generate("hi")
    prompt = len(out.prompt_token_ids)
    state = talker.init_state(
        TalkerConditioning(out.layers[0][:prompt], prompt, out.layers[ACCEPT_HIDDEN_LAYER][:prompt])
    )
    for _ in range(placeholder_frames_for_prompt(prompt)):
        frame, state, finished = talker.step(state)
        assert is_placeholder_frame(frame) and not finished
    assert not talker.ready(state)
    with pytest.raises(RuntimeError, match="waiting for upstream"):
        talker.step(state)
    talker.feed(state, out.layers[0][prompt:], finished=True)
    frame, state, finished = talker.step(state)
    assert not is_placeholder_frame(frame) and not finished
    frame, state, finished = talker.step(state)
    assert is_stop_frame(frame) and finished
    with pytest.raises(RuntimeError, match="finished"):
        talker.step(state)
    with pytest.raises(ValueError):
        talker.generate(TalkerConditioning(out.layers[0], prompt))


# --- Aligner ---


def check_cover(stamps: list, words: list[str], samples: int) -> None:
    assert [s.word for s in stamps] == words
    assert stamps[0].start_ms == 0.0
    assert stamps[-1].end_ms == pytest.approx(samples / SAMPLE_RATE * 1000)
    for s, t in itertools.pairwise(stamps):
        assert s.start_ms <= s.end_ms == t.start_ms
    for s in stamps[1:]:
        assert s.start_ms % BIN_MS == 0 or s.start_ms == stamps[-1].end_ms


def test_aligner_covers_the_whole_decoded_audio(thinker: Thinker, talker: Talker, code2wav: Code2Wav) -> None:
    text = "hello there, general kenobi"
    frames = talker.generate(conditioning_from_thinker(thinker.generate(text)))
    wav = code2wav(frames_to_codes(valid_frames(frames)))[0, 0]
    assert wav.numel() == frames_for_text(text) * U - TAIL
    words = segment_words(text)
    stamps = ForcedAligner().align(wav, words)
    check_cover(stamps, words, wav.numel())
    assert all(s.end_ms > s.start_ms for s in stamps)


def test_aligner_follows_the_energy() -> None:
    noise = torch.randn(SAMPLE_RATE, generator=torch.Generator().manual_seed(0)) * 0.3
    aligner = ForcedAligner()
    even = aligner.align(torch.cat([noise, noise]), ["aaaa", "bbbb"])
    quiet_then_loud = aligner.align(torch.cat([noise * 0.01, noise]), ["aaaa", "bbbb"])
    assert even[0].end_ms == pytest.approx(1000, abs=BIN_MS)
    assert quiet_then_loud[0].end_ms > 1500
    check_cover(quiet_then_loud, ["aaaa", "bbbb"], 2 * SAMPLE_RATE)


def test_aligner_edge_cases() -> None:
    aligner = ForcedAligner()
    assert aligner.align(torch.ones(100), []) == []
    words = ["a", "b", "c", "d", "e"]
    short = torch.ones(3 * 1920 - TAIL)  # fewer 80 ms bins than words
    check_cover(aligner.align(short, words), words, short.numel())
    assert [tuple(s)[1:] for s in aligner.align(torch.zeros(0), ["x"])] == [(0.0, 0.0)]


# --- the whole toy chain, streamed ---


def test_streamed_pipeline_audio_equals_offline(thinker: Thinker, talker: Talker, code2wav: Code2Wav) -> None:
    frames = talker.generate(conditioning_from_thinker(thinker.generate(LONG_TEXT)))
    codes = frames_to_codes(valid_frames(frames))
    streamed = streamed_decode(code2wav, codes, stop_frame_finishes=True)
    assert streamed.shape == (1, frames_for_text(LONG_TEXT) * U - TAIL)
    assert torch.allclose(streamed, code2wav(codes)[0], atol=1e-5, rtol=0)
    check_cover(
        ForcedAligner().align(streamed[0], segment_words(LONG_TEXT)), segment_words(LONG_TEXT), streamed.numel()
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_models_run_on_cuda() -> None:
    text = "hello world"
    out = Thinker(device="cuda").generate(text)
    cpu_out = Thinker().generate(text)
    assert out.layers[0].device.type == "cuda" and out.text == cpu_out.text
    assert torch.allclose(out.layers[ACCEPT_HIDDEN_LAYER].cpu(), cpu_out.layers[ACCEPT_HIDDEN_LAYER], atol=1e-4)
    frames = Talker(device="cuda").generate(conditioning_from_thinker(out))
    assert frames.shape == (steps_for_text(text), NUM_QUANTIZERS) and is_stop_frame(frames[-1])
    codes = random_codes(67, seed=2)
    gpu = Code2Wav(device="cuda")
    offline = gpu(codes)[0]
    streamed = streamed_decode(gpu, codes.cuda())
    assert offline.device.type == "cuda" and streamed.shape == (1, 67 * U - TAIL)
    assert torch.allclose(streamed.cpu(), offline.cpu(), atol=1e-5, rtol=0)
    assert torch.allclose(offline.cpu(), Code2Wav()(codes)[0], atol=1e-4, rtol=0)
    stamps = ForcedAligner(device="cuda").align(offline[0], ["hello", "world"])
    assert stamps[-1].end_ms == pytest.approx(offline.numel() / SAMPLE_RATE * 1000)
