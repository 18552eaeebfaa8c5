/* sparsegate XDP data plane: per-flow telemetry and (optionally) scoped, stateful policy.
 *
 * Compiled by BCC (programs.py) with:
 *   -DSG_ENFORCE=0|1    consult the policy (1) or only count (0)
 *   -DSG_AUDIT=0|1      with SG_ENFORCE=1: count would-be drops (audit_deny) but pass them
 *   -DSG_FLOW_ENTRIES=N size of the per-flow LRU table
 *
 * Parsing is bounds-checked at every step; anything we cannot parse is counted by type and
 * passed to the kernel stack, which validates (and drops) malformed packets itself. Non-IP frames
 * pass untouched. VLAN tags (up to two: 802.1ad + 802.1Q) are skipped and the frame inside parsed
 * as an untagged one: the kernel strips priority tags (VID 0), however many, and delivers the packet
 * as untagged. Non-first IPv4 fragments carry no ports: they are counted and passed; the first
 * fragment carries the ports and is judged, so a denied flow cannot be reassembled (one too short
 * for the TCP flags is judged as a SYN).
 *
 * IPv4 and IPv6 share every map: addresses are keyed as 16 bytes, IPv4 ones IPv4-mapped
 * (sparsegate_flow.h). IPv6: Ethernet, the 40-byte fixed header, then TCP or UDP directly after it
 * is counted, timed and judged exactly as IPv4. Extension headers are not walked: a packet whose
 * next header is one (hop-by-hop, routing, fragment, destination options, AH, ESP, mobility, HIP,
 * shim6, experimental) has no ports we read, so it is counted `ipv6_ext_header` and, to a policed
 * destination, passes only from an always-allowed source or when the policy's default action is
 * allow: with the default deny it is dropped (fail-closed: a hop-by-hop or fragment header must not
 * carry a TCP/UDP flow past the rules). Any other next header (ICMPv6, which neighbour discovery
 * needs, and other protocols) is counted and passed, as IPv4 passes ICMP.
 *
 * Scope: only packets whose destination is a policed destination (a model pod under a
 * RoutingPolicy: an SG_KEY_POLICED_DST record) are judged; everything else passes. Before the
 * allow-list, a packet to a policed destination passes when it comes from an allowed source (node
 * addresses, the operator), is DNS (port 53), is the reply of a tracked flow, or is TCP without SYN
 * that no tracked state covers (a TCP connection can only start with a SYN, which is judged; see
 * ebpf/README.md for what XDP sees in which direction). Overlay UDP (VXLAN, Geneve) to a destination
 * that is not policed is counted as such: its inner packets are not policed here.
 *
 * Policy is identity-based (as in Cilium): a policed destination's record and the source address's
 * record carry their identities (the ipcache), and the rule is looked up by (source identity,
 * destination identity, port, protocol), so the rules grow with identities, not with pod IPs
 * squared. Lookups per judged packet are as many as with IP-level rules: the source record that
 * gives the identity also tells an always-allowed source (SG_IDENTITY_ALLOWED).
 *
 * Policy: an A/B pool of inner hash maps (policy_a, policy_b) behind one outer array slot.
 * Userspace fills the inactive inner map completely, then flips the outer slot with a single
 * update (policyswap.py). The program fetches the inner map pointer once per packet, so every
 * packet is judged by exactly one policy generation. The outcome is cached in the flow's per-CPU
 * entry and reused while the destination record carries the same generation, so a swap re-judges
 * every flow at its next packet (a narrowed policy cuts established flows too).
 */
#include <uapi/linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/ip.h>
#include <linux/ipv6.h>
#include <linux/in.h>
#include <linux/tcp.h>
#include <linux/udp.h>
#include "sparsegate_flow.h"

#ifndef SG_ENFORCE
#define SG_ENFORCE 1
#endif
#ifndef SG_AUDIT
#define SG_AUDIT 0
#endif
#ifndef SG_FLOW_ENTRIES
#define SG_FLOW_ENTRIES 65536
#endif

