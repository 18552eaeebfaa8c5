"""What a kubelet would run for a pod, as pure data: the container half of the pod runner.

kwok nodes run nothing. In container mode the pod runner (``containerrunner.py``) plays the kubelet
for every pod of its cluster: it asks :func:`plan_pod` what to run, materialises the volumes it
returns as files, runs each container with podman on the host network (every pod binds its own
loopback pod IP), probes it, and writes back the status :func:`pod_status` computes.

Supported, as a kubelet does it: ``command``/``args`` (with ``$(VAR)`` expansion), ``env``
(values, ``secretKeyRef``, ``configMapKeyRef``, ``fieldRef``, ``resourceFieldRef`` is not),
``envFrom``, ``workingDir``, volumes ``configMap``, ``secret``, ``emptyDir``, ``hostPath``,
``downwardAPI`` and ``projected`` (``serviceAccountToken`` — a bound TokenRequest —, ``configMap``,
``secret``, ``downwardAPI``, which is how the API server mounts
``/var/run/secrets/kubernetes.io/serviceaccount``), ``volumeMounts`` (``readOnly``, ``subPath``),
HTTP-GET and TCP readiness/liveness/startup probes with their timing fields, ``securityContext``
(``runAsUser``/``runAsGroup``, ``readOnlyRootFilesystem``, capabilities, ``allowPrivilegeEscalation``,
``privileged``, ``seccompProfile``: unconfined unless ``RuntimeDefault``, as a kubelet's default) and ``imagePullPolicy`` (nothing is ever pulled: no registry is reachable, so a
missing image waits with ``ErrImageNeverPull`` or ``ErrImagePull``). ``KUBERNETES_SERVICE_HOST``
and ``_PORT`` point at the local API server.

Anything else that changes what runs (init containers, exec probes, PVC volumes, lifecycle hooks,
...) is reported by :func:`unsupported_fields` and the runner emits a Warning event naming it:
never a silent skip. Resource requests/limits are the scheduler's business here and are not
enforced (cgroup limits would need the cgroup v2 delegation these machines lack).
"""

from __future__ import annotations

import base64
import dataclasses
import posixpath
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

SA_MOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"
DEFAULT_TOKEN_SECONDS = 3607
# (namespace, name) -> data (str values; Secrets already decoded), None when absent.
Lookup = Callable[[str, str], Mapping[str, str] | None]
# (namespace, service account, audiences, expiration seconds, pod name, pod uid) -> token
TokenSource = Callable[[str, str, tuple[str, ...], int, str, str], str]

SUPPORTED_VOLUME_KINDS = ("configMap", "secret", "emptyDir", "hostPath", "downwardAPI", "projected")
SUPPORTED_CONTAINER_FIELDS = {
    "name", "image", "imagePullPolicy", "command", "args", "env", "envFrom", "workingDir", "ports",
    "volumeMounts", "readinessProbe", "livenessProbe", "startupProbe", "resources", "securityContext",
    "terminationMessagePath", "terminationMessagePolicy", "stdin", "tty",
}
# Pod-level fields that only the scheduler, the API server or a real CNI act on: nothing to run.
IGNORED_POD_FIELDS = {
    "containers", "volumes", "nodeName", "nodeSelector", "tolerations", "affinity", "schedulerName",
    "serviceAccountName", "serviceAccount", "automountServiceAccountToken", "securityContext",
    "restartPolicy", "terminationGracePeriodSeconds", "dnsPolicy", "enableServiceLinks", "priority",
    "priorityClassName", "preemptionPolicy", "imagePullSecrets", "hostNetwork", "topologySpreadConstraints",
    "readinessGates", "hostname", "subdomain",
}


class NotReadyToRun(Exception):
    """The pod references something that does not exist yet (a ConfigMap, Secret or key)."""


@dataclasses.dataclass(frozen=True)
class Probe:
    """A readiness/liveness/startup probe, resolved to a concrete address."""

    kind: str  # "http" | "tcp"
    host: str
    port: int
    path: str = "/"
    scheme: str = "http"
    initial_delay_s: float = 0.0
    period_s: float = 10.0
    timeout_s: float = 1.0
    failure_threshold: int = 3
    success_threshold: int = 1


