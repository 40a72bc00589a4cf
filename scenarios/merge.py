"""What a generation-mode receiver (Code2Wav) must make of the chunks it takes: spec §3.8, read
from the spec, not from the runtime.

Each chunk the receiver commits is merged into the request's ``additional_information``: the
previous dict carries over (unless the chunk's ``meta.replace_runtime_additional_information`` is
True); a dict-valued entry merges key by key, except ``codes.audio`` unless it is a tensor of two
or more dimensions (1-D codes live in the prompt) and ``meta.finished`` (it steers exhaustion);
any other value overwrites. The chunk also becomes the request's one-shot prompt: its codes (a
placeholder ``[0]`` for codes of two or more dimensions, ``[0]`` for a segment end without codes),
nothing computed yet; and a chunk with no codes that ends neither the request nor a segment is
not ready (the receiver polls on). :class:`TakenChunks` records what Code2Wav's connector handed
out; :func:`check_merge` compares, after a commit, what the runtime made of the request with what
the spec says and notes the case (``merge.case``) for the ``merged-as-spec`` invariant.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from omnisim.world import World
from runtime.connectors.base import Connector
from runtime.connectors.keys import external_id_of
from runtime.kernel import current_kernel
from runtime.request import Request

AS_SPEC = "as spec §3.8 merges the chunks taken"


def _kept(name: str, key: str, value: object) -> bool:
    """Whether ``payload[name][key]`` is merged at all."""
    if name == "codes" and key == "audio":
        return isinstance(value, torch.Tensor) and value.ndim >= 2
    return not (name == "meta" and key == "finished")


def spec_merge(info: dict[str, Any] | None, payload: dict[str, Any]) -> dict[str, Any]:
    """``info`` once ``payload`` is merged into it, by spec §3.8 (generation mode, step 3)."""
    meta = payload.get("meta")
    fresh = isinstance(meta, dict) and meta.get("replace_runtime_additional_information") is True
    merged = {} if fresh else dict(info or {})
    for name, value in payload.items():
        if isinstance(value, dict):
            before = merged.get(name)
            merged[name] = {**(before if isinstance(before, dict) else {})} | {
                key: sub for key, sub in value.items() if _kept(name, key, sub)
            }
        else:
            merged[name] = value
    return merged


def _flag(payload: dict[str, Any], name: str) -> bool:
    """``meta[name]`` as a flag: a tensor counts only with exactly one element, and a true one.
    (Spec §3.8's rule, restated here rather than taken from the runtime's ``truthy_scalar``: the
    oracle must not share the code it judges.)"""
    meta = payload.get("meta")
    value = meta.get(name) if isinstance(meta, dict) else None
    if isinstance(value, torch.Tensor):
        return value.numel() == 1 and bool(value.item())
    return bool(value)


def spec_prompt(payload: dict[str, Any]) -> list[Any]:
    """The prompt ids ``payload`` becomes (spec §3.8, generation mode, steps 2 and 5)."""
    codes = payload.get("codes")
    audio = codes.get("audio") if isinstance(codes, dict) else None
    if isinstance(audio, torch.Tensor) and audio.ndim >= 2:
        ids = [0] if audio.numel() else []  # a placeholder: the codes travel in the merged input
    elif isinstance(audio, torch.Tensor):
        ids = audio.tolist()
    else:
        ids = list(audio) if isinstance(audio, list) else []
    if not ids and _flag(payload, "is_segment_finished"):
        return [0]
    return ids


def spec_ready(payload: dict[str, Any]) -> bool:
    """Whether committing ``payload`` publishes it (step 6: not a chunk with no codes that ends
    neither the request nor a segment)."""
    return bool(spec_prompt(payload)) or _flag(payload, "finished")


def first_difference(got: object, want: object, path: str = "") -> str | None:
    """Where ``got`` and ``want`` first differ (a key path and what each holds), or None."""
    if isinstance(want, dict) and isinstance(got, dict):
        for key in sorted(set(got) | set(want), key=str):
            if key not in got or key not in want:
                return f"{path}{key}: {'missing' if key not in got else 'not merged by the spec'}"
            found = first_difference(got[key], want[key], f"{path}{key}.")
            if found is not None:
                return found
        return None
    if isinstance(want, torch.Tensor) or isinstance(got, torch.Tensor):
        same = isinstance(want, torch.Tensor) and isinstance(got, torch.Tensor) and torch.equal(got, want)
        return None if same else f"{path.rstrip('.')}: a different tensor"
    return None if type(got) is type(want) and got == want else f"{path.rstrip('.')}: {got!r}, not {want!r}"


def on_each_get(connector: Connector, see: Callable[[str, dict[str, Any]], None]) -> None:
    """Have ``see(key, payload)`` look at each payload ``connector`` hands out (a stage payload,
    a dict), once its get returned it."""
    get = connector.get

    async def watched_get(*args: Any, **kwargs: Any) -> Any:
        result = await get(*args, **kwargs)
        if result is not None and isinstance(result[0], dict):
            see(str(args[2]), result[0])
        return result

    connector.get = watched_get  # type: ignore[method-assign]


class TakenChunks:
    """The payloads Code2Wav's connector handed out, per external id, in the order taken."""

    def __init__(self, world: World, stage_id: int) -> None:
        self.by_ext: dict[str, list[dict[str, Any]]] = {}
        on_each_get(
            world.stages[stage_id].connector,
            lambda key, payload: self.by_ext.setdefault(external_id_of(key), []).append(payload),
        )

    def since(self, ext: str, count: int) -> list[dict[str, Any]]:
        return self.by_ext.get(ext, [])[count:]

    def count(self, ext: str) -> int:
        return len(self.by_ext.get(ext, []))


def check_merge(request: Request, ext: str, info_before: dict[str, Any] | None, taken: list[Any]) -> None:
    """Note whether ``request`` after a commit is what the spec makes of ``info_before`` and the
    chunks ``taken`` since: the merged ``additional_information``, the prompt of the last chunk,
    that only the last one was ready, and that a terminal ended its resumability."""
    got = _difference(request, info_before, taken) or AS_SPEC
    current_kernel().note("merge.case", req=request.request_id, ext=ext, got=got, want=AS_SPEC)


def _difference(request: Request, info_before: dict[str, Any] | None, taken: list[Any]) -> str | None:
    if not taken:
        # Registered by someone else (an orchestrator re-registering the id) and committed before
        # this watch began: what was merged is already in ``info_before``.
        return first_difference(request.additional_information, info_before)
    *skipped, last = taken
    if any(spec_ready(payload) for payload in skipped):
        return "a ready chunk was not published"
    if not spec_ready(last):
        return "published a chunk with no codes that ends neither the request nor a segment"
    if _flag(last, "finished") and request.resumable:
        return "still resumable after its terminal chunk"
    want: dict[str, Any] | None = info_before
    for payload in taken:
        want = spec_merge(want, payload)
    prompt = spec_prompt(last)
    return (
        first_difference(request.additional_information, want)
        or first_difference(request.prompt_token_ids, prompt, "prompt_token_ids.")
        or first_difference(request.num_prompt_tokens, len(prompt), "num_prompt_tokens.")
        or first_difference(request.num_computed_tokens, 0, "num_computed_tokens.")
    )