#define SG_IP_MF 0x2000
#define SG_IP_OFFSET 0x1FFF
#define SG_TCP_FLAG_SYN 0x02
#define SG_TCP_FLAG_ACK 0x10
#define SG_PORT_DNS 53
#define SG_PORT_VXLAN 4789
#define SG_PORT_VXLAN_LINUX 8472
#define SG_PORT_GENEVE 6081
#define SG_VLAN_MAX 2  /* tags parsed: QinQ (802.1ad outer, 802.1Q inner) */

struct sg_vlan_hdr {
    __be16 tci;
    __be16 proto;  /* the ethertype (or TPID) that follows */
};

BPF_PERCPU_ARRAY(counters, struct sg_counter, SG_CNT_MAX);
/* Per-flow telemetry, one table per family: an IPv4 packet hashes a 16-byte key, not the 40-byte
 * one that fits both (conntrack and handshakes, touched only when judging or on SYNs, use that). */
BPF_TABLE("lru_percpu_hash", struct sg_flow4_key, struct sg_flow_stats, flows, SG_FLOW_ENTRIES);
BPF_TABLE("lru_percpu_hash", struct sg_flow_key, struct sg_flow_stats, flows6, SG_FLOW_ENTRIES);
BPF_TABLE("lru_hash", struct sg_flow_key, struct sg_handshake, handshakes, 16384);

/* Not preallocated: kernel memory follows the records written (~120 B each), not the capacity,
 * so a large --policy-map-records costs nothing until a policy needs it. */
BPF_F_TABLE("hash", struct sg_policy_key, struct sg_policy_val, policy_a, SG_POLICY_MAX_RECORDS, BPF_F_NO_PREALLOC);
BPF_F_TABLE("hash", struct sg_policy_key, struct sg_policy_val, policy_b, SG_POLICY_MAX_RECORDS, BPF_F_NO_PREALLOC);
BPF_ARRAY_OF_MAPS(policy_outer, "policy_a", 1);
/* The live generation, written by userspace right after each outer-slot flip: a flow's cached
 * outcome is reused while it matches, with no policy lookup at all. */
BPF_ARRAY(policy_live, __u32, 1);
/* Per-packet verdict counters, one range per pool map (sparsegate_flow.h, sg_policy_val.slot). */
BPF_PERCPU_ARRAY(verdict_counts, struct sg_counter, 2 * SG_POLICY_MAX_ENTRIES);
/* Folded counters of generations whose pool map was reused: written by userspace only. */
BPF_HASH(verdicts, struct sg_verdict_key, struct sg_counter, 65536);
BPF_TABLE("lru_hash", struct sg_flow_key, struct sg_ct_val, conntrack, SG_FLOW_ENTRIES);

/* Keys are written in whole 64-bit words (a 36-byte policy key's last 4 bytes as one 32-bit word),
 * never field by field: the kernel hashes a key with 32-bit loads and compares it with 64-bit ones,
 * and a load that spans several narrower stores cannot be forwarded from them, so it waits for them
 * to reach the cache (a store-forwarding stall). Measured here: one LRU hash lookup of a 16-byte key
 * built from packet fields 21 ns written field by field, 11 ns written as two words. The header's
 * structs stay the layout (maps.py mirrors them); these unions only say how the program writes it. */
union sg_flow4_words {
    struct sg_flow4_key k;
    __u64 w[2];
};
union sg_flow_words {
    struct sg_flow_key k;
    __u64 w[5];  /* saddr (2), daddr (2), ports + proto */
};
union sg_policy_words {
    struct sg_policy_key k;
    struct {
        __u64 w[4];  /* saddr (2), daddr (2) */
        __u32 tail;  /* dport, proto, kind */
    } p;
};

/* The 64-bit word whose memory holds the 32-bit values lo then hi. */
#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
#define SG_WORD(lo, hi) ((__u64)(__u32)(lo) | ((__u64)(__u32)(hi) << 32))
#define SG_BYTE0(b) ((__u32)(__u8)(b))
#define SG_POLICY_TAIL(dport, proto, kind) \
    ((__u32)(__u16)(dport) | ((__u32)(__u8)(proto) << 16) | ((__u32)(__u8)(kind) << 24))