@dataclasses.dataclass(frozen=True)
class Mount:
    volume: str
    target: str
    read_only: bool
    sub_path: str = ""


@dataclasses.dataclass(frozen=True)
class ContainerPlan:
    """One container as podman should run it; fixed when the container is created (restarts reuse
    it), as a kubelet resolves a container's env once per start and pod specs do not change."""

    name: str
    image: str
    pull_policy: str
    entrypoint: tuple[str, ...] | None  # k8s `command` (replaces the image ENTRYPOINT and CMD)
    args: tuple[str, ...] | None  # k8s `args` (replaces the image CMD)
    env: tuple[tuple[str, str], ...]
    mounts: tuple[Mount, ...]
    working_dir: str | None = None
    user: str | None = None
    read_only_root: bool = False
    privileged: bool = False
    no_new_privileges: bool = False
    cap_add: tuple[str, ...] = ()
    cap_drop: tuple[str, ...] = ()
    seccomp_unconfined: bool = False
    readiness: Probe | None = None
    liveness: Probe | None = None
    startup: Probe | None = None


@dataclasses.dataclass(frozen=True)
class VolumeFiles:
    """A volume's content: files (relative path -> (bytes, mode)), or a host path, or empty."""

    name: str
    kind: str
    files: tuple[tuple[str, bytes, int], ...] = ()
    host_path: str | None = None
    writable: bool = False  # emptyDir: the container user writes there


@dataclasses.dataclass(frozen=True)
class PodPlan:
    namespace: str
    name: str
    uid: str
    pod_ip: str
    containers: tuple[ContainerPlan, ...]
    volumes: tuple[VolumeFiles, ...]
    unsupported: tuple[str, ...]
    grace_s: int = 30  # spec.terminationGracePeriodSeconds

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}/{self.uid}"


def _get(obj: Any, *path: str) -> Any:
    for part in path:
        if not isinstance(obj, Mapping):
            return None
        obj = obj.get(part)
    return obj


def _first(value: Any, default: Any) -> Any:
    return default if value is None else value


# -- validation -------------------------------------------------------------------------------

def unsupported_fields(pod: Mapping[str, Any]) -> list[str]:
    """Fields of ``pod`` that would change what runs and that this runner does not implement."""
    spec = pod.get("spec") or {}
    found = [f"spec.{k}" for k in sorted(spec) if k not in IGNORED_POD_FIELDS]
    for i, c in enumerate(spec.get("containers") or []):
        found += [f"spec.containers[{i}].{k}" for k in sorted(c) if k not in SUPPORTED_CONTAINER_FIELDS]
        for probe_name in ("readinessProbe", "livenessProbe", "startupProbe"):
            probe = c.get(probe_name)
            if probe and not (probe.get("httpGet") or probe.get("tcpSocket")):
                found.append(f"spec.containers[{i}].{probe_name} (only httpGet and tcpSocket probes)")
        for j, var in enumerate(c.get("env") or []):
            if _get(var, "valueFrom", "resourceFieldRef"):
                found.append(f"spec.containers[{i}].env[{j}].valueFrom.resourceFieldRef")
    for i, v in enumerate(spec.get("volumes") or []):
        kinds = [k for k in v if k != "name"]
        if not any(k in SUPPORTED_VOLUME_KINDS for k in kinds):
            found.append(f"spec.volumes[{i}] ({', '.join(kinds) or 'no source'})")
    return found


# -- environment --------------------------------------------------------------------------------

_VAR_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand(value: str, env: Mapping[str, str]) -> str:
    """A kubelet's ``$(VAR)`` expansion: defined vars replaced, undefined kept, ``$$`` escapes."""
    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))

    return _VAR_REF.sub(sub, value)


