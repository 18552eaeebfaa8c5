"""The opt-in audit log of LocalCluster (off by default, Metadata-level events for writes only) and
its opt-in API server profiling."""

from __future__ import annotations

import pytest
import yaml

from localcluster import LocalCluster
from localcluster.cluster import AUDIT_POLICY, ClusterError


def test_audit_log_is_off_by_default(tmp_path):
    assert LocalCluster(state_dir=tmp_path)._audit_args() == []
    assert not (tmp_path / "work" / "kube-apiserver" / "audit-policy.yaml").exists()


def test_audit_log_flags_and_policy(tmp_path):
    cluster = LocalCluster(state_dir=tmp_path, audit_log=True)
    args = dict(a.split("=", 1) for a in cluster._audit_args())
    assert args["--audit-log-path"] == str(cluster.audit_log_path) == str(tmp_path / "logs" / "audit.log")
    assert args["--audit-log-format"] == "json" and args["--audit-log-mode"] == "blocking"
    policy = yaml.safe_load(open(args["--audit-policy-file"]).read())
    assert policy == AUDIT_POLICY
    # Writes at Metadata (who, what, when; no bodies), everything else (reads, watches) not at all.
    first, rest = policy["rules"]
    assert first["level"] == "Metadata" and {"create", "update", "patch", "delete"} <= set(first["verbs"])
    assert rest == {"level": "None"} and policy["omitStages"] == ["RequestReceived"]


def test_apiserver_profile_refuses_without_profiling(tmp_path):
    with pytest.raises(ClusterError, match="profiling=True"):
        LocalCluster(state_dir=tmp_path).apiserver_profile(1)