#else
#define SG_WORD(lo, hi) (((__u64)(__u32)(lo) << 32) | (__u64)(__u32)(hi))
#define SG_BYTE0(b) ((__u32)(__u8)(b) << 24)
#define SG_POLICY_TAIL(dport, proto, kind) \
    (((__u32)(__u16)(dport) << 16) | ((__u32)(__u8)(proto) << 8) | (__u32)(__u8)(kind))
#endif
/* A flow key's last word: the ports as they sit in the TCP/UDP header (one 32-bit load), then the
 * protocol and three zero bytes of padding. */
#define SG_PORTS_PROTO(ports, proto) SG_WORD(ports, SG_BYTE0(proto))
/* The same ports seen from the other direction: the two 16-bit halves swapped (in memory too). */
#define SG_SWAP_PORTS(ports) (((__u32)(ports) >> 16) | ((__u32)(ports) << 16))
/* Word 1 of an IPv4-mapped address (::ffff:a.b.c.d), a.b.c.d in network order; word 0 is zero. */
#define SG_MAPPED_V4(addr) SG_WORD(bpf_htonl(SG_V4_MAPPED_WORD), addr)

/* The reverse direction of a flow key (replies; the server side of a handshake). */
static __always_inline void reverse_flow(const union sg_flow_words *fk, union sg_flow_words *rk, __u32 ports,
                                         __u8 proto)
{
    rk->w[0] = fk->w[2];
    rk->w[1] = fk->w[3];
    rk->w[2] = fk->w[0];
    rk->w[3] = fk->w[1];
    rk->w[4] = SG_PORTS_PROTO(SG_SWAP_PORTS(ports), proto);
}

/* A policy record's key for one address (kind SG_KEY_POLICED_DST: as daddr; SG_KEY_SOURCE: as
 * saddr), from a flow key's address words. */
static __always_inline void address_key(union sg_policy_words *key, __u64 w0, __u64 w1, __u8 kind)
{
    int as_dst = kind == SG_KEY_POLICED_DST;
    key->p.w[0] = as_dst ? 0 : w0;
    key->p.w[1] = as_dst ? 0 : w1;
    key->p.w[2] = as_dst ? w0 : 0;
    key->p.w[3] = as_dst ? w1 : 0;
    key->p.tail = SG_POLICY_TAIL(0, 0, kind);
}

/* After a call on the IPv6 flow table, and only there: an empty barrier on its result (no
 * instruction). Without it the compiler merges the IPv4 and IPv6 lookups (and inserts) into one call
 * instruction fed by either map, and the verifier, seeing two maps at one call, leaves that call the
 * generic helper: an indirect call through the map's ops (a retpoline here), measured ~12 ns more on
 * every packet, IPv4 included. Code that differs after the two calls keeps them apart. */
#define SG_KEEP_APART(var) asm volatile("" : "=r"(var) : "0"(var))

/* An IPv4 flow's key in the 16-byte (IPv4-mapped) form the shared maps key. */
static __always_inline void widen4(union sg_flow_words *fk, const union sg_flow4_words *fk4)
{
    fk->w[0] = 0;
    fk->w[1] = SG_MAPPED_V4(fk4->k.saddr);
    fk->w[2] = 0;
    fk->w[3] = SG_MAPPED_V4(fk4->k.daddr);
    fk->w[4] = fk4->w[1];
}

static __always_inline void count(int idx, __u64 len)
{
    struct sg_counter *c = counters.lookup(&idx);
    if (c) {
        c->packets += 1;
        c->bytes += len;
    }
}

/* What judge() decided and wants cached in the flow entry (class 0: nothing to cache). */
struct sg_outcome {
    __u32 generation;
    __u16 rule;
    __u8 cls;
    __u8 slot;
};

#if SG_ENFORCE
static __always_inline void count_verdict(__u8 slot, __u32 rule_id, __u64 len)
{
    int idx = (slot & 1) * SG_POLICY_MAX_ENTRIES + (rule_id & (SG_POLICY_MAX_ENTRIES - 1));
    struct sg_counter *vc = verdict_counts.lookup(&idx);
    if (vc) {
        vc->packets += 1;
        vc->bytes += len;
    }
}

