// cuda_workload: a CUDA program for the plugin's GPU-machine tests.
//
// It fills N GiB of device memory with a pattern, then keeps a device counter running (one
// kernel launch per period) and appends the counter to OUT.<pid>. SIGUSR1 asks it to verify the
// whole pattern on the GPU and append "verify ok" or "verify FAIL <n> words". With --children K
// it forks K children before touching CUDA; each child does the same with its own context.
//
// Build: nvcc -O2 -o cuda_workload cuda_workload.cu
// Usage: cuda_workload --out PREFIX [--gib G] [--mib M] [--children K] [--period-ms P]
//                      [--devices N | --device D | --spread 1]
//   --devices N  hold G GiB on each of devices 0..N-1 (default: device 0 only)
//   --device D   use device D only
//   --spread 1   process k of the tree (0 = parent) uses device k % (device count)
#include <cuda_runtime.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static volatile sig_atomic_t verify_requested;
static void on_usr1(int sig) { (void)sig; verify_requested = 1; }

__device__ __forceinline__ uint32_t pattern(uint64_t i) {
    uint64_t x = i * 0x9E3779B97F4A7C15ull + 0x5eed;
    x ^= x >> 29;
    return (uint32_t)(x * 0xBF58476D1CE4E5B9ull >> 32);
}

__global__ void fill(uint32_t *p, uint64_t n) {
    for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n;
         i += (uint64_t)gridDim.x * blockDim.x)
        p[i] = pattern(i);
}

__global__ void check(const uint32_t *p, uint64_t n, unsigned long long *bad) {
    unsigned long long mine = 0;
    for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n;
         i += (uint64_t)gridDim.x * blockDim.x)
        mine += p[i] != pattern(i);
    if (mine) atomicAdd(bad, mine);
}

__global__ void bump(unsigned long long *counter) { *counter += 1; }

static void out_line(const char *prefix, const char *line) {
    char path[512];
    snprintf(path, sizeof path, "%s.%d", prefix, (int)getpid());
    FILE *f = fopen(path, "a");
    if (!f) return;
    fprintf(f, "%s\n", line);
    fclose(f);
}

#define CK(call)                                                                      \
    do {                                                                              \
        cudaError_t e_ = (call);                                                      \
        if (e_ != cudaSuccess) {                                                      \
            char m_[256];                                                             \
            snprintf(m_, sizeof m_, "cuda error %s in %s", cudaGetErrorString(e_), #call); \
            out_line(out, m_);                                                        \
            exit(2);                                                                  \
        }                                                                             \
    } while (0)

#define MAX_DEV 16

static int run(const char *out, uint64_t bytes, int period_ms, int first_dev, int ndev) {
    uint64_t n = bytes / 4;
    uint32_t *buf[MAX_DEV];
    unsigned long long *counter = NULL, *bad[MAX_DEV];
    char line[512];
    int len = snprintf(line, sizeof line, "ready pid=%d bytes=%llu devices", (int)getpid(),
                       (unsigned long long)bytes);
    for (int d = 0; d < ndev; d++) {
        CK(cudaSetDevice(first_dev + d));
        CK(cudaMalloc(&buf[d], n * 4));
        CK(cudaMalloc(&bad[d], sizeof *bad[d]));
        fill<<<4096, 256>>>(buf[d], n);
        CK(cudaDeviceSynchronize());
        char pci[32] = "?";
        cudaDeviceGetPCIBusId(pci, sizeof pci, first_dev + d);
        len += snprintf(line + len, sizeof line - len, " %d:%s", first_dev + d, pci);
    }
    CK(cudaSetDevice(first_dev));
    CK(cudaMalloc(&counter, sizeof *counter));
    CK(cudaMemset(counter, 0, sizeof *counter));
    out_line(out, line);
    for (;;) {
        CK(cudaSetDevice(first_dev));
        bump<<<1, 1>>>(counter);
        unsigned long long c = 0;
        CK(cudaMemcpy(&c, counter, sizeof c, cudaMemcpyDeviceToHost));
        snprintf(line, sizeof line, "counter %llu", c);
        out_line(out, line);
        if (verify_requested) {
            verify_requested = 0;
            unsigned long long total = 0;
            for (int d = 0; d < ndev; d++) {
                CK(cudaSetDevice(first_dev + d));
                CK(cudaMemset(bad[d], 0, sizeof *bad[d]));
                check<<<4096, 256>>>(buf[d], n, bad[d]);
                unsigned long long b = 0;
                CK(cudaMemcpy(&b, bad[d], sizeof b, cudaMemcpyDeviceToHost));
                total += b;
            }
            if (total == 0)
                snprintf(line, sizeof line, "verify ok counter=%llu devices=%d", c, ndev);
            else
                snprintf(line, sizeof line, "verify FAIL %llu words", total);
            out_line(out, line);
        }
        struct timespec ts = {period_ms / 1000, (long)(period_ms % 1000) * 1000000L};
        nanosleep(&ts, NULL);
    }
}

int main(int argc, char **argv) {
    const char *out = NULL;
    uint64_t bytes = 1ull << 30;
    int children = 0, period_ms = 20, ndev = 1, device = 0, spread = 0;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--out")) out = argv[i + 1];
        else if (!strcmp(argv[i], "--gib")) bytes = strtoull(argv[i + 1], NULL, 0) << 30;
        else if (!strcmp(argv[i], "--mib")) bytes = strtoull(argv[i + 1], NULL, 0) << 20;
        else if (!strcmp(argv[i], "--children")) children = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--period-ms")) period_ms = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--devices")) ndev = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--device")) device = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--spread")) spread = atoi(argv[i + 1]);
    }
    if (!out) {
        fprintf(stderr, "usage: %s --out PREFIX [--gib G] [--children K]\n", argv[0]);
        return 1;
    }
    if (ndev < 1 || ndev > MAX_DEV) ndev = 1;
    signal(SIGUSR1, on_usr1);
    // Counting devices would initialise CUDA before fork; WORKLOAD_GPUS says how many there are.
    int count = getenv("WORKLOAD_GPUS") ? atoi(getenv("WORKLOAD_GPUS")) : 1;
    for (int k = 0; k < children; k++) {
        pid_t p = fork();
        if (p == 0) return run(out, bytes, period_ms, spread ? (k + 1) % count : device, ndev);
        char line[64];
        snprintf(line, sizeof line, "child %d", (int)p);
        out_line(out, line);
    }
    return run(out, bytes, period_ms, device, ndev);
}
