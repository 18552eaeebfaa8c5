"""The container's CPU limit from its cgroup files (v2 cpu.max, v1 CFS quota/period), and the thread
count the server takes from it: the limit rounded up, within the CPUs it may use, at least 1."""

from pathlib import Path

import pytest

from sparsegate_workload.cgroup_limits import cpu_limit, memory_limit, threads_for_limit


def write(root: Path, name: str, text: str) -> None:
    (root / name).parent.mkdir(parents=True, exist_ok=True)
    (root / name).write_text(text)


@pytest.mark.parametrize("content, expected", [
    ("max 100000\n", None),
    ("max\n", None),
    ("200000 100000\n", 2.0),
    ("150000 100000\n", 1.5),
    ("50000 100000\n", 0.5),
    ("400000 50000\n", 8.0),
    ("", None),
    ("garbage 100000\n", None),
])
def test_cgroup_v2_cpu_max(tmp_path: Path, content: str, expected) -> None:
    write(tmp_path, "cpu.max", content)
    assert cpu_limit(tmp_path) == expected


@pytest.mark.parametrize("subdir", ["cpu", "cpu,cpuacct"])
@pytest.mark.parametrize("quota, period, expected", [
    ("-1", "100000", None),
    ("300000", "100000", 3.0),
    ("25000", "100000", 0.25),
])
def test_cgroup_v1_cfs_quota(tmp_path: Path, subdir: str, quota: str, period: str, expected) -> None:
    write(tmp_path, f"{subdir}/cpu.cfs_quota_us", quota + "\n")
    write(tmp_path, f"{subdir}/cpu.cfs_period_us", period + "\n")
    assert cpu_limit(tmp_path) == expected


def test_no_cgroup_files_means_no_limit(tmp_path: Path) -> None:
    assert cpu_limit(tmp_path) is None
    assert cpu_limit(tmp_path / "absent") is None


def test_v1_quota_without_its_period_is_no_limit(tmp_path: Path) -> None:
    write(tmp_path, "cpu/cpu.cfs_quota_us", "200000\n")
    assert cpu_limit(tmp_path) is None


@pytest.mark.parametrize("limit, available, expected", [
    (None, 64, None),
    (0.25, 64, 1),
    (1.0, 64, 1),
    (1.5, 64, 2),
    (4.0, 64, 4),
    (16.0, 4, 4),      # a quota larger than the cpuset: the cpuset bounds it
])
def test_threads_for_limit(limit, available, expected) -> None:
    assert threads_for_limit(limit, available=available) == expected


def test_the_process_own_cgroup_and_its_ancestors_are_read(tmp_path: Path) -> None:
    """Without a cgroup namespace /sys/fs/cgroup is the host's: the limit is in the process's own
    cgroup (/proc/self/cgroup), and the tightest of it and its ancestors applies."""
    proc = tmp_path / "proc_cgroup"
    root = tmp_path / "cg"
    write(root, "cpu.max", "max 100000\n")
    write(root, "kubepods/pod1/cpu.max", "300000 100000\n")
    write(root, "kubepods/pod1/ctr/cpu.max", "max 100000\n")
    proc.write_text("0::/kubepods/pod1/ctr\n")
    assert cpu_limit(root, proc_cgroup=proc) == 3.0
    # v1, a host path the container's mount does not hold (Docker): the mount root is the cgroup.
    v1 = tmp_path / "v1"
    write(v1, "cpu,cpuacct/cpu.cfs_quota_us", "200000\n")
    write(v1, "cpu,cpuacct/cpu.cfs_period_us", "100000\n")
    proc.write_text("4:cpu,cpuacct:/docker/abc\n0::/\n")
    assert cpu_limit(v1, proc_cgroup=proc) == 2.0


def test_a_real_child_cgroup_limit_is_seen(tmp_path: Path) -> None:
    """On this machine, a process moved into a cgroup with a CFS quota sees it (root only)."""
    import os
    import subprocess
    import sys
    for base in (Path("/sys/fs/cgroup/cpu"), Path("/sys/fs/cgroup/cpu,cpuacct")):
        if (base / "cpu.cfs_quota_us").exists():
            break
    else:
        pytest.skip("no cgroup v1 cpu controller here")
    child = base / f"sparsegate-test-{os.getpid()}"
    try:
        child.mkdir()
        (child / "cpu.cfs_quota_us").write_text("150000")
    except OSError as e:
        pytest.skip(f"cannot make a cgroup: {e}")
    try:
        code = ("import os,sys; open(sys.argv[1] + '/cgroup.procs', 'w').write(str(os.getpid()));"
                "from sparsegate_workload.cgroup_limits import cpu_limit; print(cpu_limit())")
        out = subprocess.run([sys.executable, "-c", code, str(child)], capture_output=True,
                             text=True, check=True).stdout
        assert out.strip() == "1.5"
    finally:
        child.rmdir()


@pytest.mark.parametrize("files, expected", [
    ({"memory.max": "max\n"}, None),
    ({"memory.max": "2147483648\n"}, 2 << 30),
    ({"memory/memory.limit_in_bytes": "9223372036854771712\n"}, None),   # v1: no limit
    ({"memory/memory.limit_in_bytes": "1073741824\n"}, 1 << 30),
    ({}, None),
])
def test_memory_limit(tmp_path: Path, files: dict, expected) -> None:
    for name, text in files.items():
        write(tmp_path, name, text)
    assert memory_limit(tmp_path, proc_cgroup=tmp_path / "none") == expected


def test_a_checkpoint_larger_than_the_memory_limit_is_warned_about(tmp_path: Path, caplog,
                                                                   monkeypatch) -> None:
    """transformers holds every weight in host memory while it loads: a checkpoint whose weights
    exceed the container's memory.max is OOMKilled, and the pod restarts into the same load. The
    server logs why before it starts (the load itself still runs)."""
    import logging

    import torch
    from sparsegate_contracts.gate import DEFAULT_DOCUMENT

    from sparsegate_workload import cgroup_limits, hf_serving
    from sparsegate_workload.hf import build_tiny_checkpoint

    path = build_tiny_checkpoint(tmp_path / "ck", family="mixtral", seed=1, tokenizer=False)
    fp32 = hf_serving.weight_memory_warning(path, torch.float32, limit=4096)
    assert fp32 is not None and "memory limit" in fp32 and "float32" in fp32
    assert hf_serving.weight_memory_warning(path, torch.float32, limit=1 << 40) is None
    assert hf_serving.weight_memory_warning(path, torch.float32, limit=None) is None
    assert hf_serving.weight_memory_warning(tmp_path / "absent", torch.float32, limit=4096) is None
    write(tmp_path, "cg/memory.max", "4096\n")
    real = cgroup_limits.memory_limit
    monkeypatch.setattr(cgroup_limits, "memory_limit",
                        lambda: real(tmp_path / "cg", proc_cgroup=tmp_path / "none"))
    with caplog.at_level(logging.WARNING, logger="sparsegate.workload"):
        hf_serving.load(path, gate=DEFAULT_DOCUMENT)
    assert any("OOMKilled" in r.getMessage() for r in caplog.records)
