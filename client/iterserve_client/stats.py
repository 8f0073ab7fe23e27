"""``GET /v1/stats``: what the engines are doing right now.

The server answers the engines' counters already summed, with each replica's
own under ``replicas``; or ``{"engines": [...]}`` (or a bare list) with one
entry per engine, which is summed here. Either way ``engines`` holds the
per-engine entries.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

_COUNTS = ("num_running", "num_waiting", "slots_used", "slots_total")
_KV_COUNTS = ("kv_blocks_used", "kv_blocks_total")


@dataclass
class EngineStats:
    """Scheduler state of one engine, or the sum over all of them.

    ``slots_*`` count sequence slots (at most ``max_num_seqs`` run at once);
    ``kv_blocks_*`` count paged KV-cache blocks; ``kv_usage`` is their used
    fraction. After the last request ends, ``slots_used`` and
    ``kv_blocks_used`` return to 0.
    """

    num_running: int = 0
    num_waiting: int = 0
    slots_used: int = 0
    slots_total: int = 0
    kv_usage: float = 0.0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    policy: str | None = None
    engines: list[EngineStats] = field(default_factory=list, repr=False)
    raw: dict = field(default_factory=dict, repr=False)

    @property
    def slot_utilization(self) -> float:
        """Fraction of sequence slots in use (0.0 when there are none)."""
        return self.slots_used / self.slots_total if self.slots_total else 0.0

    @classmethod
    def from_dict(cls, data: Any) -> EngineStats:
        if isinstance(data, list):
            data = {"engines": data}
        if not isinstance(data, dict):
            return cls()
        entries = data.get("engines")
        if isinstance(entries, list) and entries:
            return cls.aggregate([cls.from_dict(e) for e in entries], raw=data)
        values: dict[str, Any] = {k: int(data.get(k) or 0) for k in _COUNTS + _KV_COUNTS}
        values["kv_usage"] = float(data.get("kv_usage") or 0.0)
        policy = data.get("policy")
        if isinstance(policy, list):  # replicas that disagree
            policy = ",".join(sorted(map(str, policy))) or None
        # An already summed answer may list its replicas: keep them, do not re-sum.
        replicas = data.get("replicas")
        engines = [cls.from_dict(r) for r in replicas] if isinstance(replicas, list) else []
        return cls(
            **values,
            policy=None if policy is None else str(policy),
            engines=engines,
            raw=data,
        )

    @classmethod
    def aggregate(cls, engines: list[EngineStats], raw: dict | None = None) -> EngineStats:
        """Counts summed; ``kv_usage`` recomputed from the summed blocks; the
        policy is the engines' common one (distinct policies joined by commas)."""
        total = {k: sum(getattr(e, k) for e in engines) for k in _COUNTS + _KV_COUNTS}
        if total["kv_blocks_total"]:
            kv_usage = total["kv_blocks_used"] / total["kv_blocks_total"]
        else:
            kv_usage = sum(e.kv_usage for e in engines) / max(len(engines), 1)
        policies = sorted({e.policy for e in engines if e.policy is not None})
        return cls(
            **total,
            kv_usage=kv_usage,
            policy=",".join(policies) or None,
            engines=engines,
            raw=raw or {},
        )
