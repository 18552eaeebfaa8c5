"""XDP data-plane cost: packets/s through a veth pair, test_run ns/packet, policy swap latency.

    sudo python tests/bench/bench_xdp.py [--packets 1000000] [--trials 5] [--policy-entries 10000]

Side by side, trials interleaved round-robin so machine noise hits every configuration alike:
1. veth pps. Two fresh namespaces joined by a veth pair; the kernel itself generates the traffic
   (BPF_PROG_TEST_RUN with BPF_F_TEST_XDP_LIVE_FRAMES running a one-line program that redirects
   each frame into the client end), so no userspace sender caps the rate. The server end runs
   - none: no XDP program (GRO on, so veth takes the same NAPI path it takes with XDP),
   - bare XDP_PASS: a one-line program, the floor of any XDP program on veth (what attaching costs
     the receive path before the program does anything),
   - telemetry: the program built with SG_ENFORCE=0,
   - telemetry+policy: SG_ENFORCE=1 with a policy of --policy-entries identity rules, one of which
     allows the flow (its destination is policed: the rules name it), so every frame is judged;
     after the first, from the outcome cached in the flow's entry.
   Then again with the frames cycling through --veth-flows UDP flows (the generator rewrites each
   frame's source port): the flow table's lookups spread over many entries instead of one.
   Frames carry a foreign destination MAC, so after XDP the stack drops them at ip_rcv: what is
   measured is the receive path up to and including XDP. pps = frames received at the server end
   (its rx counter) / wall time of the generator; ratio = median pps / median pps of `none`
   (and "vs bare": of the bare program).
2. test_run ns/packet (kernel-measured mean over --repeat runs), with a bare XDP_PASS program as
   the floor of this machine; telemetry+policy also for a destination the policy does not police,
   in audit mode (SG_AUDIT=1), and with no cached outcome (every packet judged afresh, as a flow's
   first packet is). The same UDP flow over IPv6 (the policy's identities hold both families).
   --baseline-rev REV: the program of that git revision, built from `git show`, runs the IPv4
   frames interleaved with the others, here and in the veth sections (its maps filled with the
   same policy in its own key layout, for a revision from before IPv6: 12-byte policy keys), so the
   two are compared side by side.
3. Policy swap latency: PolicySwapper.apply at 100 and --policy-entries entries: fill time of the
   inactive inner map, and the single outer-slot update (which includes the kernel's RCU wait).
Writes tests/bench/results/bench_xdp.json. --skip-veth / --skip-swap: only the other sections
(short comparisons).
"""
from __future__ import annotations

import argparse
import ctypes as ct
import fcntl
import json
import os
import platform
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

from sparsegate_contracts import flowpolicy
from sparsegate_ebpf import packets, programs, testrun, xdp
from sparsegate_ebpf.maps import KEY_RULE, Counter, PolicyKey, PolicyKeyV4
from sparsegate_ebpf.policy import parse_policy
from sparsegate_ebpf.policyswap import PolicySwapper
from sparsegate_ebpf.testing import counters
from sparsegate_ebpf.vethlab import VethLab

RESULTS = Path(__file__).resolve().parent / "results" / "bench_xdp.json"
ROOT = Path(__file__).resolve().parents[2]
SRC6, DST6 = "fd00:9::1", "fd00:9::2"
V4_MAPPED = bytes(10) + b"\xff\xff"
SIOCETHTOOL = 0x8946
ETHTOOL_SGRO = 0x2C
FOREIGN_MAC = bytes.fromhex("02aabbccddee")


def set_gro(ifname: str, *, on: bool) -> None:
    """ethtool -K <if> gro on|off, via the legacy ioctl (no ethtool binary needed)."""
    val = (ct.c_uint32 * 2)(ETHTOOL_SGRO, 1 if on else 0)
    ifr = bytearray(struct.pack("16sP16x", ifname.encode(), ct.addressof(val)))
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        fcntl.ioctl(s.fileno(), SIOCETHTOOL, ifr)


