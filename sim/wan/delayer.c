/*
 * swarm-wan-delayer: holds every forwarded IPv4 packet of one emulated WAN for
 * its link's one-way delay, then lets the kernel send it on.
 *
 * It runs inside the emulator's router namespace, where one iptables rule
 * (FORWARD -j NFQUEUE) hands each packet to this process over the
 * nfnetlink_queue protocol (spoken directly on a netlink socket: no
 * libnetfilter_queue needed, only the kernel headers). Only the first bytes
 * of a packet are copied to user space; the packet itself stays in the
 * kernel until its verdict.
 *
 * Per packet: the source and destination hosts are the third octets of the
 * 10.77.H.x addresses; the link table (set over stdin) gives the one-way
 * delay, jitter (uniform in [-jitter, +jitter], like netem's default) and
 * loss (per million). A lost packet gets NF_DROP at once; every other packet
 * is released (NF_ACCEPT) at arrival + delay + jitter, never before the
 * previous packet of the same direction (no reordering).
 *
 * Bounds: at most --max-packets packets are held (the kernel queue length is
 * set to the same number; beyond it the kernel drops, like a full router
 * buffer). Memory is allocated once at start.
 *
 * Control (stdin, one command per line; each answered by one line on stdout):
 *   link SRC DST DELAY_US JITTER_US LOSS_PPM   -> ok | err <why>
 *   stats                                     -> {json counters}
 *   reset                                     -> ok   (zero the counters)
 * End of stdin (the owner exited or crashed) releases every held packet and
 * ends the process. It prints "ready" once the queue is bound.
 */
#define _GNU_SOURCE
#include <arpa/inet.h> /* before the linux/ headers: they skip what libc defined */
#include <errno.h>
#include <fcntl.h>
#include <linux/netfilter.h>
#include <linux/netfilter/nfnetlink.h>
#include <linux/netfilter/nfnetlink_queue.h>
#include <linux/netlink.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <endian.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define NHOSTS 256
#define COPY_BYTES 20 /* the IPv4 header: addresses are at offsets 12 and 16 */

struct link {
    int64_t delay_ns;
    int64_t jitter_ns;
    uint32_t loss_ppm;
    int set;
};

struct held {
    int64_t due_ns;
    uint32_t id;
};

static struct link links[NHOSTS][NHOSTS];
static int64_t last_due[NHOSTS][NHOSTS];
static struct held *heap;
static size_t heap_len, heap_cap;

static struct {
    uint64_t packets, accepted, lost, overflow, unmatched, enobufs, nl_errors, verdict_errors;
    uint64_t late_count, late_sum_ns, late_max_ns, held_max;
    uint64_t late_hist[8]; /* |release - due|: <20us <50us <100us <200us <500us <1ms <5ms >=5ms */
    uint64_t early_count, early_sum_ns;       /* released before the due time (early wake-up) */
    uint64_t stamped, lag_sum_ns, lag_max_ns; /* kernel arrival stamp -> read here */
} st;

/* How late a wake-up comes after the time asked for (EWMA, ns): the next wake-up is asked that much early. */
static int64_t wake_late_ns = 0;
static int64_t asked_wake_ns = -1;
static int64_t realtime_offset_ns; /* CLOCK_REALTIME - CLOCK_MONOTONIC, refreshed per read */

static int nl_fd;
static uint16_t queue_num;
static uint64_t rng_state = 0x9E3779B97F4A7C15ull;

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000ll + ts.tv_nsec;
}

static int64_t realtime_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (int64_t)ts.tv_sec * 1000000000ll + ts.tv_nsec;
}

static uint64_t rng(void) { /* xorshift64* */
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return rng_state * 2685821657736338717ull;
}

static void heap_push(int64_t due, uint32_t id) {
    size_t i = heap_len++;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (heap[p].due_ns <= due) break;
        heap[i] = heap[p];
        i = p;
    }
    heap[i].due_ns = due;
    heap[i].id = id;
    if (heap_len > st.held_max) st.held_max = heap_len;
}

