"""A random or PCT find is saved shrunk: fewer deviations, the same invariant, the same world,
replayable, and the same shrunk run every time."""

from __future__ import annotations

from pathlib import Path

import pytest

from omnisim import registry
from omnisim.explore import explore, replay
from omnisim.shrink import _smaller, deviations

registry.load()


def _find(tmp_path: Path, strategy: str, **kwargs: object) -> dict:
    res = explore(
        "abort_during_put",
        strategy=strategy,
        budget=300,
        mutant="cleanup_on_scheduler_thread",
        out_dir=str(tmp_path),
        **kwargs,  # type: ignore[arg-type]
    )
    assert res.first_violation_after is not None
    return res.violations[-1]


@pytest.mark.parametrize("strategy", ["random", "pct"])
def test_a_find_is_saved_shrunk_and_replays(tmp_path: Path, strategy: str) -> None:
    entry = _find(tmp_path, strategy)
    shrunk = entry["shrunk"]
    assert shrunk["deviations"] < shrunk["deviations_before"]
    assert shrunk["preemptions"] <= shrunk["preemptions_before"]
    assert {v["invariant"] for v in entry["violations"]} >= {"abort-non-blocking"}
    again = replay(entry["artifact"])
    assert again.reproduced
    assert [v.invariant for v in again.run.violations] == [v["invariant"] for v in entry["violations"]]


def test_shrinking_is_deterministic(tmp_path: Path) -> None:
    first = _find(tmp_path / "a", "random")
    second = _find(tmp_path / "b", "random")
    assert first["shrunk"] == second["shrunk"]
    assert Path(first["artifact"]).read_text() == Path(second["artifact"]).read_text()


def test_no_shrink_saves_the_find_as_found(tmp_path: Path) -> None:
    entry = _find(tmp_path, "random", shrink_finds=False)
    assert "shrunk" not in entry


def test_every_candidate_is_smaller() -> None:
    prefix = [0, 2, 0, 1, 0, 3]
    for candidate in _smaller(prefix):
        key = (deviations(candidate), sum(candidate), len(candidate))
        assert key < (deviations(prefix), sum(prefix), len(prefix))
