"""The README's first session, run as written: every ``$ omnisim …`` line of its "A first
session" block, in order, in a copy of the checkout, with the exit status its comment states
(``# exit N``; 0 when none is stated). Afterwards ``git status`` of the copy is what it was: every
command keeps what it generates out of the tree (under the ignored ``runs/``)."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
SECTION = "## A first session"
EXIT_COMMENT = re.compile(r"#\s*exit (\d+)")


def first_session() -> list[tuple[list[str], int]]:
    text = (REPO_ROOT / "README.md").read_text()
    assert SECTION in text, f"the README has no {SECTION!r} section"
    block = text.split(SECTION, 1)[1].split("```console", 1)[1].split("```", 1)[0]
    commands = []
    for line in block.splitlines():
        if not line.startswith("$ "):
            continue
        words = shlex.split(line[2:], comments=False)
        status = 0
        if "#" in words:
            comment = " ".join(words[words.index("#") :])
            words = words[: words.index("#")]
            found = EXIT_COMMENT.search(comment)
            status = int(found.group(1)) if found else 0
        commands.append((words, status))
    assert commands and all(words[0] == "omnisim" for words, _ in commands)
    return commands


def omnisim_command() -> list[str]:
    script = Path(sys.executable).with_name("omnisim")
    return [str(script)] if script.exists() else [sys.executable, "-m", "omnisim.cli"]


def git_status(where: Path) -> str:
    return subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=all"], cwd=where, capture_output=True, text=True
    ).stdout


def test_the_first_session_runs_as_written(tmp_path: Path) -> None:
    copy = tmp_path / "checkout"
    shutil.copytree(
        REPO_ROOT,
        copy,
        ignore=shutil.ignore_patterns(".venv", "runs", "__pycache__", ".pytest_cache", ".ruff_cache", ".hypothesis"),
    )
    before = git_status(copy)
    for words, status in first_session():
        proc = subprocess.run([*omnisim_command(), *words[1:]], cwd=copy, capture_output=True, text=True, timeout=600)
        shown = " ".join(words)
        said = f"`{shown}` exited {proc.returncode}, the README says {status}"
        assert proc.returncode == status, f"{said}:\n{proc.stderr}"
        assert "Traceback" not in proc.stderr, f"`{shown}` printed a traceback"
    assert git_status(copy) == before, "the first session left files that git sees"


@pytest.mark.parametrize("command", ["check", "pytest"])
def test_the_quick_start_is_what_ci_runs(command: str) -> None:
    """The README's two quick-start lines are the ones this project promises; .ci/run runs the
    test one exactly."""
    readme = (REPO_ROOT / "README.md").read_text()
    lines = [line for line in readme.splitlines() if line.startswith("python3 -m venv .venv")]
    (line,) = [line for line in lines if line.rstrip().endswith(command)]
    if command == "pytest":
        assert line in (REPO_ROOT / ".ci" / "run").read_text()
