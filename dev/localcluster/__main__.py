"""``python -m localcluster up|down|status|nodes|podrunner`` (PYTHONPATH=dev, after dev/env.sh)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from localcluster.binaries import MissingBinaryError
from localcluster.cluster import ClusterError, LocalCluster, default_state_dir
from localcluster.health import StartupError
from localcluster.nodes import NodeShape


def _cluster(args: argparse.Namespace, **kwargs: object) -> LocalCluster:
    return LocalCluster(state_dir=args.state_dir, **kwargs)  # type: ignore[arg-type]


def cmd_up(args: argparse.Namespace) -> int:
    shape = NodeShape(count=args.nodes, gpu_count=min(args.gpu_nodes, args.nodes))
    # Detached: the components must outlive this command.
    cluster = _cluster(args, node_shape=shape, die_with_parent=False, containers=args.containers)
    cluster.start()
    print(f"cluster up in {cluster.timings['total']:.1f}s ({json.dumps(cluster.timings)})")
    print(f"server:     {cluster.server}")
    print(f"kubeconfig: {cluster.kubeconfig}")
    print(f"logs:       {cluster.layout.logs}")
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    stopped = _cluster(args).stop()
    print("stopped: " + (", ".join(stopped) if stopped else "nothing was running"))
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    cluster = _cluster(args)
    pids = cluster.pids()
    core = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok")
    for name in (*core, "podrunner"):
        if name in core or name in pids:
            print(f"{name:24} {'running pid ' + str(pids[name]) if name in pids else 'stopped'}")
    return 0 if all(name in pids for name in core) else 1


def cmd_nodes(args: argparse.Namespace) -> int:
    cluster = _cluster(args)
    if args.count is not None:
        cluster.register_nodes(NodeShape(count=args.count, gpu_count=min(args.gpu_nodes, args.count)))
    print(cluster.kubectl("get", "nodes", "-o", "wide").stdout, end="")
    return 0


def cmd_podrunner(args: argparse.Namespace) -> int:
    from localcluster import podrunner

    return podrunner.main(args.rest, state_dir=args.state_dir)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m localcluster", description=__doc__)
    parser.add_argument("--state-dir", type=Path, default=default_state_dir(), help="default: $SPARSEGATE_STATE")
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="start the control plane and register fake nodes")
    up.add_argument("--nodes", type=int, default=4)
    up.add_argument("--gpu-nodes", type=int, default=2)
    up.add_argument("--containers", action="store_true",
                    help="run every pod's containers from their images with podman (the pod runner)")
    up.set_defaults(func=cmd_up)
    sub.add_parser("down", help="stop every component (via pid files)").set_defaults(func=cmd_down)
    sub.add_parser("status", help="which components run").set_defaults(func=cmd_status)
    nodes_cmd = sub.add_parser("nodes", help="list nodes; --count N (re)registers N fake nodes")
    nodes_cmd.add_argument("--count", type=int)
    nodes_cmd.add_argument("--gpu-nodes", type=int, default=2)
    nodes_cmd.set_defaults(func=cmd_nodes)
    runner = sub.add_parser("podrunner", help="run every pod's containers with podman (see --help)", add_help=False)
    runner.set_defaults(func=cmd_podrunner)
    # The pod runner parses its own options (REMAINDER does not take ones that start with --).
    args, rest = parser.parse_known_args(argv)
    if args.command != "podrunner" and rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.rest = rest
    try:
        return args.func(args)
    except (ClusterError, MissingBinaryError, StartupError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
