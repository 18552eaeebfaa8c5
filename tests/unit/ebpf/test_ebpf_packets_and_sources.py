"""Packet builders, policy sources and metric folding (pure, no BPF)."""
from __future__ import annotations

import os
import struct
import threading
import time
from pathlib import Path
from types import SimpleNamespace

from sparsegate_ebpf import packets
from sparsegate_ebpf.metrics import fold_counter, fold_flow
from sparsegate_ebpf.policysource import document_from_configmap, watch_file


def test_ipv4_header_checksum_verifies() -> None:
    frame = packets.udp_frame(src="10.0.0.1", dst="10.0.0.2", sport=1, dport=2, payload=b"xyz")
    ip = frame[14:34]
    assert packets.ipv4_checksum(ip) == 0
    assert struct.unpack("!H", ip[2:4])[0] == 20 + 8 + 3
    assert len(frame) == 14 + 20 + 8 + 3


def test_tcp_frame_layout() -> None:
    frame = packets.tcp_frame(src="10.0.0.1", dst="10.0.0.2", sport=1000, dport=80, flags=packets.TCP_SYN)
    assert frame[12:14] == b"\x08\x00"
    assert frame[23] == 6
    assert struct.unpack("!HH", frame[34:38]) == (1000, 80)
    assert frame[34 + 13] == packets.TCP_SYN


def test_configmap_document_from_dict_and_model() -> None:
    assert document_from_configmap({"data": {"policy.json": "{}"}}) == "{}"
    assert document_from_configmap(SimpleNamespace(data={"policy.json": "x"})) == "x"
    assert document_from_configmap({"data": {"other": "x"}}) is None
    assert document_from_configmap(SimpleNamespace(data=None)) is None


def test_a_document_whose_apply_raised_is_forwarded_again(tmp_path: Path) -> None:
    """A map write that fails (ENOMEM, a full table) is not "seen": the next poll forwards the same
    document again (it was recorded before the apply and never retried)."""
    path = tmp_path / "policy.json"
    path.write_text("one")
    calls: list[str] = []

    def on_document(text: str) -> None:
        calls.append(text)
        if len(calls) == 1:
            raise Exception("Could not update table: Cannot allocate memory")  # as bcc raises it

    stop = threading.Event()
    t = threading.Thread(target=watch_file, kwargs={"path": path, "on_document": on_document,
                                                    "stop": stop, "interval": 0.02})
    t.start()
    try:
        _wait(lambda: len(calls) >= 2)
        time.sleep(0.1)  # applied now: not forwarded again
        assert calls == ["one", "one"]
    finally:
        stop.set()
        t.join()


def test_watch_file_emits_each_content_change_once(tmp_path: Path) -> None:
    path = tmp_path / "policy.json"
    seen: list[str] = []
    stop = threading.Event()
    t = threading.Thread(target=watch_file, kwargs={"path": path, "on_document": seen.append,
                                                    "stop": stop, "interval": 0.02})

    def publish(text: str) -> None:
        # Atomic, as the agent's publishers (kubelet's ConfigMap volume, editors) replace files:
        # a plain write_text could be polled while truncated and emit "" first.
        tmp = path.with_suffix(".tmp")
        tmp.write_text(text)
        os.replace(tmp, path)

    t.start()
    try:
        time.sleep(0.1)  # missing file: nothing emitted
        publish("one")
        _wait(lambda: seen == ["one"])
        time.sleep(0.1)  # unchanged content is not re-emitted
        publish("two")
        _wait(lambda: seen == ["one", "two"])
    finally:
        stop.set()
        t.join(5)
    assert seen == ["one", "two"]


def test_fold_flow_ignores_idle_cpus() -> None:
    cpu = lambda p, b, d, f, l: SimpleNamespace(packets=p, bytes=b, dropped=d, first_seen_jiffies=f, last_seen_jiffies=l)  # noqa: E731
    t = fold_flow([cpu(0, 0, 0, 0, 0), cpu(2, 100, 1, 50, 90), cpu(1, 60, 0, 40, 70)])
    assert (t.packets, t.bytes, t.dropped, t.first_seen_jiffies, t.last_seen_jiffies) == (3, 160, 1, 40, 90)
    # A CPU that only updated the entry another CPU created has packets but no first-seen stamp.
    t = fold_flow([cpu(1, 60, 0, 40, 40), cpu(2, 100, 0, 0, 90)])
    assert (t.packets, t.first_seen_jiffies, t.last_seen_jiffies) == (3, 40, 90)
    assert fold_counter([SimpleNamespace(packets=1, bytes=2), SimpleNamespace(packets=3, bytes=4)]) == (4, 6)


def _wait(cond, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)
