"""``omnisim soak``: many requests through the real engine, as an operator would run it.

Requests come from ``concurrency`` clients at once; about 15 % are aborted at a random moment
(the client stops listening), about 10 % reuse an id right after it ended, and — with
``kill_every`` — a random stage process is SIGKILLed every so many seconds; with ``faults``
(``--fault``, ``--faults sampled``; the stages in one process) the connectors' puts and gets meet
the storage and decode failures the simulator injects, raised by
:class:`~omnisim.faults.FaultingKernel`. Every request is checked: exactly one terminal; a
completed request's audio is, sample for sample, that of its text run alone; a failed one failed
because a stage died (and only while one was down), because a fault struck one of its chunks, or
because it was aborted. At the end nothing may be left: no name in /dev/shm of the engine's
namespaces, no per-request state in any stage. Figures: requests/s, latency percentiles,
restarts, faults injected, each stage process's memory (RSS) growth over the second half of the
run.
"""

from __future__ import annotations

import os
import random
import signal
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import trio

from omnisim.faults import FaultingKernel, FaultPlan, faults_of_specs
from runtime.client import generate
from runtime.config.pipeline import PipelineConfig, load_pipeline
from runtime.connectors.keys import external_id_of
from runtime.connectors.posix_store import PosixStore
from runtime.kernel import use_kernel
from runtime.orchestrator import Orchestrator
from runtime.pipeline import Models, build_engine
from runtime.process_stage import ProcessStage

#: RSS samples of a process younger than this are not compared (see ``soak``).
RSS_WARM_UP_S = 10.0
#: What a sample may differ by from its solo run (as in the pipeline scenarios' checks).
SAMPLE_TOLERANCE = 1e-5
TEXTS = (
    "hello world",
    "ok go",
    "hello there world, and more",
    "the quick brown fox jumped over the lazy dog",
    "streaming audio should start before the whole sentence is done",
    "a short one",
    "every stage in a process of its own",
    "nothing left behind",
)


@dataclass
class SoakReport:
    requests: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)
    latencies_s: list[float] = field(default_factory=list)
    kills: int = 0
    #: Faults injected into puts and gets (``faults``).
    faults_fired: int = 0
    seconds: float = 0.0
    restarts: dict[str, int] = field(default_factory=dict)
    #: None: the stage's last process was too young at the end to say (see ``RSS_WARM_UP_S``).
    rss_growth_pct: dict[str, float | None] = field(default_factory=dict)
    residue: dict[str, list[str]] = field(default_factory=dict)
    shm_left: list[str] = field(default_factory=list)
    #: The largest difference of a finished request's sample from its solo run.
    max_sample_error: float = 0.0
    #: For each kill: until the head saw the stage dead, and until it was back and ready.
    noticed_s: list[float] = field(default_factory=list)
    back_s: list[float] = field(default_factory=list)
    #: The pipeline it ran (see :meth:`PipelineConfig.settings`).
    settings: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "outcomes": dict(self.outcomes),
            "problems": self.problems[:20],
            "problem_count": len(self.problems),
            "requests_per_s": round(self.requests / self.seconds, 2) if self.seconds else None,
            "latency": _percentiles(self.latencies_s),
            "kills": self.kills,
            "faults_fired": self.faults_fired,
            "death_noticed": _percentiles(self.noticed_s, (50, 100)),
            "back_ready": _percentiles(self.back_s, (50, 100)),
            "restarts": self.restarts,
            "rss_growth_pct": self.rss_growth_pct,
            "residue": self.residue,
            "shm_left": self.shm_left,
            "max_sample_error": self.max_sample_error,
            **self.settings,
        }


