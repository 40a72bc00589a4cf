"""Pipeline configuration (spec §1, §7, §9): the resolution table, the edge rules and start-up errors."""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any

import pytest
import yaml

from runtime.config import (
    CodecChunking,
    ConfigError,
    ConnectorRole,
    Edge,
    OutputType,
    PipelineConfig,
    StageKind,
    StageProcessors,
    build_pipeline,
    load_pipeline,
    resolve_stage_async_chunk,
    shipped_pipelines,
)
from runtime.config.resolve import any_stage_async

Raw = dict[str, Any]


def shipped_raw(name: str) -> Raw:
    """A fresh, editable copy of a shipped config as parsed YAML."""
    text = (resources.files("runtime.config") / "configs" / f"{name}.yaml").read_text(encoding="utf-8")
    return yaml.safe_load(text)


def deploy_stage(raw: Raw, stage_id: int) -> dict[str, Any]:
    """The deploy entry of ``stage_id``, added if the file has none."""
    stages = raw.setdefault("deploy", {}).setdefault("stages", [])
    for entry in stages:
        if entry["stage_id"] == stage_id:
            return entry
    stages.append({"stage_id": stage_id})
    return stages[-1]


def set_modes(raw: Raw, pipeline: bool, stages: list[bool | None]) -> Raw:
    raw["deploy"]["async_chunk"] = pipeline
    for stage_id, value in enumerate(stages):
        deploy_stage(raw, stage_id)["async_chunk"] = value
    return raw


def resolved(config: PipelineConfig) -> list[bool]:
    return [config.resolved_async_chunk(stage.stage_id) for stage in config.stages]


def receiving(config: PipelineConfig) -> list[bool]:
    return [config.stage_receives_chunks(stage.stage_id) for stage in config.stages]


# --- the resolution table (spec §1.2), row by row -------------------------------------------

TABLE = [
    # (pipeline, stage, resolved)
    (False, None, False),
    (False, False, False),
    (False, True, False),  # a stage True never overrides a global False (#7544 mutant)
    (True, None, True),
    (True, True, True),
    (True, False, False),  # the stage opt-out: with "or" this row would be True (#7544 mutant)
]


@pytest.mark.parametrize(("pipeline", "stage", "expected"), TABLE)
def test_resolution_table_row(pipeline: bool, stage: bool | None, expected: bool) -> None:
    assert resolve_stage_async_chunk(pipeline, stage) is expected


@pytest.mark.parametrize(("pipeline", "stage", "expected"), TABLE)
def test_resolution_table_row_through_a_loaded_pipeline(pipeline: bool, stage: bool | None, expected: bool) -> None:
    # Every stage gets the same value, so every chunk edge agrees and the validator accepts it.
    config = build_pipeline(set_modes(shipped_raw("qwen3_omni"), pipeline, [stage] * 3))
    assert resolved(config) == [expected] * 3
    assert config.any_stage_async() is expected
    assert [config.delivery(edge) for edge in config.edges] == ["chunks" if expected else "forward"] * 2


def test_resolution_uses_and_not_or() -> None:
    # The two rows where "and" and "or" disagree.
    assert resolve_stage_async_chunk(False, True) is False
    assert resolve_stage_async_chunk(True, False) is False


def test_a_stage_true_never_overrides_a_global_false() -> None:
    raw = set_modes(shipped_raw("qwen3_tts_aligner"), False, [True, True, True])
    config = build_pipeline(raw)
    assert resolved(config) == [False, False, False]
    assert config.any_stage_async() is False
    assert config.prewarm_stages() == ()


def test_pipeline_async_chunk_defaults_to_true() -> None:
    raw = shipped_raw("qwen3_omni")
    del raw["deploy"]["async_chunk"]
    assert resolved(build_pipeline(raw)) == [True, True, True]


def test_a_single_stage_pipeline_forces_async_chunk_off() -> None:
    raw = shipped_raw("qwen3_omni")
    thinker = raw["pipeline"]["stages"][0]
    del thinker["async_chunk_processor"]  # nothing to stream to: the on-without-producer check must not fire
    raw["pipeline"]["stages"] = [thinker]
    raw["deploy"] = {"async_chunk": True}
    config = build_pipeline(raw)
    assert resolved(config) == [False]
    assert config.any_stage_async() is False
    assert config.edges == ()


