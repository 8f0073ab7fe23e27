"""The client is a light distribution: httpx only, no torch, ray or triton."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

CLIENT_DIR = Path(__file__).resolve().parents[2] / "client"


def test_import_pulls_in_no_heavy_packages():
    code = (
        "import iterserve_client, sys; "
        "heavy = {'torch', 'ray', 'triton'} & {m.split('.')[0] for m in sys.modules}; "
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_httpx_is_the_only_dependency():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((CLIENT_DIR / "pyproject.toml").read_text())["project"]
    assert project["name"] == "iterserve-client"
    assert [d.split(">")[0].split("=")[0].strip() for d in project["dependencies"]] == ["httpx"]
    assert "optional-dependencies" not in project


def test_package_imports_nothing_from_the_server():
    for path in (CLIENT_DIR / "iterserve_client").glob("*.py"):
        source = path.read_text()
        assert "import iterserve." not in source and "from iterserve." not in source, path
