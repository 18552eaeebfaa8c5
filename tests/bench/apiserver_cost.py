"""Where the API server's work goes over a window of a benchmark: who wrote what (its audit log) and
what its CPU was spent on (a pprof CPU profile read with ``go tool pprof -traces``).

Used by ``bench_scale.py --apiserver-cost``; the clusters it starts need ``audit_log=True`` and
``profiling=True``. Both cost the API server something themselves (an audit event written per
write, a profile's sampling), so their runs' CPU figures are reported apart from plain runs'.
"""

from __future__ import annotations

import bisect
import datetime
import json
import re
import shutil
import subprocess
from pathlib import Path

# A profile's samples sorted into where a request (or background work) spent them: the first
# bucket whose pattern any frame of the sample's stack matches. Watches first: serving one goes
# through ListResource too.
WORK_BUCKETS: tuple[tuple[str, str], ...] = (
    ("watch: encode and send events", r"cacher\.\(\*cacheWatcher\)|handlers\.\(\*WatchServer\)|handlers\.serveWatch"),
    ("watch cache: ingest from etcd, dispatch", r"cacher\.\(\*Cacher\)|cacher\.\(\*watchCache\)|etcd3\.\(\*watchChan\)"
                                                 r"|etcd3\.\(\*watcher\)"),
    ("create", r"handlers\.CreateResource|handlers\.createHandler"),
    ("update", r"handlers\.UpdateResource"),
    ("patch", r"handlers\.PatchResource|handlers\.\(\*patcher\)"),
    ("get", r"handlers\.GetResource|handlers\.getResourceHandler"),
    ("list", r"handlers\.ListResource"),
    ("delete", r"handlers\.DeleteResource|handlers\.DeleteCollection"),
    # Past the handlers: a stack cut off at pprof's depth limit inside the field manager's recursion.
    ("managed fields, stack too deep to show its handler", r"structured-merge-diff|/managedfields/"),
    ("request serving outside the handlers (TLS, authn/z, flow control, routing, audit)",
     r"net/http\.\(\*conn\)\.serve|golang\.org/x/net/http2|net/http\.\(\*http2|filters\.\(\*timeoutHandler\)"),
    ("etcd client connection", r"google\.golang\.org/grpc|go\.etcd\.io/etcd/client"),
    ("garbage collection (background)", r"runtime\.gcBgMarkWorker|runtime\.bgsweep|runtime\.bgscavenge"),
)
# Cross-cutting shares: of all samples, those with any frame matching (a sample may count in several).
CROSS_CUTS: tuple[tuple[str, str], ...] = (
    # Custom resources are served as unstructured objects (the CRD handler's own frame is often cut
    # off with the root of a deep stack).
    ("custom resources (unstructured objects)", r"apimachinery/pkg/apis/meta/v1/unstructured"),
    ("storage read-modify-write (GuaranteedUpdate: updates, patches)", r"etcd3\.\(\*store\)\.GuaranteedUpdate"),
    ("managed fields / server-side apply", r"structured-merge-diff|/fieldmanager|/managedfields/"),
    ("applying an apply patch", r"handlers\.\(\*applyPatcher\)"),
    ("applying a merge or strategic-merge patch", r"handlers\.\(\*jsonPatcher\)|handlers\.\(\*smpPatcher\)"),
    ("CEL validation", r"google/cel-go|k8s\.io/apiserver/pkg/cel|apiserver/schema/cel"),
    ("OpenAPI schema validation", r"kube-openapi/pkg/validation|apiextensions-apiserver/pkg/apiserver/validation"),
    ("JSON encode/decode", r"encoding/json|sigs\.k8s\.io/json|json-iterator|serializer/json"),
    ("protobuf encode/decode", r"gogo/protobuf|serializer/protobuf|google\.golang\.org/protobuf"),
    ("etcd client", r"go\.etcd\.io/etcd/client"),
    ("admission", r"k8s\.io/apiserver/pkg/admission"),
    ("TLS", r"crypto/tls"),
    ("allocation (mallocgc, incl. GC assists)", r"runtime\.mallocgc"),
)
OTHER = "other (the API server's own controllers, metrics, scheduling)"
_VALUE = re.compile(r"^\s*([0-9.]+)(ns|us|µs|ms|s)\s+(\S.*)$")
_UNIT_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0}


