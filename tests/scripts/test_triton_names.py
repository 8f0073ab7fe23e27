"""The Triton kernels use only names (and keyword arguments) that the device
image's Triton, 3.6, has: the suite runs a newer one, under which a name added
later would pass every other test and fail only on the GPU.

``triton_3_6_names.txt`` was read from the 3.6.0 wheel by
``scripts/triton_names.py``. The check reads the kernels' source: every
``tl.X`` and ``triton.X`` attribute, and every keyword of a call to one.
Methods of tensors (``x.to(...)``) are not listed there and not checked; the
device check's ``compile`` section compiles every variant under the device's
own Triton for what this cannot see.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LIST = Path(__file__).with_name("triton_3_6_names.txt")


def known() -> dict[str, set[str] | None]:
    out: dict[str, set[str] | None] = {}
    for line in LIST.read_text().splitlines():
        if line and not line.startswith("#"):
            name, *params = line.split()
            out[name] = set(params) or None
    return out


def uses(path: Path) -> tuple[set[str], list[tuple[str, str, int]]]:
    """(``tl.X``/``triton.X`` names, (name, keyword, line) of each keyword in a call)."""
    tree = ast.parse(path.read_text())
    alias = {"tl": "tl", "triton": "triton"}
    for node in ast.walk(tree):  # `import triton.language as tl` and the like
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "triton.language":
                    alias[a.asname or a.name] = "tl"
                elif a.name == "triton":
                    alias[a.asname or "triton"] = "triton"

    def name_of(node) -> str | None:
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in alias):  # fmt: skip
            return f"{alias[node.value.id]}.{node.attr}"
        return None

    names, keywords = set(), []
    for node in ast.walk(tree):
        n = name_of(node)
        if n is not None and n != "triton.language":
            names.add(n)
        if isinstance(node, ast.Call) and (n := name_of(node.func)) is not None:
            keywords += [(n, k.arg, node.lineno) for k in node.keywords if k.arg]
    return names, keywords


def kernel_sources() -> list[Path]:
    files = [p for p in sorted((ROOT / "kernels").glob("*.py")) if "import triton" in p.read_text()]
    assert any(p.name == "triton_attention.py" for p in files)
    return files


def test_the_list_is_the_3_6_release():
    first = LIST.read_text().splitlines()[0]
    assert first.startswith("# Triton 3.6.0:")
    names = known()
    # Spot checks against the release's API: present in 3.6 ...
    assert names["tl.dot"] is not None and "input_precision" in names["tl.dot"]
    assert names["triton.jit"] is not None and "do_not_specialize" in names["triton.jit"]
    # ... and names that only later releases have are absent.
    assert "tl.unsqueeze" not in names and "tl.atomic_load" not in names


def test_kernels_use_only_names_triton_3_6_has():
    names = known()
    missing = {}
    for path in kernel_sources():
        used, _ = uses(path)
        if unknown := sorted(used - set(names)):
            missing[path.name] = unknown
    assert not missing, f"not in Triton 3.6: {missing}"


def test_kernels_pass_only_keywords_triton_3_6_takes():
    names = known()
    bad = []
    for path in kernel_sources():
        for name, keyword, line in uses(path)[1]:
            params = names.get(name)
            if params is not None and keyword not in params:
                bad.append(f"{path.name}:{line} {name}({keyword}=...)")
    assert not bad, bad


def test_the_check_sees_a_name_3_6_lacks(tmp_path):
    src = tmp_path / "k.py"
    src.write_text(
        "import triton.language as tl\nx = tl.unsqueeze(y, 0)\nz = tl.dot(a, b, fast=1)\n"
    )
    used, keywords = uses(src)
    assert "tl.unsqueeze" in used and "tl.unsqueeze" not in known()
    params = known()["tl.dot"]
    assert params is not None and ("tl.dot", "fast", 3) in keywords and "fast" not in params