# --- the shipped configs -------------------------------------------------------------------


def test_shipped_configs_are_listed() -> None:
    assert set(shipped_pipelines()) >= {"qwen3_omni", "qwen3_tts_aligner"}


def test_qwen3_omni_topology() -> None:
    config = load_pipeline("qwen3_omni")
    assert [(s.name, s.kind, s.input_sources, s.final_output) for s in config.stages] == [
        ("thinker", StageKind.LLM_AR, (), OutputType.TEXT),
        ("talker", StageKind.LLM_AR, (0,), None),
        ("code2wav", StageKind.LLM_GENERATION, (1,), OutputType.AUDIO),
    ]
    assert config.edges == (Edge(0, 1), Edge(1, 2))
    assert config.stage(1).stop_token_ids == (2150,)
    assert config.final_stage_id(["text"]) == 0
    assert config.final_stage_id(["text", "audio"]) == 2


def test_qwen3_omni_streams_every_edge_with_the_deploy_frame_numbers() -> None:
    config = load_pipeline("qwen3_omni")
    assert resolved(config) == [True, True, True]
    assert receiving(config) == [False, True, True]  # stage 0 has no producer to receive from
    assert config.any_stage_async() is True
    assert [config.delivery(edge) for edge in config.edges] == ["chunks", "chunks"]
    assert config.prewarm_stages() == (1, 2)
    assert config.prewarm_stages(final_stage_id=0) == ()  # a text-only request prewarms nothing
    assert config.chunking == CodecChunking(4, 25, 25)
    assert config.processors(0).next_stage == "thinker2talker_async_chunk"
    assert config.processors(1).next_stage == "talker2code2wav_async_chunk"
    assert config.processors(1).input is None  # chunks are committed by the adapter
    deploy = config.stage_deploy(2)
    assert (deploy.device, deploy.async_scheduling) == ("cpu", False)


def test_qwen3_omni_with_async_chunk_off_uses_full_payload_processors() -> None:
    raw = shipped_raw("qwen3_omni")
    raw["deploy"]["async_chunk"] = False
    config = build_pipeline(raw)
    assert resolved(config) == receiving(config) == [False, False, False]
    assert [config.delivery(edge) for edge in config.edges] == ["forward", "forward"]
    assert config.prewarm_stages() == ()
    assert config.processors(0).next_stage == "thinker2talker_full_payload"
    assert config.processors(1).next_stage == "talker2code2wav_full_payload"
    assert config.processors(1).input == "thinker2talker_token_only"


def test_qwen3_tts_aligner_mixes_a_chunk_edge_and_a_full_handoff() -> None:
    config = load_pipeline("qwen3_tts_aligner")
    assert [s.name for s in config.stages] == ["qwen3_tts", "code2wav", "forced_aligner"]
    assert config.stage(2).final_output is OutputType.TIMESTAMPS
    assert config.stage_deploy(2).async_chunk is False
    assert config.stage_deploy(2).async_scheduling is False
    # The realistic #7544 case: [True, True, False], and the engine stays async.
    assert resolved(config) == [True, True, False]
    assert config.any_stage_async() is True
    assert config.delivery((0, 1)) == "chunks"
    assert config.delivery((1, 2)) == "forward"
    assert config.processors(2).input == "code2wav2aligner"
    assert config.chunking == CodecChunking(1, 25, 72)


def test_the_aligner_is_never_prewarmed_and_receives_the_full_payload() -> None:
    config = load_pipeline("qwen3_tts_aligner")
    assert config.stage_receives_chunks(2) is False
    assert config.prewarm_stages() == (1,)
    assert config.prewarm_stages(final_stage_id=config.final_stage_id(["audio", "timestamps"])) == (1,)
    assert config.prewarm_stages(final_stage_id=config.final_stage_id(["audio"])) == (1,)
    assert config.delivery(Edge(1, 2)) == "forward"


