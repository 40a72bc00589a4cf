"""Scenarios and mutants, registered by decorator — the same one a third-party plugin uses.

A plugin is any module (by import name or file path) that applies :func:`scenario` or
:func:`mutant` at import time; ``--plugin`` loads it. The built-in ones live in the ``scenarios``
package and are loaded the same way.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import itertools
import os
import sys
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import ModuleType

from invariants import where as _where
from omnisim.base import UsageError
from omnisim.faults import FaultPlan, UnknownFaultError, faults_of_specs
from omnisim.world import World

BUILTIN_PLUGIN = "scenarios"

#: A scenario's workload: it drives the world's stages and returns when its requests are done.
ScenarioBody = Callable[[World], Awaitable[None]]

#: What a run checks unless the scenario says otherwise.
DEFAULT_INVARIANTS = (
    "no-orphan-shm",
    "no-leaked-handle",
    "no-orphan-lock",
    "no-tombstones",
    "exact-key-ownership",
    "no-stale-commit",
    "no-stale-consume",
    "terminal-delivered",
    "samples-exactly-once",
    "aligner-complete",
    "abort-non-blocking",
    "liveness",
    "no-crash",
    "failures-have-causes",
    "no-lost-wakeup",
    "no-corrupt-accept",
    "health-counts-true",
    "merged-as-spec",
    "sender-contract",
    "ring-before-segments",
    "answers-true",
    "ring-writes-locked",
    "answered-leaves-nothing-unread",
    "streamed-as-made",
    "failures-claimed",
    "no-register-after-terminal",
    "one-generation-per-id",
)


#: One configuration of a scenario: parameter name -> value.
Params = Mapping[str, str]


@dataclass(frozen=True)
class Param:
    """A dimension of a scenario's configuration space; the first value is the default shown."""

    name: str
    values: tuple[str, ...]
    help: str

    def __str__(self) -> str:
        return f"{self.name}={'|'.join(self.values)}"


@dataclass(frozen=True)
class Scenario:
    name: str
    summary: str
    issue: str
    #: Builds the world for a store kind; a scenario with ``params`` also gets its configuration.
    build: Callable[..., World]
    body: ScenarioBody
    constraints: tuple[str, ...] = ()
    faults: Callable[[int], FaultPlan | None] = lambda seed: None
    invariants: tuple[str, ...] = DEFAULT_INVARIANTS
    horizon_s: float = 20.0
    #: The share of a command's schedule budget this scenario runs (a long schedule runs fewer).
    budget_share: float = 1.0
    params: tuple[Param, ...] = ()
    #: Faults added from the command line (``--fault``), as given: an artifact records them.
    fault_specs: tuple[str, ...] = ()
    #: Why the scenario cannot run on a store here (None: it can), e.g. a right the machine lacks.
    unavailable: Callable[[str], str | None] = lambda store: None

    def with_faults(self, specs: Sequence[str]) -> Scenario:
        """This scenario with the faults ``specs`` (see :func:`~omnisim.faults.parse_fault`)
        injected too, in every run, besides its own."""
        if not specs:
            return self
        try:
            faults_of_specs(specs, 0)  # an unknown kind is an error now, not at the first run
        except UnknownFaultError as e:
            raise UsageError(str(e)) from None
        own = self.faults

        def plan(seed: int) -> FaultPlan:
            base = own(seed)
            return FaultPlan([*(base.faults if base else []), *faults_of_specs(specs, seed)], seed)

        return dataclasses.replace(self, faults=plan, fault_specs=(*self.fault_specs, *specs))

    def budget(self, budget: int) -> int:
        return max(1, int(budget * self.budget_share))

    def configurations(self, fixed: Params | None = None) -> list[dict[str, str]]:
        """Every configuration, in a fixed order, that agrees with ``fixed``."""
        fixed = dict(fixed or {})
        for name, value in fixed.items():
            param = next((p for p in self.params if p.name == name), None)
            if param is None:
                known = ", ".join(p.name for p in self.params) or "none"
                raise UsageError(f"scenario {self.name!r} has no parameter {name!r} (its parameters: {known})")
            if value not in param.values:
                raise UsageError(
                    f"parameter {name} of {self.name!r} is one of {', '.join(param.values)}, not {value!r}"
                )
        choices = [(fixed[p.name],) if p.name in fixed else p.values for p in self.params]
        return [dict(zip((p.name for p in self.params), combo, strict=True)) for combo in itertools.product(*choices)]

    def params_for(self, seed: int, fixed: Params | None = None) -> dict[str, str]:
        """The configuration a run with ``seed`` explores: successive seeds walk through every
        configuration in turn, so any budget of at least their number covers them all."""
        combos = self.configurations(fixed)
        return combos[seed % len(combos)]

    def make_world(self, store: str, params: Params) -> World:
        try:
            world = self.build(store, dict(params)) if self.params else self.build(store)
        except UsageError:
            raise
        except Exception as e:
            if is_builtin(self.build):
                raise
            raise UsageError(
                f"scenario {self.name!r}: its build ({_where(self.build)}) raised {type(e).__name__}: {e}"
            ) from e
        world.params = dict(params)
        return world

    def describe(self) -> str:
        shown = f" [{', '.join(map(str, self.params))}]" if self.params else ""
        return f"{self.issue}: {self.summary}{shown}"


