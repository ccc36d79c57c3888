"""Definitions read from Python source without importing it: a function's parameters, the
attributes a method assigns, a class's annotated fields, a definition's text. For the drift
tests of the engine integrations, whose engines' modules do not all import on a CPU machine,
and for the stand-ins of those engines (the same reader on both sides)."""

from __future__ import annotations

import ast
from pathlib import Path


def _definition(path: Path, qualname: str) -> ast.AST:
    """The class or function `qualname` ("f", "C", "C.method") defined in `path`."""
    scope: list[ast.stmt] = ast.parse(Path(path).read_text(), str(path)).body
    node: ast.AST | None = None
    for name in qualname.split("."):
        kinds = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
        found = [n for n in scope if isinstance(n, kinds) and n.name == name]
        if not found:
            raise LookupError(f"{path}: no definition {qualname!r} (missing: {name!r})")
        node = found[-1]  # the last definition wins, as at import
        scope = getattr(node, "body", [])
    return node


def _parameter(arg: ast.arg, default: ast.expr | None) -> str:
    return arg.arg if default is None else f"{arg.arg}={ast.unparse(default)}"


def signature_of(path: Path, qualname: str) -> str:
    """The parameters of function `qualname` as written, without annotations:
    "(self, x, y=None, *args, z=1, **kwargs)" (defaults as `ast.unparse` writes them)."""
    node = _definition(path, qualname)
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        raise LookupError(f"{path}: {qualname!r} is not a function")
    args = node.args
    positional = args.posonlyargs + args.args
    defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    parts = [_parameter(a, d) for a, d in zip(positional, defaults)]
    if args.posonlyargs:
        parts.insert(len(args.posonlyargs), "/")
    if args.vararg:
        parts.append(f"*{args.vararg.arg}")
    elif args.kwonlyargs:
        parts.append("*")
    parts += [_parameter(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults)]
    if args.kwarg:
        parts.append(f"**{args.kwarg.arg}")
    return "(" + ", ".join(parts) + ")"


def assigned_attributes(path: Path, qualname: str) -> set[str]:
    """The names X of every `self.X = ...` (or annotated, or augmented) in function
    `qualname`'s body, at any depth."""
    node = _definition(path, qualname)
    names = set()
    for sub in ast.walk(node):
        targets = []
        if isinstance(sub, ast.Assign):
            targets = sub.targets
        elif isinstance(sub, (ast.AnnAssign, ast.AugAssign)):
            targets = [sub.target]
        for target in targets:
            for t in ast.walk(target):
                if (
                    isinstance(t, ast.Attribute)
                    and isinstance(t.value, ast.Name)
                    and t.value.id == "self"
                ):
                    names.add(t.attr)
    return names


def class_fields(path: Path, qualname: str) -> list[str]:
    """The annotated names of class `qualname`'s body, in order (a NamedTuple's or a
    dataclass's fields)."""
    node = _definition(path, qualname)
    if not isinstance(node, ast.ClassDef):
        raise LookupError(f"{path}: {qualname!r} is not a class")
    return [
        n.target.id
        for n in node.body
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
    ]


def source_of(path: Path, qualname: str) -> str:
    """The text of definition `qualname`, whitespace runs collapsed to one space (so a check
    of a statement does not depend on how the formatter wrapped it)."""
    text = Path(path).read_text()
    segment = ast.get_source_segment(text, _definition(path, qualname)) or ""
    return " ".join(segment.split())