def pod_fields(pod: Mapping[str, Any]) -> dict[str, str | None]:
    """The ``fieldRef`` paths a kubelet resolves (labels/annotations as ``metadata.labels['k']``)."""
    meta = pod.get("metadata") or {}
    fields: dict[str, str | None] = {
        "metadata.name": meta.get("name"),
        "metadata.namespace": meta.get("namespace") or "default",
        "metadata.uid": meta.get("uid"),
        "spec.nodeName": _get(pod, "spec", "nodeName"),
        "spec.serviceAccountName": _get(pod, "spec", "serviceAccountName") or "default",
        "status.podIP": _get(pod, "status", "podIP"),
        # A kubelet joins every address (dual-stack) with commas.
        "status.podIPs": ",".join(ip["ip"] for ip in _get(pod, "status", "podIPs") or [] if ip.get("ip"))
        or _get(pod, "status", "podIP"),
        "status.hostIP": _get(pod, "status", "hostIP"),
    }
    for kind in ("labels", "annotations"):
        for k, v in (meta.get(kind) or {}).items():
            fields[f"metadata.{kind}['{k}']"] = v
    return fields


def _ref_value(ref_kind: str, ref: Mapping[str, Any], *, namespace: str, secrets: Lookup,
               configmaps: Lookup) -> str | None:
    lookup = secrets if ref_kind == "secretKeyRef" else configmaps
    data = lookup(namespace, ref["name"])
    if data is None or ref["key"] not in data:
        if ref.get("optional"):
            return None
        raise NotReadyToRun(f"{ref_kind} {namespace}/{ref['name']} key {ref['key']} not found")
    return data[ref["key"]]


def container_env(container: Mapping[str, Any], *, pod: Mapping[str, Any], secrets: Lookup,
                  configmaps: Lookup, base: Mapping[str, str] = ()) -> dict[str, str]:
    """The container's environment as a kubelet builds it: ``base`` (service variables), then
    ``envFrom``, then ``env`` in order (later wins; values may reference earlier ones)."""
    fields = pod_fields(pod)
    namespace = fields["metadata.namespace"] or "default"
    env: dict[str, str] = dict(base)
    for source in container.get("envFrom") or []:
        prefix = source.get("prefix", "")
        for ref_kind, lookup in (("secretRef", secrets), ("configMapRef", configmaps)):
            ref = source.get(ref_kind)
            if not ref:
                continue
            data = lookup(namespace, ref["name"])
            if data is None:
                if ref.get("optional"):
                    continue
                raise NotReadyToRun(f"{ref_kind} {namespace}/{ref['name']} not found")
            env.update({prefix + k: v for k, v in data.items()})
    for var in container.get("env") or []:
        name = var["name"]
        if var.get("value") is not None:
            env[name] = expand(str(var["value"]), env)
            continue
        source = var.get("valueFrom") or {}
        value: str | None = None
        for ref_kind in ("secretKeyRef", "configMapKeyRef"):
            if source.get(ref_kind):
                value = _ref_value(ref_kind, source[ref_kind], namespace=namespace, secrets=secrets,
                                   configmaps=configmaps)
                break
        else:
            path = _get(source, "fieldRef", "fieldPath")
            if path is not None:
                value = fields.get(path)
            elif "valueFrom" not in var:
                value = ""  # `- name: X` alone is an empty variable
        if value is not None:
            env[name] = value
    return env


# -- probes and ports ---------------------------------------------------------------------------

def _port_number(port: Any, container: Mapping[str, Any]) -> int:
    if isinstance(port, int) or (isinstance(port, str) and port.isdigit()):
        return int(port)
    for p in container.get("ports") or []:
        if p.get("name") == port:
            return int(p["containerPort"])
    raise NotReadyToRun(f"container {container.get('name')}: no port named {port!r}")


def probe_plan(probe: Mapping[str, Any] | None, *, container: Mapping[str, Any], pod_ip: str) -> Probe | None:
    """``probe`` resolved against the container's named ports; None for absent or exec probes."""
    if not probe:
        return None
    timing = {
        "initial_delay_s": float(probe.get("initialDelaySeconds", 0)),
        "period_s": float(probe.get("periodSeconds", 10)),
        "timeout_s": float(probe.get("timeoutSeconds", 1)),
        "failure_threshold": int(probe.get("failureThreshold", 3)),
        "success_threshold": int(probe.get("successThreshold", 1)),
    }
    if probe.get("httpGet"):
        g = probe["httpGet"]
        return Probe(kind="http", host=g.get("host") or pod_ip, port=_port_number(g["port"], container),
                     path=g.get("path", "/"), scheme=str(g.get("scheme", "HTTP")).lower(), **timing)
    if probe.get("tcpSocket"):
        t = probe["tcpSocket"]
        return Probe(kind="tcp", host=t.get("host") or pod_ip, port=_port_number(t["port"], container), **timing)
    return None