def test_the_engine_flag_does_not_mirror_stage_0() -> None:
    """[False, True, True] keeps Talker → Code2Wav chunking (the #7544 review finding)."""
    raw = shipped_raw("qwen3_omni")
    del raw["pipeline"]["stages"][0]["async_chunk_processor"]  # Thinker → Talker is a full handoff
    set_modes(raw, True, [False, None, None])
    deploy_stage(raw, 1)["connector_role"] = "sender"  # the Talker is fed by forwarding, streams on
    config = build_pipeline(raw)
    assert resolved(config) == [False, True, True]
    assert config.any_stage_async() is True  # stage 0 alone would say False
    assert config.delivery((0, 1)) == "forward"
    assert config.delivery((1, 2)) == "chunks"
    assert config.prewarm_stages() == (2,)
    assert config.processors(1) == StageProcessors(
        next_stage="talker2code2wav_async_chunk", input="thinker2talker_token_only"
    )


def test_any_stage_async_is_any_not_the_first() -> None:
    assert any_stage_async([False, True, True]) is True
    assert any_stage_async([True, True, False]) is True
    assert any_stage_async([False, False]) is False


# --- the edge validator (spec §1.3) and the receiving rules ----------------------------------


def test_talker_off_into_code2wav_on_is_rejected_at_start_up() -> None:
    raw = set_modes(shipped_raw("qwen3_omni"), True, [False, False, True])
    with pytest.raises(ConfigError, match=re.escape("edge 1 -> 2 (talker -> code2wav): incompatible async_chunk")):
        build_pipeline(raw)


def test_thinker_opt_out_breaks_the_thinker_talker_edge() -> None:
    raw = set_modes(shipped_raw("qwen3_omni"), True, [False, None, None])
    with pytest.raises(ConfigError, match=re.escape("edge 0 -> 1 (thinker -> talker)")):
        build_pipeline(raw)


def test_code2wav_on_into_aligner_off_is_legal() -> None:
    # Code2Wav declares no async producer, so the edge is a full handoff and mixed modes are fine.
    config = build_pipeline(set_modes(shipped_raw("qwen3_tts_aligner"), True, [True, True, False]))
    assert resolved(config) == [True, True, False]


def test_an_aligner_without_the_opt_out_is_rejected_instead_of_hanging() -> None:
    """The #7505 configuration: the aligner would be prewarmed and wait for chunks forever."""
    raw = shipped_raw("qwen3_tts_aligner")
    del deploy_stage(raw, 2)["async_chunk"]
    with pytest.raises(ConfigError, match=re.escape("stage 2 (forced_aligner): its async_chunk resolves True")):
        build_pipeline(raw)


def test_a_chunk_edge_into_a_send_only_stage_is_rejected() -> None:
    raw = shipped_raw("qwen3_omni")
    deploy_stage(raw, 2)["connector_role"] = "sender"
    with pytest.raises(ConfigError, match=re.escape("edge 1 -> 2 (talker -> code2wav): talker streams chunks")):
        build_pipeline(raw)


def test_async_chunk_on_without_any_async_producer_is_rejected() -> None:
    raw = shipped_raw("qwen3_omni")
    for stage in raw["pipeline"]["stages"]:
        stage.pop("async_chunk_processor", None)
    with pytest.raises(ConfigError, match="no stage declares an async_chunk_processor"):
        build_pipeline(raw)


def test_an_entry_stage_cannot_be_made_to_receive_chunks() -> None:
    raw = shipped_raw("qwen3_omni")
    deploy_stage(raw, 0)["connector_role"] = "receiver"
    with pytest.raises(ConfigError, match=re.escape("stage 0 (thinker)")):
        build_pipeline(raw)


def test_validation_runs_on_every_construction() -> None:
    good = load_pipeline("qwen3_omni")
    stages = list(good.deploy.stages)
    stages[1] = dataclasses.replace(stages[1], async_chunk=False)
    with pytest.raises(ConfigError, match=re.escape("edge 0 -> 1 (thinker -> talker)")):
        dataclasses.replace(good, deploy=dataclasses.replace(good.deploy, stages=tuple(stages)))


# --- invalid files: one clear error naming the field -----------------------------------------


def edit(path: str, value: object) -> Callable[[Raw], None]:
    """An edit that sets ``value`` at a dotted path such as ``pipeline.stages.2.input_sources``."""

    def apply(raw: Raw) -> None:
        *parents, last = [int(p) if p.isdigit() else p for p in path.split(".")]
        node: Any = raw
        for key in parents:
            node = node[key]
        node[last] = value

    return apply


