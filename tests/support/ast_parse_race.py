"""`ast.parse` with garbage collection held off, for test sessions on CPython 3.11 before 3.11.8.

Those releases count the AST constructor's recursion depth in state the whole interpreter shares (CPython
gh-106905). The constructor is C code that keeps the GIL, except where an allocation starts a collection: gc
callbacks and finalizers are Python code, and there another thread (or the callback itself) can call
`ast.parse`, which resets the shared depth; the first parse then raises `SystemError: AST constructor recursion
depth mismatch` for a tree it built correctly. pytest parses every module it rewrites (plugins such as
schemathesis, imported lazily mid-session), and 3.11's traceback formatting parses source lines, so a thread
logging a traceback at the wrong moment failed a whole test module in CI. With collection off for the parse, no
Python code runs inside it. Errors are raised as the interpreter raises them; nothing is caught or retried.
"""

from __future__ import annotations

import ast
import gc
import sys
from typing import Any

AFFECTED = (3, 11) <= sys.version_info[:3] < (3, 11, 8)
_PARSE = ast.parse


def parse_without_collection(*args: Any, **kwargs: Any) -> ast.AST:
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _PARSE(*args, **kwargs)
    finally:
        if enabled:
            gc.enable()


def install() -> bool:
    """Replace `ast.parse` on the affected releases; True when it did."""
    if AFFECTED:
        ast.parse = parse_without_collection  # type: ignore[assignment]
    return AFFECTED
