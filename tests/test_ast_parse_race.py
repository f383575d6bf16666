"""tests/support/ast_parse_race.py: on CPython 3.11 before 3.11.8 a parse interrupted by a gc callback that
parses too raises `AST constructor recursion depth mismatch`; with the session's `ast.parse` it does not."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from support import ast_parse_race

pytestmark = pytest.mark.skipif(not ast_parse_race.AFFECTED, reason="this interpreter counts AST depth per parse")

# A collection starts often (threshold 10) while a long module is parsed; its callback parses a line, as a thread
# formatting a traceback would.
SCRIPT = """
import ast, gc, sys
sys.path.insert(0, {support!r})
if sys.argv[1] == "held":
    import ast_parse_race
    assert ast_parse_race.install()
def parse_a_line(phase, info):
    if phase == "start":
        ast.parse("f(x)")
gc.callbacks.append(parse_a_line)
gc.set_threshold(10)
tree = ast.parse(open(ast.__file__).read())
assert isinstance(tree, ast.Module) and gc.isenabled()
with open(ast.__file__) as source:
    try:
        ast.parse(source.read() + "\\n)")
    except SyntaxError:
        print("syntax error raised")
print("parsed")
"""


def _run(mode: str) -> subprocess.CompletedProcess[str]:
    script = SCRIPT.format(support=str(Path(ast_parse_race.__file__).parent))
    return subprocess.run([sys.executable, "-c", script, mode], capture_output=True, text=True, timeout=120)


def test_the_interpreter_has_the_race() -> None:
    plain = _run("plain")
    assert plain.returncode != 0 and "AST constructor recursion depth mismatch" in plain.stderr, plain


def test_a_parse_with_collection_held_off_is_not_interrupted() -> None:
    held = _run("held")
    assert held.returncode == 0 and held.stdout.split() == ["syntax", "error", "raised", "parsed"], held
