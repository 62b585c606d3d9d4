"""Executors that spawn worker processes re-run the main script in each of them (multiprocessing's spawn
start method). An engine built at the script's top level would then be built again in every worker, which
multiprocessing refuses mid-start-up with a traceback per worker. This finds that case before any process
starts, and ends the script with one line."""

from __future__ import annotations

import ast
import sys
from types import FrameType


def _is_main_guard(node: ast.AST) -> bool:
    """`if __name__ == "__main__":` (either operand order)."""
    if not isinstance(node, ast.If) or not isinstance(node.test, ast.Compare):
        return False
    t = node.test
    if len(t.ops) != 1 or not isinstance(t.ops[0], ast.Eq):
        return False
    sides = [t.left, t.comparators[0]]
    names = {s.id for s in sides if isinstance(s, ast.Name)}
    consts = {s.value for s in sides if isinstance(s, ast.Constant)}
    return names == {"__name__"} and consts == {"__main__"}


def guarded_lines(source: str) -> set[int]:
    """Line numbers inside the body of a top-level `if __name__ == "__main__":` block."""
    lines: set[int] = set()
    for node in ast.parse(source).body:
        if _is_main_guard(node):
            for stmt in node.body:  # type: ignore[attr-defined]
                lines.update(range(stmt.lineno, (stmt.end_lineno or stmt.lineno) + 1))
    return lines


def _script_frame(main_globals: dict) -> FrameType | None:
    """The outermost frame running the main script's top-level code, if this call comes from there."""
    frame, found = sys._getframe(1), None
    while frame is not None:
        if frame.f_globals is main_globals and frame.f_code.co_name == "<module>":
            found = frame
        frame = frame.f_back
    return found


def check_main_guard(what: str) -> None:
    """Print one line and exit (status 1, as for any uncaught error) when `what` (which spawns processes)
    is reached from the main script's top-level code outside `if __name__ == "__main__":`. An exception
    would print a traceback through turnout's code, above the line that matters; the fix is in the script.
    An interactive interpreter and `python -c` run no script, so they pass."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    frame = _script_frame(vars(main)) if main is not None and path else None
    if frame is None:
        return
    try:
        with open(path, encoding="utf-8") as f:  # type: ignore[arg-type]
            lines = guarded_lines(f.read())
    except (OSError, SyntaxError, ValueError):
        return  # no readable source: nothing to judge by
    if frame.f_lineno not in lines:
        print(
            f"ConfigError: {path}:{frame.f_lineno} builds {what} at the top level of the script, and its "
            'worker processes re-run the script; put that code under `if __name__ == "__main__":`',
            file=sys.stderr,
            flush=True,
        )
        raise SystemExit(1)