def policy_doc(*, lab: VethLab | None, entries: int) -> dict:
    """`entries` identity rules; the first one matches the bench flow (when a lab is given). The
    others come from 100 source identities of 10 addresses each, over as many ports as needed: the
    map holds rules + 1,000 source addresses + the flow's two (16,384 records in all at most)."""
    src, dst = (lab.client_ip, lab.server_ip) if lab else ("10.9.0.1", "10.9.0.2")
    first = flowpolicy.FIRST_IDENTITY
    identities = [{"identity": first, "ips": [src, SRC6]}, {"identity": first + 1, "ips": [dst, DST6]}]
    identities += [{"identity": first + 2 + c, "ips": [f"10.{100 + c // 25}.{c % 25 * 10 + k}.1" for k in range(10)]}
                   for c in range(100)]
    rows = [{"srcIdentity": first, "dstIdentity": first + 1, "dstPort": 9000, "protocol": "udp", "action": "allow",
             "rule": "bench#flow"}]
    for i in range(entries - 1):
        rows.append({"srcIdentity": first + 2 + i % 100, "dstIdentity": first + 1, "dstPort": 1024 + i // 100,
                     "protocol": "tcp", "action": "allow", "rule": f"bench#{i}"})
    return {"version": f"bench-{entries}", "defaultAction": "deny", "identities": identities, "rules": rows}


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def generator(ifindex: int, flows: int) -> bytes:
    """The traffic generator's program: each frame into the client end; with flows > 1, each frame's
    UDP source port set from a per-CPU count first, so the frames cycle through `flows` flows."""
    if flows == 1:
        return f"int gen(struct xdp_md *ctx) {{ return bpf_redirect({ifindex}, 0); }}".encode()
    return f"""
BPF_PERCPU_ARRAY(seq, u32, 1);
int gen(struct xdp_md *ctx) {{
    void *data = (void *)(long)ctx->data, *end = (void *)(long)ctx->data_end;
    if (data + 14 + 20 + 8 > end)  /* Ethernet, a 20-byte IPv4 header (packets.udp_frame), UDP */
        return XDP_ABORTED;
    int zero = 0;
    u32 *n = seq.lookup(&zero);
    if (n) {{
        *n += 1;
        *(u16 *)(data + 34) = bpf_htons(20000 + *n % {flows});
    }}
    return bpf_redirect({ifindex}, 0);
}}""".encode()


