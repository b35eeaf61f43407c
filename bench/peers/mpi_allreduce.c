/* OpenMPI peer of `conduit bench coll --op allreduce`: MPI_Allreduce (f32, sum) over a sweep of sizes, one JSON
 * line per size in the format of Conduit's benchmark records. Built and run by bench/peers/compare.py; by hand:
 *   mpicc -O2 -o mpi_allreduce bench/peers/mpi_allreduce.c -lm
 *   mpirun -n 2 ./mpi_allreduce --min-bytes 8 --max-bytes 256M --iters 20
 * Sizes double from --min-bytes to --max-bytes (K/M/G suffixes, powers of 1024). Each size runs --warmup
 * untimed operations, then --iters timed ones; time_us is the mean time per operation, median_us and max_us the
 * median and slowest single operation, each the largest over the ranks. algbw = bytes / time, busbw = algbw * 2(n-1)/n
 * (as nccl-tests). Every operation reduces in place (MPI_IN_PLACE), as Conduit and gloo do: out of place MPI first
 * copies the input to the output. After the timed ones the buffer is refilled and one more operation is checked
 * against the exact expected sums; "wrong" is the number of wrong elements over all ranks. */
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int parse_bytes(const char* text, uint64_t* out) {
  char* end = NULL;
  errno = 0;
  double v = strtod(text, &end);
  if (end == text || errno != 0 || !(v >= 0)) return -1;
  double mult = 1;
  if (*end == 'K' || *end == 'k') mult = 1024.0, ++end;
  else if (*end == 'M' || *end == 'm') mult = 1024.0 * 1024, ++end;
  else if (*end == 'G' || *end == 'g') mult = 1024.0 * 1024 * 1024, ++end;
  if (*end == 'i') ++end;
  if (*end == 'B') ++end;
  if (*end != '\0') return -1;
  *out = (uint64_t)llround(v * mult);
  return 0;
}

static int parse_positive(const char* text, long* out) {
  char* end = NULL;
  errno = 0;
  long v = strtol(text, &end, 10);
  if (end == text || *end != '\0' || errno != 0 || v < 0) return -1;
  *out = v;
  return 0;
}

static void usage_error(int rank, const char* msg, const char* arg) {
  if (rank == 0) {
    fprintf(stderr,
            "mpi_allreduce: %s%s%s\nusage: mpi_allreduce [--min-bytes B] [--max-bytes B] [--iters N] [--warmup N]\n",
            msg, arg ? ": " : "", arg ? arg : "");
  }
  MPI_Finalize();
  exit(2);
}

static int cmp_double(const void* a, const void* b) {
  double x = *(const double*)a, y = *(const double*)b;
  return (x > y) - (x < y);
}