/* What the policy denies: counted, then dropped (audit mode: counted as a would-be drop, passed). */
static __always_inline int deny(__u64 len)
{
    count(SG_CNT_POLICY_DENY, len);
#if SG_AUDIT
    count(SG_CNT_AUDIT_DENY, len);
    return XDP_PASS;
#else
    return XDP_DROP;
#endif
}

static __always_inline int apply_class(__u8 cls, __u8 slot, __u16 rule, __u64 len)
{
    switch (cls) {
    case SG_CLASS_RULE_ALLOW:
        count_verdict(slot, rule, len);
        count(SG_CNT_POLICY_ALLOW, len);
        return XDP_PASS;
    case SG_CLASS_RULE_DENY:
        count_verdict(slot, rule, len);
        return deny(len);
    case SG_CLASS_ALLOWED_SOURCE:
        count(SG_CNT_ALLOWED_SOURCE, len);
        return XDP_PASS;
    case SG_CLASS_DNS:
        count(SG_CNT_DNS, len);
        return XDP_PASS;
    case SG_CLASS_CT_REPLY:
        count(SG_CNT_CT_REPLY, len);
        return XDP_PASS;
    case SG_CLASS_UNPOLICED:
        count(SG_CNT_UNPOLICED, len);
        return XDP_PASS;
    case SG_CLASS_OVERLAY:
        count(SG_CNT_OVERLAY, len);
        return XDP_PASS;
    default:
        count(SG_CNT_TCP_UNTRACKED, len);
        return XDP_PASS;
    }
}

/* A packet to an unpoliced destination, first seen on this CPU: if its source is policed (a model
 * pod opening a flow, seen where its egress is our ingress), remember that for its replies. */
static __always_inline void track_outbound(void *inner, union sg_flow_words *fk)
{
    union sg_policy_words sk;
    address_key(&sk, fk->w[0], fk->w[1], SG_KEY_POLICED_DST);
    struct sg_policy_val *src = bpf_map_lookup_elem(inner, &sk.k);
    if (src) {
        struct sg_ct_val ct = {};
        ct.generation = src->generation;
        ct.kind = SG_CT_OUTBOUND;
        conntrack.update(&fk->k, &ct);
    }
}

/* XDP_PASS or XDP_DROP for one parsed TCP/UDP packet (either family). st: its flow entry on this CPU (NULL
 * for a flow's first packet here); out: the outcome to cache in it. */
static __always_inline int judge(union sg_flow_words *fw, __u32 ports, __u8 tcp_flags, __u64 len,
                                 struct sg_flow_stats *st, struct sg_outcome *out)
{
    struct sg_flow_key *fk = &fw->k;
    int zero = 0;
    void *inner = policy_outer.lookup(&zero);
    if (!inner) {
        count(SG_CNT_NO_POLICY, len);
        return XDP_PASS;
    }
    int syn_only = fk->proto == IPPROTO_TCP &&
                   (tcp_flags & (SG_TCP_FLAG_SYN | SG_TCP_FLAG_ACK)) == SG_TCP_FLAG_SYN;
    /* Cached for the live generation: no policy lookup. The flip happens before the generation is
     * written (and waits for running programs), so a program that reads the new generation also
     * sees the new map; one that still reads the old one, just after a flip, may reuse an outcome
     * of the old generation for that instant. A SYN is judged afresh: what its 5-tuple's earlier
     * packets were (tcp_untracked, dns from port 53) says nothing about a connection attempt. */
    __u32 *live = policy_live.lookup(&zero);
    __u32 live_gen = live ? *live : 0;
    if (st && live_gen && st->ct_generation == live_gen && !syn_only)
        return apply_class(st->ct_class, st->ct_slot, st->ct_rule, len);