static struct held heap_pop(void) {
    struct held top = heap[0], last = heap[--heap_len];
    size_t i = 0;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= heap_len) break;
        if (c + 1 < heap_len && heap[c + 1].due_ns < heap[c].due_ns) c++;
        if (last.due_ns <= heap[c].due_ns) break;
        heap[i] = heap[c];
        i = c;
    }
    if (heap_len > 0) heap[i] = last;
    return top;
}

/* ---- netlink messages ---- */

static char vbuf[64 * 64];
static size_t vlen;

static void put_attr(char *buf, size_t *off, uint16_t type, const void *data, uint16_t len) {
    struct nlattr *a = (struct nlattr *)(buf + *off);
    a->nla_type = type;
    a->nla_len = NLA_HDRLEN + len;
    memcpy(buf + *off + NLA_HDRLEN, data, len);
    *off += NLA_ALIGN(a->nla_len);
}

static size_t start_msg(char *buf, uint16_t type) {
    struct nlmsghdr *h = (struct nlmsghdr *)buf;
    memset(buf, 0, NLMSG_HDRLEN + sizeof(struct nfgenmsg));
    h->nlmsg_type = (NFNL_SUBSYS_QUEUE << 8) | type;
    h->nlmsg_flags = NLM_F_REQUEST;
    struct nfgenmsg *g = (struct nfgenmsg *)(buf + NLMSG_HDRLEN);
    g->nfgen_family = AF_UNSPEC;
    g->version = NFNETLINK_V0;
    g->res_id = htons(queue_num);
    return NLMSG_HDRLEN + NLMSG_ALIGN(sizeof(struct nfgenmsg));
}

static void flush_verdicts(void) {
    if (vlen == 0) return;
    if (send(nl_fd, vbuf, vlen, 0) < 0) st.verdict_errors++;
    vlen = 0;
}

static void verdict(uint32_t id, uint32_t v) {
    if (vlen + 64 > sizeof(vbuf)) flush_verdicts();
    char *m = vbuf + vlen;
    size_t off = start_msg(m, NFQNL_MSG_VERDICT);
    struct nfqnl_msg_verdict_hdr vh = {htonl(v), htonl(id)};
    put_attr(m, &off, NFQA_VERDICT_HDR, &vh, sizeof vh);
    ((struct nlmsghdr *)m)->nlmsg_len = off;
    vlen += NLMSG_ALIGN(off);
}

static int config(const void *attr1, uint16_t t1, uint16_t l1, const void *attr2, uint16_t t2, uint16_t l2) {
    char buf[256];
    size_t off = start_msg(buf, NFQNL_MSG_CONFIG);
    struct nlmsghdr *h = (struct nlmsghdr *)buf;
    h->nlmsg_flags |= NLM_F_ACK;
    put_attr(buf, &off, t1, attr1, l1);
    if (attr2) put_attr(buf, &off, t2, attr2, l2);
    h->nlmsg_len = off;
    if (send(nl_fd, buf, off, 0) < 0) return -errno;
    char rbuf[1024];
    ssize_t n = recv(nl_fd, rbuf, sizeof rbuf, 0);
    if (n < 0) return -errno;
    struct nlmsghdr *r = (struct nlmsghdr *)rbuf;
    if (r->nlmsg_type == NLMSG_ERROR) return ((struct nlmsgerr *)NLMSG_DATA(r))->error;
    return 0;
}

/* ---- packets ---- */

