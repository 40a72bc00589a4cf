"""Explorations on a Ray cluster (``--ray ADDRESS``): the jobs ``--jobs N`` runs in a local process
pool, each one a Ray task instead, reported in the jobs' order. Every exploration is
deterministic and independent, so the results are those of one process, on any cluster.

Ray is an optional extra (``pip install 'omnisim[ray]'``). ``--ray local`` starts a Ray instance
on this machine for the campaign and stops it afterwards; any other address goes to
``ray.init`` as it is (``auto``, ``ray://head:10001``) and the cluster is left running. Its
workers must import omnisim and the ``--plugin`` modules: the same environment on every node, or
a ``runtime_env`` the cluster was started with.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from omnisim.base import UsageError
from omnisim.progress import LIVE_EVERY_S, Sofar

#: (scenario, explore's keyword arguments): one exploration.
Job = tuple[str, dict[str, Any]]

#: Set in a Ray worker process once it loaded the plugins (a worker runs many jobs).
_ready_in_worker: list[tuple[list[str], int]] = []


def explore_on_ray(
    address: str,
    jobs: list[Job],
    report: Callable[[dict[str, Any]], None],
    plugins: list[str],
    live: Callable[[int, Sofar], None] | None = None,
) -> None:
    """Run ``jobs`` as Ray tasks on the cluster at ``address``; ``report`` gets each one's
    summary, in the jobs' order, as soon as it and those before it are done, and ``live`` (the
    campaign's bar) what each has run so far, as the workers send it through a Ray queue. On an
    interrupt the tasks not yet done are cancelled; those done before are still reported."""
    try:
        import ray
        from ray.util.queue import Queue
    except ImportError:
        raise UsageError("--ray needs Ray, an optional extra: pip install 'omnisim[ray]'") from None
    local = address == "local"
    options: dict[str, Any] = {"include_dashboard": False} if local else {"address": address}
    ray.init(log_to_driver=False, **options)
    try:
        # (an actor that holds no CPU while it waits: every CPU runs explorations)
        sofar = Queue(actor_options={"num_cpus": 0}) if live is not None else None
        run = ray.remote(num_cpus=1)(_run_job)
        level = logging.getLogger().level
        refs = [run.remote(scenario, kwargs, plugins, level, i, sofar) for i, (scenario, kwargs) in enumerate(jobs)]
        done: dict[int, dict[str, Any]] = {}
        position = {ref: i for i, ref in enumerate(refs)}
        reported = 0
        pending = list(refs)
        try:
            while pending:
                ready, pending = ray.wait(pending, num_returns=1, timeout=LIVE_EVERY_S if live else None)
                if sofar is not None and live is not None:
                    for index, so_far in sofar.get_nowait_batch(sofar.qsize()):
                        live(index, so_far)
                for ref in ready:
                    done[position[ref]] = ray.get(ref)
                while reported in done:
                    report(done.pop(reported))
                    reported += 1
        except BaseException:
            for ref in pending:
                ray.cancel(ref, force=True)
            raise
    finally:
        if local:
            ray.shutdown()


def _run_job(
    scenario: str, kwargs: dict[str, Any], plugins: list[str], log_level: int, index: int, sofar: Any
) -> dict[str, Any]:
    """:func:`omnisim.cli.explore_job` in a Ray worker, which it readies on its first job; what
    it has run so far goes to ``sofar`` (a Ray queue; None: nobody shows it)."""
    from omnisim.cli import explore_job, init_worker, report_sofar_to

    if (plugins, log_level) not in _ready_in_worker:
        init_worker(plugins, log_level)
        _ready_in_worker.append((plugins, log_level))
    # Per job: a worker of a long-lived cluster serves one campaign after another.
    report_sofar_to(sofar)
    return explore_job(scenario, kwargs, index)
