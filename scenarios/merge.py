"""What a generation-mode receiver (Code2Wav) must make of the chunks it takes: spec §3.8, read
from the spec, not from the runtime.

Each chunk the receiver commits is merged into the request's ``additional_information``: the
previous dict carries over (unless the chunk's ``meta.replace_runtime_additional_information`` is
True); a dict-valued entry merges key by key, except ``codes.audio`` unless it is a tensor of two
or more dimensions (1-D codes live in the prompt) and ``meta.finished`` (it steers exhaustion);
any other value overwrites. :class:`TakenChunks` records what Code2Wav's connector handed out;
:func:`check_merge` compares, after a commit, what the runtime merged with what the spec says and
notes the case (``merge.case``) for the ``merged-as-spec`` invariant.
"""

from __future__ import annotations

from typing import Any

import torch

from omnisim.world import World
from runtime.connectors.keys import external_id_of
from runtime.kernel import current_kernel

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


class TakenChunks:
    """The payloads Code2Wav's connector handed out, per external id, in the order taken."""

    def __init__(self, world: World, stage_id: int) -> None:
        self.by_ext: dict[str, list[dict[str, Any]]] = {}
        connector = world.stages[stage_id].connector
        get = connector.get

        async def recording_get(*args: Any, **kwargs: Any) -> Any:
            result = await get(*args, **kwargs)
            if result is not None and isinstance(result[0], dict):
                self.by_ext.setdefault(external_id_of(str(args[2])), []).append(result[0])
            return result

        connector.get = recording_get  # type: ignore[method-assign]

    def since(self, ext: str, count: int) -> list[dict[str, Any]]:
        return self.by_ext.get(ext, [])[count:]

    def count(self, ext: str) -> int:
        return len(self.by_ext.get(ext, []))


def check_merge(request_id: str, ext: str, info_before: dict[str, Any] | None, got: Any, taken: list[Any]) -> None:
    """Note whether ``got`` (the request's ``additional_information`` after a commit) is what the
    spec makes of ``info_before`` and the chunks ``taken`` since."""
    want: dict[str, Any] | None = info_before
    for payload in taken:
        want = spec_merge(want, payload)
    difference = first_difference(got, want)
    current_kernel().note(
        "merge.case", req=request_id, ext=ext, got=AS_SPEC if difference is None else difference, want=AS_SPEC
    )
