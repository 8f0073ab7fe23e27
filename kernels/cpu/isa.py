"""The instruction set the CPU kernels of this process may use: probed once, and
capped by one environment variable.

The levels, each with everything the ones before it have:

============  ===========================================================
``generic``   none of the below (or not x86-64): numba's loops, torch, oneDNN
``avx2``      AVX2 and FMA
``avx512``    AVX-512 F, BW, VL
``avx512_bf16``  and AVX512_BF16 (``vdpbf16ps``, ``vcvtneps2bf16``)
``amx``       and AMX-TILE, AMX-BF16, with Linux granting this process the
              tiles' state (``arch_prctl``)
============  ===========================================================

:func:`level` is what this CPU has, at most :envvar:`ITERSERVE_CPU_ISA` when that
is set (one of the level names; anything else is refused by name). That variable
is read here and nowhere else, and one value caps everything that looks at the
CPU, so one machine can behave as another kind:

- the dispatch table (:mod:`.dispatch`) and the dtype rule read :func:`level`;
- oneDNN (the matrix products, through torch) is capped with
  ``ONEDNN_MAX_CPU_ISA``, set when this module is imported, before oneDNN's
  first primitive in the process (importing :mod:`iterserve.kernels` imports
  this module);
- numba compiles the kernels for the host's features less those above the level
  (:func:`numba_features`), which the package sets before its first compile;
- torch's own probes (``torch.cpu._is_amx_tile_supported`` and the like) are not
  consulted: what they would say is what this module says.

The level of an engine is the lowest of its ranks' (:func:`lowest`), so that every
rank runs the same kernels; a rank is told it at load (:func:`cap`).
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform

ENV_VAR = "ITERSERVE_CPU_ISA"
LEVELS = ("generic", "avx2", "avx512", "avx512_bf16", "amx")

# What oneDNN calls each level's instruction set (ONEDNN_MAX_CPU_ISA's values).
_ONEDNN = {
    "generic": "SSE41",
    "avx2": "AVX2",
    "avx512": "AVX512_CORE",
    "avx512_bf16": "AVX512_CORE_BF16",
    "amx": "AVX512_CORE_AMX",
}
# LLVM's feature names (numba's target) that each level adds over the one before.
_FEATURES = {
    "avx2": ("avx2", "fma"),
    "avx512": ("avx512f", "avx512bw", "avx512vl"),
    "avx512_bf16": ("avx512bf16",),
    "amx": ("amx-tile", "amx-bf16"),
}
# Features that come with a level and go when it is capped below it: every AVX-512
# and AVX10 extension below avx512, every AMX one below amx.
_DROPPED_PREFIXES = {"avx512": ("avx512", "avx10", "evex512"), "amx": ("amx-",)}

# Linux's request for an extended state component, and AMX's tile data component
# (arch/x86/include/uapi/asm/prctl.h).
_ARCH_PRCTL = 158
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18


class IsaError(ValueError):
    """An instruction-set level that does not exist."""


def check_level(name: str, what: str = ENV_VAR) -> str:
    if name not in LEVELS:
        raise IsaError(f"{what}={name!r} is not an instruction-set level; use one of "
                       f"{', '.join(LEVELS)}")  # fmt: skip
    return name


def rank(name: str) -> int:
    """Where ``name`` stands among :data:`LEVELS` (higher has more)."""
    return LEVELS.index(name)


def at_least(have: str, need: str) -> bool:
    return rank(have) >= rank(need)


def lowest(levels) -> str:
    return min(levels, key=rank)


@functools.cache
def override() -> str | None:
    """The cap :envvar:`ITERSERVE_CPU_ISA` sets, or None (read once a process)."""
    value = os.environ.get(ENV_VAR, "").strip().lower()
    return check_level(value) if value else None


def _host_features() -> dict[str, bool]:
    """LLVM's view of this CPU's features (what numba compiles for), {} without llvmlite."""
    try:
        from llvmlite import binding
    except ImportError:  # pragma: no cover - numba (and llvmlite) are dependencies
        return {}
    return dict(binding.get_host_cpu_features())


def level_of(features: dict[str, bool]) -> str:
    """The highest level whose features are all in ``features`` (LLVM's names)."""
    found = "generic"
    for name in LEVELS[1:]:
        if not all(features.get(f, False) for f in _FEATURES[name]):
            break
        found = name
    return found


def _amx_granted() -> bool:
    """Asks Linux for AMX's tile state for this process (it grants it once asked)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) == 0
    except (OSError, AttributeError):  # not Linux, or no syscall()
        return False


@functools.cache
def hardware() -> str:
    """What this CPU and OS run, uncapped (probed once a process)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return "generic"
    found = level_of(_host_features())
    if found == "amx" and not _amx_granted():
        found = "avx512_bf16"
    return found


_cap: list[str | None] = [None]  # the engine's level, once a rank is told it (cap)


def level() -> str:
    """The level the kernels of this process use: the hardware's, at most the
    environment's cap and the engine's (:func:`cap`)."""
    found = hardware()
    for limit in (override(), _cap[0]):
        if limit is not None and rank(limit) < rank(found):
            found = limit
    return found


def cap(name: str) -> None:
    """Caps this process at ``name`` (an engine's lowest rank level), before any
    kernel compiles or product runs; oneDNN is told too."""
    _cap[0] = check_level(name, "the engine's instruction set")
    _tell_onednn(level())
    from . import jit  # numba compiles for the capped level from here on

    jit.configure()


def _tell_onednn(name: str) -> None:
    """Caps oneDNN at ``name`` unless the user capped it already; oneDNN reads the
    variable once, at its first primitive, so a later change is ignored."""
    if name != hardware() and "ONEDNN_MAX_CPU_ISA" not in os.environ:
        os.environ["ONEDNN_MAX_CPU_ISA"] = _ONEDNN[name]


def numba_features(host: dict[str, bool] | None = None, name: str | None = None) -> str:
    """The feature string numba compiles for at ``name`` (default :func:`level`):
    the host's features less those above it, and at AVX-512 without LLVM's
    ``prefer-256-bit`` tuning. That tuning suits CPUs whose wide units lower the
    clock; for these kernels, which widen bf16 to fp32 and multiply-add a head's 64
    values, 512-bit code is the faster: the decode attention of 32 rows over 160
    positions 1.23 against 1.55 ms a layer (docs/kernels.md)."""
    host = _host_features() if host is None else host
    name = level() if name is None else name
    dropped: list[str] = []
    for above in LEVELS[rank(name) + 1 :]:
        dropped += _FEATURES.get(above, ())
    prefixes = tuple(
        p for above in LEVELS[rank(name) + 1 :] for p in _DROPPED_PREFIXES.get(above, ())
    )
    flags = []
    for feature, on in sorted(host.items()):
        if feature in dropped or (prefixes and feature.startswith(prefixes)):
            on = False
        if feature == "prefer-256-bit":
            continue
        flags.append(("+" if on else "-") + feature)
    if at_least(name, "avx512"):
        flags.append("-prefer-256-bit")
    return ",".join(flags)


def describe() -> str:
    """One phrase for logs and ``/version``: the level, and what capped it."""
    found, limit = level(), override()
    if found == hardware():
        return found
    by = f"{ENV_VAR}={limit}" if limit is not None and rank(limit) <= rank(found) else "the engine"
    return f"{found} (capped by {by}; the CPU has {hardware()})"


# Capped before anything in the process can start oneDNN (the package imports this
# module first); the rank's engine cap comes later, also before its first product.
if override() is not None:
    _tell_onednn(level())
