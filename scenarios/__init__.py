"""Built-in scenarios and mutants: the seed's race cases, registered with omnisim's decorators."""

from scenarios import (  # noqa: F401
    codec,
    config_contract,
    input_wait,
    mutants_4855,
    mutants_6670,
    mutants_8082,
    mutants_codec,
    mutants_pipeline,
    pipeline,
    race_6670,
    race_8082,
)