def bench_veth(*, n_packets: int, trials: int, policy_entries: int, flows: int = 1,
               baseline_rev: str | None = None) -> dict:
    from bcc import BPF

    out: dict[str, list[float]] = {"none": [], "bare XDP_PASS": [], "telemetry": [], "telemetry+policy": []}
    with VethLab.create() as lab:
        link = lab.link_stats(lab.client_ns, lab.client_if)
        gen = BPF(text=generator(link["ifindex"], flows))
        gen_fn = gen.load_func(b"gen", BPF.XDP)
        with lab.inside(lab.server_ns):
            set_gro(lab.server_if, on=True)
        bare = BPF(text=b"int bare(struct xdp_md *ctx) { return XDP_PASS; }")
        tele = programs.load(enforce=False)
        enf = programs.load(enforce=True)
        PolicySwapper(bpf=enf.bpf).apply(parse_policy(policy_doc(lab=lab, entries=policy_entries)))
        frame = packets.udp_frame(src=lab.client_ip, dst=lab.server_ip, sport=40000, dport=9000, payload=b"b" * 18)
        frame = FOREIGN_MAC + frame[6:]
        progs = {"none": None, "bare XDP_PASS": SimpleNamespace(bpf=bare, fn=bare.load_func(b"bare", BPF.XDP)),
                 "telemetry": tele, "telemetry+policy": enf}
        baseline = []
        if baseline_rev:
            from sparsegate_ebpf.policy import compile_policy

            records = compile_policy(parse_policy(policy_doc(lab=lab, entries=policy_entries)), generation=1)
            for enforce, name in ((False, "telemetry"), (True, "telemetry+policy")):
                b, b_fn = load_revision(baseline_rev, enforce=enforce)
                if enforce:
                    fill_baseline_policy(b, records, generation=1)
                baseline.append(b)
                progs[f"{baseline_rev} {name}"] = SimpleNamespace(bpf=b, fn=b_fn)
                out[f"{baseline_rev} {name}"] = []

        def rx() -> int:
            return lab.link_stats(lab.server_ns, lab.server_if)["stats64"]["rx"]["packets"]

        for _ in range(trials):
            for name, prog in progs.items():
                if prog:
                    with lab.inside(lab.server_ns):
                        xdp.attach(bpf=prog.bpf, fn=prog.fn, ifname=lab.server_if, mode=xdp.XdpMode.NATIVE)
                try:
                    before = rx()
                    t0 = time.perf_counter()
                    with lab.inside(lab.client_ns):
                        testrun.run_xdp(prog_fd=gen_fn.fd, data=frame, repeat=n_packets,
                                        flags=testrun.BPF_F_TEST_XDP_LIVE_FRAMES, batch_size=64)
                    wall = time.perf_counter() - t0
                    got = rx() - before
                finally:
                    if prog:
                        with lab.inside(lab.server_ns):
                            xdp.detach(bpf=prog.bpf, ifname=lab.server_if, mode=xdp.XdpMode.NATIVE)
                # A few may be lost where the generator outruns the receiving end's ring (seen with
                # many flows, with no program attached too); pps counts what arrived.
                if got < n_packets * 0.95:
                    raise RuntimeError(f"{name}: only {got} of {n_packets} frames reached the server end")
                out[name].append(got / wall)
        if counters(enf)[Counter.POLICY_ALLOW] < n_packets * trials:
            raise RuntimeError("policy program did not judge the bench frames")
        for p in (tele, enf):
            p.close()
        for b in baseline:
            b.cleanup()
        bare.cleanup()
        gen.cleanup()
    base = statistics.median(out["none"])
    floor = statistics.median(out["bare XDP_PASS"])
    return {name: {"pps_median": statistics.median(v), "pps_trials": v,
                   "ratio_to_none": statistics.median(v) / base,
                   "ratio_to_bare": statistics.median(v) / floor} for name, v in out.items()}


def load_revision(rev: str, *, enforce: bool) -> tuple[object, object]:
    """(bcc.BPF, function) of the XDP program as it was at git revision `rev`."""
    from bcc import BPF

    tmp = Path(tempfile.mkdtemp(prefix="sg-xdp-baseline-"))
    for name in (programs.PROGRAM_PATH.name, "sparsegate_flow.h"):
        text = subprocess.run(["git", "show", f"{rev}:ebpf/sparsegate_ebpf/{name}"], cwd=ROOT, check=True,
                              capture_output=True).stdout
        (tmp / name).write_bytes(text)
    bpf = BPF(src_file=str(tmp / programs.PROGRAM_PATH.name).encode(),
              cflags=[f"-I{tmp}", *programs.cflags(enforce=enforce)[1:]])
    return bpf, bpf.load_func(programs.FUNCTION.encode(), BPF.XDP)


def fill_baseline_policy(bpf: object, records: list, *, generation: int) -> None:
    """The compiled records, in the baseline program's own key layout (same size: as they are; a
    12-byte layout: IPv4 addresses from the mapped word, identities from the first), made live."""
    inner = bpf[b"policy_a"]  # type: ignore[index]
    narrow = ct.sizeof(inner.Key) == ct.sizeof(PolicyKeyV4)
    if not narrow and ct.sizeof(inner.Key) != ct.sizeof(PolicyKey):
        raise RuntimeError(f"baseline policy key of {ct.sizeof(inner.Key)} bytes: unknown layout")
    for k, v in records:
        if narrow:
            if k.kind != KEY_RULE and any(bytes(a)[:12] not in (bytes(12), V4_MAPPED) for a in (k.saddr, k.daddr)):
                continue  # an IPv6 address: the IPv4-only baseline cannot hold it
            word = 0 if k.kind == KEY_RULE else 3
            k = PolicyKeyV4(saddr=k.saddr[word], daddr=k.daddr[word], dport=k.dport, proto=k.proto, kind=k.kind)
        inner[inner.Key.from_buffer_copy(bytes(k))] = inner.Leaf.from_buffer_copy(bytes(v))
    bpf[b"policy_outer"][ct.c_int(0)] = ct.c_int(inner.get_fd())  # type: ignore[index]
    bpf[b"policy_live"][ct.c_int(0)] = ct.c_uint32(generation)  # type: ignore[index]


