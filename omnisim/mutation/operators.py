"""Source mutations of the runtime: each a small, plausible slip a person could make in one place.

A :class:`Mutation` names a span of a module's source and the text that replaces it; applying it
splices bytes, so everything else in the file (comments, layout, line numbers) stays as written
and a survivor prints as a one-hunk diff. Sites are found with :mod:`ast`. The operators are the
ones a protocol's bugs are made of (why not mutmut or cosmic-ray: their operators are about
arithmetic and literals, neither removes a lock or a cleanup call, and both run a test command per
mutant, where omnisim runs a schedule sweep in a forked, already-warm process):

- ``delete-statement``: a call, an ``await``, a state update or a ``raise`` that never happens
  (a forgotten cleanup, a missing wake-up, a lost checkpoint);
- ``negate-compare``: ``==``/``!=``, ``<``/``>=``, ``in``/``not in``, ``is``/``is not`` turned over;
- ``boundary``: ``<``/``<=`` and ``>``/``>=`` exchanged (off by one);
- ``drop-not``: a ``not`` forgotten;
- ``and-or``: ``and`` and ``or`` exchanged;
- ``constant``: an integer one larger, ``True`` and ``False`` exchanged;
- ``swap-args``: a call's first two positional arguments exchanged;
- ``remove-lock``: ``with lock:`` / ``async with lock:`` gone, its body left unguarded.

Some sites are never mutated, because no behaviour could tell: docstrings, logging calls, an
assignment to a local name (deleting it is a NameError, not a slip), a trace note or kernel point
(they observe, or offer a switch, and do nothing in production), type-checking blocks and ``__repr__``."""

from __future__ import annotations

import ast
import difflib
import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

OPERATORS = (
    "delete-statement",
    "negate-compare",
    "boundary",
    "drop-not",
    "and-or",
    "constant",
    "swap-args",
    "remove-lock",
)

_NEGATED: dict[type[ast.cmpop], str] = {
    ast.Eq: "!=",
    ast.NotEq: "==",
    ast.Lt: ">=",
    ast.LtE: ">",
    ast.Gt: "<=",
    ast.GtE: "<",
    ast.In: "not in",
    ast.NotIn: "in",
    ast.Is: "is not",
    ast.IsNot: "is",
}
_BOUNDARY: dict[type[ast.cmpop], str] = {ast.Lt: "<=", ast.LtE: "<", ast.Gt: ">=", ast.GtE: ">"}
_LOGGERS = ("log", "logger", "_log", "_logger", "logging")
_BUILTINS = ("isinstance", "issubclass", "getattr", "setattr", "hasattr", "print")


@dataclass(frozen=True)
class Mutation:
    """One mutant: the bytes ``[start, end)`` of ``path`` replaced by ``replacement``."""

    path: str
    #: The module's import name (``runtime.connectors.shm``).
    module: str
    #: The function or class it sits in (``ShmConnector.put``); ``<module>`` at the top level.
    where: str
    line: int
    end_line: int
    operator: str
    start: int
    end: int
    original: str
    replacement: str
    #: It sits in code that runs when the module is imported (a class body: a dataclass default).
    at_import: bool
    #: A stable name: the same slip in the same function keeps its id when other lines move.
    id: str

    def describe(self) -> str:
        was = " ".join(self.original.split())
        now = " ".join(self.replacement.split())
        return f"{self.operator}: {_clip(was)} → {_clip(now)}"

    def apply(self, source: bytes) -> bytes:
        return source[: self.start] + self.replacement.encode() + source[self.end :]

    def diff(self) -> str:
        source = Path(self.path).read_bytes()
        before = source.decode().splitlines(keepends=True)
        after = self.apply(source).decode().splitlines(keepends=True)
        name = self.module.replace(".", "/") + ".py"
        return "".join(difflib.unified_diff(before, after, name, f"{name} (mutant {self.id})", n=1))