# -- volumes ------------------------------------------------------------------------------------

def _mode(value: Any, default: int) -> int:
    return int(value) if value is not None else default


def _key_files(data: Mapping[str, str | bytes], items: Sequence[Mapping[str, Any]] | None,
               default_mode: int, *, what: str, optional: bool) -> list[tuple[str, bytes, int]]:
    def raw(v: str | bytes) -> bytes:
        # surrogateescape: a binary Secret value comes back byte for byte (see decode_secret).
        return v if isinstance(v, bytes) else v.encode(errors="surrogateescape")

    if not items:
        return [(k, raw(v), default_mode) for k, v in sorted(data.items())]
    out = []
    for item in items:
        if item["key"] not in data:
            if optional:
                continue
            raise NotReadyToRun(f"{what} has no key {item['key']}")
        out.append((item["path"], raw(data[item["key"]]), _mode(item.get("mode"), default_mode)))
    return out


def _downward_files(items: Sequence[Mapping[str, Any]], fields: Mapping[str, str | None],
                    default_mode: int) -> list[tuple[str, bytes, int]]:
    out = []
    for item in items:
        path = _get(item, "fieldRef", "fieldPath")
        if path not in fields:
            raise NotReadyToRun(f"downwardAPI field {path!r} is not supported")
        out.append((item["path"], str(fields[path] or "").encode(), _mode(item.get("mode"), default_mode)))
    return out


def volume_files(volume: Mapping[str, Any], *, pod: Mapping[str, Any], secrets: Lookup, configmaps: Lookup,
                 tokens: TokenSource) -> VolumeFiles:
    """The files a kubelet would put in ``volume`` (kinds: :data:`SUPPORTED_VOLUME_KINDS`)."""
    name = volume["name"]
    fields = pod_fields(pod)
    namespace = fields["metadata.namespace"] or "default"

    def from_ref(kind: str, ref_name: str, items: Any, mode: int, optional: bool) -> list[tuple[str, bytes, int]]:
        lookup = secrets if kind == "secret" else configmaps
        data = lookup(namespace, ref_name)
        if data is None:
            if optional:
                return []
            raise NotReadyToRun(f"{kind} {namespace}/{ref_name} not found")
        return _key_files(data, items, mode, what=f"{kind} {namespace}/{ref_name}", optional=optional)

    if "configMap" in volume:
        cm = volume["configMap"]
        files = from_ref("configMap", cm["name"], cm.get("items"), _mode(cm.get("defaultMode"), 0o644),
                         bool(cm.get("optional")))
        return VolumeFiles(name, "configMap", tuple(files))
    if "secret" in volume:
        s = volume["secret"]
        files = from_ref("secret", s["secretName"], s.get("items"), _mode(s.get("defaultMode"), 0o644),
                         bool(s.get("optional")))
        return VolumeFiles(name, "secret", tuple(files))
    if "emptyDir" in volume:
        return VolumeFiles(name, "emptyDir", writable=True)
    if "hostPath" in volume:
        return VolumeFiles(name, "hostPath", host_path=volume["hostPath"]["path"])
    if "downwardAPI" in volume:
        d = volume["downwardAPI"]
        return VolumeFiles(name, "downwardAPI",
                           tuple(_downward_files(d.get("items") or [], fields, _mode(d.get("defaultMode"), 0o644))))
    if "projected" in volume:
        p = volume["projected"]
        mode = _mode(p.get("defaultMode"), 0o644)
        files: list[tuple[str, bytes, int]] = []
        for source in p.get("sources") or []:
            if "serviceAccountToken" in source:
                t = source["serviceAccountToken"]
                audience = (t["audience"],) if t.get("audience") else ()
                token = tokens(namespace, fields["spec.serviceAccountName"] or "default", audience,
                               int(t.get("expirationSeconds", DEFAULT_TOKEN_SECONDS)),
                               fields["metadata.name"] or "", fields["metadata.uid"] or "")
                files.append((t.get("path", "token"), token.encode(), mode))
            elif "configMap" in source:
                cm = source["configMap"]
                files += from_ref("configMap", cm["name"], cm.get("items"), mode, bool(cm.get("optional")))
            elif "secret" in source:
                s = source["secret"]
                files += from_ref("secret", s["name"], s.get("items"), mode, bool(s.get("optional")))
            elif "downwardAPI" in source:
                files += _downward_files(source["downwardAPI"].get("items") or [], fields, mode)
            else:
                raise NotReadyToRun(f"projected volume {name}: unsupported source {sorted(source)}")
        return VolumeFiles(name, "projected", tuple(files))
    raise NotReadyToRun(f"volume {name}: unsupported source {sorted(k for k in volume if k != 'name')}")


