"""Bounded loopback load generator for model-server pods (tests, demos, benchmarks).

Sends ``POST /v1/infer`` round-robin over a set of ``ip:port`` targets at a fixed total
rate, with a cap on requests in flight so a slow (e.g. fault-injected) pod cannot make the
generator pile up sockets. Only loopback targets are accepted (127.0.0.0/8): this project's
pods bind loopback IPs, and nothing here may send traffic anywhere else.

Library use (the e2e tests)::

    gen = LoadGen(targets=lambda: ["127.20.0.5:8080"], qps=40)
    task = asyncio.create_task(gen.run(duration_s=30))
    ...; gen.stop(); await task; print(gen.stats)

CLI::

    python dev/loadgen.py --target 127.20.0.5:8080 --target 127.20.0.6:8080 --qps 40 --duration 10
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import ipaddress
import itertools
import json
import random
import sys
import threading
import time
from collections.abc import Callable, Sequence

import aiohttp

LOOPBACK = ipaddress.ip_network("127.0.0.0/8")


def check_loopback(target: str) -> str:
    host, _, port = target.rpartition(":")
    if not host or not port.isdigit() or ipaddress.ip_address(host) not in LOOPBACK:
        raise ValueError(f"target {target!r} must be a loopback ip:port (127.0.0.0/8)")
    return target


class LoadGen:
    def __init__(self, *, targets: Callable[[], Sequence[str]], qps: float, concurrency: int = 32,
                 seq_len: int = 8, timeout_s: float = 10.0, vocab: int = 256, seed: int = 0) -> None:
        self._targets = targets
        self.qps = qps
        self._sem = asyncio.Semaphore(concurrency)
        self._seq_len, self._vocab = seq_len, vocab
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._rng = random.Random(seed)
        self._stop = asyncio.Event()
        self.stats: collections.Counter[str] = collections.Counter()  # "200", "503", "error", "skipped"
        self.per_target: collections.Counter[str] = collections.Counter()

    def stop(self) -> None:
        self._stop.set()

    async def _one(self, session: aiohttp.ClientSession, target: str) -> None:
        body = {"tokens": [[self._rng.randrange(self._vocab) for _ in range(self._seq_len)]]}
        try:
            async with session.post(f"http://{target}/v1/infer", data=json.dumps(body),
                                    headers={"Content-Type": "application/json"}) as resp:
                await resp.read()
                self.stats[str(resp.status)] += 1
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            self.stats["error"] += 1
        finally:
            self.per_target[target] += 1
            self._sem.release()

    async def run(self, *, duration_s: float | None = None) -> collections.Counter[str]:
        """Send until ``duration_s`` elapses or :meth:`stop` is called; returns status counts."""
        interval = 1.0 / self.qps
        deadline = None if duration_s is None else time.monotonic() + duration_s
        tasks: set[asyncio.Task[None]] = set()
        rr = itertools.count()
        targets: list[str] = []
        refreshed = 0.0
        async with aiohttp.ClientSession(timeout=self._timeout) as session:
            next_at = time.monotonic()
            while not self._stop.is_set() and (deadline is None or time.monotonic() < deadline):
                now = time.monotonic()
                if now - refreshed > 1.0:  # pods come and go: re-read the target list each second
                    targets = [check_loopback(t) for t in self._targets()]
                    refreshed = now
                if targets:
                    if self._sem.locked():
                        self.stats["skipped"] += 1  # at the in-flight cap: drop, keep the rate honest
                    else:
                        await self._sem.acquire()
                        task = asyncio.create_task(self._one(session, targets[next(rr) % len(targets)]))
                        tasks.add(task)
                        task.add_done_callback(tasks.discard)
                next_at += interval
                delay = next_at - time.monotonic()
                if delay > 0:
                    try:
                        await asyncio.wait_for(self._stop.wait(), timeout=delay)
                    except asyncio.TimeoutError:
                        pass
                else:
                    next_at = time.monotonic()  # fell behind: do not burst to catch up
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)
        return self.stats


class BackgroundLoad:
    """A :class:`LoadGen` on a thread of its own, for tests and the demo stack; ``targets`` (which
    may call the API) is re-read every 2 s on another thread so a slow call never stalls the load."""

    def __init__(self, targets: Callable[[], list[str]], *, qps: float, concurrency: int = 64) -> None:
        self._targets_fn = targets
        self._targets: list[str] = []
        self.qps, self.concurrency = qps, concurrency
        self._stop = threading.Event()
        self.gen: LoadGen | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._refresher = threading.Thread(target=self._refresh, name="load-targets", daemon=True)
        self._runner = threading.Thread(target=self._run, name="loadgen", daemon=True)

    def _refresh(self) -> None:
        while not self._stop.is_set():
            try:
                self._targets = self._targets_fn()
            except Exception as e:  # a slow API call must not kill the load
                sys.stderr.write(f"[loadgen] targets: {e}\n")
            self._stop.wait(2.0)

    def _run(self) -> None:
        async def go() -> None:
            self._loop = asyncio.get_running_loop()
            self.gen = LoadGen(targets=lambda: list(self._targets), qps=self.qps, concurrency=self.concurrency)
            await self.gen.run()

        asyncio.run(go())

    @property
    def stats(self) -> dict[str, int]:
        return dict(self.gen.stats) if self.gen else {}

    def start(self) -> BackgroundLoad:
        self._targets = self._targets_fn()
        self._refresher.start()
        self._runner.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._loop is not None and self.gen is not None:
            self._loop.call_soon_threadsafe(self.gen.stop)
        self._runner.join(timeout=30)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", action="append", required=True, help="loopback ip:port (repeatable)")
    p.add_argument("--qps", type=float, default=20.0)
    p.add_argument("--duration", type=float, default=10.0, help="seconds")
    p.add_argument("--concurrency", type=int, default=32)
    args = p.parse_args(argv)
    targets = [check_loopback(t) for t in args.target]
    gen = LoadGen(targets=lambda: targets, qps=args.qps, concurrency=args.concurrency)
    stats = asyncio.run(gen.run(duration_s=args.duration))
    print(json.dumps({"stats": dict(stats), "perTarget": dict(gen.per_target)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
