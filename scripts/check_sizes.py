"""The size budget of the lint step: product files at most 400 lines, functions at most 60.

Run by `make lint` and `make test` (exit 1 past the budget, naming each offender). Tests
have a looser bound (files 600 lines, functions 120): a test module may hold many cases,
but a test body that long is several tests. A file or function past its bound is two
concepts; split it rather than raising the bound.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("orchestrator", "trainer", "ckpt", "monitor", "chaos", "paramserver", "bench", "scripts")
TESTS = ("tests",)
BOUNDS = {"product": (400, 60), "tests": (600, 120)}


def _functions(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            # A decorator belongs to the function it decorates; its docstring too.
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            yield node.name, first, node.end_lineno - first + 1


def problems_in(path: Path, max_lines: int, max_function: int) -> list[str]:
    text = path.read_text()
    out = []
    lines = text.count("\n") + (0 if text.endswith("\n") or not text else 1)
    rel = path.relative_to(ROOT)
    if lines > max_lines:
        out.append(f"{rel}: {lines} lines (at most {max_lines}); split it by concept")
    for name, line, length in _functions(ast.parse(text, str(path))):
        if length > max_function:
            out.append(f"{rel}:{line}: function {name} is {length} lines (at most {max_function})")
    return out


def main() -> int:
    found = []
    for kind, folders in (("product", PRODUCT), ("tests", TESTS)):
        max_lines, max_function = BOUNDS[kind]
        for folder in folders:
            for path in sorted((ROOT / folder).rglob("*.py")):
                found += problems_in(path, max_lines, max_function)
    for line in found:
        print(line, file=sys.stderr)
    if found:
        print(f"size budget: {len(found)} problem(s)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
