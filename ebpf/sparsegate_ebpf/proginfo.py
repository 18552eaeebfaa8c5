"""What the kernel made of a loaded BPF program: the functions its translated instructions call.

After verification the kernel rewrites each map helper call whose map it can pin down to a direct call
of that map type's own function (``htab_lru_percpu_map_lookup_elem``) or inlines it; a call it cannot
pin to one map (the compiler fed it two) stays the generic helper ``bpf_map_lookup_elem``, an indirect
call through the map's ops. Read through the raw bpf() syscall (BPF_OBJ_GET_INFO_BY_FD, the
translated image) and /proc/kallsyms, as ``bpftool prog dump xlated`` does; needs root.
"""
from __future__ import annotations

import ctypes as ct
import struct

from .testrun import sys_bpf

BPF_OBJ_GET_INFO_BY_FD = 15
_BPF_JMP_CALL = 0x85
_BPF_PSEUDO_CALL = 1  # src_reg of a BPF-to-BPF call (imm: an instruction offset, not a function)


class _ProgInfoHead(ct.Structure):
    """The head of struct bpf_prog_info (include/uapi/linux/bpf.h) up to the translated image."""

    _fields_ = [
        ("type", ct.c_uint32),
        ("id", ct.c_uint32),
        ("tag", ct.c_uint8 * 8),
        ("jited_prog_len", ct.c_uint32),
        ("xlated_prog_len", ct.c_uint32),
        ("jited_prog_insns", ct.c_uint64),
        ("xlated_prog_insns", ct.c_uint64),
    ]


class _InfoAttr(ct.Structure):
    _fields_ = [("bpf_fd", ct.c_uint32), ("info_len", ct.c_uint32), ("info", ct.c_uint64)]


def _get_info(prog_fd: int, info: _ProgInfoHead) -> None:
    attr = _InfoAttr(bpf_fd=prog_fd, info_len=ct.sizeof(info), info=ct.addressof(info))
    sys_bpf(BPF_OBJ_GET_INFO_BY_FD, attr, what="BPF_OBJ_GET_INFO_BY_FD")


def xlated_instructions(prog_fd: int) -> bytes:
    """The program as the kernel runs it (after the verifier's rewrites), 8 bytes an instruction."""
    head = _ProgInfoHead()
    _get_info(prog_fd, head)
    size = head.xlated_prog_len
    buf = ct.create_string_buffer(size)
    head = _ProgInfoHead(xlated_prog_len=size, xlated_prog_insns=ct.addressof(buf))
    _get_info(prog_fd, head)
    return buf.raw[:head.xlated_prog_len]


def _kernel_symbols() -> dict[int, str]:
    symbols = {}
    with open("/proc/kallsyms") as f:
        for line in f:
            addr, _, name = line.split()[:3]
            symbols[int(addr, 16)] = name
    if not any(symbols):  # kptr_restrict hides the addresses (all zero) from this reader
        raise PermissionError("/proc/kallsyms shows no addresses to this process")
    return symbols


def called_functions(prog_fd: int) -> list[str]:
    """The kernel functions the translated program calls, in order (BPF-to-BPF calls left out)."""
    symbols = _kernel_symbols()
    base = next(a for a, n in symbols.items() if n == "__bpf_call_base")
    insns = xlated_instructions(prog_fd)
    calls = []
    for i in range(0, len(insns), 8):
        op, regs, _off, imm = struct.unpack_from("<BBhi", insns, i)
        if op == _BPF_JMP_CALL and regs >> 4 != _BPF_PSEUDO_CALL:
            addr = base + imm
            calls.append(symbols.get(addr, hex(addr)))
    return calls
