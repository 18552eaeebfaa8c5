/* sparsegate XDP data plane: per-flow telemetry and (optionally) policy enforcement.
 *
 * Compiled by BCC (programs.py) with:
 *   -DSG_ENFORCE=0|1    consult the policy map and drop denied flows (1) or only count (0)
 *   -DSG_FLOW_ENTRIES=N size of the per-flow LRU table
 *
 * Parsing is bounds-checked at every step; anything we cannot parse is counted by type and
 * passed to the kernel stack, which validates (and drops) malformed packets itself. IPv6 and
 * non-IP frames pass untouched. Non-first IPv4 fragments carry no ports: they are counted and
 * passed; the first fragment carries the ports and is judged, so a denied flow cannot be
 * reassembled.
 *
 * Policy: an A/B pool of inner hash maps (policy_a, policy_b) behind one outer array slot.
 * Userspace fills the inactive inner map completely, then flips the outer slot with a single
 * update (policyswap.py). The program fetches the inner map pointer once per packet, so every
 * packet is judged by exactly one policy generation.
 */
#include <uapi/linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/ip.h>
#include <linux/in.h>
#include <linux/tcp.h>
#include <linux/udp.h>
#include "sparsegate_flow.h"

#ifndef SG_ENFORCE
#define SG_ENFORCE 1
#endif
#ifndef SG_FLOW_ENTRIES
#define SG_FLOW_ENTRIES 65536
#endif

#define SG_IP_MF 0x2000
#define SG_IP_OFFSET 0x1FFF
#define SG_TCP_FLAG_SYN 0x02
#define SG_TCP_FLAG_ACK 0x10

BPF_PERCPU_ARRAY(counters, struct sg_counter, SG_CNT_MAX);
BPF_TABLE("lru_percpu_hash", struct sg_flow_key, struct sg_flow_stats, flows, SG_FLOW_ENTRIES);
BPF_TABLE("lru_percpu_hash", struct sg_port_key, struct sg_counter, port_totals, 8192);
BPF_TABLE("lru_hash", struct sg_flow_key, struct sg_handshake, handshakes, 16384);

BPF_HASH(policy_a, struct sg_policy_key, struct sg_policy_val, SG_POLICY_MAX_ENTRIES);
BPF_HASH(policy_b, struct sg_policy_key, struct sg_policy_val, SG_POLICY_MAX_ENTRIES);
BPF_ARRAY_OF_MAPS(policy_outer, "policy_a", 1);
BPF_PERCPU_HASH(verdicts, struct sg_verdict_key, struct sg_counter, 65536);

static __always_inline void count(int idx, __u64 len)
{
    struct sg_counter *c = counters.lookup(&idx);
    if (c) {
        c->packets += 1;
        c->bytes += len;
    }
}

/* Returns XDP_PASS or XDP_DROP for one parsed IPv4 TCP/UDP packet. */
static __always_inline int judge(struct sg_flow_key *fk, __u64 len)
{
#if SG_ENFORCE
    int zero = 0;
    void *inner = policy_outer.lookup(&zero);
    if (!inner) {
        count(SG_CNT_NO_POLICY, len);
        return XDP_PASS;
    }
    /* Both lookups go to the same inner map: one generation judges the whole packet. */
    struct sg_policy_key meta_key = {};
    struct sg_policy_val *meta = bpf_map_lookup_elem(inner, &meta_key);
    if (!meta) {
        count(SG_CNT_NO_POLICY, len);
        return XDP_PASS;
    }
    struct sg_policy_key pk = {};
    pk.saddr = fk->saddr;
    pk.daddr = fk->daddr;
    pk.dport = fk->dport;
    pk.proto = fk->proto;
    struct sg_policy_val *entry = bpf_map_lookup_elem(inner, &pk);

    struct sg_verdict_key vk = {};
    vk.generation = meta->generation;
    vk.rule_id = entry ? entry->rule_id : 0;
    vk.action = entry ? entry->action : meta->action;
    struct sg_counter *vc = verdicts.lookup(&vk);
    if (vc) {
        vc->packets += 1;
        vc->bytes += len;
    } else {
        struct sg_counter init = {1, len};
        verdicts.update(&vk, &init);
    }
    if (vk.action == SG_ACTION_DENY) {
        count(SG_CNT_POLICY_DENY, len);
        return XDP_DROP;
    }
    count(SG_CNT_POLICY_ALLOW, len);
#endif
    return XDP_PASS;
}