static void on_packet(struct nlmsghdr *h, int64_t t) {
    struct nlattr *a = (struct nlattr *)((char *)NLMSG_DATA(h) + NLMSG_ALIGN(sizeof(struct nfgenmsg)));
    int remaining = (int)h->nlmsg_len - (int)((char *)a - (char *)h);
    uint32_t id = 0;
    int have_id = 0;
    const unsigned char *payload = NULL;
    int plen = 0;
    int64_t stamp = 0;
    while (remaining >= NLA_HDRLEN && a->nla_len >= NLA_HDRLEN && a->nla_len <= remaining) {
        int type = a->nla_type & NLA_TYPE_MASK;
        if (type == NFQA_PACKET_HDR) {
            struct nfqnl_msg_packet_hdr *ph = (void *)((char *)a + NLA_HDRLEN);
            id = ntohl(ph->packet_id);
            have_id = 1;
        } else if (type == NFQA_TIMESTAMP && a->nla_len >= NLA_HDRLEN + 16) {
            struct nfqnl_msg_packet_timestamp *ts = (void *)((char *)a + NLA_HDRLEN);
            stamp = (int64_t)be64toh(ts->sec) * 1000000000ll + (int64_t)be64toh(ts->usec) * 1000ll;
        } else if (type == NFQA_PAYLOAD) {
            payload = (const unsigned char *)a + NLA_HDRLEN;
            plen = a->nla_len - NLA_HDRLEN;
        }
        remaining -= NLA_ALIGN(a->nla_len);
        a = (struct nlattr *)((char *)a + NLA_ALIGN(a->nla_len));
    }
    if (!have_id) return;
    st.packets++;
    if (stamp) { /* the kernel's arrival time (realtime, us): start the delay there, not at our read */
        int64_t arrived = stamp - realtime_offset_ns;
        int64_t lag = t - arrived;
        if (lag >= 0 && lag < 100000000ll) {
            st.stamped++;
            st.lag_sum_ns += (uint64_t)lag;
            if ((uint64_t)lag > st.lag_max_ns) st.lag_max_ns = (uint64_t)lag;
            t = arrived;
        }
    }
    int src = -1, dst = -1;
    if (payload && plen >= 20 && (payload[0] >> 4) == 4 && payload[12] == 10 && payload[13] == 77 &&
        payload[16] == 10 && payload[17] == 77) {
        src = payload[14];
        dst = payload[18];
    }
    if (src < 0 || !links[src][dst].set) {
        st.unmatched++;
        st.accepted++;
        verdict(id, NF_ACCEPT);
        return;
    }
    struct link *l = &links[src][dst];
    if (l->loss_ppm && (rng() % 1000000u) < l->loss_ppm) {
        st.lost++;
        verdict(id, NF_DROP);
        return;
    }
    if (heap_len >= heap_cap) { /* cannot happen while the kernel queue is as long as the heap */
        st.overflow++;
        verdict(id, NF_DROP);
        return;
    }
    int64_t d = l->delay_ns;
    if (l->jitter_ns > 0) {
        d += (int64_t)(rng() % (uint64_t)(2 * l->jitter_ns + 1)) - l->jitter_ns;
        if (d < 0) d = 0;
    }
    int64_t due = t + d;
    if (due < last_due[src][dst]) due = last_due[src][dst];
    last_due[src][dst] = due;
    heap_push(due, id);
}

static void read_queue(void) {
    static char buf[1 << 17];
    for (int rounds = 0; rounds < 64; rounds++) {
        ssize_t n = recv(nl_fd, buf, sizeof buf, MSG_DONTWAIT);
        if (n < 0) {
            if (errno == ENOBUFS) { /* messages were lost: their packets stay queued until the queue is unbound */
                st.enobufs++;
                continue;
            }
            return;
        }
        int64_t t = now_ns();
        realtime_offset_ns = realtime_ns() - t;
        for (struct nlmsghdr *h = (struct nlmsghdr *)buf; NLMSG_OK(h, (size_t)n); h = NLMSG_NEXT(h, n)) {
            if (h->nlmsg_type == NLMSG_ERROR) {
                if (((struct nlmsgerr *)NLMSG_DATA(h))->error != 0) st.nl_errors++;
            } else if ((h->nlmsg_type & 0xff) == NFQNL_MSG_PACKET) {
                on_packet(h, t);
            }
        }
    }
}

