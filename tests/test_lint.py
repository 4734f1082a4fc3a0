"""The code's lint: ruff (line length 120, pyflakes, pycodestyle, import sorting; the rules are in pyproject.toml)
finds nothing, and every import inside a function of `pyrl/` says why it is not at the top of its module with a
`# lazy: <reason>` comment (on the import's line, or on a comment line right above a run of imports)."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _ruff() -> list[str]:
    found = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    assert found, "ruff is not installed: it comes with the test extra (pip install -e '.[test]')"
    return [found]


def test_ruff_finds_nothing():
    result = subprocess.run(_ruff() + ["check", "--no-cache", "pyrl", "tests", "benchmarks", "setup.py"], cwd=ROOT,
                            capture_output=True, text=True)
    assert result.returncode == 0, f"ruff check found:\n{result.stdout[-6000:]}{result.stderr[-2000:]}"


def unexplained_function_imports(source: str) -> list[int]:
    """Line numbers of imports inside a function with no `# lazy:` reason, on their own line or on a comment line
    right above the run of consecutive imports they belong to."""
    lines = source.splitlines()
    missing = []

    def check_body(body: list[ast.stmt]) -> None:
        run_reason = False
        previous_import = False
        for stmt in body:
            if isinstance(stmt, (ast.Import, ast.ImportFrom)):
                above = lines[stmt.lineno - 2].strip() if stmt.lineno >= 2 else ""
                if above.startswith("#") and "lazy:" in above:  # covers the imports that follow it without a break
                    run_reason = True
                elif not previous_import:
                    run_reason = False
                if not (run_reason or "# lazy:" in lines[stmt.lineno - 1]):
                    missing.append(stmt.lineno)
                previous_import = True
            else:
                previous_import = False

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if inside:
                for field in ("body", "orelse", "finalbody", "handlers"):
                    block = getattr(child, field, None)
                    if isinstance(block, list) and block and isinstance(block[0], ast.stmt):
                        check_body(block)
            visit(child, inside)

    visit(ast.parse(source), False)
    return sorted(set(missing))


def test_function_level_imports_give_a_reason():
    offenders = []
    for path in sorted((ROOT / "pyrl").rglob("*.py")):
        offenders += [f"{path.relative_to(ROOT)}:{line}" for line in unexplained_function_imports(path.read_text())]
    assert not offenders, (f"{len(offenders)} imports inside functions without a '# lazy: <reason>' comment (move "
                           "them to the module's top, or say why they cannot be there):\n" + "\n".join(offenders))


def test_the_import_check_sees_what_it_should():
    source = '''
import os

def f():
    import json  # lazy: json is only needed here
    import re
    # lazy: both are heavy
    import torch
    from numpy import array
    x = 1
    import sys
    if x:
        import csv

class C:
    def m(self):
        import math
'''
    assert unexplained_function_imports(source) == [6, 11, 13, 17]