    union sg_policy_words dk;
    address_key(&dk, fw->w[2], fw->w[3], SG_KEY_POLICED_DST);
    struct sg_policy_val *dst = bpf_map_lookup_elem(inner, &dk.k);
    if (!dst) {
        out->generation = live_gen;
        /* Overlay UDP is told apart only here: to a policed pod, its port 4789 is judged as any. */
        out->cls = fk->proto == IPPROTO_UDP && (fk->dport == bpf_htons(SG_PORT_VXLAN_LINUX) ||
                   fk->dport == bpf_htons(SG_PORT_VXLAN) || fk->dport == bpf_htons(SG_PORT_GENEVE))
                   ? SG_CLASS_OVERLAY : SG_CLASS_UNPOLICED;
        if (!st)
            track_outbound(inner, fw);
        return apply_class(out->cls, 0, 0, len);
    }
    __u32 generation = dst->generation;  /* the generation of the map that judges this packet */
    out->generation = generation;
    out->slot = dst->slot;
    if (fk->dport == bpf_htons(SG_PORT_DNS) || (fk->sport == bpf_htons(SG_PORT_DNS) && !syn_only)) {
        out->cls = SG_CLASS_DNS;
        return apply_class(out->cls, out->slot, 0, len);
    }
    /* The source's identity (ipcache): one lookup tells an always-allowed source too. */
    union sg_policy_words sk;
    address_key(&sk, fw->w[0], fw->w[1], SG_KEY_SOURCE);
    struct sg_policy_val *src = bpf_map_lookup_elem(inner, &sk.k);
    if (src && src->identity == SG_IDENTITY_ALLOWED) {
        out->cls = SG_CLASS_ALLOWED_SOURCE;
        return apply_class(out->cls, out->slot, 0, len);
    }
    union sg_flow_words rk;
    reverse_flow(fw, &rk, ports, fk->proto);
    if (conntrack.lookup(&rk.k)) {  /* the reverse flow was allowed or opened by this destination */
        out->cls = SG_CLASS_CT_REPLY;
        return apply_class(out->cls, out->slot, 0, len);
    }
    if (fk->proto == IPPROTO_TCP && !syn_only && !conntrack.lookup(fk)) {
        /* Not a connection attempt and never allowed here: a reply to a connection the destination
         * opened unseen, or one established before this program. Judged flows (a CT entry) are
         * re-judged below, so narrowing a policy cuts them. */
        out->cls = SG_CLASS_TCP_UNTRACKED;
        return apply_class(out->cls, out->slot, 0, len);
    }

    /* The rule for (source identity, destination identity, port, protocol); an address without
     * identity (0) matches no rule: the default action. */
    struct sg_policy_val *entry = NULL;
    if (src && dst->identity) {
        union sg_policy_words pk;
        pk.p.w[0] = SG_WORD(src->identity, 0);
        pk.p.w[1] = 0;
        pk.p.w[2] = SG_WORD(dst->identity, 0);
        pk.p.w[3] = 0;
        pk.p.tail = SG_POLICY_TAIL(fk->dport, fk->proto, SG_KEY_RULE);
        entry = bpf_map_lookup_elem(inner, &pk.k);
    }
    __u32 action = entry ? entry->action : dst->action;
    out->rule = entry ? entry->rule_id : 0;
    if (action == SG_ACTION_DENY) {
        out->cls = SG_CLASS_RULE_DENY;
    } else {
        out->cls = SG_CLASS_RULE_ALLOW;
        struct sg_ct_val ct = {};
        ct.generation = generation;
        ct.rule_id = out->rule;
        ct.kind = SG_CT_ALLOWED;
        conntrack.update(fk, &ct);
    }
    return apply_class(out->cls, out->slot, out->rule, len);
}

/* An IPv6 packet whose ports sit behind an extension header (not read): to a policed destination
 * it passes from an always-allowed source, else the destination's default action decides
 * (verdict counted as the default, rule 0). No flow entry, no conntrack: there are no ports. */