/* Release what is due; a packet due within half the usual wake-up lateness (at most EARLY_MAX_NS)
 * goes now too: sleeping again would make it later than releasing it this early. */
#define EARLY_MAX_NS 50000
static void release_due(int64_t t) {
    int64_t early = wake_late_ns / 2 < EARLY_MAX_NS ? wake_late_ns / 2 : EARLY_MAX_NS;
    while (heap_len > 0 && heap[0].due_ns <= t + early) {
        struct held p = heap_pop();
        int64_t diff = t - p.due_ns;
        uint64_t late = (uint64_t)(diff < 0 ? -diff : diff);
        if (diff < 0) {
            st.early_count++;
            st.early_sum_ns += late;
        }
        st.late_count++;
        st.late_sum_ns += late;
        if (late > st.late_max_ns) st.late_max_ns = late;
        static const uint64_t edges[] = {20000, 50000, 100000, 200000, 500000, 1000000, 5000000};
        int b = 0;
        while (b < 7 && late >= edges[b]) b++;
        st.late_hist[b]++;
        st.accepted++;
        verdict(p.id, NF_ACCEPT);
    }
    flush_verdicts();
}

/* ---- control ---- */

static char cbuf[4096];
static size_t clen;

static void reply(const char *s) {
    fputs(s, stdout);
    fputc('\n', stdout);
    fflush(stdout);
}

static void command(char *line) {
    int src, dst;
    long long delay_us, jitter_us, loss_ppm;
    char extra;
    if (strncmp(line, "link ", 5) == 0) {
        if (sscanf(line + 5, "%d %d %lld %lld %lld %c", &src, &dst, &delay_us, &jitter_us, &loss_ppm, &extra) != 5) {
            reply("err expected: link SRC DST DELAY_US JITTER_US LOSS_PPM");
        } else if (src < 1 || src > 254 || dst < 1 || dst > 254) {
            reply("err hosts are 1..254");
        } else if (delay_us < 0 || delay_us > 60000000 || jitter_us < 0 || jitter_us > 60000000 || loss_ppm < 0 ||
                   loss_ppm > 1000000) {
            reply("err delay and jitter 0..60 s, loss 0..1000000 ppm");
        } else {
            links[src][dst] = (struct link){delay_us * 1000, jitter_us * 1000, (uint32_t)loss_ppm, 1};
            reply("ok");
        }
    } else if (strcmp(line, "stats") == 0) {
        char out[1024];
        snprintf(out, sizeof out,
                 "{\"packets\": %llu, \"accepted\": %llu, \"lost\": %llu, \"overflow\": %llu, \"unmatched\": %llu, "
                 "\"enobufs\": %llu, \"netlink_errors\": %llu, \"verdict_errors\": %llu, \"held_now\": %zu, "
                 "\"held_max\": %llu, \"late_count\": %llu, \"late_sum_ns\": %llu, \"late_max_ns\": %llu, "
                 "\"late_hist\": [%llu, %llu, %llu, %llu, %llu, %llu, %llu, %llu], \"early_count\": %llu, "
                 "\"early_sum_ns\": %llu, \"stamped\": %llu, \"lag_sum_ns\": %llu, \"lag_max_ns\": %llu, "
                 "\"wake_late_ns\": %lld}",
                 (unsigned long long)st.packets, (unsigned long long)st.accepted, (unsigned long long)st.lost,
                 (unsigned long long)st.overflow, (unsigned long long)st.unmatched, (unsigned long long)st.enobufs,
                 (unsigned long long)st.nl_errors, (unsigned long long)st.verdict_errors, heap_len,
                 (unsigned long long)st.held_max, (unsigned long long)st.late_count,
                 (unsigned long long)st.late_sum_ns, (unsigned long long)st.late_max_ns,
                 (unsigned long long)st.late_hist[0], (unsigned long long)st.late_hist[1],
                 (unsigned long long)st.late_hist[2], (unsigned long long)st.late_hist[3],
                 (unsigned long long)st.late_hist[4], (unsigned long long)st.late_hist[5],
                 (unsigned long long)st.late_hist[6], (unsigned long long)st.late_hist[7],
                 (unsigned long long)st.early_count, (unsigned long long)st.early_sum_ns,
                 (unsigned long long)st.stamped, (unsigned long long)st.lag_sum_ns,
                 (unsigned long long)st.lag_max_ns, (long long)wake_late_ns);
        reply(out);
    } else if (strcmp(line, "reset") == 0) {
        memset(&st, 0, sizeof st);
        st.held_max = heap_len;
        reply("ok");
    } else {
        reply("err unknown command (link, stats, reset)");
    }
}

