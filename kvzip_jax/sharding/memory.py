"""A run's memory per device against what the devices hold: the plan's parts, the device's free bytes, and a named
error before anything is allocated.

    need = memory_plan.plan(cfg, dtype, context_tokens=32768, mesh=mesh)   # what the model needs (shapes alone)
    memory.check(need)           # MemoryPlanError, naming the largest part, when it cannot fit the device
"""

from __future__ import annotations

import dataclasses
import os

import jax

from kvzip_jax.errors import KvzipError

GiB = 1 << 30
PARTS = ("params", "cache", "scores", "workspace")


class MemoryPlanError(KvzipError, MemoryError):
    """A run that would not fit the devices' memory (raised before anything is allocated)."""


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Bytes per device of each part."""

    params: int
    cache: int
    scores: int
    workspace: int

    @property
    def total(self) -> int:
        return self.params + self.cache + self.scores + self.workspace

    def describe(self) -> str:
        parts = ", ".join(f"{name} {getattr(self, name) / GiB:.2f}" for name in PARTS)
        return f"{self.total / GiB:.2f} GiB per device ({parts})"


def device_memory() -> int | None:
    """Bytes one local device can hold: the accelerator's limit, or on CPU the host's available memory shared by
    its (simulated) devices; None when unknown."""
    device = jax.local_devices()[0]
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024 // max(len(jax.local_devices()), 1)
    except (OSError, KeyError, ValueError):
        return None


def check(need: MemoryPlan, available: int | None = None, headroom: float = 0.9) -> MemoryPlan:
    """need, or MemoryPlanError when its total exceeds `headroom` x `available` bytes per device (default: what
    device_memory finds; nothing is checked when that is unknown)."""
    available = device_memory() if available is None else available
    if available is not None and need.total > headroom * available:
        largest = max(PARTS, key=lambda n: getattr(need, n))
        raise MemoryPlanError(
            f"this run needs {need.describe()} of {available / GiB:.2f} GiB available; the largest part is the "
            f"{largest}. Shard it (a mesh with more tensor or seq devices), use bfloat16, a shorter context or a "
            f"smaller batch or chunk"
        )
    return need


def process_memory() -> int:
    """Resident bytes of this process now (Linux; 0 elsewhere)."""
    try:
        with open(f"/proc/{os.getpid()}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0