def bench_test_run(*, repeat: int, trials: int, policy_entries: int, baseline_rev: str | None = None) -> dict:
    from bcc import BPF

    bare = BPF(text=b"int bare(struct xdp_md *ctx) { return XDP_PASS; }")
    bare_fn = bare.load_func(b"bare", BPF.XDP)
    tele = programs.load(enforce=False)
    enf = programs.load(enforce=True)
    aud = programs.load(enforce=True, audit=True)
    judged = programs.load(enforce=True)
    for p in (enf, aud, judged):
        PolicySwapper(bpf=p.bpf).apply(parse_policy(policy_doc(lab=None, entries=policy_entries)))
    # No live generation: no outcome is ever reused, every packet takes the whole judgement
    # (destination, source identity, conntrack, rule lookups): what a flow's first packet costs.
    judged.bpf[b"policy_live"][ct.c_int(0)] = ct.c_uint32(0)
    frame = packets.udp_frame(src="10.9.0.1", dst="10.9.0.2", sport=40000, dport=9000, payload=b"b" * 18)
    unpoliced = packets.udp_frame(src="10.9.0.1", dst="10.9.0.3", sport=40000, dport=9000, payload=b"b" * 18)
    frame6 = packets.udp_frame(src=SRC6, dst=DST6, sport=40000, dport=9000, payload=b"b" * 18)
    runs = {"bare XDP_PASS": (bare_fn.fd, frame), "telemetry": (tele.prog_fd, frame),
            "telemetry+policy": (enf.prog_fd, frame), "+policy, unpoliced dst": (enf.prog_fd, unpoliced),
            "+policy, judged every packet": (judged.prog_fd, frame),
            "audit (policy, no drop)": (aud.prog_fd, frame),
            "IPv6 telemetry": (tele.prog_fd, frame6), "IPv6 telemetry+policy": (enf.prog_fd, frame6),
            "IPv6 judged every packet": (judged.prog_fd, frame6)}
    baseline: list = []
    if baseline_rev:
        from sparsegate_ebpf.policy import compile_policy

        records = compile_policy(parse_policy(policy_doc(lab=None, entries=policy_entries)), generation=1)
        b_tele, b_tele_fn = load_revision(baseline_rev, enforce=False)
        b_enf, b_enf_fn = load_revision(baseline_rev, enforce=True)
        b_judged, b_judged_fn = load_revision(baseline_rev, enforce=True)
        fill_baseline_policy(b_enf, records, generation=1)
        fill_baseline_policy(b_judged, records, generation=1)
        b_judged[b"policy_live"][ct.c_int(0)] = ct.c_uint32(0)
        baseline = [b_tele, b_enf, b_judged]
        runs.update({f"{baseline_rev} telemetry": (b_tele_fn.fd, frame),
                     f"{baseline_rev} telemetry+policy": (b_enf_fn.fd, frame),
                     f"{baseline_rev} judged every packet": (b_judged_fn.fd, frame)})
    ns: dict[str, list[int]] = {k: [] for k in runs}
    for _ in range(trials):
        for name, (fd, data) in runs.items():
            r = testrun.run_xdp(prog_fd=fd, data=data, repeat=repeat)
            assert r.verdict == "pass", (name, r.verdict)
            ns[name].append(r.duration_ns)
    for p in (tele, enf, aud, judged):
        p.close()
    for bpf in baseline:
        bpf.cleanup()
    bare.cleanup()
    return {k: {"ns_median": statistics.median(v), "ns_trials": v} for k, v in ns.items()}