/* Returns 0 at end of input. */
static int read_control(void) {
    ssize_t n = read(0, cbuf + clen, sizeof cbuf - 1 - clen);
    if (n == 0) return 0;
    if (n < 0) return errno == EINTR || errno == EAGAIN ? 1 : 0;
    clen += (size_t)n;
    char *start = cbuf, *nl;
    while ((nl = memchr(start, '\n', clen - (size_t)(start - cbuf)))) {
        *nl = 0;
        command(start);
        start = nl + 1;
    }
    clen -= (size_t)(start - cbuf);
    memmove(cbuf, start, clen);
    if (clen == sizeof cbuf - 1) { /* a line longer than the buffer: drop it */
        clen = 0;
        reply("err line too long");
    }
    return 1;
}

static void die(const char *what, int err) {
    fprintf(stderr, "swarm-wan-delayer: %s: %s\n", what, strerror(err));
    exit(2);
}

int main(int argc, char **argv) {
    long max_packets = 65536, rt_priority = 50, seed = 1;
    queue_num = 0;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--queue")) queue_num = (uint16_t)atol(argv[i + 1]);
        else if (!strcmp(argv[i], "--max-packets")) max_packets = atol(argv[i + 1]);
        else if (!strcmp(argv[i], "--rt-priority")) rt_priority = atol(argv[i + 1]);
        else if (!strcmp(argv[i], "--seed")) seed = atol(argv[i + 1]);
        else {
            fprintf(stderr, "usage: %s [--queue N] [--max-packets N] [--rt-priority 0..99] [--seed N]\n", argv[0]);
            return 2;
        }
    }
    if (max_packets < 16 || max_packets > (1 << 22)) {
        fprintf(stderr, "swarm-wan-delayer: --max-packets must be 16..4194304\n");
        return 2;
    }
    rng_state ^= (uint64_t)seed * 0xD1B54A32D192ED03ull;
    heap_cap = (size_t)max_packets;
    heap = calloc(heap_cap, sizeof *heap);
    if (!heap) die("calloc", ENOMEM);
    signal(SIGPIPE, SIG_IGN);
    prctl(PR_SET_TIMERSLACK, 1UL, 0, 0, 0);
    const char *rt = "none";
    if (rt_priority > 0) {
        struct sched_param sp = {.sched_priority = (int)rt_priority};
        if (sched_setscheduler(0, SCHED_FIFO, &sp) == 0) rt = "SCHED_FIFO";
        else fprintf(stderr, "swarm-wan-delayer: no real-time priority (%s); delays will be less exact\n",
                     strerror(errno));
    }
    if (mlockall(MCL_CURRENT | MCL_FUTURE) != 0) { /* not fatal: only page faults on a busy machine */
    }

    nl_fd = socket(AF_NETLINK, SOCK_RAW | SOCK_CLOEXEC, NETLINK_NETFILTER);
    if (nl_fd < 0) die("netlink socket", errno);
    int rcvbuf = 32 << 20, one = 1;
    if (setsockopt(nl_fd, SOL_SOCKET, SO_RCVBUFFORCE, &rcvbuf, sizeof rcvbuf) != 0)
        setsockopt(nl_fd, SOL_SOCKET, SO_RCVBUF, &rcvbuf, sizeof rcvbuf);
    setsockopt(nl_fd, SOL_NETLINK, NETLINK_NO_ENOBUFS, &one, sizeof one);
    struct sockaddr_nl sa = {.nl_family = AF_NETLINK};
    if (bind(nl_fd, (struct sockaddr *)&sa, sizeof sa) != 0) die("netlink bind", errno);

    struct nfqnl_msg_config_cmd cmd = {.command = NFQNL_CFG_CMD_BIND, .pf = htons(AF_INET)};
    int err = config(&cmd, NFQA_CFG_CMD, sizeof cmd, NULL, 0, 0);
    if (err) die("binding the queue (is nfnetlink_queue available and the queue free?)", -err);
    struct nfqnl_msg_config_params params = {.copy_range = htonl(COPY_BYTES), .copy_mode = NFQNL_COPY_PACKET};
    uint32_t maxlen = htonl((uint32_t)max_packets);
    err = config(&params, NFQA_CFG_PARAMS, sizeof params, &maxlen, NFQA_CFG_QUEUE_MAXLEN, sizeof maxlen);
    if (err) die("configuring the queue", -err);
    /* Whole GSO packets (no segmentation on the way to user space): fewer messages, same bytes. */
    uint32_t flags = htonl(NFQA_CFG_F_GSO);
    err = config(&flags, NFQA_CFG_FLAGS, sizeof flags, &flags, NFQA_CFG_MASK, sizeof flags);
    if (err) fprintf(stderr, "swarm-wan-delayer: GSO flag refused (%s); packets are segmented\n", strerror(-err));

    /* Any socket asking for receive timestamps makes the kernel stamp every arriving packet
     * (NFQA_TIMESTAMP then carries it). Held open for the life of the process. */
    int stamp_fd = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (stamp_fd >= 0) setsockopt(stamp_fd, SOL_SOCKET, SO_TIMESTAMPNS, &one, sizeof one);

    char ready[128];
    snprintf(ready, sizeof ready, "ready queue=%u max_packets=%ld scheduler=%s", queue_num, max_packets, rt);
    reply(ready);

    struct pollfd fds[2] = {{.fd = nl_fd, .events = POLLIN}, {.fd = 0, .events = POLLIN}};
    for (;;) {
        struct timespec ts, *tsp = NULL;
        asked_wake_ns = -1;
        if (heap_len > 0) {
            int64_t now = now_ns();
            int64_t wait = heap[0].due_ns - wake_late_ns - now;
            if (wait < 0) wait = 0;
            else asked_wake_ns = now + wait;
            ts.tv_sec = wait / 1000000000ll;
            ts.tv_nsec = wait % 1000000000ll;
            tsp = &ts;
        }
        int n = ppoll(fds, 2, tsp, NULL);
        if (n < 0 && errno != EINTR) die("ppoll", errno);
        if (n == 0 && asked_wake_ns >= 0) { /* a timer wake-up: learn how late they come */
            int64_t late = now_ns() - asked_wake_ns;
            if (late >= 0 && late < 2000000) wake_late_ns += (late - wake_late_ns) / 16;
        }
        if (n > 0 && (fds[0].revents & POLLIN)) read_queue();
        if (n > 0 && (fds[1].revents & (POLLIN | POLLHUP | POLLERR))) {
            if (!read_control()) break;
        }
        release_due(now_ns());
    }
    /* The owner is gone: let everything still held through, then leave (the queue unbinds on close). */
    while (heap_len > 0) verdict(heap_pop().id, NF_ACCEPT);
    flush_verdicts();
    return 0;
}
