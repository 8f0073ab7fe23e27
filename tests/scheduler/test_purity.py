"""scheduler/ stays pure Python: it never imports ray, torch or triton."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

SCHEDULER = pathlib.Path(__file__).resolve().parents[2] / "scheduler"
FORBIDDEN = {"ray", "torch", "triton"}


def test_no_module_under_scheduler_imports_ray_torch_or_triton():
    offenders = []
    for path in SCHEDULER.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            offenders += [f"{path.name}: {n}" for n in names if n.split(".")[0] in FORBIDDEN]
    assert not offenders, offenders


def test_importing_the_scheduler_loads_none_of_them():
    code = (
        "import sys, iterserve.scheduler, iterserve.scheduler.codec;"
        "print(sorted(m for m in {'ray','torch','triton'} if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_policies_see_the_scheduler_only_through_the_step_builder():
    # No policy imports the scheduler's core, not even to name its type: what a
    # policy reads and writes goes through StepBuilder's API.
    for path in (SCHEDULER / "policies").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                module = node.module or ""
                assert module.split(".")[-1] != "core", f"policies/{path.name} imports the core"
