"""``omnisim bench serve``: drive a running server over HTTP at several concurrencies and print
upstream's serving metrics (``vllm bench serve --omni``), measured on the client side.

Each request streams ``/v1/audio/speech`` as server-sent events. A listener starts playing at
the first audio packet (:class:`~runtime.serving.metrics.Playback`): ``audio_ttfp`` is the time
to that packet, ``audio_rtf`` the request's time over its audio's duration, ``audio_underrun``
the time the listener waited mid-stream, and continuity is OK when no wait exceeded 100 ms. Audio
seconds per second is the audio delivered over the level's wall time.

It also checks the audio. Streamed alone, a text's audio must equal its non-streamed audio byte
for byte (every sample once, none lost or repeated); that failing is exit status 1. Under load,
requests share batches, and a batched matrix product rounds differently from one alone, so
samples may move by a least significant bit (vLLM's kernels are not batch-invariant either): per
level, the report gives whether every stream had the reference's sample count and the largest
deviation in LSBs.
"""

from __future__ import annotations

import base64
import json
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from omnisim.base import CommandFailed, UsageError
from runtime.models.code2wav import SAMPLE_RATE
from runtime.serving.metrics import Playback

TEXTS = (
    "The quick brown fox jumps over the lazy dog.",
    "Streaming audio should start quickly and never stall.",
    "Every sample is sent once, in order, to the listener.",
    "Shared memory moves chunks between the stages.",
)


@dataclass
class Level:
    concurrency: int
    playbacks: list[Playback] = field(default_factory=list)
    rtfs: list[float] = field(default_factory=list)
    seconds: float = 0.0
    #: Each text's streamed PCM, as received.
    streamed: dict[str, list[bytes]] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        ttfp_ms = [p.ttfp_s * 1000 for p in self.playbacks if p.ttfp_s is not None]
        audio = [p.audio_s for p in self.playbacks]
        return {
            "concurrency": self.concurrency,
            "requests": len(self.playbacks),
            "audio_ttfp_ms": _stats(ttfp_ms),
            "audio_rtf": _stats(self.rtfs),
            "audio_duration_s": _stats(audio),
            "audio_underrun_s": _stats([p.underrun_s for p in self.playbacks]),
            "continuity_ok_rate": (
                sum(p.continuous for p in self.playbacks) / len(self.playbacks) if self.playbacks else None
            ),
            "audio_s_per_s": sum(audio) / self.seconds if self.seconds else None,
        }

    def compared(self, reference: dict[str, bytes]) -> dict[str, Any]:
        """Whether every stream had its reference's sample count, and the largest deviation."""
        import numpy as np

        counts_match, worst = True, 0
        for text, pcms in self.streamed.items():
            ref = np.frombuffer(reference[text], "<i2").astype(np.int32)
            for pcm in pcms:
                got = np.frombuffer(pcm, "<i2").astype(np.int32)
                if got.size != ref.size:
                    counts_match = False
                    continue
                worst = max(worst, int(np.abs(got - ref).max(initial=0)))
        return {"sample_counts_match": counts_match, "max_deviation_lsb": worst}


def _stats(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "median": None, "p99": None}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return {"mean": statistics.fmean(values), "median": statistics.median(values), "p99": p99}


async def _streamed(client: Any, url: str, text: str) -> tuple[Playback, float, bytes]:
    start = time.monotonic()
    playback = Playback(start)
    pcm = bytearray()
    body = {"input": text, "stream": True, "response_format": "pcm"}
    async with client.stream("POST", f"{url}/v1/audio/speech", json=body) as response:
        if response.status_code != 200:
            raise CommandFailed(f"the server answered {response.status_code}: {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            if event["type"] == "speech.audio.delta":
                chunk = base64.b64decode(event["audio"])
                pcm += chunk
                playback.packet(time.monotonic(), len(chunk) / 2 / SAMPLE_RATE)
            elif event["type"] == "speech.audio.error":
                raise CommandFailed(f"a request failed: {event['error']['message']}")
    return playback, time.monotonic(), bytes(pcm)


async def _whole(client: Any, url: str, text: str) -> bytes:
    response = await client.post(f"{url}/v1/audio/speech", json={"input": text, "response_format": "pcm"})
    if response.status_code != 200:
        raise CommandFailed(f"the server answered {response.status_code}: {response.text[:300]}")
    return response.content


def run(url: str, concurrencies: list[int], prompts: int | None, timeout_s: float) -> dict[str, Any]:
    import httpx
    import trio

    async def main() -> dict[str, Any]:
        levels = []
        async with httpx.AsyncClient(timeout=timeout_s) as client:
            try:
                (await client.get(f"{url}/health")).raise_for_status()
            except httpx.HTTPError as e:
                raise UsageError(f"no healthy server at {url}: {e}") from None
            for concurrency in concurrencies:
                level = Level(concurrency)
                todo = list(range(prompts or 2 * concurrency))
                start = time.monotonic()

                async def worker(level: Level = level, todo: list[int] = todo) -> None:
                    while todo:
                        text = TEXTS[todo.pop() % len(TEXTS)]
                        playback, end, pcm = await _streamed(client, url, text)
                        level.playbacks.append(playback)
                        level.rtfs.append(playback.rtf(end) or 0.0)
                        level.streamed.setdefault(text, []).append(pcm)

                async with trio.open_nursery() as nursery:
                    for _ in range(concurrency):
                        nursery.start_soon(worker)
                level.seconds = time.monotonic() - start
                levels.append(level)
            # Alone, one request after the other: no batch shared with anyone.
            reference = {text: await _whole(client, url, text) for text in TEXTS}
            identical = {text: (await _streamed(client, url, text))[2] == reference[text] for text in TEXTS}
        summaries = [level.summary() | level.compared(reference) for level in levels]
        return {"url": url, "levels": summaries, "identical": identical}

    return trio.run(main)


def print_table(report: dict[str, Any]) -> None:
    def ms(stats: dict[str, float | None], unit: str = "") -> str:
        return "/".join("-" if v is None else f"{v:.0f}" if unit == "ms" else f"{v:.3f}" for v in stats.values())

    print(f"omnisim bench serve against {report['url']} (mean/median/p99)")
    print(
        f"{'concurrency':>11} {'requests':>8} {'audio_ttfp ms':>17} {'audio_rtf':>19} {'audio_duration s':>20} "
        f"{'audio_underrun s':>20} {'continuity OK':>13} {'audio s/s':>9}"
    )
    for level in report["levels"]:
        ok = level["continuity_ok_rate"]
        print(
            f"{level['concurrency']:>11} {level['requests']:>8} {ms(level['audio_ttfp_ms'], 'ms'):>17} "
            f"{ms(level['audio_rtf']):>19} {ms(level['audio_duration_s']):>20} {ms(level['audio_underrun_s']):>20} "
            f"{'-' if ok is None else f'{100 * ok:.0f}%':>13} {level['audio_s_per_s'] or 0:>9.2f}"
        )
    same = sum(report["identical"].values())
    print(f"streamed alone, identical to the non-streamed request: {same}/{len(report['identical'])} texts")
    for level in report["levels"]:
        counts = "every stream had the reference's sample count" if level["sample_counts_match"] else "COUNTS DIFFER"
        print(
            f"  under concurrency {level['concurrency']}: {counts}; largest deviation "
            f"{level['max_deviation_lsb']} LSB (batched numerics)"
        )