def _percentiles(seconds: list[float], qs: tuple[int, ...] = (50, 90, 99)) -> dict[str, float | None]:
    """``{"p50_ms": …}`` of ``seconds`` (p100 is the largest)."""
    ordered = sorted(seconds)
    return {
        f"p{q}_ms": round(ordered[min(len(ordered) - 1, len(ordered) * q // 100)] * 1000, 1) if ordered else None
        for q in qs
    }


def _rss_kib(pid: int | None) -> int | None:
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


async def _reference(engine: Orchestrator) -> dict[str, torch.Tensor]:
    """Each text's audio, run alone through the same engine."""
    out = {}
    for text in TEXTS:
        pieces = []
        async for item in generate(engine, text, ("audio",)):
            if item.data is not None and not item.finished:
                pieces.append(item.data.reshape(-1))
        out[text] = torch.cat(pieces) if pieces else torch.empty(0)
    return out


def soak(
    requests: int,
    concurrency: int,
    *,
    processes: bool | None,
    kill_every: float | None,
    config: PipelineConfig | None = None,
    device: str = "cpu",
    abort_fraction: float = 0.15,
    reuse_fraction: float = 0.10,
    seed: int = 0,
    faults: Sequence[str] = (),
    fault_probability: float = 0.001,
    progress: Any = None,
) -> SoakReport:
    """``config``: the pipeline (default: the shipped ``qwen3_omni``), its stages in OS processes
    with ``processes`` (default: as its deploy file says). ``faults``: fault specs (see
    :func:`~omnisim.faults.faults_of_specs`; a sampled kind fires on a hit with
    ``fault_probability``), which need the stages in this process."""
    config = config or load_pipeline("qwen3_omni")
    processes = config.deploy.processes if processes is None else processes
    if faults and processes:
        raise ValueError("faults fire in the process that puts or gets: the stages must run in this one")
    rng = random.Random(seed)
    report = SoakReport(settings=config.settings())
    # No plan until the solo runs are done: they are the reference the requests are checked against.
    kernel = FaultingKernel()
    store = PosixStore()
    engine = build_engine(config, Models.build(device), store, processes=processes)
    stages = [s for s in engine.stages.values() if isinstance(s, ProcessStage)]
    namespaces: set[str] = {store.namespace}
    todo = list(range(requests))
    done = 0
    all_done = trio.Event()
    #: Per stage: (pid, requests done, seconds since that pid was first seen, RSS in KiB).
    rss: dict[str, list[tuple[int | None, int, float, int]]] = {s.spec.name: [] for s in stages}
    first_seen: dict[int | None, float] = {}
    started = time.perf_counter()

    async def client(c: int, reference: dict[str, torch.Tensor]) -> None:
        nonlocal done
        previous: str | None = None
        while todo:
            n = todo.pop()
            text = TEXTS[rng.randrange(len(TEXTS))]
            reuse = previous is not None and rng.random() < reuse_fraction
            rid = previous if reuse and previous is not None else f"s{c}x{n}"
            leave_after = rng.randrange(1, 6) if rng.random() < abort_fraction else None
            begun, since = time.perf_counter(), kernel.now()
            terminals, audio, error, outputs = 0, [], None, 0
            answer = generate(engine, text, ("audio",), request_id=rid)
            async for item in answer:
                outputs += 1
                if item.finished:
                    terminals += 1
                    error = item.error
                elif item.data is not None:
                    audio.append(item.data.reshape(-1))
                if leave_after is not None and outputs >= leave_after and not item.finished:
                    await answer.aclose()  # the client goes away: an abort
                    break
            left = leave_after is not None and terminals == 0
            if left:
                report.outcomes["left"] += 1
            elif terminals != 1:
                report.problems.append(f"{rid}: {terminals} terminals")
            elif error is None:
                got = torch.cat(audio) if audio else torch.empty(0)
                want = reference[text]
                # Code2Wav batches chunks of concurrent requests in one forward pass, which moves
                # float rounding (by ~1e-7); every sample must be there once, in order, and equal
                # to its solo run within the simulator's own tolerance.
                if got.shape != want.shape:
                    report.problems.append(f"{rid}: {got.numel()} samples, its solo run has {want.numel()}")
                elif not torch.allclose(got, want, atol=SAMPLE_TOLERANCE, rtol=0):
                    worst = float((got - want).abs().max())
                    report.problems.append(f"{rid}: samples differ from its solo run by up to {worst:.2e}")
                else:
                    report.max_sample_error = max(report.max_sample_error, float((got - want).abs().max()))
                report.outcomes["finished"] += 1
                report.latencies_s.append(time.perf_counter() - begun)
            elif "died" in error or "exited" in error:
                report.outcomes["failed: its stage died"] += 1
            elif "is down" in error:
                report.outcomes["failed: a stage was restarting"] += 1
            elif any(external_id_of(key) == rid and at >= since for _, key, at in kernel.fired):
                report.outcomes["failed: an injected fault"] += 1
            else:
                report.problems.append(f"{rid}: failed for no stage death: {error}")
            previous = rid
            done += 1
            if done >= requests:
                all_done.set()
            if progress is not None:
                progress(done, report)

    async def killer(work: trio.Nursery) -> None:
        assert kill_every is not None
        while True:
            with trio.move_on_after(kill_every):
                await all_done.wait()  # (the run ends when its requests do, not at the next kill)
            if done >= requests:
                return
            victim = stages[rng.randrange(len(stages))]
            if victim.alive and victim.pid is not None:
                os.kill(victim.pid, signal.SIGKILL)
                report.kills += 1
                work.start_soon(recovery, victim, victim.restarts, time.perf_counter())

    async def recovery(victim: ProcessStage, restarts: int, killed: float) -> None:
        """How long the head took to see the kill, and to have the stage ready again."""
        while victim.alive and victim.restarts == restarts:
            await trio.sleep(0.005)
        report.noticed_s.append(time.perf_counter() - killed)
        while not (victim.alive and victim.restarts > restarts) and done < requests:
            await trio.sleep(0.005)
        if victim.alive:
            report.back_s.append(time.perf_counter() - killed)

    async def sampler() -> None:
        while done < requests:
            for stage in stages:
                namespaces.add(stage.namespace)
                kib = _rss_kib(stage.pid) if stage.alive else None  # a live process, its model loaded
                if kib is not None:
                    age = time.perf_counter() - first_seen.setdefault(stage.pid, time.perf_counter())
                    rss[stage.spec.name].append((stage.pid, done, age, kib))
            await trio.sleep(0.5)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(engine.run)
            await engine.wait_ready()
            reference = await _reference(engine)
            if faults:
                kernel.plan = FaultPlan(faults_of_specs(faults, seed, fault_probability), seed)
            async with trio.open_nursery() as work:
                for c in range(concurrency):
                    work.start_soon(client, c, reference)
                if kill_every and stages:
                    work.start_soon(killer, work)
                work.start_soon(sampler)
            await engine.wait_ready()
            await engine.drain()
            report.residue = await engine.residue_now()
            engine.shutdown()

    try:
        with use_kernel(kernel):
            trio.run(main)
    finally:
        store.sweep()
    report.faults_fired = len(kernel.fired)
    report.seconds = time.perf_counter() - started
    if kill_every and stages and not report.kills:
        # A soak asked to kill that killed nothing did not test what it was asked to.
        report.problems.append(
            f"asked to kill a stage every {kill_every:g} s, but the requests were done before the first kill "
            f"({report.seconds:.1f} s in all): send more requests, or kill more often"
        )
    report.requests = requests
    report.restarts = {s.spec.name: s.restarts for s in stages}
    for name, samples in rss.items():
        # The process that served the end of the run, once warm: a restarted one starts small and
        # its allocator fills up over its first seconds, which is not growth.
        last_pid = samples[-1][0] if samples else None
        second_half = [
            kib for pid, n, age, kib in samples if n >= requests // 2 and pid == last_pid and age >= RSS_WARM_UP_S
        ]
        if len(second_half) >= 2 and second_half[0]:
            report.rss_growth_pct[name] = round((second_half[-1] / second_half[0] - 1) * 100, 1)
        else:
            report.rss_growth_pct[name] = None  # its last process started too near the end
    report.shm_left = sorted(
        name for name in os.listdir("/dev/shm") if any(name.startswith(f"omnisim-{ns}-") for ns in namespaces)
    )
    return report


def print_report(report: SoakReport) -> None:
    d = report.as_dict()
    print(
        f"{d['requests']} requests in {report.seconds:.1f}s ({d['requests_per_s']}/s): {d['outcomes']}; "
        f"{d['kills']} stage(s) killed, restarts {d['restarts']}, {d['faults_fired']} fault(s) injected",
    )
    print(
        f"latency of finished requests: {d['latency']}; largest sample difference from a solo run "
        f"{d['max_sample_error']:.1e}",
    )
    if report.kills:
        print(f"after a kill: death noticed {d['death_noticed']}; stage back and ready {d['back_ready']}")
    print(f"RSS growth over the second half, per stage process: {d['rss_growth_pct']}")
    print(f"residue: {d['residue'] or 'none'}; /dev/shm left: {d['shm_left'] or 'none'}")
    for problem in d["problems"]:
        print(f"  PROBLEM {problem}")
    if d["problem_count"] > len(d["problems"]):
        print(f"  … {d['problem_count'] - len(d['problems'])} more")


def clean(report: SoakReport) -> bool:
    """No wrong or missing answer, and nothing left behind."""
    return not report.problems and not report.residue and not report.shm_left
