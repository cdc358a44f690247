/*
 * The MPI peer of `dxnet-bench shuffle`: the same all-to-all exchange as a
 * dxshuffle run (P processes = MPI ranks, T workers each, every worker
 * sending `records` records of `size` bytes to destinations drawn by the
 * same generator, uniform or skewed to worker 0), done the way an MPI
 * program does it: records are laid out per destination process, counts
 * go out with MPI_Alltoall and the data with MPI_Alltoallv, and each rank
 * parses what it received, counting the records of each of its workers.
 * With `chunk` > 0 the exchange runs in rounds of at most `chunk` records
 * per worker (bounded memory, like a streaming shuffle); 0: one round.
 *
 * Wire layout of one record: [dest worker u32][length u32][payload].
 *
 * Usage: shuffle-mpi THREADS RECORDS SIZE SKEW CHUNK
 * Prints (rank 0): RESULT pushed=.. received=.. bytes=.. elapsed_s=..
 * cpu_s=.. blocked_s=0, summed over ranks (elapsed: the slowest rank).
 */
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>

static double cpu_s(void) {
    struct rusage u;
    getrusage(RUSAGE_SELF, &u);
    return u.ru_utime.tv_sec + u.ru_utime.tv_usec / 1e6 + u.ru_stime.tv_sec +
           u.ru_stime.tv_usec / 1e6;
}

static void die(const char *what) {
    fprintf(stderr, "shuffle-mpi: %s\n", what);
    MPI_Abort(MPI_COMM_WORLD, 2);
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank, procs;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &procs);
    if (argc != 6) die("usage: shuffle-mpi THREADS RECORDS SIZE SKEW CHUNK");
    const uint64_t threads = strtoull(argv[1], NULL, 10);
    const uint64_t records = strtoull(argv[2], NULL, 10);
    const uint64_t size = strtoull(argv[3], NULL, 10);
    const double skew = strtod(argv[4], NULL);
    uint64_t chunk = strtoull(argv[5], NULL, 10);
    if (threads == 0 || size > UINT32_MAX) die("bad arguments");
    if (chunk == 0 || chunk > records) chunk = records ? records : 1;
    const uint64_t workers = (uint64_t)procs * threads;
    const uint64_t rec_bytes = 8 + size;

    /* One generator per local worker, as in dxnet-bench's shuffle-node. */
    uint64_t *x = malloc(threads * sizeof *x);
    for (uint64_t t = 0; t < threads; t++)
        x[t] = ((rank * threads + t + 1) * 0x9E3779B97F4A7C15ull) | 1;
    /* Per destination process: bytes this round (worst case: everything). */
    const uint64_t cap = chunk * threads * rec_bytes;
    if (cap > (uint64_t)1 << 40) die("chunk too large");
    char **out = malloc(procs * sizeof *out);
    for (int p = 0; p < procs; p++) out[p] = malloc(cap ? cap : 1);
    int *scount = calloc(procs, sizeof(int)), *sdispl = calloc(procs, sizeof(int));
    int *rcount = calloc(procs, sizeof(int)), *rdispl = calloc(procs, sizeof(int));
    char *sendbuf = NULL, *recvbuf = NULL;
    size_t sendcap = 0, recvcap = 0;
    char *payload = malloc(size ? size : 1);
    memset(payload, 0x5a, size);
    uint64_t *per_worker = calloc(threads, sizeof *per_worker);
    uint64_t received = 0, bytes = 0;

    MPI_Barrier(MPI_COMM_WORLD);
    const double cpu0 = cpu_s();
    const double t0 = MPI_Wtime();
    for (uint64_t done = 0; done < records; done += chunk) {
        const uint64_t n = records - done < chunk ? records - done : chunk;
        uint64_t *fill = calloc(procs, sizeof *fill);
        for (uint64_t t = 0; t < threads; t++) {
            for (uint64_t i = 0; i < n; i++) {
                uint64_t v = x[t];
                v ^= v << 13;
                v ^= v >> 7;
                v ^= v << 17;
                x[t] = v;
                uint64_t to;
                if (skew > 0.0 && (double)(v >> 11) / (double)(1ull << 53) <= skew)
                    to = 0;
                else
                    to = v % workers;
                int p = (int)(to / threads);
                char *at = out[p] + fill[p];
                uint32_t h[2] = {(uint32_t)to, (uint32_t)size};
                memcpy(at, h, 8);
                memcpy(at + 8, payload, size);
                fill[p] += rec_bytes;
            }
        }
        uint64_t total = 0;
        for (int p = 0; p < procs; p++) {
            if (fill[p] > INT32_MAX) die("a round exceeds 2 GiB to one rank: use a smaller chunk");
            scount[p] = (int)fill[p];
            sdispl[p] = (int)total;
            total += fill[p];
        }
        if (total > INT32_MAX) die("a round exceeds 2 GiB: use a smaller chunk");
        if (total > sendcap) {
            free(sendbuf);
            sendcap = total;
            sendbuf = malloc(sendcap ? sendcap : 1);
        }
        for (int p = 0; p < procs; p++) memcpy(sendbuf + sdispl[p], out[p], fill[p]);
        free(fill);
        MPI_Alltoall(scount, 1, MPI_INT, rcount, 1, MPI_INT, MPI_COMM_WORLD);
        uint64_t rtotal = 0;
        for (int p = 0; p < procs; p++) {
            rdispl[p] = (int)rtotal;
            rtotal += (uint64_t)rcount[p];
        }
        if (rtotal > INT32_MAX) die("a round exceeds 2 GiB received: use a smaller chunk");
        if (rtotal > recvcap) {
            free(recvbuf);
            recvcap = rtotal;
            recvbuf = malloc(recvcap ? recvcap : 1);
        }
        MPI_Alltoallv(sendbuf, scount, sdispl, MPI_BYTE, recvbuf, rcount, rdispl, MPI_BYTE,
                      MPI_COMM_WORLD);
        /* Parse: every record checked against its header, counted per worker. */
        for (uint64_t off = 0; off < rtotal;) {
            uint32_t h[2];
            if (rtotal - off < 8) die("a record header runs past the data");
            memcpy(h, recvbuf + off, 8);
            if (h[0] / threads != (uint64_t)rank || h[1] != size || rtotal - off - 8 < h[1])
                die("a record is not for this rank or runs past the data");
            per_worker[h[0] % threads]++;
            received++;
            bytes += h[1];
            off += 8 + (uint64_t)h[1];
        }
    }
    double elapsed = MPI_Wtime() - t0;
    double cpu = cpu_s() - cpu0;

    uint64_t pushed = records * threads, sums[3] = {pushed, received, bytes}, tot[3];
    double slowest, cpu_total;
    MPI_Reduce(sums, tot, 3, MPI_UINT64_T, MPI_SUM, 0, MPI_COMM_WORLD);
    MPI_Reduce(&elapsed, &slowest, 1, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
    MPI_Reduce(&cpu, &cpu_total, 1, MPI_DOUBLE, MPI_SUM, 0, MPI_COMM_WORLD);
    if (rank == 0) {
        printf("RESULT pushed=%llu received=%llu bytes=%llu elapsed_s=%.6f cpu_s=%.6f blocked_s=0\n",
               (unsigned long long)tot[0], (unsigned long long)tot[1],
               (unsigned long long)tot[2], slowest, cpu_total);
        fflush(stdout);
    }
    MPI_Finalize();
    return 0;
}
