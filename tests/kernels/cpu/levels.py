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


def fail_on_loops(monkeypatch) -> None:
    """The row kernels may run the tiles only: a call of the loops fails the test."""
    from iterserve.kernels.cpu import attention_rows

    for name in ("attend_rows", "attend_rows_parallel"):
        kernel = getattr(attention_rows, name)

        def tiles_only(*args, kernel=kernel):
            assert args[11] is not None, "the loops ran where the tiles must"
            return kernel(*args)

        monkeypatch.setattr(attention_rows, name, tiles_only)
