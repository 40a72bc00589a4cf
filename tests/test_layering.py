"""The architecture, checked: runtime/ is the bottom layer and goes through the kernel seam."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from omnisim.points import POINTS

ROOT = Path(__file__).resolve().parent.parent
RUNTIME = ROOT / "runtime"
#: The real kernel *is* the seam: the one runtime module allowed to touch trio's and time's
#: waiting, locking and clock primitives directly.
SEAM = RUNTIME / "real_kernel.py"
FORBIDDEN_PACKAGES = {"omnisim", "invariants", "scenarios", "threading"}
FORBIDDEN_CALLS = {
    ("time", "sleep"),
    ("time", "monotonic"),
    ("time", "time"),
    ("trio", "sleep"),
    ("trio", "Lock"),
    ("trio", "Event"),
    ("trio", "Condition"),
    ("trio", "current_time"),
    ("trio", "open_nursery"),
    ("trio", "move_on_after"),
    ("trio", "to_thread"),
    ("trio", "lowlevel"),
}


def runtime_modules() -> list[Path]:
    return sorted(p for p in RUNTIME.rglob("*.py") if p != SEAM)


def test_runtime_imports_nothing_above_it() -> None:
    offenders = []
    for path in sorted(RUNTIME.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            offenders += [
                f"{path.relative_to(ROOT)} imports {n}" for n in names if n.split(".")[0] in FORBIDDEN_PACKAGES
            ]
    assert offenders == []


def test_runtime_waits_locks_and_reads_the_clock_only_through_the_kernel() -> None:
    offenders = []
    for path in runtime_modules():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module in ("time", "trio"):
                offenders.append(f"{path.relative_to(ROOT)}: from {node.module} import …")
            if isinstance(node, ast.Import) and any(a.name in ("time", "trio") for a in node.names):
                offenders.append(f"{path.relative_to(ROOT)}: import {', '.join(a.name for a in node.names)}")
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and (node.value.id, node.attr) in FORBIDDEN_CALLS
            ):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} uses {node.value.id}.{node.attr}")
    assert offenders == []


def test_runtime_never_asks_whether_it_is_simulated() -> None:
    """No identifier in runtime code names a kernel or simulation (docs and comments may)."""
    pattern = re.compile(r"sim|realkernel", re.IGNORECASE)
    offenders = []
    for path in runtime_modules():
        if path.name == "kernel.py":  # the seam installs the default kernel
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
            if name and pattern.search(name):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} {name}")
    assert offenders == []


def test_every_point_and_note_is_in_the_public_vocabulary() -> None:
    used = set()
    for folder in ("runtime", "omnisim", "scenarios"):
        for path in (ROOT / folder).rglob("*.py"):
            used |= set(re.findall(r"\.(?:point|note)\(\s*\"([a-z_.]+)\"", path.read_text()))
    assert used, "no points found: the pattern is out of date"
    assert sorted(used - set(POINTS)) == []


def test_the_adapter_state_locks_are_never_held_across_an_await() -> None:
    """Spec §3.1: no connector I/O and no processor call while ``_sender_state_lock`` or
    ``_receiver_state_lock`` is held. On the kernel's one thread that means no await inside a
    section, so a section can never be interleaved — and is why a mutant that removes one of
    these locks is reviewed as equivalent (``omnisim/mutation/equivalents.toml``)."""
    sections = [
        (path.name, node)
        for path in sorted((RUNTIME / "transfer").glob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.AsyncWith) and ast.unparse(node.items[0].context_expr).endswith("_state_lock")
    ]
    assert len(sections) >= 10, "the adapter's state sections were not found"
    awaiting = [
        f"{name}:{node.lineno}"
        for name, node in sections
        if any(isinstance(n, ast.Await | ast.AsyncWith) for stmt in node.body for n in ast.walk(stmt))
    ]
    assert not awaiting, f"a state lock is held across an await at {awaiting}"