@dataclass(frozen=True)
class Patch:
    """Replace attribute ``attr`` of ``owner`` (a class or module) by ``value`` while applied."""

    owner: object
    attr: str
    value: object


@dataclass(frozen=True)
class Mutant:
    name: str
    summary: str
    issue: str
    patches: Callable[[], Iterator[Patch]]
    #: Scenarios expected to detect it (used by ``omnisim mutants``).
    scenarios: tuple[str, ...] = field(default=())
    #: The invariants it must trip: a run counts as a detection only if one of them fails.
    expect: tuple[str, ...] = field(default=())
    #: The store its scenarios must run on to meet the code it changes (None: any).
    store: str | None = None


SCENARIOS: dict[str, Scenario] = {}
MUTANTS: dict[str, Mutant] = {}


def scenario(
    name: str,
    *,
    summary: str,
    issue: str,
    build: Callable[[str], World],
    constraints: tuple[str, ...] = (),
    faults: Callable[[int], FaultPlan | None] | None = None,
    invariants: tuple[str, ...] = DEFAULT_INVARIANTS,
    horizon_s: float = 20.0,
    budget_share: float = 1.0,
    params: tuple[Param, ...] = (),
    unavailable: Callable[[str], str | None] = lambda store: None,
) -> Callable[[ScenarioBody], ScenarioBody]:
    """Register the decorated ``async def body(world)`` as scenario ``name``.

    With ``params``, ``build(store_kind, params)`` gets the run's configuration (also on
    ``world.params``), and exploring walks through every combination of the values.
    ``unavailable(store)`` says why it cannot run on ``store`` on this machine (None: it can):
    a check leaves such a store out and says so; asking for it is a usage error."""

    _names_of_invariants(f"scenario {name!r}", "invariants", invariants)

    def register(body: ScenarioBody) -> ScenarioBody:
        _builtins_first(body)
        if name in SCENARIOS and _where(SCENARIOS[name].body) != _where(body):
            raise UsageError(f"scenario {name!r} is registered twice (first in {_where(SCENARIOS[name].body)})")
        SCENARIOS[name] = Scenario(
            name,
            summary,
            issue,
            build,
            body,
            constraints,
            faults or (lambda seed: None),
            invariants,
            horizon_s,
            budget_share,
            params,
            unavailable=unavailable,
        )
        return body

    return register


def _names_of_invariants(who: str, field: str, names: object) -> None:
    """``names`` must be a tuple or list of invariant names (a lone string would be taken
    letter by letter). Whether each is registered is checked when a run uses them: a plugin may
    register its invariants after its scenarios."""
    if isinstance(names, str) or not isinstance(names, tuple | list) or not all(isinstance(n, str) for n in names):
        raise UsageError(f"{who}: {field}= must be a tuple of invariant names, got {names!r}")


