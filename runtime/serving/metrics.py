"""How streamed audio plays, and the server's Prometheus metrics under upstream's names.

:class:`Playback` is the one definition of time to first audio packet, real-time factor and
underrun, used by the server for ``/metrics`` and by ``omnisim bench serve`` on the client side.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

if TYPE_CHECKING:
    from runtime.connectors.stores import Store
    from runtime.orchestrator import Orchestrator

#: A gap in playback longer than this breaks continuity (upstream's continuity-OK threshold).
CONTINUITY_GAP_S = 0.100


@dataclass
class Playback:
    """A listener who starts playing at the first packet and plays every packet as it comes."""

    start_s: float
    first_packet_s: float | None = None
    audio_s: float = 0.0
    underrun_s: float = 0.0
    longest_gap_s: float = 0.0
    #: When what has arrived so far runs out.
    _plays_until: float = field(default=0.0, repr=False)

    def packet(self, now_s: float, seconds: float) -> None:
        if self.first_packet_s is None:
            self.first_packet_s = now_s
            self._plays_until = now_s
        gap = now_s - self._plays_until
        if gap > 0:
            self.underrun_s += gap
            self.longest_gap_s = max(self.longest_gap_s, gap)
            self._plays_until = now_s
        self._plays_until += seconds
        self.audio_s += seconds

    @property
    def ttfp_s(self) -> float | None:
        return None if self.first_packet_s is None else self.first_packet_s - self.start_s

    def rtf(self, end_s: float) -> float | None:
        """Generation time over audio time: below 1 keeps up with playback."""
        return (end_s - self.start_s) / self.audio_s if self.audio_s else None

    @property
    def continuous(self) -> bool:
        return self.longest_gap_s <= CONTINUITY_GAP_S


class ServingMetrics:
    """The counters and histograms of one server, in a registry of its own."""

    def __init__(self, engine: Orchestrator, store: Store) -> None:
        self.engine = engine
        self.store = store
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("omnisim_requests", "Requests accepted, by endpoint", ["endpoint"], registry=r)
        self.rejected = Counter("omnisim_requests_rejected", "Requests refused with a 4xx", ["endpoint"], registry=r)
        self.aborts = Counter("omnisim_aborts", "Requests whose client went away before the end", registry=r)
        self.failed = Counter("omnisim_requests_failed", "Requests that ended with an error", registry=r)
        buckets = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
        self.ttfp = Histogram("vllm:omni_audio_ttfp_s", "Time to first audio packet", registry=r, buckets=buckets)
        self.rtf = Histogram(
            "vllm:omni_audio_rtf", "Real-time factor", registry=r, buckets=(0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
        )
        self.underrun = Histogram(
            "vllm:omni_audio_underrun_s", "Seconds a listener waited mid-stream", registry=r, buckets=buckets
        )
        self.queue = Gauge("omnisim_stage_requests", "Requests live on a stage", ["stage"], registry=r)
        self.segments = Gauge("omnisim_store_segments", "Segments in the store", registry=r)
        self.lock_files = Gauge("omnisim_store_lock_files", "Lock files in the store", registry=r)

    def finished(self, playback: Playback, end_s: float) -> None:
        if playback.ttfp_s is not None:
            self.ttfp.observe(playback.ttfp_s)
        rtf = playback.rtf(end_s)
        if rtf is not None:
            self.rtf.observe(rtf)
        self.underrun.observe(playback.underrun_s)

    def exposition(self) -> bytes:
        """The Prometheus text, with the gauges read now."""
        for stage in self.engine.config.stages:
            live = sum(
                1
                for state in self.engine.requests.values()
                if stage.stage_id in state.stage_requests and stage.stage_id not in state.finished_stages
            )
            self.queue.labels(stage=stage.name).set(live)
        self.segments.set(len(self.store.segments()))
        self.lock_files.set(len(self.store.lock_files()))
        return generate_latest(self.registry)
