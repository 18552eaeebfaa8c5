"""The container's CPU limit, read from its cgroup (v2 ``cpu.max``, else v1 CFS quota).

``os.cpu_count()`` (and torch's own default) count the node's cores, not the pod's
``resources.limits.cpu``: a server that sized its thread pools from it on a many-core node would
run far more threads than its CFS quota lets run at once and be throttled every period.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = "/sys/fs/cgroup"
# cgroup v1 mounts the cpu controller alone or joined with cpuacct, depending on the runtime.
V1_CPU_DIRS = ("cpu", "cpu,cpuacct", "cpuacct,cpu")


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


def cpu_limit(root: str | os.PathLike[str] = CGROUP_ROOT, *,
              proc_cgroup: str | os.PathLike[str] = "/proc/self/cgroup") -> float | None:
    """CPUs the quota of this process's cgroup allows (quota / period; the tightest of its
    cgroup and their ancestors under ``root``), None when there is no limit or nothing can be
    read. v2: ``cpu.max`` is ``"<quota> <period>"`` or ``"max <period>"``; v1:
    ``cpu.cfs_quota_us`` (-1 for none) over ``cpu.cfs_period_us``. In a container with its own
    cgroup namespace (or a runtime that mounts the container's cgroup there) ``root`` itself is
    the container's cgroup."""
    base = Path(root)
    own = _own_paths(proc_cgroup)
    limits = []
    v2_dirs = [d for d in _dirs(base, own.get("")) if (d / "cpu.max").exists()]
    for directory in v2_dirs:
        parts = (_read(directory / "cpu.max") or "").split()
        if parts and parts[0] != "max":
            limits.append(_ratio(parts[0], parts[1] if len(parts) > 1 else "100000"))
    if not v2_dirs:
        v1_path = next((p for k, p in own.items() if "cpu" in k.split(",")), None)
        for sub in V1_CPU_DIRS:
            for directory in _dirs(base / sub, v1_path):
                quota = _read(directory / "cpu.cfs_quota_us")
                period = _read(directory / "cpu.cfs_period_us")
                if quota is not None and period is not None:
                    limits.append(_ratio(quota, period))
    found = [x for x in limits if x is not None]
    return min(found) if found else None


def _own_paths(proc_cgroup: str | os.PathLike[str]) -> dict[str, str]:
    """``/proc/self/cgroup`` as {controllers: path}: "" for the v2 line (``0::/path``)."""
    paths: dict[str, str] = {}
    for line in (_read(Path(proc_cgroup)) or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            paths[parts[1]] = parts[2]
    return paths


def _dirs(base: Path, own: str | None) -> list[Path]:
    """``base``/``own`` and each ancestor up to ``base``, those that exist; ``base`` always."""
    dirs = []
    if own:
        rel = Path(own.lstrip("/"))
        while rel.parts:
            if (base / rel).is_dir():
                dirs.append(base / rel)
            rel = rel.parent
    dirs.append(base)
    return dirs


def _ratio(quota: str, period: str) -> float | None:
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None


def threads_for_limit(limit: float | None, *, available: int | None = None) -> int | None:
    """Threads for a CPU limit: its ceiling, at most the CPUs this process may run on, at least
    1; None without a limit."""
    if limit is None:
        return None
    if available is None:
        available = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(math.ceil(limit - 1e-9), available))


# cgroup v1 writes "no limit" as the largest page-aligned 63-bit value.
V1_NO_MEMORY_LIMIT = 1 << 62


def memory_limit(root: str | os.PathLike[str] = CGROUP_ROOT, *,
                 proc_cgroup: str | os.PathLike[str] = "/proc/self/cgroup") -> int | None:
    """Bytes this process's cgroup may hold (the tightest of it and its ancestors under
    ``root``): v2 ``memory.max`` (``max`` for none), else v1 ``memory.limit_in_bytes``; None
    when there is no limit or nothing can be read."""
    base = Path(root)
    own = _own_paths(proc_cgroup)
    values = [_read(d / "memory.max") for d in _dirs(base, own.get(""))
              if (d / "memory.max").exists()]
    if not values:
        v1_path = next((p for k, p in own.items() if "memory" in k.split(",")), None)
        values = [_read(d / "memory.limit_in_bytes") for d in _dirs(base / "memory", v1_path)]
    limits = []
    for value in values:
        try:
            n = int(value or "")
        except ValueError:
            continue  # "max", unreadable
        if 0 < n < V1_NO_MEMORY_LIMIT:
            limits.append(n)
    return min(limits) if limits else None