def delete(path: str) -> Callable[[Raw], None]:
    def apply(raw: Raw) -> None:
        *parents, last = [int(p) if p.isdigit() else p for p in path.split(".")]
        node: Any = raw
        for key in parents:
            node = node[key]
        del node[last]

    return apply


INVALID = [
    # topology
    (
        edit("pipeline.stages.2.input_sources", [7]),
        "pipeline.stages[2].input_sources: stage 2 (code2wav) takes input from unknown stage 7",
    ),
    (
        edit("pipeline.stages.1.input_sources", [2]),
        "input_sources form a cycle (producer -> consumer): 1 (talker) -> 2 (code2wav) -> 1 (talker)",
    ),
    (
        edit("pipeline.stages.1.input_sources", [1]),
        "input_sources form a cycle (producer -> consumer): 1 (talker) -> 1 (talker)",
    ),
    (
        edit("pipeline.stages.0.input_sources", [2]),
        "input_sources form a cycle (producer -> consumer): 0 (thinker) -> 1 (talker) -> 2 (code2wav) -> 0 (thinker)",
    ),
    (edit("pipeline.stages.2.input_sources", [0, 0]), "pipeline.stages[2].input_sources: duplicate source in [0, 0]"),
    (
        edit("pipeline.stages.2.input_sources", []),
        "pipeline.stages[2].input_sources: stage 2 (code2wav) has no input source",
    ),
    (
        edit("pipeline.stages.2.input_sources", "1"),
        "pipeline.stages[2].input_sources: expected a list of integers, got '1'",
    ),
    (
        edit("pipeline.stages.2.input_sources", [-1]),
        "pipeline.stages[2].input_sources[0]: expected an integer >= 0, got -1",
    ),
    (
        edit("pipeline.stages.2.input_sources", 0),
        "pipeline.stages[2].input_sources: expected a list of integers, got 0",
    ),
    (edit("pipeline.stages.0.kind", None), "pipeline.stages[0].kind: required"),
    (delete("pipeline.stages.2.final_output"), "pipeline.stages[2].final_output: missing final stage"),
    (edit("pipeline.stages.1.stage_id", 5), "pipeline.stages[1].stage_id: expected 1 (stages are listed in run order"),
    (edit("pipeline.stages", []), "pipeline.stages: a pipeline needs at least one stage"),
    (
        edit("pipeline.stages.0.kind", "DIFFUSION"),
        "pipeline.stages[0].kind: expected one of LLM_AR, LLM_GENERATION, got 'DIFFUSION'",
    ),
    (
        edit("pipeline.stages.2.final_output", "video"),
        "pipeline.stages[2].final_output: expected one of text, audio, timestamps, got 'video'",
    ),
    (delete("pipeline.stages.1.model"), "pipeline.stages[1].model: required"),
    (edit("pipeline.stages.1.model", 3), "pipeline.stages[1].model: expected a non-empty string, got 3"),
    (
        edit("pipeline.stages.1.stop_token_ids", [2150.0]),
        "pipeline.stages[1].stop_token_ids[0]: expected an integer >= 0, got 2150.0",
    ),
    (edit("pipeline.stages.1.async_chunk", True), "pipeline.stages[1].async_chunk: unknown key"),
    (delete("pipeline"), "config.pipeline: required"),
    (edit("pipelines", {}), "config.pipelines: unknown key (known keys: pipeline, deploy)"),
    # deploy
    (edit("deploy.stages.2.async_chunk", "yes"), "deploy.stages[2].async_chunk: expected bool, got 'yes'"),
    (edit("deploy.stages.2.async_chunk", 1), "deploy.stages[2].async_chunk: expected bool, got 1"),
    (edit("deploy.async_chunk", "true"), "deploy.async_chunk: expected bool, got 'true'"),
    (edit("deploy.stages.2.asyn_chunk", False), "deploy.stages[2].asyn_chunk: unknown key"),
    (edit("deploy.chunk_frames", 25), "deploy.chunk_frames: unknown key"),
    (
        edit("deploy.codec_left_context_frames", -1),
        "deploy.codec_left_context_frames: expected an integer >= 0, got -1",
    ),
    (
        edit("deploy.initial_codec_chunk_frames", -4),
        "deploy.initial_codec_chunk_frames: expected an integer >= 0, got -4",
    ),
    (edit("deploy.codec_chunk_frames", 0), "deploy.codec_chunk_frames: expected an integer >= 1, got 0"),
    (edit("deploy.codec_chunk_frames", 2.5), "deploy.codec_chunk_frames: expected an integer >= 1, got 2.5"),
    (edit("deploy.codec_chunk_frames", "25"), "deploy.codec_chunk_frames: expected an integer >= 1, got '25'"),
    (edit("deploy.codec_chunk_frames", True), "deploy.codec_chunk_frames: expected an integer >= 1, got True"),
    (edit("deploy.stages.0.stage_id", 5), "deploy.stages[0].stage_id: the pipeline has no stage 5"),
    (edit("deploy.stages.1.stage_id", 0), "deploy.stages[1].stage_id: stage 0 is configured twice"),
    (delete("deploy.stages.1.stage_id"), "deploy.stages[1].stage_id: required"),
    (edit("deploy.stages.0.device", "tpu"), "deploy.stages[0].device: expected 'cpu', 'cuda' or 'cuda:N', got 'tpu'"),
    (
        edit("deploy.stages.0.connector_role", "both"),
        "deploy.stages[0].connector_role: expected one of sender, receiver",
    ),
    (edit("deploy.stages.1.async_scheduling", "no"), "deploy.stages[1].async_scheduling: expected bool, got 'no'"),
    (edit("deploy.stages", {"stage_id": 0}), "deploy.stages: expected a list"),
    (edit("deploy.transport", "pipes"), "deploy.transport: expected one of ring, segments"),
    (edit("deploy.ring_bytes", 1000), "deploy.ring_bytes: expected an integer >= 65536, got 1000"),
    (
        edit("deploy.ring_bytes", 65537),
        "deploy.ring_bytes: expected a multiple of 64 bytes, at most 67108864, got 65537",
    ),
    (
        edit("deploy.edges", [{"from_stage": 0, "to_stage": 2, "transport": "ring"}]),
        "deploy.edges[0]: the pipeline has no edge 0 -> 2",
    ),
    (edit("deploy.edges", [{"from_stage": 0, "to_stage": 1}]), "deploy.edges[0].transport: required"),
    (
        edit("deploy.edges", [{"from_stage": 0, "to_stage": 1, "transport": "ring", "size": 3}]),
        "deploy.edges[0].size: unknown key",
    ),
    (edit("deploy", ["async_chunk"]), "deploy: expected a mapping, got ['async_chunk']"),
]


