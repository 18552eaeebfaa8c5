"""Every map call of the loaded XDP program is bound to its map (proginfo.called_functions).

The kernel turns a map helper call it can pin to one map into that map type's own function (or
inlines it); a call the compiler fed two maps stays the generic helper, an indirect call (a retpoline
here). That happened to the IPv4 and IPv6 flow-table lookups, merged into one call: ~12 ns more per
packet in the telemetry program, found by bench_xdp. Needs root and a kernel that loads the program.
"""
from __future__ import annotations

import pytest

from sparsegate_ebpf import programs, proginfo

GENERIC = {"bpf_map_lookup_elem", "bpf_map_update_elem", "bpf_map_delete_elem"}


@pytest.mark.parametrize("variant", [dict(enforce=False), dict(enforce=True), dict(enforce=True, audit=True)],
                         ids=["telemetry", "enforce", "audit"])
def test_no_map_call_is_left_to_the_generic_helper(variant):
    prog = programs.load(**variant)
    try:
        calls = proginfo.called_functions(prog.prog_fd)
    finally:
        prog.close()
    assert all(not c.startswith("0x") for c in calls), calls  # every call resolved to a kernel symbol
    # The flow tables (LRU per-CPU hashes) are called through their own functions, IPv4 and IPv6 each.
    assert calls.count("htab_lru_percpu_map_lookup_elem") == 2, calls
    assert calls.count("htab_lru_percpu_map_update_elem") == 2, calls
    assert not GENERIC & set(calls), calls
