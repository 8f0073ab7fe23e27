"""Start-up objects are frozen out of the garbage collector's full collections."""

from __future__ import annotations

import gc

from iterserve.cluster.gc_pauses import freeze_startup_objects


def test_freezing_hides_surviving_objects_from_collections():
    survivor = [{"held": i} for i in range(1000)]
    try:
        freeze_startup_objects()
        assert gc.get_freeze_count() >= len(survivor)
        assert not any(obj is survivor for obj in gc.get_objects(generation=2))
    finally:
        gc.unfreeze()