static __always_inline void record_flow(struct sg_flow_key *fk, __u64 len, int verdict, __u64 now)
{
    struct sg_flow_stats *st = flows.lookup(fk);
    if (st) {
        st->packets += 1;
        st->bytes += len;
        if (verdict == XDP_DROP)
            st->dropped += 1;
        st->last_seen_ns = now;
    } else {
        struct sg_flow_stats init = {};
        init.packets = 1;
        init.bytes = len;
        init.dropped = verdict == XDP_DROP ? 1 : 0;
        init.first_seen_ns = now;
        init.last_seen_ns = now;
        if (flows.update(fk, &init))
            count(SG_CNT_FLOW_TABLE_FULL, len);
    }

    struct sg_port_key ptk = {};
    ptk.port = bpf_ntohs(fk->dport);
    ptk.proto = fk->proto;
    struct sg_counter *pc = port_totals.lookup(&ptk);
    if (pc) {
        pc->packets += 1;
        pc->bytes += len;
    } else {
        struct sg_counter init = {1, len};
        port_totals.update(&ptk, &init);
    }
}

/* SYN opens a sample on the client->server key; the SYN-ACK coming back closes it. */
static __always_inline void record_handshake(struct sg_flow_key *fk, __u8 flags, __u64 now)
{
    if ((flags & (SG_TCP_FLAG_SYN | SG_TCP_FLAG_ACK)) == SG_TCP_FLAG_SYN) {
        struct sg_handshake *h = handshakes.lookup(fk);
        if (h) {
            h->syn_ns = now;
        } else {
            struct sg_handshake init = {};
            init.syn_ns = now;
            handshakes.update(fk, &init);
        }
    } else if ((flags & (SG_TCP_FLAG_SYN | SG_TCP_FLAG_ACK)) == (SG_TCP_FLAG_SYN | SG_TCP_FLAG_ACK)) {
        struct sg_flow_key rk = {};
        rk.saddr = fk->daddr;
        rk.daddr = fk->saddr;
        rk.sport = fk->dport;
        rk.dport = fk->sport;
        rk.proto = fk->proto;
        struct sg_handshake *h = handshakes.lookup(&rk);
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
    if (h_proto == bpf_htons(ETH_P_IPV6)) {
        count(SG_CNT_IPV6, len);
        return XDP_PASS;
    }
    if (h_proto == bpf_htons(ETH_P_ARP)) {
        count(SG_CNT_ARP, len);
        return XDP_PASS;
    }
    if (h_proto == bpf_htons(ETH_P_8021Q) || h_proto == bpf_htons(ETH_P_8021AD)) {
        count(SG_CNT_VLAN, len);
        return XDP_PASS;
    }
    if (h_proto != bpf_htons(ETH_P_IP)) {
        count(SG_CNT_OTHER_L2, len);
        return XDP_PASS;
    }

    struct iphdr *iph = (void *)(eth + 1);
    if ((void *)(iph + 1) > data_end) {
        count(SG_CNT_IPV4_TRUNCATED, len);
        return XDP_PASS;
    }
    if (iph->version != 4 || iph->ihl < 5) {
        count(SG_CNT_IPV4_BAD_HEADER, len);
        return XDP_PASS;
    }
    __u32 ihl_bytes = iph->ihl * 4;
    void *l4 = (void *)iph + ihl_bytes;
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
    }

    struct sg_flow_key fk = {};
    fk.saddr = iph->saddr;
    fk.daddr = iph->daddr;
    fk.proto = iph->protocol;
    __u8 tcp_flags = 0;
    if (iph->protocol == IPPROTO_TCP) {
        struct tcphdr *tcp = l4;
        if ((void *)(tcp + 1) > data_end || tcp->doff < 5) {
            count(SG_CNT_L4_TRUNCATED, len);
            return XDP_PASS;
        }
        fk.sport = tcp->source;
        fk.dport = tcp->dest;
        tcp_flags = ((__u8 *)tcp)[13];
        count(SG_CNT_TCP, len);
    } else if (iph->protocol == IPPROTO_UDP) {
        struct udphdr *udp = l4;
        if ((void *)(udp + 1) > data_end) {
            count(SG_CNT_L4_TRUNCATED, len);
            return XDP_PASS;
        }
        fk.sport = udp->source;
        fk.dport = udp->dest;
        count(SG_CNT_UDP, len);
    } else {
        count(SG_CNT_IPV4_OTHER_PROTO, len);
        return XDP_PASS;
    }

    __u64 now = bpf_ktime_get_ns();
    int verdict = judge(&fk, len);
    record_flow(&fk, len, verdict, now);
    if (verdict == XDP_PASS && fk.proto == IPPROTO_TCP)
        record_handshake(&fk, tcp_flags, now);
    return verdict;
}