def test_every_edge_is_on_the_ring_unless_the_deploy_says_otherwise() -> None:
    raw = shipped_raw("qwen3_omni")
    assert [build_pipeline(raw).deploy.transport_of(*e) for e in build_pipeline(raw).edges] == ["ring", "ring"]
    raw["deploy"]["edges"] = [{"from_stage": 1, "to_stage": 2, "transport": "segments"}]
    config = build_pipeline(raw)
    assert [config.deploy.transport_of(*e) for e in config.edges] == ["ring", "segments"]
    assert [config.with_transport("ring").deploy.transport_of(*e) for e in config.edges] == ["ring", "ring"]
    with pytest.raises(ConfigError, match="transport: expected one of ring, segments, got 'pipes'"):
        config.with_transport("pipes")


@pytest.mark.parametrize(("mutate", "message"), INVALID, ids=[message[:60] for _, message in INVALID])
def test_invalid_config_names_the_field(mutate: Callable[[Raw], None], message: str) -> None:
    raw = shipped_raw("qwen3_omni")
    mutate(raw)
    with pytest.raises(ConfigError, match=re.escape(message)):
        build_pipeline(raw, source="omni.yaml")


def test_the_error_names_the_file(tmp_path: Path) -> None:
    raw = set_modes(shipped_raw("qwen3_omni"), True, [False, False, True])
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}: edge 1 -> 2 \(talker -> code2wav\)"):
        load_pipeline(path)


def test_config_error_is_a_value_error() -> None:
    assert issubclass(ConfigError, ValueError)


def test_unknown_shipped_name() -> None:
    with pytest.raises(ConfigError, match=r"no shipped pipeline named 'qwen9'.*qwen3_omni"):
        load_pipeline("qwen9")


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read the config"):
        load_pipeline(tmp_path / "absent.yaml")


