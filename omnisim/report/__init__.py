"""Reports written under ``reports/latest/``: JSON for machines, Markdown for people."""

from __future__ import annotations

import json
import os
from typing import Any


def _write(out_dir: str, stem: str, data: object, markdown: list[str]) -> str:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{stem}.json"), "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    path = os.path.join(out_dir, f"{stem}.md")
    with open(path, "w") as f:
        f.write("\n".join(markdown) + "\n")
    return path


def write_check_report(results: list[dict[str, Any]], out_dir: str) -> str:
    lines = [
        "# omnisim check",
        "",
        "| scenario | strategy | store | faults | schedules | schedules/s | unsatisfied orders | violations |",
        "|---|---|---|---|---:|---:|---:|---|",
    ]
    for s in results:
        found = "; ".join(f"{v['invariant']}: {v['message']}" for e in s["violations"] for v in e["violations"][:3])
        lines.append(
            f"| {s['scenario']} | {s['strategy']} | {s['store']} | {', '.join(s.get('faults') or []) or 'none'} "
            f"| {s['schedules']} | {s['schedules_per_s']} "
            f"| {s['unsatisfied_runs']} | {found or 'none'} |"
        )
    return _write(out_dir, "check", results, lines)


def write_mutant_report(rows: list[dict[str, Any]], out_dir: str) -> str:
    lines = [
        "# mutant detection",
        "",
        "A mutant is detected only when an invariant it declares fails; anything else it trips is breakage.",
        "",
        "| mutant | issue | scenario | strategy | detected | schedules | seconds | declared | fired |",
        "|---|---|---|---|---|---:|---:|---|---|",
    ]
    for r in rows:
        verdict = "yes" if r["detected"] else "BROKEN" if r["invariants"] else "NO"
        lines.append(
            f"| {r['mutant']} | {r['issue']} | {r['scenario']} | {r['strategy']} | {verdict} "
            f"| {r['schedules']} | {r['seconds']} | {', '.join(r['expect'])} | {', '.join(r['invariants'])} |"
        )
    return _write(out_dir, "mutants", rows, lines)
