/*
 * The `mpi-*` bindings of dxnet-bench: its operations done the way the OSU
 * micro-benchmarks do them with MPI point-to-point calls, one MPI rank per
 * node, so that MPI's numbers sit in the same tables as dxnet's.
 *
 * Roles and counts are dxnet-bench's (ops.rs): ranks pair up as (0,1),
 * (2,3), ...; a rank's COUNT messages (or round trips) are split over its
 * THREADS threads; thread j's i-th all-to-all message goes to the
 * ((i + j) mod (N-1))-th other rank. Thread j talks only to thread j of
 * its peers (tag j), under MPI_THREAD_MULTIPLE when THREADS > 1.
 *
 *   throughput uni  osu_bw: the even rank posts WINDOW MPI_Isend and waits
 *                   for them, the odd rank WINDOW MPI_Irecv; after every
 *                   window the receiver sends a 4-byte ack.
 *   throughput bi   osu_bibw: both ranks post WINDOW receives and WINDOW
 *                   sends per window and wait for all of them.
 *   all_to_all      per window up to WINDOW sends to and receives from
 *                   every other rank, then wait for all.
 *   latency,        osu_latency: the even rank's MPI_Send then MPI_Recv of
 *   pingpong        the echo; one sample (round trip, ns) per exchange.
 *
 * Every message carries its index + 1 (the first up to 8 bytes; a slot
 * nothing was received into reads 0), so each thread checks that the sum
 * of what it received is the sum of what was sent to it, and the
 * receivers' total against the senders'. A window holds at most
 * WINDOW_BYTES per thread and direction (fewer messages of large sizes).
 *
 * Usage: bench-mpi OP MODE SIZE COUNT WARMUP WINDOW THREADS IFACE
 * (IFACE: the interface whose tx_bytes rank 0 reads around the measured
 * phase, "-" for none). Rank 0 prints
 *   RESULT messages=.. elapsed_s=.. cpu_s=.. wire_bytes=.. sum_ok=1
 * (messages: received, or round trips; elapsed: the slowest rank; cpu:
 * summed over ranks) and for latency operations one `S <ns>` line per
 * round-trip sample.
 */
#include <mpi.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>

enum op { THROUGHPUT, LATENCY, ALL_TO_ALL };

struct cfg {
    enum op op;
    int bi;
    size_t size;
    uint64_t count;
    uint64_t window;
    int threads;
    int rank, procs;
};

/* What one thread did in one phase. */
struct part {
    const struct cfg *c;
    int j;
    uint64_t count;        /* the rank's messages of this phase */
    uint64_t received;     /* messages (or round trips) */
    uint64_t sent_sum;     /* sum of the indices sent */
    uint64_t recv_sum;     /* sum of the indices received */
    uint64_t expect_sum;   /* what recv_sum must be */
    uint64_t *samples;     /* round trips, ns (initiators of latency ops) */
    uint64_t nsamples;
};

/* Most bytes a thread's window holds per direction. */
#define WINDOW_BYTES ((uint64_t)16 << 20)

/* The window for messages of `size` bytes to `peers` peers. */
static uint64_t window_for(uint64_t w, size_t size, uint64_t peers) {
    const uint64_t per = (size ? size : 1) * peers;
    const uint64_t cap = WINDOW_BYTES / per;
    return w < cap ? w : (cap ? cap : 1);
}

static void die(const char *what) {
    fprintf(stderr, "bench-mpi: %s\n", what);
    MPI_Abort(MPI_COMM_WORLD, 2);
    exit(2);
}

static double cpu_s(void) {
    struct rusage u;
    getrusage(RUSAGE_SELF, &u);
    return u.ru_utime.tv_sec + u.ru_utime.tv_usec / 1e6 + u.ru_stime.tv_sec +
           u.ru_stime.tv_usec / 1e6;
}

static uint64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000ull + (uint64_t)t.tv_nsec;
}

static uint64_t tx_bytes(const char *iface) {
    if (!iface || strcmp(iface, "-") == 0) return 0;
    char path[256];
    snprintf(path, sizeof path, "/sys/class/net/%s/statistics/tx_bytes", iface);
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    unsigned long long v = 0;
    if (fscanf(f, "%llu", &v) != 1) v = 0;
    fclose(f);
    return v;
}

/* Messages thread j of `threads` sends when its rank sends `count`. */
static uint64_t thread_count(uint64_t count, uint64_t threads, uint64_t j) {
    return count / threads + (j < count % threads ? 1 : 0);
}

/* The other ranks of `rank`, in order. */
static int other(int rank, int k) { return k < rank ? k : k + 1; }

static void stamp(char *buf, size_t size, uint64_t i) {
    memcpy(buf, &i, size < 8 ? size : 8);
}

