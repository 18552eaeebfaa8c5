"""``python -m localcluster podrunner``: the kubelet part kwok leaves out.

kwok marks pods Running with a loopback pod IP but runs nothing. The pod runner
(:class:`localcluster.containerrunner.ContainerPodRunner`) runs every Running pod's containers from
their images with podman, probes them and writes their status; ``LocalCluster(containers=True)``
(``python -m localcluster up --containers``) starts it as a managed component.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
from pathlib import Path
from urllib.parse import urlsplit

from localcluster import processes
from localcluster.containerrunner import ContainerPodRunner

LOG = logging.getLogger("localcluster.podrunner")


def main(argv: list[str] | None = None, *, state_dir: Path | None = None) -> int:
    from kubernetes import client, config as kube_config

    from localcluster.cluster import default_state_dir

    state = state_dir or default_state_dir()
    parser = argparse.ArgumentParser(prog="python -m localcluster podrunner", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kubeconfig", type=Path, default=state / "kubeconfig")
    parser.add_argument("--work-dir", type=Path, default=state / "podrunner",
                        help="volumes of the pods (one directory each); its path names the runner's containers")
    parser.add_argument("--pid-file", type=Path, help="write this runner's pid here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s podrunner %(levelname)s %(message)s")

    api_client = kube_config.new_client_from_config(config_file=str(args.kubeconfig))
    server = urlsplit(api_client.configuration.host)
    runner = ContainerPodRunner(core_api=client.CoreV1Api(api_client), work_dir=args.work_dir,
                                api_host=server.hostname or "127.0.0.1", api_port=server.port or 443)
    if args.pid_file:
        args.pid_file.parent.mkdir(parents=True, exist_ok=True)
        args.pid_file.write_text(f"{os.getpid()} {processes.process_start_ticks(os.getpid()) or 0}\n")
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: runner.shutdown())
    LOG.info("running every pod's containers; API %s", args.kubeconfig)
    runner.run()
    return 0
