"""A real local Kubernetes control plane (etcd, kube-apiserver, controller-manager, scheduler,
kwok fake nodes) on loopback, for tests and the demo. See ``python -m localcluster --help``.
"""

from localcluster.binaries import MissingBinaryError
from localcluster.cluster import ClusterError, LocalCluster, default_state_dir
from localcluster.health import StartupError
from localcluster.nodes import NodeShape

__all__ = ["ClusterError", "LocalCluster", "MissingBinaryError", "NodeShape", "StartupError", "default_state_dir"]