static uint64_t unstamp(const char *buf, size_t size) {
    uint64_t i = 0;
    memcpy(&i, buf, size < 8 ? size : 8);
    return i;
}

/* The low `size` bytes of i, as the receiver will read them back. */
static uint64_t truncated(uint64_t i, size_t size) {
    return size >= 8 ? i : i & ((1ull << (8 * size)) - 1);
}

/* The sum of the stamps of messages 0..n-1 (what a receiver must add up). */
static uint64_t stamps(uint64_t n, size_t size) {
    uint64_t sum = 0;
    for (uint64_t i = 0; i < n; i++) sum += truncated(i + 1, size);
    return sum;
}

static void throughput(struct part *p) {
    const struct cfg *c = p->c;
    const int peer = c->rank ^ 1;
    if (peer >= c->procs) return;
    const int even = (c->rank & 1) == 0;
    const int sends = c->bi || even, recvs = c->bi || !even;
    const uint64_t n = thread_count(p->count, c->threads, p->j);
    const size_t size = c->size, w = window_for(c->window, size, 1);
    char *sbuf = calloc(w, size ? size : 1), *rbuf = calloc(w, size ? size : 1);
    if (recvs) p->expect_sum = stamps(n, size);
    MPI_Request *req = malloc(2 * w * sizeof *req);
    if (!sbuf || !rbuf || !req) die("out of memory");
    char ack[4] = {0};
    for (uint64_t done = 0; done < n;) {
        const uint64_t m = n - done < w ? n - done : w;
        int r = 0;
        if (recvs)
            for (uint64_t k = 0; k < m; k++)
                MPI_Irecv(rbuf + k * size, (int)size, MPI_CHAR, peer, p->j, MPI_COMM_WORLD,
                          &req[r++]);
        if (sends)
            for (uint64_t k = 0; k < m; k++) {
                stamp(sbuf + k * size, size, done + k + 1);
                p->sent_sum += truncated(done + k + 1, size);
                MPI_Isend(sbuf + k * size, (int)size, MPI_CHAR, peer, p->j, MPI_COMM_WORLD,
                          &req[r++]);
            }
        MPI_Waitall(r, req, MPI_STATUSES_IGNORE);
        if (recvs) {
            for (uint64_t k = 0; k < m; k++) p->recv_sum += unstamp(rbuf + k * size, size);
            p->received += m;
        }
        if (!c->bi) {
            const int tag = c->threads + p->j;
            if (even)
                MPI_Recv(ack, 4, MPI_CHAR, peer, tag, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
            else
                MPI_Send(ack, 4, MPI_CHAR, peer, tag, MPI_COMM_WORLD);
        }
        done += m;
    }
    free(sbuf);
    free(rbuf);
    free(req);
}

static void latency(struct part *p) {
    const struct cfg *c = p->c;
    const int peer = c->rank ^ 1;
    if (peer >= c->procs) return;
    const int even = (c->rank & 1) == 0;
    const uint64_t n = thread_count(p->count, c->threads, p->j);
    const size_t size = c->size;
    char *sbuf = calloc(1, size ? size : 1), *rbuf = calloc(1, size ? size : 1);
    if (!sbuf || !rbuf) die("out of memory");
    if (even) {
        p->samples = malloc((n ? n : 1) * sizeof *p->samples);
        if (!p->samples) die("out of memory");
        p->expect_sum = stamps(n, size); /* the echoes */
    }
    for (uint64_t i = 0; i < n; i++) {
        if (even) {
            stamp(sbuf, size, i + 1);
            p->sent_sum += truncated(i + 1, size);
            const uint64_t t0 = now_ns();
            MPI_Send(sbuf, (int)size, MPI_CHAR, peer, p->j, MPI_COMM_WORLD);
            MPI_Recv(rbuf, (int)size, MPI_CHAR, peer, p->j, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
            p->samples[p->nsamples++] = now_ns() - t0;
            p->received++;
            /* The echo carries the index back: it counts as received. */
            p->recv_sum += unstamp(rbuf, size);
        } else {
            MPI_Recv(rbuf, (int)size, MPI_CHAR, peer, p->j, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
            MPI_Send(rbuf, (int)size, MPI_CHAR, peer, p->j, MPI_COMM_WORLD);
        }
    }
    free(sbuf);
    free(rbuf);
}

/* Messages thread j of rank `src` sends to rank `dst` in all-to-all. */
static uint64_t sent_to(const struct cfg *c, uint64_t count, int src, int dst, int j) {
    const uint64_t d = (uint64_t)c->procs - 1;
    const uint64_t k = (uint64_t)(dst < src ? dst : dst - 1);
    const uint64_t n = thread_count(count, c->threads, j);
    /* The i-th message goes to index (i + j) mod d: index k gets
     * i = (k - j) mod d, (k - j) mod d + d, ... */
    const uint64_t first = (k + d - ((uint64_t)j % d)) % d;
    return n / d + (first < n % d ? 1 : 0);
}

static void all_to_all(struct part *p) {
    const struct cfg *c = p->c;
    const int d = c->procs - 1;
    if (d < 1) return;
    const size_t size = c->size, w = window_for(c->window, size, (uint64_t)d);
    uint64_t *to = calloc(d, sizeof *to), *from = calloc(d, sizeof *from);
    uint64_t *sent = calloc(d, sizeof *sent), *got = calloc(d, sizeof *got);
    char *sbuf = calloc(w * d, size ? size : 1), *rbuf = calloc(w * d, size ? size : 1);
    MPI_Request *req = malloc(2 * w * d * sizeof *req);
    if (!to || !from || !sent || !got || !sbuf || !rbuf || !req) die("out of memory");
    for (int k = 0; k < d; k++) {
        to[k] = sent_to(c, p->count, c->rank, other(c->rank, k), p->j);
        from[k] = sent_to(c, p->count, other(c->rank, k), c->rank, p->j);
        p->expect_sum += stamps(from[k], size);
    }
    for (;;) {
        int r = 0;
        for (int k = 0; k < d; k++) {
            const uint64_t m = from[k] - got[k] < w ? from[k] - got[k] : w;
            for (uint64_t x = 0; x < m; x++)
                MPI_Irecv(rbuf + (k * w + x) * size, (int)size, MPI_CHAR, other(c->rank, k),
                          p->j, MPI_COMM_WORLD, &req[r++]);
        }
        const int nrecv = r;
        for (int k = 0; k < d; k++) {
            const uint64_t m = to[k] - sent[k] < w ? to[k] - sent[k] : w;
            for (uint64_t x = 0; x < m; x++) {
                char *b = sbuf + (k * w + x) * size;
                stamp(b, size, sent[k] + x + 1);
                p->sent_sum += truncated(sent[k] + x + 1, size);
                MPI_Isend(b, (int)size, MPI_CHAR, other(c->rank, k), p->j, MPI_COMM_WORLD,
                          &req[r++]);
            }
            sent[k] += m;
        }
        if (r == 0) break;
        MPI_Waitall(r, req, MPI_STATUSES_IGNORE);
        int x = 0;
        for (int k = 0; k < d && x < nrecv; k++) {
            const uint64_t m = from[k] - got[k] < w ? from[k] - got[k] : w;
            for (uint64_t y = 0; y < m; y++, x++)
                p->recv_sum += unstamp(rbuf + (k * w + y) * size, size);
            got[k] += m;
            p->received += m;
        }
    }
    free(to);
    free(from);
    free(sent);
    free(got);
    free(sbuf);
    free(rbuf);
    free(req);
}

static void *run_part(void *arg) {
    struct part *p = arg;
    switch (p->c->op) {
    case THROUGHPUT: throughput(p); break;
    case LATENCY: latency(p); break;
    case ALL_TO_ALL: all_to_all(p); break;
    }
    return NULL;
}

/* One phase of `count` messages per rank on every thread. */
static void phase(const struct cfg *c, uint64_t count, struct part *parts) {
    for (int j = 0; j < c->threads; j++) {
        memset(&parts[j], 0, sizeof parts[j]);
        parts[j].c = c;
        parts[j].j = j;
        parts[j].count = count;
    }
    if (c->threads == 1) {
        run_part(&parts[0]);
        return;
    }
    pthread_t *t = malloc(c->threads * sizeof *t);
    if (!t) die("out of memory");
    for (int j = 0; j < c->threads; j++)
        if (pthread_create(&t[j], NULL, run_part, &parts[j]) != 0) die("pthread_create");
    for (int j = 0; j < c->threads; j++) pthread_join(t[j], NULL);
    free(t);
}

int main(int argc, char **argv) {
    if (argc != 9) {
        fprintf(stderr, "usage: bench-mpi OP MODE SIZE COUNT WARMUP WINDOW THREADS IFACE\n");
        return 2;
    }
    struct cfg c = {0};
    if (strcmp(argv[1], "throughput") == 0)
        c.op = THROUGHPUT;
    else if (strcmp(argv[1], "latency") == 0 || strcmp(argv[1], "pingpong") == 0)
        c.op = LATENCY;
    else if (strcmp(argv[1], "all_to_all") == 0)
        c.op = ALL_TO_ALL;
    else {
        fprintf(stderr, "bench-mpi: operation %s: throughput, latency, pingpong or all_to_all\n",
                argv[1]);
        return 2;
    }
    c.bi = strcmp(argv[2], "bi") == 0;
    c.size = strtoull(argv[3], NULL, 10);
    c.count = strtoull(argv[4], NULL, 10);
    const uint64_t warmup = strtoull(argv[5], NULL, 10);
    c.window = strtoull(argv[6], NULL, 10);
    c.threads = atoi(argv[7]);
    const char *iface = argv[8];
    if (c.size > (1u << 30) || c.window == 0 || c.window > 4096 || c.threads < 1 ||
        c.threads > 4096) {
        fprintf(stderr, "bench-mpi: bad arguments\n");
        return 2;
    }

    int provided = 0;
    const int want = c.threads > 1 ? MPI_THREAD_MULTIPLE : MPI_THREAD_SINGLE;
    MPI_Init_thread(&argc, &argv, want, &provided);
    if (provided < want) die("this MPI library does not provide MPI_THREAD_MULTIPLE");
    MPI_Comm_rank(MPI_COMM_WORLD, &c.rank);
    MPI_Comm_size(MPI_COMM_WORLD, &c.procs);
    if (c.op != ALL_TO_ALL && c.procs % 2 != 0) die("point-to-point operations need an even number of ranks");

    struct part *parts = calloc(c.threads, sizeof *parts);
    if (!parts) die("out of memory");
    if (warmup > 0) {
        phase(&c, warmup, parts);
        for (int j = 0; j < c.threads; j++) free(parts[j].samples);
    }

    /* Read before the barrier: no rank can leave it (and start sending)
       before rank 0 has entered it, so no measured byte is missed. */
    const uint64_t wire0 = c.rank == 0 ? tx_bytes(iface) : 0;
    MPI_Barrier(MPI_COMM_WORLD);
    const double cpu0 = cpu_s();
    const double t0 = MPI_Wtime();
    phase(&c, c.count, parts);
    const double elapsed = MPI_Wtime() - t0;
    const double cpu = cpu_s() - cpu0;
    MPI_Barrier(MPI_COMM_WORLD);
    const uint64_t wire = c.rank == 0 ? tx_bytes(iface) - wire0 : 0;

    uint64_t mine[4] = {0, 0, 0, 0}, all[4];
    for (int j = 0; j < c.threads; j++) {
        mine[0] += parts[j].received;
        mine[1] += parts[j].sent_sum;
        mine[2] += parts[j].recv_sum;
        /* Threads whose received stamps are not what was sent to them. */
        mine[3] += parts[j].recv_sum != parts[j].expect_sum;
    }
    MPI_Reduce(mine, all, 4, MPI_UINT64_T, MPI_SUM, 0, MPI_COMM_WORLD);
    double slowest = 0, cpu_sum = 0;
    MPI_Reduce(&elapsed, &slowest, 1, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
    MPI_Reduce(&cpu, &cpu_sum, 1, MPI_DOUBLE, MPI_SUM, 0, MPI_COMM_WORLD);

    /* Round-trip samples of every rank to rank 0. */
    uint64_t nmine = 0;
    for (int j = 0; j < c.threads; j++) nmine += parts[j].nsamples;
    uint64_t *flat = malloc((nmine ? nmine : 1) * sizeof *flat);
    if (!flat) die("out of memory");
    for (int j = 0, k = 0; j < c.threads; j++)
        for (uint64_t i = 0; i < parts[j].nsamples; i++) flat[k++] = parts[j].samples[i];
    if (nmine > (uint64_t)1 << 30) die("too many samples");
    int n_i = (int)nmine;
    int *counts = NULL, *displs = NULL;
    uint64_t *samples = NULL;
    if (c.rank == 0) {
        counts = calloc(c.procs, sizeof *counts);
        displs = calloc(c.procs, sizeof *displs);
        if (!counts || !displs) die("out of memory");
    }
    MPI_Gather(&n_i, 1, MPI_INT, counts, 1, MPI_INT, 0, MPI_COMM_WORLD);
    uint64_t total = 0;
    if (c.rank == 0) {
        for (int r = 0; r < c.procs; r++) {
            displs[r] = (int)total;
            total += (uint64_t)counts[r];
        }
        if (total > (uint64_t)1 << 30) die("too many samples");
        samples = malloc((total ? total : 1) * sizeof *samples);
        if (!samples) die("out of memory");
    }
    MPI_Gatherv(flat, n_i, MPI_UINT64_T, samples, counts, displs, MPI_UINT64_T, 0,
                MPI_COMM_WORLD);

    if (c.rank == 0) {
        printf("RESULT messages=%llu elapsed_s=%.9f cpu_s=%.6f wire_bytes=%llu sum_ok=%d\n",
               (unsigned long long)all[0], slowest, cpu_sum, (unsigned long long)wire,
               all[1] == all[2] && all[3] == 0);
        for (uint64_t i = 0; i < total; i++) printf("S %llu\n", (unsigned long long)samples[i]);
        /* The output is complete: the launcher may stop ranks that hang in
           MPI_Finalize (MPICH over UCX's TCP transport does now and then). */
        printf("END\n");
        fflush(stdout);
    }
    MPI_Finalize();
    return 0;
}