def parse_traces(text: str) -> list[tuple[float, list[str]]]:
    """``go tool pprof -traces`` output → (seconds, frames leaf first) per sample stack."""
    stacks: list[tuple[float, list[str]]] = []
    for block in text.split("-----------+-------------------------------------------------------")[1:]:
        lines = [line for line in block.splitlines() if line.strip()]
        if not lines or not (m := _VALUE.match(lines[0])):
            continue
        frames = [m.group(3).strip()] + [line.strip() for line in lines[1:]
                                         if not line.strip().startswith(("bytes:", "label:"))]
        stacks.append((float(m.group(1)) * _UNIT_S[m.group(2)], frames))
    return stacks


def breakdown(stacks: list[tuple[float, list[str]]]) -> dict[str, object]:
    """Seconds of CPU in all, and each work bucket's and cross-cut's share of them."""
    total = sum(s for s, _ in stacks)
    work: dict[str, float] = {}
    cuts = {name: 0.0 for name, _ in CROSS_CUTS}
    compiled = [(name, re.compile(p)) for name, p in WORK_BUCKETS]
    compiled_cuts = [(name, re.compile(p)) for name, p in CROSS_CUTS]
    for seconds, frames in stacks:
        joined = "\n".join(frames)
        bucket = next((name for name, rx in compiled if rx.search(joined)), OTHER)
        work[bucket] = work.get(bucket, 0.0) + seconds
        for name, rx in compiled_cuts:
            if rx.search(joined):
                cuts[name] += seconds

    def share(x: float) -> float:
        return round(x / total, 3) if total else 0.0

    return {"cpuSeconds": round(total, 2),
            "work": {k: share(v) for k, v in sorted(work.items(), key=lambda kv: -kv[1])},
            "crossCuts": {k: share(v) for k, v in sorted(cuts.items(), key=lambda kv: -kv[1])}}


def profile_breakdown(profile: bytes, out: Path) -> dict[str, object]:
    """Writes the profile to ``out`` and sorts its samples (``breakdown``); needs ``go`` on PATH
    (the Go toolchain the dev binaries are built with)."""
    out.write_bytes(profile)
    go = shutil.which("go")
    if go is None:
        raise RuntimeError("go is not on PATH: `go tool pprof` reads the API server's profile (source dev/env.sh)")
    text = subprocess.run([go, "tool", "pprof", "-traces", str(out)], capture_output=True, text=True,
                          check=True, timeout=300).stdout
    return {"profile": str(out), **breakdown(parse_traces(text))}


def writer(event: dict) -> str:
    """Who sent a write: a controller-manager controller by its service account, else the client
    program from its user agent (kubectl, kopf, the operator's client, kwok, ...)."""
    user = (event.get("user") or {}).get("username", "")
    prefix = "system:serviceaccount:kube-system:"
    if user.startswith(prefix):
        return user[len(prefix):]
    return (event.get("userAgent") or user or "?").split("/", 1)[0].split(" ", 1)[0]


def _when(stamp: str) -> datetime.datetime:
    return datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00"))


def audited_writes(path: Path, *, edges: list[datetime.datetime]) -> list[dict[str, int]]:
    """Writes the API server answered in each window [edges[i], edges[i + 1]), by "writer verb
    resource[/subresource]", largest first (from a Metadata-level audit log, one JSON event per
    line, read once for all windows)."""
    windows: list[dict[str, int]] = [{} for _ in edges[1:]]
    with path.open() as f:
        for line in f:
            event = json.loads(line)
            i = bisect.bisect_right(edges, _when(event["stageTimestamp"])) - 1
            if not 0 <= i < len(windows):
                continue
            ref = event.get("objectRef") or {}
            resource = ref.get("resource", "?") + (f"/{ref['subresource']}" if ref.get("subresource") else "")
            key = f"{writer(event)} {event['verb']} {resource}"
            windows[i][key] = windows[i].get(key, 0) + 1
    return [dict(sorted(w.items(), key=lambda kv: -kv[1])) for w in windows]
