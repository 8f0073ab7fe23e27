"""Keeping garbage-collection pauses out of steps.

A process that has imported torch, Ray and a model holds a few hundred thousand
long-lived objects; a full (generation 2) collection walks all of them, which
takes tens of milliseconds on a CPU, and the collector starts one whenever
enough new objects have piled up: a step that happens to trigger it stalls
every running stream by that much. Freezing what start-up allocated moves it
out of the collector's sight for good, so later collections only walk what the
steps allocate.
"""

from __future__ import annotations

import gc


def freeze_startup_objects() -> None:
    """Collects once, then freezes every surviving object (``gc.freeze``). Call it
    when start-up is done; calling it again freezes what survived since."""
    gc.collect()
    gc.freeze()
