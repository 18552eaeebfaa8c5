"""The Pod Security Standards' ``restricted`` profile as a check on a pod spec (tests use it).

The rules the kube-apiserver's PodSecurity admission applies at ``restricted`` (which includes
``baseline``), for a pod spec as written: no host namespaces, hostPath, hostPort, privileged or
added capabilities but NET_BIND_SERVICE; only the restricted volume types; every container
with ``allowPrivilegeEscalation: false``, ``capabilities.drop`` holding ALL, ``runAsNonRoot: true``
and a RuntimeDefault or Localhost seccomp profile (its own or the pod's), no uid 0, and only
``baseline``'s safe sysctls. procMount, AppArmor and SELinux options are not checked: nothing here
renders them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

RESTRICTED_VOLUME_KINDS = frozenset({"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
                                     "persistentVolumeClaim", "projected", "secret"})
ALLOWED_ADDED_CAPABILITIES = frozenset({"NET_BIND_SERVICE"})
# baseline's allowed sysctls (Pod Security Standards, policy version 1.22).
ALLOWED_SYSCTLS = frozenset({"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range",
                             "net.ipv4.ip_unprivileged_port_start", "net.ipv4.tcp_syncookies",
                             "net.ipv4.ping_group_range"})


def restricted_violations(pod_spec: Mapping[str, Any]) -> list[str]:
    """What in ``pod_spec`` the ``restricted`` profile refuses, one line each (empty: it passes)."""
    found = [f"spec.{k}" for k in ("hostNetwork", "hostPID", "hostIPC") if pod_spec.get(k)]
    for v in pod_spec.get("volumes") or []:
        kinds = set(v) - {"name"}
        if not kinds <= RESTRICTED_VOLUME_KINDS:
            found.append(f"volume {v['name']}: {sorted(kinds - RESTRICTED_VOLUME_KINDS)}")
    psc = pod_spec.get("securityContext") or {}
    found += [f"sysctl {s.get('name')}" for s in psc.get("sysctls") or [] if s.get("name") not in ALLOWED_SYSCTLS]
    containers = [*(pod_spec.get("initContainers") or []), *(pod_spec.get("containers") or [])]
    for c in containers:
        name, sc = c["name"], c.get("securityContext") or {}
        caps = sc.get("capabilities") or {}
        if sc.get("privileged"):
            found.append(f"{name}: privileged")
        if any(p.get("hostPort") for p in c.get("ports") or []):
            found.append(f"{name}: hostPort")
        if sc.get("allowPrivilegeEscalation") is not False:
            found.append(f"{name}: allowPrivilegeEscalation is not false")
        if "ALL" not in (caps.get("drop") or []):
            found.append(f"{name}: capabilities.drop lacks ALL")
        if set(caps.get("add") or []) - ALLOWED_ADDED_CAPABILITIES:
            found.append(f"{name}: capabilities.add {caps['add']}")
        if sc.get("runAsNonRoot", psc.get("runAsNonRoot")) is not True:
            found.append(f"{name}: runAsNonRoot is not true")
        if sc.get("runAsUser", psc.get("runAsUser")) == 0:
            found.append(f"{name}: runAsUser 0")
        seccomp = (sc.get("seccompProfile") or psc.get("seccompProfile") or {}).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            found.append(f"{name}: seccompProfile {seccomp or 'unset'}")
    return found