def _builtins_first(fn: Callable[..., object]) -> None:
    """Before a plugin registers anything, the built-ins do: a plugin that takes one of their
    names then fails where it does so, naming itself, and the built-ins stay whole. (The same
    definition registered again is its module imported a second time: it replaces itself.)"""
    if fn.__module__.split(".")[0] != BUILTIN_PLUGIN:
        load()


def is_builtin(fn: Callable[..., object]) -> bool:
    """Whether ``fn`` is omnisim's own (else a plugin's: a user's code)."""
    return fn.__module__.split(".")[0] in (BUILTIN_PLUGIN, "omnisim", "invariants")


def mutant(
    name: str,
    *,
    summary: str,
    issue: str,
    scenarios: tuple[str, ...],
    expect: tuple[str, ...],
    store: str | None = None,
) -> Callable[[Callable[[], Iterator[Patch]]], Callable[[], Iterator[Patch]]]:
    """Register the decorated generator of :class:`Patch` es as mutant ``name``, found by
    ``scenarios`` when one of the ``expect`` invariants fails. Any other failure it causes (an
    exception in the runtime, an invariant it does not declare) is breakage, not a detection."""

    if not expect:
        raise UsageError(f"mutant {name!r} declares no invariant it must trip (expect=)")
    _names_of_invariants(f"mutant {name!r}", "expect", expect)

    def register(patches: Callable[[], Iterator[Patch]]) -> Callable[[], Iterator[Patch]]:
        _builtins_first(patches)
        if name in MUTANTS and _where(MUTANTS[name].patches) != _where(patches):
            raise UsageError(f"mutant {name!r} is registered twice (first in {_where(MUTANTS[name].patches)})")
        MUTANTS[name] = Mutant(name, summary, issue, patches, scenarios, expect, store)
        return patches

    return register


@contextmanager
def applied(m: Mutant | None) -> Iterator[None]:
    """Apply a mutant's patches for the duration of the block (no-op for None). A patch of an
    attribute its owner does not have is a usage error (a misspelt name would patch nothing)."""
    if m is None:
        yield
        return
    saved: list[_Patched] = []
    try:
        for p in m.patches():
            if not hasattr(p.owner, p.attr):
                owner = getattr(p.owner, "__qualname__", None) or getattr(p.owner, "__name__", repr(p.owner))
                raise UsageError(
                    f"mutant {m.name!r} ({_where(m.patches)}) patches {owner}.{p.attr}, which does not exist"
                )
            # A class's own attribute as it is (a staticmethod stays one); an inherited one is
            # shadowed for the block, then uncovered again.
            own = vars(p.owner).get(p.attr, _INHERITED) if isinstance(p.owner, type) else getattr(p.owner, p.attr)
            saved.append(_Patched(p.owner, p.attr, own, p.value))
            setattr(p.owner, p.attr, p.value)
        _APPLIED[m.name] = saved
        yield
    finally:
        _APPLIED.pop(m.name, None)
        _undo(saved)


@contextmanager
def lifted(m: Mutant | None) -> Iterator[None]:
    """The runtime without ``m`` for the block: the patches :func:`applied` made around it are
    undone, then made again."""
    saved = _APPLIED.get(m.name, []) if m is not None else []
    _undo(saved)
    try:
        yield
    finally:
        for patched in saved:
            setattr(patched.owner, patched.attr, patched.value)


@dataclass(frozen=True)
class _Patched:
    """An attribute a mutant's patch replaced: what it was, and what it is while patched."""

    owner: object
    attr: str
    original: object
    value: object


#: The patches of the mutants applied now, by name.
_APPLIED: dict[str, list[_Patched]] = {}


def _undo(saved: list[_Patched]) -> None:
    for patched in reversed(saved):
        if patched.original is _INHERITED:
            delattr(patched.owner, patched.attr)
        else:
            setattr(patched.owner, patched.attr, patched.original)


#: Stands for a class attribute a patch shadowed that the class itself did not define.
_INHERITED = object()


