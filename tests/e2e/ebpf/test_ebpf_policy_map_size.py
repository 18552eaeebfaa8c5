"""A policy map larger than the default (`--policy-map-records`, chart `agent.policyMapRecords`):
an allow-list of more records than 65,536 is refused by the default program and enforced, packet by
packet on a veth pair, by one loaded with room for it; the maps are not preallocated, so their
kernel memory follows the records written."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from sparsegate_contracts import flowpolicy
from sparsegate_ebpf import xdp
from sparsegate_ebpf.maps import Counter
from sparsegate_ebpf.policy import PolicyError, parse_policy
from sparsegate_ebpf.policyswap import PolicySwapper
from sparsegate_ebpf.programs import LoadedProgram
from sparsegate_ebpf.testing import counters, require_program, reset_maps
from sparsegate_ebpf.vethlab import VethLab

pytestmark = [pytest.mark.bpf, pytest.mark.slow]
APP = [sys.executable, "-m", "sparsegate_ebpf.netapps"]
RECORDS = 131072
CALLERS = 70_000  # source addresses of one identity: more records than the default map holds


def _memlock(prog: LoadedProgram, name: str) -> int:
    fd = prog.table(name).get_fd()
    with open(f"/proc/self/fdinfo/{fd}") as f:
        return int(dict(line.split(":\t", 1) for line in f.read().splitlines())["memlock"])


def _big_policy(lab: VethLab) -> dict:
    """70,000 callers allowed to the server on UDP 9000, the lab's client address the last of them;
    nothing else allowed (the client's other port is judged and dropped)."""
    callers = [f"10.{64 + i // 65536}.{i // 256 % 256}.{i % 256}" for i in range(CALLERS - 1)] + [lab.client_ip]
    return flowpolicy.build_document(
        rules=[flowpolicy.identity_rule_json(256, 257, 9000, "udp", "allow", "models/many-callers#0")],
        identities=[{"identity": 256, "ips": callers}, {"identity": 257, "ips": [lab.server_ip]}],
        policed_destinations=[lab.server_ip])


def test_a_larger_map_enforces_what_the_default_one_refuses(lab: VethLab, enforce_prog: LoadedProgram) -> None:
    document = _big_policy(lab)
    assert flowpolicy.map_records(document) > flowpolicy.MAP_MAX_ENTRIES
    # The default program (the session's): refused before anything is written, nothing swapped.
    with pytest.raises(PolicyError, match=f"exceed the map capacity {flowpolicy.MAP_MAX_ENTRIES - 1}"):
        parse_policy(document)  # one record is the meta record
    default = PolicySwapper(bpf=enforce_prog.bpf)
    with pytest.raises(PolicyError, match=f"exceed the map capacity {flowpolicy.MAP_MAX_ENTRIES}"):
        default.apply(parse_policy(document, max_records=RECORDS))
    assert default.generation == 0 and default.live_records == 0

    big = require_program(enforce=True, policy_records=RECORDS)
    try:
        swapper = PolicySwapper(bpf=big.bpf)
        assert swapper.max_records == RECORDS  # read back from the loaded maps
        empty = _memlock(big, "policy_a")
        result = swapper.apply(parse_policy(document, max_records=RECORDS))
        assert result.entries == swapper.live_records > flowpolicy.MAP_MAX_ENTRIES
        filled = _memlock(big, result.slot)
        # Not preallocated: an empty map costs its buckets only, a filled one grows with its records.
        assert empty < RECORDS * 32 and filled - empty > result.entries * 64, (empty, filled)
        with lab.inside(lab.server_ns):
            mode = xdp.attach(bpf=big.bpf, fn=big.fn, ifname=lab.server_if, mode=xdp.XdpMode.NATIVE)
        try:
            reset_maps(big)
            rx = lab.popen(lab.server_ns, [*APP, "udp-count", "--ports", "9000", "9001", "--idle", "2"],
                           stdout=subprocess.PIPE)
            assert rx.stdout.readline().strip() == "ready"
            sent = tuple(int(lab.run(lab.client_ns, [*APP, "udp-send", "--dst", lab.server_ip, "--port", str(port),
                                                      "--count", str(count)]).stdout)
                         for port, count in ((9000, 200), (9001, 100)))
            got = {int(k): v for k, v in json.loads(rx.communicate(timeout=60)[0]).items()}
        finally:
            with lab.inside(lab.server_ns):
                xdp.detach(bpf=big.bpf, ifname=lab.server_if, mode=mode)
        assert sent == (200, 100) and got == {9000: 200, 9001: 0}
        c = counters(big)
        assert (c[Counter.POLICY_ALLOW], c[Counter.POLICY_DENY]) == (200, 100)
    finally:
        big.close()
