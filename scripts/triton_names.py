#!/usr/bin/env python3
"""The public names of one Triton release, read from its wheel without
installing it: ``triton.language``'s and ``triton``'s ``__all__``, and for each
name that is a function, its parameter names.

    pip download --no-deps triton==3.6.0 -d /tmp/t36
    python scripts/triton_names.py /tmp/t36/triton-3.6.0-*.whl > tests/scripts/triton_3_6_names.txt

Output: a header, then one line per name, ``tl.NAME`` or ``triton.NAME``,
followed by the function's parameters (leading-underscore ones left out).
``tests/scripts/test_triton_names.py`` checks the kernels against the list
for the device image's Triton, which is older than the one the suite runs.
"""

from __future__ import annotations

import ast
import sys
import zipfile


def _all(tree: ast.Module) -> list[str]:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            return [e.value for e in node.value.elts if isinstance(e, ast.Constant)]
    raise ValueError("no __all__")


def _defs(tree: ast.Module) -> dict[str, list[str]]:
    out = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]
            out[node.name] = [n for n in names if not n.startswith("_")]
    return out


def names(wheel: str) -> tuple[str, list[tuple[str, list[str] | None]]]:
    with zipfile.ZipFile(wheel) as z:

        def parse(path: str) -> ast.Module | None:
            try:
                return ast.parse(z.read(path).decode())
            except KeyError:
                return None

        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        version = next(line.split(":", 1)[1].strip() for line in z.read(meta).decode().splitlines()
                       if line.startswith("Version:"))  # fmt: skip
        rows: list[tuple[str, list[str] | None]] = []
        for prefix, package in (("tl", "triton/language"), ("triton", "triton")):
            init = parse(f"{package}/__init__.py")
            assert init is not None
            where: dict[str, tuple[str, str]] = {}  # name -> (module file, name there)
            for node in init.body:
                if isinstance(node, ast.ImportFrom) and node.level == 1:
                    base = f"{package}/{(node.module or '').replace('.', '/')}"
                    for alias in node.names:
                        where[alias.asname or alias.name] = (base, alias.name)
            local = _defs(init)
            for name in sorted(_all(init)):
                params = local.get(name)
                if params is None and name in where:
                    base, orig = where[name]
                    tree = parse(base + ".py") or parse(base + "/__init__.py")
                    params = _defs(tree).get(orig) if tree is not None else None
                rows.append((f"{prefix}.{name}", params))
    return version, rows


def main(argv: list[str]) -> int:
    version, rows = names(argv[1])
    print(f"# Triton {version}: triton.language and triton __all__, with each function's")
    print("# parameters (leading-underscore ones left out). Made by scripts/triton_names.py.")
    for name, params in rows:
        print(" ".join([name, *(params or [])]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
