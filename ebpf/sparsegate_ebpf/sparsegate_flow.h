/* Structs and constants read by both the XDP program (xdp_flow.bpf.c) and the Python
 * loader (maps.py mirrors them with ctypes; tests/unit/ebpf checks the two agree).
 * Plain fixed-width fields, explicit padding: no compiler-chosen holes. */
#ifndef SPARSEGATE_FLOW_H
#define SPARSEGATE_FLOW_H

/* Addresses of either family fit one 16-byte field (four __u32, network order): IPv6 as is, IPv4
 * as the IPv4-mapped IPv6 address ::ffff:a.b.c.d (words 0-1 zero, word 2 htonl(0xffff), word 3 the
 * IPv4 address), so one key and one map serve both families. */
#define SG_V4_MAPPED_WORD 0xffff

/* One direction of a TCP/UDP conversation, IPv4 or IPv6. Addresses/ports in network order. */
struct sg_flow_key {
    __u32 saddr[4];
    __u32 daddr[4];
    __u16 sport;
    __u16 dport;
    __u8 proto;
    __u8 pad[3];
};

/* The key of the IPv4 per-flow table (`flows`): the 16-byte key would cost every IPv4 packet a
 * longer hash on the one lookup its fast path makes; IPv6 flows go to `flows6` (sg_flow_key). */
struct sg_flow4_key {
    __u32 saddr;
    __u32 daddr;
    __u16 sport;
    __u16 dport;
    __u8 proto;
    __u8 pad[3];
};

/* Per-CPU per-flow counters. first/last_seen_jiffies: bpf_jiffies64, the kernel tick count (one tick
 * of resolution, as CLOCK_MONOTONIC_COARSE has; the verifier inlines it into a load, where
 * bpf_ktime_get_coarse_ns is a helper call, ~6 ns a packet here). Userspace converts with the tick
 * rate and the current count that sg_clock samples (flowclock.py). The ct_* fields cache the
 * policy outcome for this flow on this CPU, valid while ct_generation is the live generation. */
struct sg_flow_stats {
    __u64 packets;
    __u64 bytes;
    __u64 dropped;
    __u64 first_seen_jiffies;
    __u64 last_seen_jiffies;
    __u32 ct_generation;  /* 0: nothing cached */
    __u16 ct_rule;        /* rule id of a rule verdict (SG_CLASS_RULE_*) */
    __u8 ct_class;        /* SG_CLASS_* */
    __u8 ct_slot;         /* pool map of that generation: its verdict counters */
};

/* Connection tracking shared by all CPUs, keyed by the flow in its initiator's direction. */
struct sg_ct_val {
    __u32 generation;   /* policy generation that allowed it (SG_CT_ALLOWED) */
    __u16 rule_id;
    __u8 kind;          /* SG_CT_* */
    __u8 pad;
};

#define SG_CT_ALLOWED 1   /* a packet to a policed destination allowed by a rule */
#define SG_CT_OUTBOUND 2  /* a packet from a policed destination (it opened the flow) */

/* What decided a packet to a policed destination (cached per flow and CPU). */
#define SG_CLASS_RULE_ALLOW 1
#define SG_CLASS_RULE_DENY 2
#define SG_CLASS_ALLOWED_SOURCE 3
#define SG_CLASS_DNS 4
#define SG_CLASS_CT_REPLY 5
#define SG_CLASS_TCP_UNTRACKED 6
#define SG_CLASS_UNPOLICED 7
#define SG_CLASS_OVERLAY 8         /* overlay UDP to a destination that is not policed */

/* TCP SYN -> SYN-ACK handshake time, keyed by the client->server flow. Only measurable
 * when both directions cross an attached interface (XDP sees ingress only). */
struct sg_handshake {
    __u64 syn_ns;       /* last SYN seen, 0 once matched */
    __u64 last_rtt_ns;
    __u64 rtt_sum_ns;
    __u64 samples;
};

/* One reading of both kernel clocks, written by the sg_clock program when userspace runs it. */
struct sg_clock_sample {
    __u64 jiffies;   /* bpf_jiffies64 */
    __u64 mono_ns;   /* bpf_ktime_get_ns: CLOCK_MONOTONIC */
};

struct sg_counter {
    __u64 packets;
    __u64 bytes;
};

/* Policy records, network order, one inner map per generation (identity-based, as Cilium's ipcache
 * + policy map, but in one map so that both swap together). Addresses of both families, as in
 * sg_flow_key (IPv4 mapped):
 * kind SG_KEY_POLICED_DST (only daddr set): a destination the policy judges; its value carries the
 *   default action, the generation and the destination's identity (0: none).
 * kind SG_KEY_SOURCE (only saddr set): a source address's identity; SG_IDENTITY_ALLOWED: always
 *   allowed to policed destinations (node addresses, the operator).
 * kind SG_KEY_RULE: exact match on (source identity in saddr[0], destination identity in daddr[0],
 *   both host order, dst port, protocol).
 * The all-zero key (kind 0, proto 0) holds the generation's meta record. Kinds SG_KEY_ENTRY (an
 * IP-level rule) and SG_KEY_ALLOWED_SRC are what programs before identities used: the program no
 * longer reads them; records inherited from such a program are converted (policy.py), and so are
 * those of IPv4-only programs, whose keys had one __u32 per address (inherit.py). */