def test_broken_yaml(tmp_path: Path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text("pipeline: [unclosed\n")
    with pytest.raises(ConfigError, match=re.escape(f"{path}: not valid YAML")):
        load_pipeline(path)


def test_a_top_level_list_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "list.yaml"
    path.write_text("- stage_id: 0\n")
    with pytest.raises(ConfigError, match=re.escape(f"{path}: config: expected a mapping")):
        load_pipeline(path)


# --- loading, defaults, immutability ---------------------------------------------------------


def test_defaults_when_the_deploy_section_is_absent() -> None:
    raw = shipped_raw("qwen3_omni")
    del raw["deploy"]
    config = build_pipeline(raw)
    assert config.deploy.async_chunk is True
    assert config.chunking == CodecChunking(
        initial_codec_chunk_frames=0, codec_chunk_frames=25, codec_left_context_frames=25
    )
    assert all(config.stage_deploy(s.stage_id).device == "cpu" for s in config.stages)
    assert all(config.stage_deploy(s.stage_id).async_chunk is None for s in config.stages)


def test_processor_frame_defaults_when_the_keys_are_absent() -> None:
    raw = shipped_raw("qwen3_omni")
    for key in ("initial_codec_chunk_frames", "codec_chunk_frames", "codec_left_context_frames"):
        del raw["deploy"][key]
    assert build_pipeline(raw).chunking == CodecChunking(0, 25, 25)


def test_null_means_inherit() -> None:
    raw = set_modes(shipped_raw("qwen3_tts_aligner"), True, [None, None, False])
    assert resolved(build_pipeline(raw)) == [True, True, False]


def test_load_by_path_equals_load_by_name() -> None:
    path = Path(str(resources.files("runtime.config") / "configs" / "qwen3_omni.yaml"))
    by_path, by_name = load_pipeline(path), load_pipeline("qwen3_omni")
    assert (by_path.topology, by_path.deploy) == (by_name.topology, by_name.deploy)
    assert by_name.source == "qwen3_omni.yaml"


def test_a_separate_deploy_file_replaces_the_shipped_one(tmp_path: Path) -> None:
    deploy = tmp_path / "deploy.yaml"
    deploy.write_text("async_chunk: false\ncodec_chunk_frames: 10\n")
    config = load_pipeline("qwen3_omni", deploy=deploy)
    assert config.any_stage_async() is False
    assert config.chunking == CodecChunking(0, 10, 25)
    deploy.write_text("stages:\n  - stage_id: 1\n    async_chunk: false\n")
    with pytest.raises(ConfigError, match=re.escape("qwen3_omni.yaml with ") + ".*" + re.escape("edge 0 -> 1")):
        load_pipeline("qwen3_omni", deploy=deploy)


def test_configs_are_frozen() -> None:
    config = load_pipeline("qwen3_omni")
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.deploy.async_chunk = False  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.stage(0).name = "x"  # type: ignore[misc]
    assert isinstance(config.stages, tuple)
    assert isinstance(config.stage(1).input_sources, tuple)


def test_placed_on_moves_every_stage() -> None:
    config = load_pipeline("qwen3_tts_aligner").placed_on("cuda:0")
    assert [config.stage_deploy(s.stage_id).device for s in config.stages] == ["cuda:0"] * 3
    assert resolved(config) == [True, True, False]  # placement changes nothing else
    with pytest.raises(ConfigError, match="device"):
        config.placed_on("gpu")


def test_describe_and_unknown_lookups() -> None:
    config = load_pipeline("qwen3_omni")
    assert config.describe((1, 2)) == "edge 1 -> 2 (talker -> code2wav)"
    assert config.stage(1).label == "1 (talker)"
    with pytest.raises(KeyError):
        config.delivery((0, 2))
    with pytest.raises(KeyError):
        config.resolved_async_chunk(3)
    with pytest.raises(ValueError, match="produces none"):
        config.final_stage_id(["timestamps"])


def test_connector_role_parses_to_the_enum() -> None:
    raw = shipped_raw("qwen3_omni")
    deploy_stage(raw, 2)["connector_role"] = "receiver"
    assert build_pipeline(raw).stage_deploy(2).connector_role is ConnectorRole.RECEIVER


# -- files as users write them (found by a review that wrote its own) ---------------------------


def _shipped_text() -> str:
    return (resources.files("runtime.config") / "configs" / "qwen3_omni.yaml").read_text()


@pytest.mark.parametrize(
    ("content", "error"),
    [
        (_shipped_text() + "\ndeploy:\n  async_chunk: false\n", "the key 'deploy' is given twice"),
        (b"name: \xff\xfe\n", "not UTF-8 text"),
        ("a: " + "[" * 5000 + "]" * 5000 + "\n", "nested too deeply"),
        ("# " + "x" * (2 << 20) + "\n", "larger than the 1024 KiB a config may be"),
    ],
)
def test_a_file_that_is_no_config_is_refused_naming_itself(tmp_path: Path, content: str | bytes, error: str) -> None:
    path = tmp_path / "mine.yaml"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(ConfigError, match=re.escape(error)) as raised:
        load_pipeline(path)
    assert str(path) in str(raised.value)


def test_a_fifo_at_the_path_is_refused_at_once(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match="a config must be a regular file"):
        load_pipeline(fifo)


def test_an_error_quotes_a_huge_value_cut_short(tmp_path: Path) -> None:
    """Aliases let a tiny file hold a value whose repr runs to gigabytes."""
    laughs = "deploy:\n  ring_bytes: &a [1, 1, 1, 1, 1, 1, 1, 1, 1]\n"
    for level in range(1, 9):
        laughs += f"  x{level}: &{'a' * (level + 1)} [" + ", ".join(["*" + "a" * level] * 9) + "]\n"
    text = _shipped_text().split("deploy:")[0] + laughs.replace("deploy:\n", "deploy:\n", 1)
    path = tmp_path / "laughs.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as raised:
        load_pipeline(path)
    assert len(str(raised.value)) < 400


def test_the_runtime_refuses_a_shape_it_does_not_run() -> None:
    from runtime.stages import check_shape

    for edits, error in [
        (edit("pipeline.stages.1.final_output", "text"), "pipeline.stages[1].final_output"),
        (edit("pipeline.stages.0.final_output", "audio"), "pipeline.stages[0].final_output"),
        (edit("pipeline.stages.2.kind", "LLM_AR"), "pipeline.stages[2].kind"),
        (edit("pipeline.stages.1.kind", "LLM_GENERATION"), "pipeline.stages[1].kind"),
        (edit("pipeline.stages.1.async_chunk_processor", "bogus_proc"), "pipeline.stages[1].async_chunk_processor"),
        (edit("pipeline.stages.1.stop_token_ids", [2149]), "pipeline.stages[1].stop_token_ids"),
    ]:
        raw = shipped_raw("qwen3_omni")
        edits(raw)
        with pytest.raises(ValueError, match=re.escape(error)):
            check_shape(build_pipeline(raw, source="mine.yaml"))


@pytest.mark.parametrize(
    ("edits", "error"),
    [
        (edit("deploy.ring_bytes", 1 << 50), "at most 67108864"),
        (
            edit("deploy.edges", [{"from_stage": 1, "to_stage": 2, "transport": t} for t in ("segments", "ring")]),
            "the edge 1 -> 2 is configured twice",
        ),
    ],
)
def test_deploy_settings_out_of_range_or_twice(edits: Callable[[Raw], None], error: str) -> None:
    raw = shipped_raw("qwen3_omni")
    edits(raw)
    with pytest.raises(ConfigError, match=re.escape(error)):
        build_pipeline(raw, source="mine.yaml")


def test_max_num_seqs_is_64_unless_a_stage_says_otherwise() -> None:
    """vLLM's ``max_num_seqs`` per stage (spec §9: 64 in the shipped deploys); at least 1."""
    raw = shipped_raw("qwen3_omni")
    deploy_stage(raw, 2)["max_num_seqs"] = 2
    config = build_pipeline(raw, "test")
    assert [config.deploy.stage(sid).max_num_seqs for sid in range(3)] == [64, 64, 2]
    deploy_stage(raw, 2)["max_num_seqs"] = 0
    with pytest.raises(ConfigError, match="max_num_seqs"):
        build_pipeline(raw, "test")
