"""Running the CPU kernels as on another kind of CPU: the dispatch table read for a
lower instruction-set level than this one's (a faked ISA)."""

import pytest

from iterserve.kernels.cpu import dispatch, isa


def at_level(monkeypatch, level: str) -> None:
    """The kernels this process runs from here on are those of ``level`` (skipped
    when the CPU has less: its kernels would not run here)."""
    if not isa.at_least(isa.level(), level):
        pytest.skip(f"this CPU runs below {level}")
    monkeypatch.setattr(dispatch, "current", lambda: dispatch.Dispatch(level))


def fail_on(monkeypatch, module, *names: str) -> None:
    """Any call to ``module.<name>`` fails the test (a kernel that must not run)."""

    def called(*args, **kwargs):
        raise AssertionError("a kernel that must not run was called")

    for name in names:
        monkeypatch.setattr(module, name, called)
