"""Built-in scenarios and mutants: the seed's race cases, registered with omnisim's decorators."""

from scenarios import (  # noqa: F401
    codec,
    config_contract,
    connector,
    crash,
    generation_merge,
    hostile,
    hostile_shm,
    input_wait,
    large,
    mutants_4855,
    mutants_6670,
    mutants_8082,
    mutants_codec,
    mutants_dataplane,
    mutants_pipeline,
    mutants_ring,
    mutants_sender,
    mutants_stages,
    pipeline,
    processor_contract,
    race_6670,
    race_8082,
    ring,
    segments,
    stage_crash,
)

#: The seed's race table (#8082 a–i) and #6670 (a, b), by the names the issues use.
RACE_TABLE = (
    "abort_during_put",
    "id_reuse_after_cancel",
    "similar_ids",
    "terminal_success_vs_failure",
    "stale_receiver_entry",
    "repeated_receiver_cleanups",
    "idle_reap",
    "unread_head_rotation",
    "deserialize_failure",
    "abort_with_terminal_queued",
    "parked_sender_terminal",
)