# -- the plan -----------------------------------------------------------------------------------

def _security(container: Mapping[str, Any], pod: Mapping[str, Any]) -> dict[str, Any]:
    pod_sc = _get(pod, "spec", "securityContext") or {}
    sc = container.get("securityContext") or {}
    uid = sc.get("runAsUser", pod_sc.get("runAsUser"))
    gid = sc.get("runAsGroup", pod_sc.get("runAsGroup"))
    user = None if uid is None else (f"{uid}:{gid}" if gid is not None else str(uid))
    caps = sc.get("capabilities") or {}
    # As a kubelet without SeccompDefault: no profile (or Unconfined) means unconfined; only
    # RuntimeDefault/Localhost get the runtime's profile (a Localhost file is not loaded here).
    seccomp = (sc.get("seccompProfile") or pod_sc.get("seccompProfile") or {}).get("type")
    return {
        "seccomp_unconfined": seccomp not in ("RuntimeDefault", "Localhost"),
        "user": user,
        "read_only_root": bool(sc.get("readOnlyRootFilesystem")),
        "privileged": bool(sc.get("privileged")),
        "no_new_privileges": sc.get("allowPrivilegeEscalation") is False,
        "cap_add": tuple(str(c).upper() for c in caps.get("add") or ()),
        "cap_drop": tuple(str(c).upper() for c in caps.get("drop") or ()),
    }


def plan_pod(pod: Mapping[str, Any], *, secrets: Lookup, configmaps: Lookup, tokens: TokenSource,
             service_env: Mapping[str, str]) -> PodPlan | None:
    """What to run for ``pod``; None when nothing should run (not Running, no IP, deleting).

    Raises :class:`NotReadyToRun` while a referenced object is missing (the runner retries).
    ``service_env`` holds ``KUBERNETES_SERVICE_HOST``/``_PORT`` (and anything else every container gets).
    """
    meta = pod.get("metadata") or {}
    if meta.get("deletionTimestamp") or _get(pod, "status", "phase") != "Running":
        return None
    pod_ip = _get(pod, "status", "podIP")
    if not pod_ip:
        return None
    volumes = {v["name"]: v for v in _get(pod, "spec", "volumes") or []}
    vol_files = tuple(
        volume_files(v, pod=pod, secrets=secrets, configmaps=configmaps, tokens=tokens)
        for v in volumes.values() if any(k in SUPPORTED_VOLUME_KINDS for k in v)
    )
    planned = {v.name for v in vol_files}
    containers = []
    for c in _get(pod, "spec", "containers") or []:
        env = container_env(c, pod=pod, secrets=secrets, configmaps=configmaps, base=service_env)
        mounts = []
        for m in c.get("volumeMounts") or []:
            if m["name"] not in planned:
                raise NotReadyToRun(f"container {c['name']}: volume {m['name']} is not mounted by this runner")
            mounts.append(Mount(volume=m["name"], target=m["mountPath"], read_only=bool(m.get("readOnly")),
                                sub_path=posixpath.normpath(m["subPath"]) if m.get("subPath") else ""))
        policy = c.get("imagePullPolicy") or ("Always" if str(c["image"]).endswith(":latest") else "IfNotPresent")
        containers.append(ContainerPlan(
            name=c["name"], image=c["image"], pull_policy=policy,
            entrypoint=tuple(expand(str(a), env) for a in c["command"]) if c.get("command") else None,
            args=tuple(expand(str(a), env) for a in c["args"]) if c.get("args") is not None else None,
            env=tuple(sorted(env.items())), mounts=tuple(mounts), working_dir=c.get("workingDir"),
            readiness=probe_plan(c.get("readinessProbe"), container=c, pod_ip=pod_ip),
            liveness=probe_plan(c.get("livenessProbe"), container=c, pod_ip=pod_ip),
            startup=probe_plan(c.get("startupProbe"), container=c, pod_ip=pod_ip),
            **_security(c, pod),
        ))
    return PodPlan(namespace=meta.get("namespace") or "default", name=meta["name"], uid=meta["uid"],
                   pod_ip=pod_ip, containers=tuple(containers), volumes=vol_files,
                   unsupported=tuple(unsupported_fields(pod)),
                   grace_s=int(_first(_get(pod, "spec", "terminationGracePeriodSeconds"), 30)))


