"""Tiny traffic programs run inside test namespaces (`python -m sparsegate_ebpf.netapps ...`).

udp-send: send exactly N datagrams (paced, so the veth ring never overflows) and print N.
udp-count: count datagrams per port until idle, print JSON {port: count}.
http-get: K sequential HTTP GETs on fresh connections; print the number that succeeded.
tcp-try: try one TCP connect (optionally from --src); print "ok" or "timeout".
udp-echo: answer every datagram on --port (bound to --bind) until idle; print how many.
udp-ask: send N datagrams (optionally from --src) and count the answers; print the count.
"""
from __future__ import annotations

import argparse
import json
import select
import socket
import sys
import time
import urllib.request

SO_RCVBUFFORCE = getattr(socket, "SO_RCVBUFFORCE", 33)


def udp_send(a: argparse.Namespace) -> None:
    family = socket.AF_INET6 if ":" in a.dst else socket.AF_INET
    s = socket.socket(family, socket.SOCK_DGRAM)
    if a.src:
        s.bind((a.src, 0))
    payload = b"s" * a.size
    sent = 0
    deadline = time.monotonic() + a.duration if a.duration else None
    while (sent < a.count) if not deadline else (time.monotonic() < deadline):
        s.sendto(payload, (a.dst, a.port))
        sent += 1
        if sent % a.burst == 0:
            time.sleep(a.pause)
    print(sent)


def udp_count(a: argparse.Namespace) -> None:
    socks = {}
    for port in a.ports:
        s = socket.socket(socket.AF_INET6 if a.ipv6 else socket.AF_INET, socket.SOCK_DGRAM)
        try:  # root in a test namespace: beyond net.core.rmem_max, so a busy CI box drops nothing
            s.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 64 << 20)
        except PermissionError:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
        s.bind(("::" if a.ipv6 else "0.0.0.0", port))
        s.setblocking(False)
        socks[s] = port
    counts = {p: 0 for p in a.ports}
    print("ready", flush=True)
    last = time.monotonic()
    start = last
    while time.monotonic() - last < a.idle and time.monotonic() - start < a.max_time:
        ready, _, _ = select.select(list(socks), [], [], 0.1)
        for s in ready:
            while True:
                try:
                    s.recv(65536)
                except BlockingIOError:
                    break
                counts[socks[s]] += 1
                last = time.monotonic()
    print(json.dumps(counts), flush=True)


def http_get(a: argparse.Namespace) -> None:
    ok = 0
    for _ in range(a.count):
        with urllib.request.urlopen(a.url, timeout=5) as r:
            r.read()
            ok += r.status == 200
    print(ok)


def tcp_try(a: argparse.Namespace) -> None:
    try:
        socket.create_connection((a.dst, a.port), timeout=a.timeout,
                                 source_address=(a.src, 0) if a.src else None).close()
        print("ok")
    except (TimeoutError, socket.timeout):
        print("timeout")
    except OSError as exc:
        print(f"error {exc}")


def udp_echo(a: argparse.Namespace) -> None:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind((a.bind, a.port))
    s.settimeout(a.idle)
    print("ready", flush=True)
    answered = 0
    try:
        while True:
            data, peer = s.recvfrom(65536)
            s.sendto(data, peer)
            answered += 1
    except (TimeoutError, socket.timeout):
        pass
    print(answered, flush=True)


def udp_ask(a: argparse.Namespace) -> None:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind((a.src or "0.0.0.0", 0))
    s.settimeout(a.timeout)
    answers = 0
    for i in range(a.count):
        s.sendto(b"q%d" % i, (a.dst, a.port))
        try:
            s.recvfrom(65536)
            answers += 1
        except (TimeoutError, socket.timeout):
            pass
    print(answers)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("udp-send")
    p.add_argument("--dst", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--count", type=int, default=0)
    p.add_argument("--duration", type=float, default=0.0)
    p.add_argument("--size", type=int, default=64)
    p.add_argument("--burst", type=int, default=32)
    p.add_argument("--pause", type=float, default=0.001)
    p.add_argument("--src", default="")
    p.set_defaults(fn=udp_send)
    p = sub.add_parser("udp-count")
    p.add_argument("--ports", type=int, nargs="+", required=True)
    p.add_argument("--idle", type=float, default=1.0)
    p.add_argument("--max-time", type=float, default=60.0)
    p.add_argument("--ipv6", action="store_true")
    p.set_defaults(fn=udp_count)
    p = sub.add_parser("http-get")
    p.add_argument("--url", required=True)
    p.add_argument("--count", type=int, default=1)
    p.set_defaults(fn=http_get)
    p = sub.add_parser("tcp-try")
    p.add_argument("--dst", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--timeout", type=float, default=2.0)
    p.add_argument("--src", default="")
    p.set_defaults(fn=tcp_try)
    p = sub.add_parser("udp-echo")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--bind", default="0.0.0.0")
    p.add_argument("--idle", type=float, default=3.0)
    p.set_defaults(fn=udp_echo)
    p = sub.add_parser("udp-ask")
    p.add_argument("--dst", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--count", type=int, default=1)
    p.add_argument("--src", default="")
    p.add_argument("--timeout", type=float, default=0.5)
    p.set_defaults(fn=udp_ask)
    a = ap.parse_args(argv)
    a.fn(a)


if __name__ == "__main__":
    main(sys.argv[1:])
