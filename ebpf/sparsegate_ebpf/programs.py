"""Compile and load the XDP program with BCC.

`python -m sparsegate_ebpf.programs --print-c [--telemetry-only]` prints the C that BCC
generates after its rewriting (BCC's DEBUG_PREPROCESSOR), which is what the verifier sees.
"""
from __future__ import annotations

import argparse
import ctypes as ct
import os
import sys
from dataclasses import dataclass
from typing import Any

from sparsegate_contracts import flowpolicy

from . import flowclock
from .maps import POLICY_MAX_RECORDS, PROGRAM_PATH, STRUCTS

FUNCTION = "xdp_flow"
DEBUG_PREPROCESSOR = 0x4  # bcc: print the rewritten C


class BpfUnavailable(RuntimeError):
    """BCC cannot be imported, we lack privileges, or the kernel refuses the program."""


@dataclass
class LoadedProgram:
    bpf: Any          # bcc.BPF
    fn: Any           # bcc function handle (fd, name)
    enforce: bool
    clock: flowclock.FlowClock  # the flow table's jiffies, read by the exporter
    audit: bool = False  # enforce=True, audit=True: judges and counts, never drops

    @property
    def prog_fd(self) -> int:
        return self.fn.fd

    def table(self, name: str) -> Any:
        return self.bpf[name.encode()]

    def close(self) -> None:
        self.bpf.cleanup()


def cflags(*, enforce: bool, audit: bool = False, flow_entries: int = 65536,
           policy_records: int = POLICY_MAX_RECORDS) -> list[str]:
    return [
        f"-I{PROGRAM_PATH.parent}",
        f"-DSG_ENFORCE={1 if enforce else 0}",
        f"-DSG_AUDIT={1 if audit else 0}",
        f"-DSG_FLOW_ENTRIES={flow_entries}",
        f"-DSG_POLICY_MAX_RECORDS={policy_records}",
    ]


def check_policy_records(value: int) -> int:
    """`value` if it is a valid policy map size, else ValueError saying the range."""
    low, high = flowpolicy.MAP_MIN_ENTRIES, flowpolicy.MAP_MAX_ENTRIES_LIMIT
    if not low <= value <= high:
        raise ValueError(f"policy map records must be in {low}..{high}, got {value}")
    return value


def import_bcc() -> Any:
    try:
        import bcc  # Debian's python3-bpfcc, linked into the venv by dev/setup/bpf.sh
    except ImportError as exc:
        raise BpfUnavailable(
            f"cannot import bcc ({exc}); run dev/setup/bpf.sh (python3-bpfcc), never PyPI's 'bcc'"
        ) from exc
    return bcc


def load(*, enforce: bool = True, audit: bool = False, flow_entries: int = 65536,
         policy_records: int = POLICY_MAX_RECORDS, debug: int = 0) -> LoadedProgram:
    """Compile, verify and load the program (not attached anywhere yet). `audit` (with `enforce`):
    the policy is judged and would-be drops are counted (`audit_deny`), but nothing is dropped.
    `policy_records`: max_entries of each inner policy map (`--policy-map-records`)."""
    check_policy_records(policy_records)
    bcc = import_bcc()
    if os.geteuid() != 0:
        raise BpfUnavailable("loading XDP programs needs root (CAP_BPF + CAP_NET_ADMIN)")
    try:
        bpf = bcc.BPF(src_file=str(PROGRAM_PATH).encode(),
                      cflags=cflags(enforce=enforce, audit=audit, flow_entries=flow_entries,
                                    policy_records=policy_records), debug=debug)
        fn = bpf.load_func(FUNCTION.encode(), bcc.BPF.XDP)
        clock_fn = bpf.load_func(flowclock.FUNCTION.encode(), bcc.BPF.XDP)
    except Exception as exc:  # bcc raises bare Exception on compile/verify failure
        raise BpfUnavailable(f"BCC could not compile/load {PROGRAM_PATH.name}: {exc}") from exc
    _check_layouts(bpf)
    clock = flowclock.FlowClock(prog_fd=clock_fn.fd, table=bpf[flowclock.TABLE.encode()])
    return LoadedProgram(bpf=bpf, fn=fn, enforce=enforce, audit=audit and enforce, clock=clock)


def _check_layouts(bpf: Any) -> None:
    """BCC builds its own ctypes from the C; make sure ours (maps.py) have the same sizes."""
    expected = {
        "flows": ("sg_flow4_key", None),
        "flows6": ("sg_flow_key", None),
        "handshakes": ("sg_flow_key", "sg_handshake"),
        "conntrack": ("sg_flow_key", "sg_ct_val"),
        "policy_a": ("sg_policy_key", "sg_policy_val"),
        "verdicts": ("sg_verdict_key", "sg_counter"),
    }
    for table, (key_struct, leaf_struct) in expected.items():
        t = bpf[table.encode()]
        if ct.sizeof(t.Key) != ct.sizeof(STRUCTS[key_struct]):
            raise BpfUnavailable(f"{table}: key size {ct.sizeof(t.Key)} != maps.{key_struct}")
        if leaf_struct and ct.sizeof(t.Leaf) != ct.sizeof(STRUCTS[leaf_struct]):
            raise BpfUnavailable(f"{table}: value size {ct.sizeof(t.Leaf)} != maps.{leaf_struct}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sparsegate_ebpf.programs", description=__doc__)
    ap.add_argument("--print-c", action="store_true", help="print BCC's generated C and exit")
    ap.add_argument("--telemetry-only", action="store_true", help="compile without policy enforcement")
    args = ap.parse_args(argv)
    prog = load(enforce=not args.telemetry_only, debug=DEBUG_PREPROCESSOR if args.print_c else 0)
    print(f"loaded {FUNCTION} fd={prog.prog_fd} enforce={prog.enforce}", file=sys.stderr)
    prog.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