def load_plugin(spec: str) -> ModuleType:
    """Import a plugin by module name or by the path of a ``.py`` file.

    A file is imported under the name pytest gives it (its stem, below the packages its folders
    make), with the folder above those packages on the import path: a test file that imports the
    plugin by name, or its package's other modules, then finds the one module already imported,
    not a second copy that would register everything again."""
    try:
        if spec.endswith(".py") or os.sep in spec:
            path = os.path.abspath(spec)
            if not os.path.isfile(path):
                raise UsageError(f"plugin file {spec!r} does not exist")
            return _load_file(path)
        return importlib.import_module(spec)
    except UsageError:
        raise
    except ImportError as e:
        raise UsageError(f"cannot load plugin {spec!r}: {e}") from e
    except Exception as e:  # (its own code raised as it was imported: the plugin's error, not omnisim's)
        raise UsageError(f"cannot load plugin {spec!r}: {type(e).__name__}: {e}") from e


def _load_file(path: str) -> ModuleType:
    root, name = os.path.dirname(path), os.path.splitext(os.path.basename(path))[0]
    while os.path.isfile(os.path.join(root, "__init__.py")):
        root, name = os.path.dirname(root), f"{os.path.basename(root)}.{name}"
    loaded = sys.modules.get(name)
    if loaded is not None and os.path.abspath(getattr(loaded, "__file__", None) or "") == path:
        return loaded
    top = name.split(".")[0]
    if loaded is not None or (top != name and top in sys.modules and not _is_package_in(sys.modules[top], root)):
        # The name, or its package's, is another module's (one of omnisim's, or of the user's
        # elsewhere): the file is loaded under a name of its own.
        return _load_file_as(_own_name(path), path)
    if root not in sys.path:
        sys.path.insert(0, root)  # (kept: the plugin may import its neighbours when it runs)
    module = importlib.import_module(name)
    if os.path.abspath(getattr(module, "__file__", None) or "") != path:  # (a module of that name came first)
        return _load_file_as(_own_name(path), path)
    return module


def _is_package_in(package: ModuleType, root: str) -> bool:
    return os.path.join(root, package.__name__) in map(os.path.abspath, getattr(package, "__path__", []))


def _own_name(path: str) -> str:
    return f"omnisim_plugin_{abs(hash(path)) & 0xFFFFFFFF:x}"


def _load_file_as(name: str, path: str) -> ModuleType:
    if name in sys.modules:
        return sys.modules[name]
    loader_spec = importlib.util.spec_from_file_location(name, path)
    assert loader_spec is not None and loader_spec.loader is not None
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[name] = module
    # Its own folder first, as when it ran as a script or a test: it may import its neighbours.
    sys.path.insert(0, os.path.dirname(path))
    try:
        loader_spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    finally:
        sys.path.remove(os.path.dirname(path))
    return module


def load(plugins: list[str] | None = None) -> None:
    """Load the built-in scenarios and mutants, then each plugin."""
    builtin = load_plugin(BUILTIN_PLUGIN)
    ours = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), BUILTIN_PLUGIN)
    where = os.path.dirname(os.path.abspath(getattr(builtin, "__file__", None) or ours))
    if where != ours:
        raise UsageError(
            f"a package named {BUILTIN_PLUGIN!r} at {where} hides omnisim's built-in scenarios ({ours}): rename it"
        )
    for spec in plugins or []:
        load_plugin(spec)


def get_scenario(name: str) -> Scenario:
    if name not in SCENARIOS:
        load()  # (a caller of the Python API may not have loaded the built-ins)
    if name not in SCENARIOS:
        raise UsageError(f"unknown scenario {name!r}; known: {', '.join(sorted(SCENARIOS))}")
    return SCENARIOS[name]


def get_mutant(name: str | None) -> Mutant | None:
    if name is None:
        return None
    if name not in MUTANTS:
        load()  # (a caller of the Python API may not have loaded the built-ins)
    if name not in MUTANTS:
        raise UsageError(f"unknown mutant {name!r}; known: {', '.join(sorted(MUTANTS))}")
    m = MUTANTS[name]
    from invariants import INVARIANTS

    unknown = [i for i in m.expect if i not in INVARIANTS]
    if unknown:
        raise UsageError(
            f"mutant {name!r} expects {unknown[0]!r}, which is no invariant; known: {', '.join(INVARIANTS)}"
        )
    return m