struct sg_policy_key {
    __u32 saddr[4];
    __u32 daddr[4];
    __u16 dport;
    __u8 proto;
    __u8 kind;
};

#define SG_KEY_ENTRY 0
#define SG_KEY_POLICED_DST 1
#define SG_KEY_ALLOWED_SRC 2
#define SG_KEY_SOURCE 3
#define SG_KEY_RULE 4

#define SG_IDENTITY_ALLOWED 1

struct sg_policy_val {
    __u32 action;       /* SG_ACTION_* ; in the meta record: the default action */
    __u32 rule_id;      /* 1-based index of the document's rule; meta record: 0 */
    __u32 generation;   /* same in every record of one inner map */
    __u16 slot;         /* pool map holding it (0: policy_a, 1: policy_b); its verdict counters
                           are verdict_counts[slot * SG_POLICY_MAX_ENTRIES + rule_id] */
    __u16 identity;     /* SG_KEY_POLICED_DST / SG_KEY_SOURCE: the address's identity */
};

/* Verdict counters keyed by who judged: lets tests prove each packet saw one policy wholly. The
 * program counts into the per-CPU array verdict_counts; before a pool map is reused, userspace
 * folds its counters into the `verdicts` hash under this key and zeroes them (policyswap.py). */
struct sg_verdict_key {
    __u32 generation;
    __u32 rule_id;      /* 0 = default action */
    __u32 action;
    __u32 pad;
};

#define SG_ACTION_ALLOW 1
#define SG_ACTION_DENY 2

/* Rule ids per pool map (the verdict counter range; ids 1..16383, 0 = the default action), and
 * records per inner policy map (rules, policed destinations, source addresses, meta). */
#define SG_POLICY_MAX_ENTRIES 16384
#ifndef SG_POLICY_MAX_RECORDS /* -DSG_POLICY_MAX_RECORDS=N (programs.cflags): the agent's --policy-map-records */
#define SG_POLICY_MAX_RECORDS 65536
#endif

/* Index into the per-CPU packet-type counters. Keep in sync with maps.Counter. */
enum sg_counter_index {
    SG_CNT_ETH_TRUNCATED = 0,   /* shorter than an Ethernet header (or its VLAN tags) */
    SG_CNT_IPV4 = 1,            /* well-formed IPv4 header */
    SG_CNT_IPV6 = 2,            /* well-formed IPv6 fixed header (version 6) */
    SG_CNT_ARP = 3,             /* passed untouched */
    SG_CNT_VLAN = 4,            /* 802.1Q/802.1ad tagged: up to 2 tags skipped, the inner frame
                                   counted and judged as an untagged one; deeper: denied */
    SG_CNT_OTHER_L2 = 5,        /* any other ethertype: passed untouched */
    SG_CNT_IPV4_TRUNCATED = 6,  /* frame ends inside the IPv4 header */
    SG_CNT_IPV4_BAD_HEADER = 7, /* IHL < 5 or version != 4: passed, the stack drops it */
    SG_CNT_IPV4_FRAGMENT = 8,   /* any fragment; non-first ones have no ports; a first one with
                                   a partial TCP header is judged as a SYN */
    SG_CNT_L4_TRUNCATED = 9,    /* TCP/UDP header cut short */
    SG_CNT_IPV4_OTHER_PROTO = 10, /* ICMP etc.: counted, not policed */
    SG_CNT_TCP = 11,
    SG_CNT_UDP = 12,
    SG_CNT_POLICY_ALLOW = 13,
    SG_CNT_POLICY_DENY = 14,
    SG_CNT_NO_POLICY = 15,      /* enforcement on but no policy installed yet: passed */
    SG_CNT_FLOW_TABLE_FULL = 16, /* a new flow the LRU table could not insert (no entry free even by
                                   eviction): a full table evicts its least recently used flows
                                   instead, uncounted */
    SG_CNT_UNPOLICED = 17,      /* TCP/UDP to a destination no policy covers: passed */
    SG_CNT_ALLOWED_SOURCE = 18, /* to a policed destination from a node address / the operator */
    SG_CNT_DNS = 19,            /* to a policed destination, port 53 (either side) */
    SG_CNT_OVERLAY = 20,        /* VXLAN (4789, 8472) / Geneve (6081) UDP to a destination not
                                   policed: passed, inner not policed */
    SG_CNT_CT_REPLY = 21,       /* reply of a tracked flow (the reverse flow was seen allowed/opened) */
    SG_CNT_TCP_UNTRACKED = 22,  /* TCP without SYN to a policed destination, no tracked state: passed */
    SG_CNT_AUDIT_DENY = 23,     /* denied by policy but passed: audit mode (would-be drops) */
    SG_CNT_IPV6_TRUNCATED = 24, /* frame ends inside the IPv6 fixed header */
    SG_CNT_IPV6_BAD_HEADER = 25, /* version != 6 under an IPv6 ethertype: passed, the stack drops it */
    SG_CNT_IPV6_EXT_HEADER = 26, /* an extension header follows the fixed header: no ports read;
                                    to a policed destination judged by its default action */
    SG_CNT_IPV6_OTHER_PROTO = 27, /* ICMPv6 (neighbour discovery) etc.: counted, not policed */
    SG_CNT_MAX = 28,
};

#endif