# -- status -------------------------------------------------------------------------------------

@dataclasses.dataclass
class Observed:
    """What the runner knows about one container right now."""

    state: str  # "waiting" | "running" | "terminated"
    reason: str = ""
    message: str = ""
    started_at: str | None = None
    finished_at: str | None = None
    exit_code: int | None = None
    ready: bool = False
    started: bool = False
    restart_count: int = 0
    last_terminated: dict[str, Any] | None = None
    container_id: str = ""


def container_status(plan: ContainerPlan, obs: Observed) -> dict[str, Any]:
    if obs.state == "running":
        state: dict[str, Any] = {"running": {"startedAt": obs.started_at}}
    elif obs.state == "terminated":
        state = {"terminated": {"exitCode": obs.exit_code if obs.exit_code is not None else -1,
                                "reason": obs.reason or ("Completed" if obs.exit_code == 0 else "Error"),
                                "startedAt": obs.started_at, "finishedAt": obs.finished_at}}
    else:
        state = {"waiting": {"reason": obs.reason or "ContainerCreating",
                             **({"message": obs.message} if obs.message else {})}}
    status: dict[str, Any] = {
        "name": plan.name, "image": plan.image, "imageID": "", "ready": obs.ready, "started": obs.started,
        "restartCount": obs.restart_count, "state": state,
        **({"containerID": f"podman://{obs.container_id}"} if obs.container_id else {}),
    }
    if obs.last_terminated:
        status["lastState"] = {"terminated": obs.last_terminated}
    return status


def pod_status(plan: PodPlan, observed: Mapping[str, Observed], *, previous: Mapping[str, Any] | None,
               now: str) -> dict[str, Any]:
    """The status fields the runner owns: containerStatuses and the Ready/ContainersReady conditions.

    ``lastTransitionTime`` moves only when a condition's status flips (as the kubelet does).
    """
    statuses = [container_status(c, observed.get(c.name, Observed("waiting"))) for c in plan.containers]
    not_ready = [s["name"] for s in statuses if not s["ready"]]
    ready = "False" if not_ready else "True"
    message = f"containers with unready status: [{' '.join(not_ready)}]" if not_ready else None
    old = {c.get("type"): c for c in (previous or {}).get("conditions") or []}

    def cond(kind: str) -> dict[str, Any]:
        prev = old.get(kind) or {}
        moved = prev.get("status") != ready
        c = {"type": kind, "status": ready,
             "lastTransitionTime": now if moved or not prev.get("lastTransitionTime") else prev["lastTransitionTime"]}
        if message:
            c.update(reason="ContainersNotReady", message=message)
        return c

    kept = [c for t, c in old.items() if t not in ("Ready", "ContainersReady")]
    return {"containerStatuses": statuses, "conditions": [*kept, cond("ContainersReady"), cond("Ready")]}


def decode_secret(data: Mapping[str, str] | None) -> dict[str, str]:
    """A Secret's ``data`` (base64) as text, the shape :data:`Lookup` returns."""
    # Binary values survive (as a kubelet writes them) instead of failing the whole pass.
    return {k: base64.b64decode(v).decode(errors="surrogateescape") for k, v in (data or {}).items()}
