"""Benchmarks that print figures (they assert nothing about time).

* ``schedules`` — simulated schedules per second for each scenario (memory store, random
  strategy, one process, so one core);
* ``connector`` — ShmConnector put+get on the POSIX store for the sizes of upstream's own
  benchmark (``shared/bench/upstream_shm.py``), rows in the same JSON shape; with ``--upstream``
  that script runs too, so both are measured in one go.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import torch
import trio

from omnisim import registry
from omnisim.explore import explore
from omnisim.world import UsageError
from runtime.connectors.posix_store import PosixStore
from runtime.connectors.shm import ShmConnector

# label -> (dtype, shape, repetitions): the same payloads as upstream's benchmark.
SIZES: dict[str, tuple[torch.dtype, tuple[int, ...], int]] = {
    "6.4KB": (torch.int64, (16, 50), 2000),
    "1MiB": (torch.float32, (262144,), 200),
    "16MiB": (torch.float32, (4194304,), 30),
    "128MiB": (torch.float32, (33554432,), 7),
}
UPSTREAM_SCRIPT_CANDIDATES = ("../shared/bench/upstream_shm.py", "shared/bench/upstream_shm.py")


def bench_schedules(seconds: float) -> list[dict[str, Any]]:
    """Explore each scenario for ``seconds``, exactly as ``omnisim explore`` does."""
    rows = []
    for name in sorted(registry.SCENARIOS):
        res = explore(name, budget=10**9, time_limit=seconds, stop_on_violation=False)
        rate = res.schedules / res.seconds
        rows.append(
            {
                "scenario": name,
                "schedules": res.schedules,
                "schedules_per_s": round(rate, 1),
                "violations": len(res.violations),
            }
        )
        print(f"{name:<28} {rate:8.1f} schedules/s", flush=True)
    return rows


def _payload(label: str, i: int) -> dict[str, Any]:
    dtype, shape, _ = SIZES[label]
    t = torch.randint(0, 4096, shape, dtype=dtype) if dtype == torch.int64 else torch.rand(shape, dtype=dtype)
    return {"codes": {"audio": t}, "meta": {"request_id": f"req-{i}", "chunk": i, "sample_rate": 24000}}


async def _bench_connector(labels: list[str], scale: float) -> list[dict[str, Any]]:
    store = PosixStore()
    conn = ShmConnector(store, stage_id=0)
    rows = []
    try:
        for label in labels:
            payload = _payload(label, 0)
            t = payload["codes"]["audio"]
            nbytes = t.numel() * t.element_size()
            reps = max(3, int(SIZES[label][2] * scale))
            put_t, get_t, tot_t = [], [], []
            size = 0
            for r in range(reps):
                key = f"bench_{label.replace('.', '_')}_{r}"
                t0 = time.perf_counter()
                ok, size, md = await conn.put("0", "1", key, payload)
                t1 = time.perf_counter()
                got = await conn.get("0", "1", key, md)
                t2 = time.perf_counter()
                if not ok or got is None:
                    raise RuntimeError(f"put/get failed for {label}")
                if r == 0 and not torch.equal(got[0]["codes"]["audio"], t):
                    raise RuntimeError(f"round trip mismatch for {label}")
                del got
                put_t.append(t1 - t0)
                get_t.append(t2 - t1)
                tot_t.append(t2 - t0)
            total = statistics.median(tot_t)
            rows.append(
                {
                    "size": label,
                    "tensor_bytes": nbytes,
                    "serialized_bytes": size,
                    "reps": reps,
                    "put_us": statistics.median(put_t) * 1e6,
                    "get_us": statistics.median(get_t) * 1e6,
                    "total_us": total * 1e6,
                    "GBps": nbytes / total / 1e9,
                }
            )
            gc.collect()
    finally:
        await conn.close()
        store.sweep()
    return rows


def bench_connector(labels: list[str], scale: float) -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    rows = trio.run(_bench_connector, labels, scale)
    print(f"{'size':>7} {'reps':>5} {'put us':>10} {'get us':>10} {'total us':>10} {'GB/s':>6}")
    for r in rows:
        print(
            f"{r['size']:>7} {r['reps']:>5} {r['put_us']:>10.1f} {r['get_us']:>10.1f} {r['total_us']:>10.1f} "
            f"{r['GBps']:>6.2f}"
        )
    return rows


def bench_upstream(labels: list[str], scale: float) -> list[dict[str, Any]] | None:
    script = next((p for p in UPSTREAM_SCRIPT_CANDIDATES if os.path.exists(p)), None)
    if script is None:
        print("upstream: shared/bench/upstream_shm.py not found; skipped")
        return None
    out = os.path.join("reports", "latest", "upstream_shm.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    proc = subprocess.run(
        [sys.executable, script, "--sizes", ",".join(labels), "--reps-scale", str(scale), "--json", out],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0 or "SKIP" in proc.stdout or not os.path.exists(out):
        print(
            f"upstream: not measured ({(proc.stdout + proc.stderr).strip().splitlines()[-1:]}); "
            f"run `python {script} --fetch` once first"
        )
        return None
    with open(out) as f:
        return json.load(f)["in_process"]


def main(args: argparse.Namespace) -> dict[str, Any]:
    registry.load()
    payload: dict[str, Any] = {}
    if args.what in ("schedules", "all"):
        print(f"== simulated schedules per second (memory store, random strategy, {args.seconds}s each)")
        payload["schedules"] = bench_schedules(args.seconds)
    if args.what in ("connector", "all"):
        labels = [s.strip() for s in args.sizes.split(",") if s.strip()]
        unknown = [s for s in labels if s not in SIZES]
        if unknown:
            raise UsageError(f"unknown sizes {unknown}; choose from {', '.join(SIZES)}")
        print("== ShmConnector put+get, POSIX store, in process (median)")
        payload["connector"] = bench_connector(labels, args.reps_scale)
        if args.upstream:
            print("== upstream vLLM-Omni SharedMemoryConnector, same payloads")
            upstream = bench_upstream(labels, args.reps_scale)
            if upstream:
                payload["upstream"] = upstream
                by_size = {r["size"]: r for r in upstream}
                print(f"{'size':>7} {'omnisim us':>11} {'upstream us':>12} {'speed-up':>9}")
                for r in payload["connector"]:
                    u = by_size.get(r["size"])
                    if u:
                        print(
                            f"{r['size']:>7} {r['total_us']:>11.1f} {u['total_us']:>12.1f} "
                            f"{u['total_us'] / r['total_us']:>8.2f}x"
                        )
    return payload
