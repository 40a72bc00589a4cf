"""A model that raises on one request's step, in the middle of its stream (a CUDA out-of-memory on
a long input, an input of a shape it cannot take; upstream's #4384 class: one bad request must not
take the engine down).

The stage's scheduler fails that request, naming the failure; the orchestrator ends it everywhere
else (the chunks it already sent downstream are reclaimed, the stages after it drop it), and the
request next to it gets its exact answer. Nothing is left behind.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

import torch

from omnisim.registry import Param, Params
from omnisim.world import World
from runtime.models.thinker import prompt_token_ids
from runtime.orchestrator import Unavailable
from runtime.pipeline import Models
from scenarios.edge import together
from scenarios.pipeline import ASYNC_CHUNK, REMAINDER, SHORT, Client, models, pipeline_scenario, pipeline_world


class Failure(NamedTuple):
    """Where a model raises on the failing request: its stage's model, the method, at which of
    the request's calls of it, and how a call's argument tells the request (its prompt's rows)."""

    stage: str
    method: str
    at: int
    #: None: any request's call counts (a batch of several requests' chunks, as Code2Wav decodes).
    rows_of: Callable[[Any], int] | None


#: The Thinker's step 3 comes after chunks went to the Talker, the Talker's step 8 after frames
#: went to Code2Wav; the Thinker's ``init_state`` refuses the request at submission (a prompt too
#: long for it, say: nothing of it ever runs); the Talker's refuses the request's first input (an
#: input of a shape it cannot take), chunk 0 with async chunk on, the forwarded payload with it off. Code2Wav
#: decodes a batch of chunks per forward pass: its second one fails, whoever's chunks it holds.
FAILURES = {
    "thinker_step": Failure("thinker", "step", 3, lambda state: len(state.prompt_token_ids)),
    "thinker_input": Failure("thinker", "init_state", 1, lambda text: len(prompt_token_ids(text))),
    "talker_step": Failure("talker", "step", 8, lambda state: state.prefill_inputs.shape[0]),
    "talker_input": Failure("talker", "init_state", 1, lambda conditioning: conditioning.num_prompt_rows),
    "code2wav_decode": Failure("code2wav", "forward", 2, None),
}
WHERE = Param("fails", tuple(FAILURES), "which model call raises on the failing request")
#: What the model raises, as torch words a CUDA out-of-memory.
MODEL_ERROR = "CUDA out of memory (injected)"

_Model = TypeVar("_Model", bound=torch.nn.Module)


def failing_copy(model: _Model, failure: Failure, prompt_rows: int) -> _Model:
    """A copy of ``model`` (sharing its weights) whose ``failure.method`` raises at the
    ``failure.at``-th call for the request with ``prompt_rows`` prompt rows (without
    ``failure.rows_of``: at the ``failure.at``-th call of all). Everything else is the real model's."""
    calls = 0
    real = getattr(model, failure.method)

    def method(arg: Any, *more: Any) -> Any:
        nonlocal calls
        if failure.rows_of is None or failure.rows_of(arg) == prompt_rows:
            calls += 1
            if calls == failure.at:
                raise RuntimeError(MODEL_ERROR)
        return real(arg, *more)

    failing = copy.copy(model)
    setattr(failing, failure.method, method)
    return failing


def failing_world(store_kind: str, params: Params) -> World:
    """The pipeline, with one model call raising on :data:`REMAINDER`'s request."""
    real = models()
    prompt_rows = len(real.thinker.init_state(REMAINDER).prompt_token_ids)
    failure = FAILURES[params["fails"]]
    failing = failing_copy(getattr(real, failure.stage), failure, prompt_rows)
    stage_models: Models = dataclasses.replace(real, **{failure.stage: failing})
    return pipeline_world(store_kind, params, stage_models)


@pipeline_scenario(
    "model_step_failure",
    summary="the Thinker's or the Talker's model raises on one request mid-stream (a CUDA out-of-memory), or the "
    "Thinker's refuses a request at submission, or the Talker's its first input, or a Code2Wav decode pass fails: "
    "the requests it struck fail, once each, "
    "naming the model's error (the Thinker's or Talker's: that request alone); the others get their exact text "
    "and audio; nothing is left behind",
    issue="#4384 (one bad request must not take the engine down); omnisim issue 11 (a blind spot of the mutation "
    "score of runtime/sched: no model ever raised)",
    params=(WHERE, ASYNC_CHUNK),
    build=failing_world,
)
async def model_step_failure(world: World) -> None:
    failing = Client(world, "failing", REMAINDER, "F", modalities=("text", "audio"))
    healthy = Client(world, "healthy", SHORT, "H", modalities=("text", "audio"))
    one_request = FAILURES[world.params["fails"]].rows_of is not None
    # A failed batch fails the requests whose chunks it held: either, or both.
    failing.outcomes = frozenset({"failed"} if one_request else {"failed", "finished"})
    if not one_request:
        healthy.outcomes = failing.outcomes
    await together(("F", failing.run), ("H", healthy.run))
    failed = [c for c in (failing, healthy) if c.stream.outcome == "failed"]
    if not one_request and all(c.stream.outcome == "finished" for c in (failing, healthy)):
        world.probe("liveness", False, "Code2Wav's decode failed, and yet both requests finished")
    for client in failed:
        error = client.stream.error or ""
        world.probe(
            "failures-have-causes",
            MODEL_ERROR in error or bool(world.fired_faults()),  # (a sampled fault may strike it first)
            f"{client.name}'s error does not name its model's failure: {error!r}",
        )
        # Every stage lives: the engine is up, and a server must not answer 503, retry later.
        world.probe(
            "failures-have-causes",
            not isinstance(error, Unavailable),
            f"{client.name} failed of its model's error, yet is told the engine is unavailable: {error!r}",
        )