def _clip(text: str, width: int = 60) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def module_name(path: Path, root: Path) -> str:
    parts = list(path.resolve().relative_to(root.resolve()).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def find_mutations(path: Path, root: Path, operators: tuple[str, ...] = OPERATORS) -> list[Mutation]:
    """Every mutation of the module at ``path`` (``root`` is where imports start), in source order."""
    path = path.resolve()
    source = path.read_bytes()
    tree = ast.parse(source, filename=str(path))
    finder = _Finder(source, str(path), module_name(path, root), set(operators))
    finder.visit(tree)
    return sorted(finder.found, key=lambda m: (m.start, m.operator, m.replacement))


class _Finder(ast.NodeVisitor):
    def __init__(self, source: bytes, path: str, module: str, operators: set[str]) -> None:
        self.source = source
        self.path = path
        self.module = module
        self.operators = operators
        # ast columns are UTF-8 byte offsets within a line.
        self.line_starts = [0]
        for line in source.splitlines(keepends=True):
            self.line_starts.append(self.line_starts[-1] + len(line))
        self.scope: list[str] = []
        #: How many functions deep the visit is (statements run at import are not mutated).
        self.functions = 0
        self.found: list[Mutation] = []
        self._seen: dict[tuple[str, ...], int] = {}

    # -- where we are ------------------------------------------------------------------------

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self._in_scope(node.name, node, function=False)

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        if node.name != "__repr__":
            self._in_scope(node.name, node, function=True)

    def visit_AsyncFunctionDef(self, node: ast.AsyncFunctionDef) -> None:
        self._in_scope(node.name, node, function=True)

    def _in_scope(self, name: str, node: ast.AST, *, function: bool) -> None:
        self.scope.append(name)
        self.functions += function
        # Decorators, defaults and annotations are left alone: only the body is behaviour.
        for stmt in node.body:  # type: ignore[attr-defined]
            self.visit(stmt)
        self.functions -= function
        self.scope.pop()

    def visit_If(self, node: ast.If) -> None:
        if isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            return
        self.generic_visit(node)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        if node.value is not None:
            self.visit(node.value)  # the annotation is not behaviour

    def visit_arg(self, node: ast.arg) -> None:
        return

    # -- the operators ------------------------------------------------------------------------

    def visit_Expr(self, node: ast.Expr) -> None:
        if isinstance(node.value, ast.Constant):
            return  # a docstring or an abstract method's `...`
        if _is_observation(node.value):
            return
        self._statement(node)
        self.generic_visit(node)

    def visit_Assign(self, node: ast.Assign) -> None:
        if not all(isinstance(t, ast.Name) for t in node.targets):
            self._statement(node)
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        self._statement(node)
        self.generic_visit(node)

    def visit_Delete(self, node: ast.Delete) -> None:
        self._statement(node)
        self.generic_visit(node)

    def visit_Raise(self, node: ast.Raise) -> None:
        self._statement(node)
        self.generic_visit(node)

    def _statement(self, node: ast.stmt) -> None:
        if self.functions:  # what runs at import (a module's or class's body) defines, not behaves
            self._add(node, "delete-statement", "pass")

    def visit_Compare(self, node: ast.Compare) -> None:
        if len(node.ops) == 1:
            op, left, right = node.ops[0], self._text(node.left), self._text(node.comparators[0])
            self._add(node, "negate-compare", f"{left} {_NEGATED[type(op)]} {right}")
            if type(op) in _BOUNDARY:
                self._add(node, "boundary", f"{left} {_BOUNDARY[type(op)]} {right}")
        self.generic_visit(node)

    def visit_UnaryOp(self, node: ast.UnaryOp) -> None:
        if isinstance(node.op, ast.Not):
            self._add(node, "drop-not", f"({self._text(node.operand)})")
        self.generic_visit(node)

    def visit_BoolOp(self, node: ast.BoolOp) -> None:
        if len(node.values) == 2:
            other = "or" if isinstance(node.op, ast.And) else "and"
            a, b = (self._text(v) for v in node.values)
            self._add(node, "and-or", f"({a}) {other} ({b})")
        self.generic_visit(node)

    def visit_Constant(self, node: ast.Constant) -> None:
        if not self.scope:
            return
        if isinstance(node.value, bool):
            self._add(node, "constant", str(not node.value))
        elif isinstance(node.value, int):
            self._add(node, "constant", _int_like(self._text(node), node.value + 1))

    def visit_Call(self, node: ast.Call) -> None:
        if len(node.args) >= 2 and not _is_builtin(node.func):
            first, second = node.args[0], node.args[1]
            # Two variables exchanged is a slip; exchanging a literal and a name is only a TypeError.
            if all(isinstance(a, ast.Name | ast.Attribute) for a in (first, second)) and (
                ast.dump(first) != ast.dump(second)
            ):
                # Only the span of the two arguments (and the comma between) is rewritten.
                self._add_span(first, second, "swap-args", f"{self._text(second)}, {self._text(first)}", anchor=node)
        self.generic_visit(node)

    def visit_With(self, node: ast.With) -> None:
        self._with(node)

    def visit_AsyncWith(self, node: ast.AsyncWith) -> None:
        self._with(node)

    def _with(self, node: ast.With | ast.AsyncWith) -> None:
        if len(node.items) == 1 and node.items[0].optional_vars is None:
            guard = node.items[0].context_expr
            if "lock" in self._text(guard).lower():
                # `if True:` keeps the body's indentation, so only the header is rewritten.
                self._add_span(node, guard, "remove-lock", "if True", anchor=node)
        self.generic_visit(node)

    # -- bookkeeping --------------------------------------------------------------------------

    def _offset(self, line: int, col: int) -> int:
        return self.line_starts[line - 1] + col

    def _text(self, node: ast.AST) -> str:
        return self.source[self._span(node, node)[0] : self._span(node, node)[1]].decode()

    def _span(self, first: ast.AST, last: ast.AST) -> tuple[int, int]:
        start = self._offset(first.lineno, first.col_offset)  # type: ignore[attr-defined]
        end = self._offset(last.end_lineno, last.end_col_offset)  # type: ignore[attr-defined]
        return start, end

    def _add(self, node: ast.AST, operator: str, replacement: str) -> None:
        self._add_span(node, node, operator, replacement, anchor=node)

    def _add_span(self, first: ast.AST, last: ast.AST, operator: str, replacement: str, *, anchor: ast.AST) -> None:
        if operator not in self.operators:
            return
        start, end = self._span(first, last)
        original = self.source[start:end].decode()
        where = ".".join(self.scope) or "<module>"
        key = (where, operator, original, replacement)
        nth = self._seen.get(key, 0)
        self._seen[key] = nth + 1
        digest = hashlib.sha1(repr((self.module, *key, nth)).encode()).hexdigest()[:8]
        line, end_line = anchor.lineno, anchor.end_lineno  # type: ignore[attr-defined]
        self.found.append(
            Mutation(
                self.path,
                self.module,
                where,
                line,
                end_line,
                operator,
                start,
                end,
                original,
                replacement,
                not self.functions,
                digest,
            )
        )


def _is_observation(expr: ast.expr) -> bool:
    """A log line, a trace note or a kernel point: it reports what happened, or offers the
    simulator a place to switch tasks, and changes nothing the runtime does (the real kernel's
    ``point`` returns at once)."""
    call = expr.value if isinstance(expr, ast.Await) else expr
    if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Attribute):
        return False
    owner = call.func.value
    return call.func.attr in ("note", "point") or (isinstance(owner, ast.Name) and owner.id in _LOGGERS)


def _int_like(written: str, value: int) -> str:
    """``value`` written the way ``written`` was (``0o600`` becomes ``0o601``, not ``385``)."""
    prefix = written[:2].lower()
    return {"0o": f"0o{value:o}", "0x": f"0x{value:x}", "0b": f"0b{value:b}"}.get(prefix, str(value))


def _is_builtin(func: ast.expr) -> bool:
    return isinstance(func, ast.Name) and func.id in _BUILTINS


def iter_modules(targets: list[Path]) -> Iterator[Path]:
    """The ``.py`` files under each target (a file or a folder), sorted."""
    for target in targets:
        yield from sorted(target.rglob("*.py")) if target.is_dir() else [target]