static __always_inline int judge_portless(union sg_flow_words *fw, __u64 len)
{
    int zero = 0;
    void *inner = policy_outer.lookup(&zero);
    if (!inner) {
        count(SG_CNT_NO_POLICY, len);
        return XDP_PASS;
    }
    union sg_policy_words dk;
    address_key(&dk, fw->w[2], fw->w[3], SG_KEY_POLICED_DST);
    struct sg_policy_val *dst = bpf_map_lookup_elem(inner, &dk.k);
    if (!dst)
        return XDP_PASS;
    union sg_policy_words sk;
    address_key(&sk, fw->w[0], fw->w[1], SG_KEY_SOURCE);
    struct sg_policy_val *src = bpf_map_lookup_elem(inner, &sk.k);
    if (src && src->identity == SG_IDENTITY_ALLOWED)
        return apply_class(SG_CLASS_ALLOWED_SOURCE, dst->slot, 0, len);
    return apply_class(dst->action == SG_ACTION_DENY ? SG_CLASS_RULE_DENY : SG_CLASS_RULE_ALLOW, dst->slot, 0, len);
}

/* A frame whose IP header lies past the VLAN tags we parse: the kernel would still deliver it (it
 * strips any number of VID-0 tags) and we cannot tell its destination, so with a policy it is
 * denied (no legitimate sender stacks three tags). */
static __always_inline int judge_unparsed(__u64 len)
{
    int zero = 0;
    if (!policy_outer.lookup(&zero)) {
        count(SG_CNT_NO_POLICY, len);
        return XDP_PASS;
    }
    return deny(len);
}
#endif

static __always_inline int vlan_tpid(__u16 h_proto)
{
    return h_proto == bpf_htons(ETH_P_8021Q) || h_proto == bpf_htons(ETH_P_8021AD);
}

/* IPv6 next-header values that are extension headers (RFC 8200 and the IANA list), not an
 * upper-layer protocol. */
static __always_inline int ipv6_ext_header(__u8 nexthdr)
{
    switch (nexthdr) {
    case 0: case 43: case 44: case 50: case 51: case 60: case 135: case 139: case 140: case 253: case 254:
        return 1;
    default:
        return 0;
    }
}

/* SYN opens a sample on the client->server key; the SYN-ACK coming back closes it. */
static __always_inline void record_handshake(union sg_flow_words *fw, __u32 ports, __u8 flags)
{
    __u8 sa = flags & (SG_TCP_FLAG_SYN | SG_TCP_FLAG_ACK);
    if (sa == SG_TCP_FLAG_SYN) {
        __u64 now = bpf_ktime_get_ns();
        struct sg_handshake *h = handshakes.lookup(&fw->k);
        if (h) {
            h->syn_ns = now;
        } else {
            struct sg_handshake init = {};
            init.syn_ns = now;
            handshakes.update(&fw->k, &init);
        }
    } else if (sa == (SG_TCP_FLAG_SYN | SG_TCP_FLAG_ACK)) {
        __u64 now = bpf_ktime_get_ns();
        union sg_flow_words rk;
        reverse_flow(fw, &rk, ports, IPPROTO_TCP);
        struct sg_handshake *h = handshakes.lookup(&rk.k);
        if (h && h->syn_ns && now > h->syn_ns) {
            __u64 rtt = now - h->syn_ns;
            h->syn_ns = 0;
            h->last_rtt_ns = rtt;
            __sync_fetch_and_add(&h->rtt_sum_ns, rtt);
            __sync_fetch_and_add(&h->samples, 1);
        }
    }
}

