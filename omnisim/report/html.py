"""One self-contained HTML page for a campaign (its report folder) and any artifacts: the
explorations, the mutant detection table by strategy, the mutation score with its survivors, and
for each violation a timeline of the failing run. No script, no external file: it opens anywhere."""

from __future__ import annotations

import base64
import html
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from omnisim.base import UsageError
from omnisim.explore import load_artifact
from omnisim.report.timeline import draw, preemptions, read_trace

#: A page shows at most this many violations' timelines (each is an image).
MAX_TIMELINES = 12

_STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 2em auto; max-width: 75em; color: #222; }
h1 { font-size: 1.6em; } h2 { margin-top: 2em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; margin: .5em 0; } td, th { padding: .2em .6em; border: 1px solid #ddd; }
th { background: #f4f4f4; text-align: left; } td.n { text-align: right; font-variant-numeric: tabular-nums; }
.ok { color: #2a7d2a; } .bad { color: #b42318; font-weight: 600; } .warn { color: #b25e09; }
pre { background: #f7f7f7; padding: .6em; overflow-x: auto; font-size: 12px; }
img.timeline { max-width: 100%; border: 1px solid #ddd; } code { font-size: 12px; }
"""


def _esc(value: object) -> str:
    return html.escape(str(value))


def _table(headers: list[str], rows: Iterable[list[str]], numeric: frozenset[int] = frozenset()) -> str:
    head = "".join(f"<th>{_esc(h)}</th>" for h in headers)
    body = "".join(
        "<tr>"
        + "".join(f'<td class="n">{c}</td>' if i in numeric else f"<td>{c}</td>" for i, c in enumerate(r))
        + "</tr>"
        for r in rows
    )
    return f"<table><tr>{head}</tr>{body}</table>"


def _read(folder: Path, name: str) -> Any:
    path = folder / name
    if not path.exists():
        return None
    try:
        with path.open(encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise UsageError(f"cannot read {path}: {e}") from None


def _check_section(results: list[dict[str, Any]]) -> str:
    rows = []
    for s in results:
        found = sorted({v["invariant"] for e in s["violations"] for v in e["violations"]})
        verdict = f'<span class="bad">{_esc(", ".join(found))}</span>' if found else '<span class="ok">none</span>'
        rows.append(
            [
                _esc(s["scenario"]),
                _esc(s["strategy"]),
                _esc(s["store"]),
                _esc(s["schedules"]),
                _esc(s.get("distinct_traces", "")),
                _esc(s.get("schedules_per_s", "")),
                verdict,
            ]
        )
    failed = sum(1 for s in results if s["violations"])
    return (
        f"<h2>Explorations</h2><p>{len(results)} explorations, "
        f'<span class="{"bad" if failed else "ok"}">{failed} with violations</span>.</p>'
        + _table(
            ["scenario", "strategy", "store", "schedules", "distinct traces", "schedules/s", "violations"],
            rows,
            frozenset({3, 4, 5}),
        )
    )


def _mutants_section(rows: list[dict[str, Any]]) -> str:
    strategies = sorted({r["strategy"] for r in rows})
    by_mutant: dict[tuple[str, str], dict[str, dict[str, Any]]] = {}
    for r in rows:
        by_mutant.setdefault((r["mutant"], r["scenario"]), {})[r["strategy"]] = r

    def cell(r: dict[str, Any] | None) -> str:
        if r is None:
            return ""
        if r["detected"]:
            return f'<span class="ok">{_esc(r["schedules"])}</span> <small>{_esc(", ".join(r["fired"]))}</small>'
        if r["invariants"]:
            return f'<span class="warn">broken: {_esc(", ".join(r["invariants"]))}</span>'
        return f'<span class="bad">not found in {_esc(r["schedules"])}</span>'

    table = _table(
        ["mutant", "scenario", "declares", *strategies],
        (
            [_esc(m), _esc(scn), _esc(", ".join(next(iter(cells.values()))["expect"]))]
            + [cell(cells.get(st)) for st in strategies]
            for (m, scn), cells in sorted(by_mutant.items())
        ),
    )
    found = len({m for (m, _), cells in by_mutant.items() if any(c["detected"] for c in cells.values())})
    total = len({m for m, _ in by_mutant})
    return (
        f"<h2>Mutant detection</h2><p>{found} of {total} mutants found by an invariant they declare; "
        "a cell gives the schedules it took and the invariant that fired.</p>" + table
    )


def _mutation_section(report: dict[str, Any]) -> str:
    def score_rows(items: list[dict[str, Any]]) -> Iterable[list[str]]:
        for s in items:
            score = f"{s['score']:.1f}%" if s["score"] is not None else "-"
            counts = [_esc(s.get(k, 0)) for k in ("killed", "crashed", "timeout", "survived", "equivalent")]
            yield [_esc(s["name"]), *counts, score]

    headers = ["module", "killed", "crashed", "timeout", "survived", "equivalent", "score"]
    survivors = [o for o in report["outcomes"] if o["outcome"] == "survived"]
    listed = "".join(
        f"<details><summary><code>{_esc(o['id'])}</code> {_esc(o['module'])}:{o['line']} "
        f"{_esc(o['where'])}: {_esc(o['description'])} <small>{_esc(o['detail'])}</small></summary>"
        f"<pre>{_esc(o['diff'])}</pre></details>"
        for o in survivors
    )
    rows = [*report["modules"], *([report["total"]] if report["total"] else [])]
    return (
        "<h2>Mutation score</h2><p>Systematic slips in the runtime's source, run against the scenarios that "
        "execute them. Survivors are the harness's blind spots.</p>"
        + _table(headers, score_rows(rows), frozenset(range(1, 7)))
        + f"<h3>{len(survivors)} survivors</h3>{listed}"
    )


def _violation_section(artifact_path: str) -> str:
    artifact = load_artifact(artifact_path)
    events = read_trace(artifact_path)
    title = f"{artifact['scenario']} seed {artifact['seed']} ({artifact['strategy']['strategy']}, {artifact['store']})"
    png = base64.b64encode(draw(events, title)).decode()
    found = "".join(f"<li><b>{_esc(v['invariant'])}</b>: {_esc(v['message'])}</li>" for v in artifact["violations"])
    tail = "\n".join(f"{e.index:>5} {e.task:<24} {e.name} {json.dumps(e.attrs)}" for e in events[-40:])
    left_out = artifact.get("left_out") or []
    smaller = f" Requests the shrinker left out: {_esc(', '.join(left_out))}." if left_out else ""
    return (
        f"<h3>{_esc(title)}{' with mutant ' + _esc(artifact['mutant']) if artifact.get('mutant') else ''}</h3>"
        f"<ul>{found}</ul><p>{len(events)} events, {len(preemptions(events))} preemptions.{smaller} Replay: "
        f"<code>omnisim replay {_esc(artifact_path)}</code></p>"
        f'<img class="timeline" alt="timeline of {_esc(title)}" src="data:image/png;base64,{png}">'
        f"<details><summary>the last 40 events</summary><pre>{_esc(tail)}</pre></details>"
    )


def _artifacts_in(folder: Path) -> list[str]:
    """The artifacts in ``folder``, by name (its other JSON files left out)."""
    found = []
    for path in sorted(folder.glob("*.json")):
        try:
            load_artifact(str(path))
        except UsageError:
            continue
        found.append(str(path))
    return found


def write_page(sources: list[str], out_path: str) -> str:
    """Write the page for report folders and artifact files in ``sources``; returns its path."""
    parts: list[str] = []
    artifacts: list[str] = []
    for source in sources:
        path = Path(source)
        if path.is_dir():
            check = _read(path, "check.json")
            if check is not None:
                parts.append(_check_section(check))
                artifacts += [e["artifact"] for s in check for e in s["violations"] if e.get("artifact")]
            mutants = _read(path, "mutants.json")
            if mutants is not None:
                parts.append(_mutants_section(mutants))
            mutation = _read(path, "mutation.json")
            if mutation is not None:
                parts.append(_mutation_section(mutation))
            if check is None and mutants is None and mutation is None:
                artifacts += _artifacts_in(path)  # (a folder explore --out saved finds in)
        else:
            artifacts.append(source)
    shown = [a for a in dict.fromkeys(artifacts) if os.path.exists(a)][:MAX_TIMELINES]
    if shown:  # what failed comes first
        parts.insert(0, "<h2>Violations</h2>" + "".join(_violation_section(a) for a in shown))
    if not parts:
        parts.append("<p>Nothing to show: no check.json, mutants.json, mutation.json or artifact given or found.</p>")
    page = (
        f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>omnisim report</title>'
        f"<style>{_STYLE}</style></head><body><h1>omnisim report</h1>"
        f"<p>From: {_esc(', '.join(sources))}</p>{''.join(parts)}</body></html>"
    )
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    with open(out_path, "w") as f:
        f.write(page)
    return out_path