/* The median of v[0..n) (sorts v). */
static double median(double* v, long n) {
  qsort(v, (size_t)n, sizeof(double), cmp_double);
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/* Element i of rank r holds (r + 1) * (i % 13 + 1): small integers, so every sum is exact in f32. */
static void fill(float* buf, size_t count, int rank) {
  for (size_t i = 0; i < count; ++i) buf[i] = (float)((rank + 1) * (int)(i % 13 + 1));
}

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, world = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world);

  uint64_t min_bytes = 8, max_bytes = 256ull << 20;
  long iters = 20, warmup = 5;
  for (int i = 1; i < argc; ++i) {
    const char* a = argv[i];
    const char* v = i + 1 < argc ? argv[i + 1] : NULL;
    if (strcmp(a, "--min-bytes") == 0 || strcmp(a, "--max-bytes") == 0) {
      if (!v || parse_bytes(v, a[2] == 'm' && a[3] == 'i' ? &min_bytes : &max_bytes) != 0)
        usage_error(rank, "expected a size like 8, 64K, 4M or 1G after", a);
      ++i;
    } else if (strcmp(a, "--iters") == 0 || strcmp(a, "--warmup") == 0) {
      if (!v || parse_positive(v, a[2] == 'i' ? &iters : &warmup) != 0)
        usage_error(rank, "expected a non-negative integer after", a);
      ++i;
    } else {
      usage_error(rank, "unknown argument", a);
    }
  }
  if (iters < 1) usage_error(rank, "--iters must be at least 1", NULL);
  /* (sizes were rounded down to whole f32 elements, 0-3 bytes raised to 4; past INT_MAX elements MPI's int count
     wrapped negative) */
  if (min_bytes < 4 || min_bytes % 4 || max_bytes < 4 || max_bytes % 4)
    usage_error(rank, "--min-bytes and --max-bytes: allowed: positive multiples of 4 bytes (whole f32 elements)", NULL);
  if (max_bytes / sizeof(float) > (uint64_t)INT_MAX)
    usage_error(rank, "--max-bytes: allowed: at most 2^31 - 1 f32 elements (MPI's int count)", NULL);
  if (max_bytes < min_bytes) usage_error(rank, "--max-bytes is smaller than --min-bytes", NULL);

  size_t max_count = (size_t)(max_bytes / sizeof(float));
  float* send = malloc(max_count * sizeof(float));
  float* recv = malloc(max_count * sizeof(float));
  double* each = malloc((size_t)iters * sizeof(double));
  if (!send || !recv || !each) {
    fprintf(stderr, "mpi_allreduce: rank %d cannot allocate 2 x %llu bytes\n", rank, (unsigned long long)max_bytes);
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  fill(send, max_count, rank);
  memset(recv, 0, max_count * sizeof(float));
  const long rank_sum = (long)world * (world + 1) / 2; /* sum over r of (r + 1) */

  for (uint64_t bytes = min_bytes; bytes <= max_bytes; bytes *= 2) {
    size_t count = (size_t)(bytes / sizeof(float));
    size_t nbytes = count * sizeof(float);
    memcpy(recv, send, nbytes);
    for (long i = 0; i < warmup; ++i) MPI_Allreduce(MPI_IN_PLACE, recv, (int)count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    MPI_Barrier(MPI_COMM_WORLD);
    /* One clock read per operation (as Conduit's loop): the mean, median and slowest single call. */
    double t0 = MPI_Wtime(), prev = t0;
    for (long i = 0; i < iters; ++i) {
      MPI_Allreduce(MPI_IN_PLACE, recv, (int)count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
      double now = MPI_Wtime();
      each[i] = now - prev;
      prev = now;
    }
    double mine[3] = {(prev - t0) / (double)iters, median(each, iters), 0};
    for (long i = 0; i < iters; ++i) mine[2] = each[i] > mine[2] ? each[i] : mine[2];
    double worst[3] = {0, 0, 0}; /* each the largest over the ranks */
    MPI_Allreduce(mine, worst, 3, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    double slowest = worst[0];

    memcpy(recv, send, nbytes);
    MPI_Allreduce(MPI_IN_PLACE, recv, (int)count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    long long wrong = 0, wrong_total = 0;
    for (size_t i = 0; i < count; ++i) {
      if (recv[i] != (float)(rank_sum * (long)(i % 13 + 1))) ++wrong;
    }
    MPI_Reduce(&wrong, &wrong_total, 1, MPI_LONG_LONG, MPI_SUM, 0, MPI_COMM_WORLD);

    if (rank == 0) {
      double algbw = (double)nbytes / slowest / 1e9;
      double busbw = algbw * 2.0 * (world - 1) / world;
      printf(
          "{\"impl\":\"openmpi\",\"op\":\"allreduce\",\"algo\":\"MPI_Allreduce\",\"transport\":\"mpi\",\"world\":%d,"
          "\"dtype\":\"f32\",\"bytes\":%zu,\"count\":%zu,\"iters\":%ld,\"time_us\":%.3f,\"median_us\":%.3f,"
          "\"max_us\":%.3f,\"algbw_gbs\":%.6g,\"busbw_gbs\":%.6g,\"wrong\":%lld}\n",
          world, nbytes, count, iters, slowest * 1e6, worst[1] * 1e6, worst[2] * 1e6, algbw, busbw, wrong_total);
      fflush(stdout);
    }
    if (bytes > max_bytes / 2) break; /* no overflow past max */
  }
  free(send);
  free(recv);
  free(each);
  MPI_Finalize();
  return 0;
}
