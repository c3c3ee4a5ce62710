// Do the CUDA virtual-memory calls run in parallel when several host threads make them?
//
// Each of T threads owns 2 MiB physical handles and a virtual range of its own and repeats:
// map every handle (one cuMemMap each), set access (one cuMemSetAccess each), unmap them (one
// cuMemUnmap each). Printed: wall time, calls per second over all threads, and the mean
// microseconds per call as one thread sees it. If the driver serialises these calls, the
// aggregate calls per second stays flat as T grows; if not, it rises.
//
// Build and run on a machine with the CUDA toolkit and a driver:
//     cc -O2 -o /tmp/vmm_threads scripts/vmm_threads.c -I/usr/local/cuda/include -lcuda -lpthread
//     /tmp/vmm_threads            # T = 1, 2, 4, 8
#include <cuda.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define PAGES 8
#define ROUNDS 100

static CUcontext ctx;
static CUmemAllocationProp prop;
static CUmemAccessDesc acc;
static size_t page;

static void ck(CUresult r, const char *what) {
    if (r != CUDA_SUCCESS) {
        const char *s = "?";
        cuGetErrorString(r, &s);
        fprintf(stderr, "%s: %s\n", what, s);
        exit(1);
    }
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

typedef struct {
    CUdeviceptr va;
    CUmemGenericAllocationHandle h[PAGES];
    pthread_barrier_t *start;
    double seconds;
} Worker;

static void *work(void *arg) {
    Worker *w = arg;
    ck(cuCtxSetCurrent(ctx), "cuCtxSetCurrent");
    pthread_barrier_wait(w->start);
    double t0 = now();
    for (int r = 0; r < ROUNDS; r++) {
        for (int i = 0; i < PAGES; i++) ck(cuMemMap(w->va + i * page, page, 0, w->h[i], 0), "map");
        for (int i = 0; i < PAGES; i++) ck(cuMemSetAccess(w->va + i * page, page, &acc, 1), "access");
        for (int i = 0; i < PAGES; i++) ck(cuMemUnmap(w->va + i * page, page), "unmap");
    }
    w->seconds = now() - t0;
    return NULL;
}

static void run(int threads) {
    Worker *ws = calloc(threads, sizeof(Worker));
    pthread_t *ts = calloc(threads, sizeof(pthread_t));
    pthread_barrier_t start;
    pthread_barrier_init(&start, NULL, threads + 1);
    for (int t = 0; t < threads; t++) {
        ck(cuMemAddressReserve(&ws[t].va, PAGES * page, 0, 0, 0), "reserve");
        for (int i = 0; i < PAGES; i++) ck(cuMemCreate(&ws[t].h[i], page, &prop, 0), "create");
        ws[t].start = &start;
    }
    for (int t = 0; t < threads; t++) pthread_create(&ts[t], NULL, work, &ws[t]);
    double t0 = now();
    pthread_barrier_wait(&start);
    for (int t = 0; t < threads; t++) pthread_join(ts[t], NULL);
    double wall = now() - t0;
    double calls = (double)threads * ROUNDS * PAGES * 3;
    double per_thread = 0;
    for (int t = 0; t < threads; t++) per_thread += ws[t].seconds;
    per_thread /= threads;
    printf("%7d %9.1f %14.0f %16.2f\n", threads, wall * 1e3, calls / wall,
           per_thread * 1e6 / (ROUNDS * PAGES * 3));
    for (int t = 0; t < threads; t++) {
        for (int i = 0; i < PAGES; i++) ck(cuMemRelease(ws[t].h[i]), "release");
        ck(cuMemAddressFree(ws[t].va, PAGES * page), "address free");
    }
    pthread_barrier_destroy(&start);
    free(ws);
    free(ts);
}

int main(void) {
    CUdevice dev;
    ck(cuInit(0), "cuInit");
    ck(cuDeviceGet(&dev, 0), "cuDeviceGet");
    ck(cuDevicePrimaryCtxRetain(&ctx, dev), "retain");
    ck(cuCtxSetCurrent(ctx), "cuCtxSetCurrent");
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = dev;
    acc.location = prop.location;
    acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    ck(cuMemGetAllocationGranularity(&page, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM), "granularity");
    printf("%d pages of %zu KiB per thread, %d rounds of map + set access + unmap\n", PAGES,
           page >> 10, ROUNDS);
    printf("threads   wall ms  calls/s (all)  us/call (thread)\n");
    int ns[] = {1, 2, 4, 8, 1};
    for (int i = 0; i < 5; i++) run(ns[i]);
    return 0;
}