def bench_swap(*, sizes: list[int], swaps: dict[int, int]) -> dict:
    enf = programs.load(enforce=True)
    sw = PolicySwapper(bpf=enf.bpf)
    out = {}
    for size in sizes:
        pa = parse_policy(policy_doc(lab=None, entries=size))
        doc_b = policy_doc(lab=None, entries=size)
        doc_b["rules"][0]["rule"] = "bench#flow-b"
        pb = parse_policy(doc_b)
        swap_s, fill_s = [], []
        for i in range(swaps[size]):
            r = sw.apply(pa if i % 2 else pb)
            swap_s.append(r.swap_seconds)
            fill_s.append(r.fill_seconds)
        out[str(size)] = {
            "swaps": len(swap_s),
            "swap_ms_median": statistics.median(swap_s) * 1e3, "swap_ms_p99": pct(swap_s, 0.99) * 1e3,
            "fill_ms_median": statistics.median(fill_s) * 1e3, "fill_ms_p99": pct(fill_s, 0.99) * 1e3,
        }
    enf.close()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--packets", type=int, default=1_000_000)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--repeat", type=int, default=1_000_000, help="test_run repetitions per trial")
    ap.add_argument("--policy-entries", type=int, default=10_000)
    ap.add_argument("--swaps", type=int, default=200, help="swaps at 100 entries (a tenth at the large size)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--baseline-rev", default=None, help="also time the program of this git revision (veth and test_run)")
    ap.add_argument("--veth-flows", type=int, default=4096,
                    help="also time the veth pair with frames cycling through this many flows (1: not)")
    ap.add_argument("--skip-veth", action="store_true", help="no veth pps section")
    ap.add_argument("--skip-swap", action="store_true", help="no policy swap section")
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("bench_xdp needs root (BPF, network namespaces)", file=sys.stderr)
        return 2

    t0 = time.time()
    veth = {} if args.skip_veth else bench_veth(n_packets=args.packets, trials=args.trials,
                                                 policy_entries=args.policy_entries, baseline_rev=args.baseline_rev)
    veth_many = {} if args.skip_veth or args.veth_flows <= 1 else bench_veth(
        n_packets=args.packets, trials=args.trials, policy_entries=args.policy_entries, flows=args.veth_flows,
        baseline_rev=args.baseline_rev)
    tr = bench_test_run(repeat=args.repeat, trials=args.trials, policy_entries=args.policy_entries,
                        baseline_rev=args.baseline_rev)
    sizes = [100, args.policy_entries]
    swap = {} if args.skip_swap else bench_swap(sizes=sizes, swaps={100: args.swaps,
                                                                     args.policy_entries: max(10, args.swaps // 10)})

    for label, table in (("1 flow", veth), (f"{args.veth_flows:,} flows in turn", veth_many)):
        if not table:
            continue
        print(f"\nveth pair, kernel-generated {args.packets:,} frames x {args.trials} trials (medians), {label}")
        print(f"{'config':<28}{'Mpps':>8}{'ratio':>8}{'vs bare':>9}")
        for name, r in table.items():
            print(f"{name:<28}{r['pps_median'] / 1e6:>8.3f}{r['ratio_to_none']:>8.3f}{r['ratio_to_bare']:>9.3f}")
    print(f"\nBPF_PROG_TEST_RUN, {args.repeat:,} repeats, policy of {args.policy_entries:,} identity rules")
    print(f"{'program':<40}{'ns/pkt':>8}")
    for name, r in tr.items():
        print(f"{name:<40}{r['ns_median']:>8.0f}")
    print("\npolicy swap (A/B inner maps, one outer-slot update)")
    print(f"{'entries':>8}{'swaps':>7}{'swap med ms':>13}{'swap p99 ms':>13}{'fill med ms':>13}")
    for size, r in swap.items():
        print(f"{size:>8}{r['swaps']:>7}{r['swap_ms_median']:>13.3f}{r['swap_ms_p99']:>13.3f}{r['fill_ms_median']:>13.1f}")

    result = {
        "bench": "bench_xdp", "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t0)),
        "machine": {"kernel": platform.release(), "cpus": os.cpu_count(), "loadavg": os.getloadavg()},
        "params": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "veth_pps": veth, "veth_pps_many_flows": veth_many, "test_run_ns_per_packet": tr, "policy_swap": swap,
        "seconds": time.time() - t0,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