int xdp_flow(struct xdp_md *ctx)
{
    void *data = (void *)(long)ctx->data;
    void *data_end = (void *)(long)ctx->data_end;
    __u64 len = data_end - data;

    struct ethhdr *eth = data;
    if ((void *)(eth + 1) > data_end) {
        count(SG_CNT_ETH_TRUNCATED, len);
        return XDP_PASS;
    }
    __u16 h_proto = eth->h_proto;
    void *l3 = eth + 1;
    if (vlan_tpid(h_proto)) {
        count(SG_CNT_VLAN, len);
#pragma unroll
        for (int i = 0; i < SG_VLAN_MAX && vlan_tpid(h_proto); i++) {
            struct sg_vlan_hdr *vh = l3;
            if ((void *)(vh + 1) > data_end) {
                count(SG_CNT_ETH_TRUNCATED, len);
                return XDP_PASS;
            }
            h_proto = vh->proto;
            l3 = vh + 1;
        }
        if (vlan_tpid(h_proto)) {
#if SG_ENFORCE
            return judge_unparsed(len);
#else
            return XDP_PASS;
#endif
        }
    }
    union sg_flow_words fk;     /* IPv6 flows, and IPv4 ones where a shared map needs them (widened) */
    union sg_flow4_words fk4;   /* the IPv4 flow table's key */
    void *l4;
    __u8 proto;
    int v6 = 0;
    int tiny_tcp = 0;  /* a first fragment whose TCP header ends in the next fragment */
    if (h_proto == bpf_htons(ETH_P_IP)) {
        struct iphdr *iph = l3;
        if ((void *)(iph + 1) > data_end) {
            count(SG_CNT_IPV4_TRUNCATED, len);
            return XDP_PASS;
        }
        if (iph->version != 4 || iph->ihl < 5) {
            count(SG_CNT_IPV4_BAD_HEADER, len);
            return XDP_PASS;
        }
        __u32 ihl_bytes = iph->ihl * 4;
        l4 = (void *)iph + ihl_bytes;
        if (l4 > data_end) {
            /* Options announced by IHL run past the frame. */
            count(SG_CNT_IPV4_TRUNCATED, len);
            return XDP_PASS;
        }
        count(SG_CNT_IPV4, len);

        __u16 frag = bpf_ntohs(iph->frag_off);
        if (frag & (SG_IP_MF | SG_IP_OFFSET)) {
            count(SG_CNT_IPV4_FRAGMENT, len);
            if (frag & SG_IP_OFFSET)
                return XDP_PASS; /* no L4 header in this fragment */
            /* RFC 1858 tiny fragment: the kernel keeps what tot_len covers (not the frame) and
             * takes the rest of the TCP header, SYN flag included, from the next fragment, which
             * passes unread: judged as a connection attempt, by its ports. */
            tiny_tcp = iph->protocol == IPPROTO_TCP && bpf_ntohs(iph->tot_len) < ihl_bytes + sizeof(struct tcphdr);
        }
        proto = iph->protocol;
        if (proto != IPPROTO_TCP && proto != IPPROTO_UDP) {
            count(SG_CNT_IPV4_OTHER_PROTO, len);
            return XDP_PASS;
        }
        /* The flow table's IPv4 key: saddr and daddr sit side by side in the header, one load. The
         * 16-byte (mapped) addresses only where a shared map needs them (judge, handshakes): an
         * unjudged IPv4 packet pays for no IPv6. */
        fk4.w[0] = *(__u64 *)&iph->saddr;
    } else if (h_proto == bpf_htons(ETH_P_IPV6)) {
        struct ipv6hdr *ip6h = l3;
        if ((void *)(ip6h + 1) > data_end) {
            count(SG_CNT_IPV6_TRUNCATED, len);
            return XDP_PASS;
        }
        if (ip6h->version != 6) {
            count(SG_CNT_IPV6_BAD_HEADER, len);
            return XDP_PASS;
        }
        count(SG_CNT_IPV6, len);
        v6 = 1;
        l4 = (void *)(ip6h + 1);
        proto = ip6h->nexthdr;
        /* An IPv4-mapped address (::ffff:a.b.c.d) is not meant to be on the wire (RFC 4291
         * 2.5.5.2; the kernel drops such a source): keyed as is, it meets the IPv4 address's
         * records and is judged like that address's traffic. */
        __u64 *addrs = (__u64 *)&ip6h->saddr;  /* saddr, then daddr: four words */
        fk.w[0] = addrs[0];
        fk.w[1] = addrs[1];
        fk.w[2] = addrs[2];
        fk.w[3] = addrs[3];
        if (proto != IPPROTO_TCP && proto != IPPROTO_UDP) {
            if (ipv6_ext_header(proto)) {
                count(SG_CNT_IPV6_EXT_HEADER, len);
#if SG_ENFORCE
                fk.w[4] = SG_PORTS_PROTO(0, proto);
                return judge_portless(&fk, len);
#endif
            } else {
                count(SG_CNT_IPV6_OTHER_PROTO, len);
            }
            return XDP_PASS;
        }
    } else {
        if (h_proto == bpf_htons(ETH_P_ARP))
            count(SG_CNT_ARP, len);
        else
            count(SG_CNT_OTHER_L2, len);
        return XDP_PASS;
    }

    __u8 tcp_flags = 0;
    __u32 ports;  /* source then destination port, network order, as in the header */
    if (proto == IPPROTO_TCP) {
        struct tcphdr *tcp = l4;
        if ((void *)(tcp + 1) > data_end || tcp->doff < 5) {
            if (!tiny_tcp || l4 + sizeof(__u32) > data_end) {
                count(SG_CNT_L4_TRUNCATED, len);
                return XDP_PASS;
            }
            ports = *(__u32 *)l4;
        } else {
            ports = *(__u32 *)tcp;
            tcp_flags = ((__u8 *)tcp)[13];
        }
        if (tiny_tcp)
            tcp_flags = SG_TCP_FLAG_SYN;
        count(SG_CNT_TCP, len);
    } else {
        struct udphdr *udp = l4;
        if ((void *)(udp + 1) > data_end) {
            count(SG_CNT_L4_TRUNCATED, len);
            return XDP_PASS;
        }
        ports = *(__u32 *)udp;
        count(SG_CNT_UDP, len);
    }

    struct sg_flow_stats *st;
    __u64 last_word = SG_PORTS_PROTO(ports, proto);
    if (v6) {
        fk.w[4] = last_word;
        st = flows6.lookup(&fk.k);
        SG_KEEP_APART(st);
    } else {
        fk4.w[1] = last_word;
        st = flows.lookup(&fk4.k);
    }
    int verdict = XDP_PASS;
    struct sg_outcome out = {};
#if SG_ENFORCE
    if (!v6)
        widen4(&fk, &fk4);
    verdict = judge(&fk, ports, tcp_flags, len, st, &out);
#endif
    __u64 now = bpf_jiffies64();
    if (st) {
        st->packets += 1;
        st->bytes += len;
        if (verdict == XDP_DROP)
            st->dropped += 1;
        st->last_seen_jiffies = now;
        if (out.cls) {
            st->ct_generation = out.generation;
            st->ct_rule = out.rule;
            st->ct_class = out.cls;
            st->ct_slot = out.slot;
        }
    } else {
        struct sg_flow_stats init = {};
        init.packets = 1;
        init.bytes = len;
        init.dropped = verdict == XDP_DROP ? 1 : 0;
        init.first_seen_jiffies = now;
        init.last_seen_jiffies = now;
        init.ct_generation = out.generation;
        init.ct_rule = out.rule;
        init.ct_class = out.cls;
        init.ct_slot = out.slot;
        int full;
        if (v6) {
            full = flows6.update(&fk.k, &init);
            SG_KEEP_APART(full);
        } else {
            full = flows.update(&fk4.k, &init);
        }
        if (full)
            count(SG_CNT_FLOW_TABLE_FULL, len);
    }
    if (verdict == XDP_PASS && proto == IPPROTO_TCP && (tcp_flags & SG_TCP_FLAG_SYN)) {
#if !SG_ENFORCE
        if (!v6)
            widen4(&fk, &fk4);
#endif
        record_handshake(&fk, ports, tcp_flags);
    }
    return verdict;
}

/* Never attached: userspace runs it with BPF_PROG_TEST_RUN to read "now" in the flow table's unit
 * (jiffies) next to CLOCK_MONOTONIC (flowclock.py), at each scrape and to measure the tick rate. */
BPF_ARRAY(clock_sample, struct sg_clock_sample, 1);

int sg_clock(struct xdp_md *ctx)
{
    int zero = 0;
    struct sg_clock_sample *s = clock_sample.lookup(&zero);
    if (s) {
        s->jiffies = bpf_jiffies64();
        s->mono_ns = bpf_ktime_get_ns();
    }
    return XDP_PASS;
}
