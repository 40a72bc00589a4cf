"""The configuration contract of spec §1 and #7544, checked as a scenario so its mutants run
through the same harness: the resolution table, prewarm, delivery, the start-up validator, and the
one pipeline shape this runtime runs (a config that says otherwise is refused at start-up)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from importlib import resources
from typing import Any

import yaml

from omnisim.registry import Patch, mutant, scenario
from omnisim.world import World
from runtime.config import resolve
from runtime.config.fields import ConfigError
from runtime.config.pipeline import build_pipeline, load_pipeline
from runtime.kernel import current_kernel
from runtime.stages import build_stages, check_shape
from scenarios.pipeline import models

#: (pipeline-wide, stage) -> resolved async_chunk (spec §1.2).
RESOLUTION_TABLE = {
    (False, None): False,
    (False, False): False,
    (False, True): False,
    (True, None): True,
    (True, True): True,
    (True, False): False,
}


def omni_raw() -> dict[str, Any]:
    text = (resources.files("runtime.config") / "configs" / "qwen3_omni.yaml").read_text(encoding="utf-8")
    return yaml.safe_load(text)


def set_stage(raw: dict[str, Any], stage_id: int, **values: Any) -> None:
    stages = raw.setdefault("deploy", {}).setdefault("stages", [])
    entry = next((e for e in stages if e["stage_id"] == stage_id), None)
    if entry is None:
        entry = {"stage_id": stage_id}
        stages.append(entry)
    entry.update(values)


def no_world(store_kind: str) -> World:
    return World(store_kind)


@scenario(
    "config_contract",
    summary="async_chunk resolution (and, never or), the aligner opt-out, any_stage_async, prewarm, delivery, the "
    "start-up edge validator and the pipeline shape the runtime runs, on the shipped configs and their variants",
    issue="#7544, spec §1",
    build=no_world,
    invariants=("config-contract", "no-crash"),
)
async def config_contract(world: World) -> None:
    def fact(what: str, got: object, want: object) -> None:
        current_kernel().note("config.fact", fact=what, got=str(got), want=str(want))

    for (pipeline, stage), want in RESOLUTION_TABLE.items():
        fact(
            f"async_chunk of pipeline {pipeline} with stage {stage}",
            resolve.resolve_stage_async_chunk(pipeline, stage),
            want,
        )

    tts = load_pipeline("qwen3_tts_aligner")
    aligner = tts.stages[-1].stage_id
    fact("the aligner's async_chunk (false in its deploy)", tts.resolved_async_chunk(aligner), False)
    fact("the aligner prewarmed (a word-timestamp request would hang)", aligner in tts.prewarm_stages(), False)
    fact("delivery to the aligner", tts.delivery((aligner - 1, aligner)), "forward")

    raw = omni_raw()
    del raw["pipeline"]["stages"][0]["async_chunk_processor"]
    raw["deploy"]["async_chunk"] = True
    set_stage(raw, 0, async_chunk=False)
    set_stage(raw, 1, connector_role="sender")
    mixed = build_pipeline(raw)
    fact("the engine's async flag with stages [False, True, True]", mixed.any_stage_async(), True)
    fact("Talker -> Code2Wav delivery with stages [False, True, True]", mixed.delivery((1, 2)), "chunks")

    raw = omni_raw()
    raw["deploy"]["async_chunk"] = True
    for stage_id, value in enumerate([False, False, True]):
        set_stage(raw, stage_id, async_chunk=value)
    try:
        build_pipeline(raw)
        verdict = "accepted"
    except ConfigError:
        verdict = "refused"
    fact("Talker(False) -> Code2Wav(True) at start-up (accepted, it hangs at run time)", verdict, "refused")

    # The one shape this runtime runs: a config that says otherwise is refused before any stage is
    # built (it would run as something else than it says), and the shipped one is not.
    shipped = omni_raw()
    fact(
        "the shipped qwen3_omni pipeline's shape",
        start_up_verdict(lambda: check_shape(build_pipeline(shipped))),
        "accepted",
    )
    for what, change, want in SHAPE_CASES:
        raw = omni_raw()
        change(raw["pipeline"]["stages"])
        fact(f"a pipeline whose {what}", start_up_verdict(lambda raw=raw: check_shape(build_pipeline(raw))), want)
    raw = omni_raw()
    raw["pipeline"]["stages"][2]["kind"] = "LLM_AR"
    built = start_up_verdict(lambda: build_stages(build_pipeline(raw), models(), world.store))
    fact("building the stages of a pipeline whose Code2Wav runs as LLM_AR", built, "refused")


def _set(stage_id: int, **values: Any) -> Callable[[list[dict[str, Any]]], None]:
    return lambda stages: stages[stage_id].update(values)


#: (what differs from the shipped pipeline, the change, what building its stages must give).
SHAPE_CASES: tuple[tuple[str, Callable[[list[dict[str, Any]]], None], str], ...] = (
    (
        "Thinker and Talker models are swapped",
        lambda stages: (stages[0].update(model="talker"), stages[1].update(model="thinker")),
        "refused",
    ),
    ("Code2Wav runs as LLM_AR", _set(2, kind="LLM_AR"), "refused"),
    ("Talker returns audio to the client", _set(1, final_output="audio"), "refused"),
    ("Thinker returns audio to the client", _set(0, final_output="audio"), "refused"),
    (
        "Thinker names the Talker's chunk processor",
        _set(0, async_chunk_processor="talker2code2wav_async_chunk"),
        "refused",
    ),
    ("Talker stops on [7] (not its codec's stop token)", _set(1, stop_token_ids=[7]), "refused"),
    ("Talker stops on [2150, 7]", _set(1, stop_token_ids=[2150, 7]), "accepted"),
    (
        "Talker names no stop ids (its codec's is the default)",
        lambda stages: stages[1].pop("stop_token_ids"),
        "accepted",
    ),
)


def start_up_verdict(start: Callable[[], object]) -> str:
    """Whether ``start`` (reading a pipeline, checking its shape, building its stages) refuses it
    as a start-up does: with a ``ValueError`` (a ``ConfigError`` is one)."""
    try:
        start()
    except ValueError:
        return "refused"
    return "accepted"


@mutant(
    "resolve_with_or",
    summary="async_chunk resolves with 'or': a stage True overrides a global False",
    issue="#7544",
    scenarios=("config_contract",),
    expect=("config-contract",),
)
def resolve_with_or() -> Iterator[Patch]:
    yield Patch(resolve, "resolve_stage_async_chunk", lambda pipeline, stage: bool(pipeline or stage))


@mutant(
    "aligner_opt_out_ignored",
    summary="a stage's async_chunk: false is ignored: the aligner inherits True",
    issue="#7544",
    scenarios=("config_contract",),
    expect=("config-contract",),
)
def aligner_opt_out_ignored() -> Iterator[Patch]:
    yield Patch(resolve, "resolve_stage_async_chunk", lambda pipeline, stage: bool(pipeline))


@mutant(
    "engine_mirrors_stage0",
    summary="the engine's async_chunk mirrors stage 0 instead of any stage",
    issue="#7544",
    scenarios=("config_contract",),
    expect=("config-contract",),
)
def engine_mirrors_stage0() -> Iterator[Patch]:
    yield Patch(resolve, "any_stage_async", lambda resolved: next(iter(resolved), False))


@mutant(
    "edge_validator_removed",
    summary="the start-up edge validator is gone: incompatible edges are accepted",
    issue="#7544",
    scenarios=("config_contract",),
    expect=("config-contract",),
)
def edge_validator_removed() -> Iterator[Patch]:
    yield Patch(resolve, "validate", lambda topology, deploy: None)
