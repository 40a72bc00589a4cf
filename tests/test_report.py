"""``omnisim report`` and ``omnisim trace export --perfetto``: a failing run becomes a page with a
timeline a browser renders, and a trace Perfetto opens."""

from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from omnisim.cli import main
from omnisim.report.timeline import Event, preemptions

BROWSERS = ("chromium-headless-shell", "chromium", "chromium-browser", "google-chrome")


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real failing run: the abort reclaims keys on the caller's task (#8082 a)."""
    out = tmp_path_factory.mktemp("artifacts")
    code = main(
        ["explore", "abort_during_put", "--mutant", "cleanup_on_scheduler_thread", "--budget", "300", "--out", str(out)]
    )
    assert code == 1
    [path] = [p for p in out.glob("*.json") if not p.name.endswith(".trace.jsonl")]
    return path


def _event(i: int, task: str, name: str = "shm.put.begin") -> Event:
    return Event(i, 0, task, name, {})


def test_a_preemption_is_a_switch_away_from_a_task_that_could_go_on() -> None:
    events = [
        _event(0, "a"),
        _event(1, "b"),  # a could go on (it has event 3): a preemption after 0
        _event(2, "b", "kernel.block"),
        _event(3, "a"),  # b blocked itself: no preemption after 2
        _event(4, "c"),  # a has nothing after 3: it finished, no preemption
    ]
    assert preemptions(events) == [0]


def test_the_page_shows_the_violation_with_its_timeline(artifact: Path, tmp_path: Path) -> None:
    page = tmp_path / "index.html"
    assert main(["report", str(artifact), "-o", str(page)]) == 0
    text = page.read_text()
    assert "abort-non-blocking" in text
    assert f"omnisim replay {artifact}" in text
    png = base64.b64decode(re.search(r'src="data:image/png;base64,([^"]+)"', text).group(1))  # type: ignore[union-attr]
    assert png.startswith(b"\x89PNG")
    assert "<script" not in text and "http" not in text.replace("ui.perfetto.dev", "")  # self-contained


def test_a_folder_of_finds_shows_each_find(artifact: Path, tmp_path: Path) -> None:
    """The folder explore --out saved its finds in is a source too (its other files left out)."""
    (artifact.parent / "notes.json").write_text("{}")
    page = tmp_path / "index.html"
    assert main(["report", str(artifact.parent), "-o", str(page)]) == 0
    assert page.read_text().count('alt="timeline of') == 1


def test_the_page_names_the_requests_a_shrink_left_out(artifact: Path, tmp_path: Path) -> None:
    """A reader of the page must know the run's world: the requests the shrinker left out."""
    shrunk = tmp_path / artifact.name
    shutil.copy(artifact, shrunk)
    shutil.copy(
        str(artifact).removesuffix(".json") + ".trace.jsonl", str(shrunk).removesuffix(".json") + ".trace.jsonl"
    )
    shrunk.write_text(json.dumps(json.loads(artifact.read_text()) | {"left_out": ["plain", "timed"]}))
    page = tmp_path / "index.html"
    assert main(["report", str(shrunk), "-o", str(page)]) == 0
    assert "Requests the shrinker left out: plain, timed." in page.read_text()


def test_the_perfetto_export_has_a_thread_per_task_and_every_event(artifact: Path, tmp_path: Path) -> None:
    out = tmp_path / "run.perfetto.json"
    assert main(["trace", "export", "--perfetto", str(artifact), "-o", str(out)]) == 0
    trace = json.loads(out.read_text())["traceEvents"]
    lines = artifact.with_name(artifact.name.removesuffix(".json") + ".trace.jsonl").read_text().splitlines()
    tasks = {json.loads(line)["task"] for line in lines}
    assert {e["args"]["name"] for e in trace if e["name"] == "thread_name"} == tasks
    indices = sorted(e["args"]["index"] for e in trace if e["ph"] in ("i", "X") and e["name"] != "preempted")
    assert indices == list(range(len(lines)))
    assert all(e["dur"] >= 0 for e in trace if e["ph"] == "X")


def test_a_missing_source_is_a_usage_error(tmp_path: Path) -> None:
    assert main(["report", str(tmp_path / "nowhere")]) == 2


def test_a_real_browser_renders_the_page(artifact: Path, tmp_path: Path) -> None:
    browser = next((b for b in BROWSERS if shutil.which(b)), None)
    if browser is None:
        pytest.skip(f"no headless browser installed (looked for {', '.join(BROWSERS)}); CI installs one")
    page = tmp_path / "index.html"
    assert main(["report", str(artifact), "-o", str(page)]) == 0
    shot = tmp_path / "screenshot.png"
    subprocess.run(
        [
            browser,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--window-size=1200,900",
            f"--screenshot={shot}",
            page.as_uri(),
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    print(f"screenshot: {shot}")
    from matplotlib import image

    pixels = image.imread(str(shot))
    assert pixels.shape[:2] == (900, 1200)
    # A blank (or all-error) page is one colour; the report has text, tables and a timeline.
    assert pixels[:, :, :3].std() > 0.05
    # The timeline's orange preemption bands are on screen.
    orange = (pixels[:, :, 0] > 0.9) & (abs(pixels[:, :, 1] - 0.83) < 0.08) & (pixels[:, :, 2] < 0.75)
    assert orange.sum() > 100
