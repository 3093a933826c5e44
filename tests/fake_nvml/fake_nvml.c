/*
 * A fake libnvidia-ml.so.1 for tests: the real pynvml binding loads it and calls it through ctypes,
 * so struct layouts, versioned structs, the two-call process-list protocol and error codes are
 * exercised exactly as against a driver.
 *
 * Values come from a script file named by $FAKE_NVML_SCRIPT, re-read whenever the file changes
 * (inode, size or mtime), so a test can change what the "GPUs" report between two polls.
 * One `key=value` per line, '#' starts a comment:
 *
 *   init=0              return code of nvmlInit* (9 = driver not loaded, 18 = version mismatch ...)
 *   count=8             number of GPUs          count_rc=0  return code of nvmlDeviceGetCount
 *   driver=550.54.15
 *   gpu.N.name=NVIDIA H100 80GB HBM3           gpu.N.uuid=GPU-...
 *   gpu.N.util=97  gpu.N.mem_util=40  gpu.N.util_rc=3 (3 = NotSupported)
 *   gpu.N.total=BYTES gpu.N.used=BYTES gpu.N.reserved=BYTES gpu.N.mem_rc=RC gpu.N.mem_v2_rc=RC
 *   gpu.N.procs=1234:1000000,5678:NA           NA = usedGpuMemory not available
 *   gpu.N.procs_rc=RC  gpu.N.name_rc=RC  gpu.N.uuid_rc=RC  gpu.N.handle_rc=RC
 *   gpu.N.lost=1        every call on the device returns GPU_IS_LOST (15)
 *   gpu.N.mig=1         MIG enabled: utilization becomes NotSupported, as on real MIG GPUs
 *   gpu.N.mig_rc=RC     return code of nvmlDeviceGetMigMode (3 on GPUs without MIG)
 *   gpu.N.events=MASK   supported event types (default Xid critical = 8)   gpu.N.events_rc=RC
 *   gpu.N.xid=79 gpu.N.xid_seq=1   raise one Xid event each time xid_seq grows
 *   cuda=12040          nvmlSystemGetCudaDriverVersion (default 12040 = CUDA 12.4)
 *
 * Health fields: each one UNSET makes its entry point return NOT_SUPPORTED (3), as on a GPU or
 * driver without it, so "unknown" is exercised through ctypes:
 *   gpu.N.ecc_mode=1                      nvmlDeviceGetEccMode (current = pending)
 *   gpu.N.ecc_uncorrected_volatile=2      nvmlDeviceGetTotalEccErrors(UNCORRECTED, VOLATILE)
 *   gpu.N.ecc_uncorrected_aggregate=5     nvmlDeviceGetTotalEccErrors(UNCORRECTED, AGGREGATE)
 *   gpu.N.retired_pending=1               nvmlDeviceGetRetiredPagesPendingStatus
 *   gpu.N.remap_pending=1 gpu.N.remap_failed=1   nvmlDeviceGetRemappedRows (either set = supported)
 *   gpu.N.pcie_gen=4 gpu.N.pcie_gen_max=5 nvmlDeviceGetCurr/MaxPcieLinkGeneration
 *   gpu.N.pcie_width=4 gpu.N.pcie_width_max=16   nvmlDeviceGetCurr/MaxPcieLinkWidth
 *   gpu.N.throttle=0x48                   nvmlDeviceGetCurrentClocksEventReasons (and the older
 *                                         ...ClocksThrottleReasons): NVML's clock-event bitmask
 *   gpu.N.temp=45                         nvmlDeviceGetTemperature(V) in C
 *   gpu.N.power_mw=70000                  nvmlDeviceGetPowerUsage in mW
 *   gpu.N.persistence=1                   nvmlDeviceGetPersistenceMode
 *   gpu.N.nvlink_down=2                   the GPU has 18 NVLink links, the first 2 inactive;
 *                                         nvmlDeviceGetNvLinkState on links 18+ is NOT_SUPPORTED
 *
 * Built with -DFAKE_OLD_DRIVER the library lacks the newer entry points (memory v2, process
 * list v2/v3, ClocksEventReasons, TemperatureV, CudaDriverVersion_v2), like an old driver, so the binding's FunctionNotFound fallbacks are exercised.
 *
 * Test helpers (not NVML): fake_nvml_reset(), fake_nvml_count("nvmlDeviceGetMemoryInfo_v2"),
 * fake_nvml_initialized().
 */

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

typedef int nvmlReturn_t;

#define NVML_SUCCESS 0
#define NVML_ERROR_UNINITIALIZED 1
#define NVML_ERROR_INVALID_ARGUMENT 2
#define NVML_ERROR_NOT_SUPPORTED 3
#define NVML_ERROR_INSUFFICIENT_SIZE 7
#define NVML_ERROR_TIMEOUT 10
#define NVML_ERROR_GPU_IS_LOST 15
#define NVML_ERROR_ARGUMENT_VERSION_MISMATCH 25

#define MAXG 64
#define MAXP 64
#define XID_CRITICAL 0x8ULL

struct fake_dev { int index; };
typedef struct fake_dev *nvmlDevice_t;

typedef struct { unsigned int gpu; unsigned int memory; } nvmlUtilization_t;
typedef struct { unsigned long long total, free, used; } nvmlMemory_t;
typedef struct {
    unsigned int version;
    unsigned long long total, reserved, free, used;
} nvmlMemory_v2_t;
#define NVML_MEMORY_V2_VERSION ((unsigned int)(sizeof(nvmlMemory_v2_t) | (2u << 24)))

typedef struct { unsigned int pid; unsigned long long usedGpuMemory; } nvmlProcessInfo_v1_t;
typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlProcessInfo_t;  /* the layout of both _v2 and _v3 */

typedef struct {
    nvmlDevice_t device;
    unsigned long long eventType;
    unsigned long long eventData;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlEventData_t;

struct fake_set { int used; unsigned long long mask[MAXG]; };
typedef struct fake_set *nvmlEventSet_t;

/* health fields: unset ones answer NOT_SUPPORTED */
enum {
    H_ECC_MODE, H_ECC_VOL, H_ECC_AGG, H_RETIRED, H_REMAP_PENDING, H_REMAP_FAILED, H_PCIE_GEN,
    H_PCIE_GEN_MAX, H_PCIE_WIDTH, H_PCIE_WIDTH_MAX, H_THROTTLE, H_TEMP, H_POWER, H_PERSIST, H_NVLINK_DOWN, H_N
};
static const char *h_keys[H_N] = {
    "ecc_mode", "ecc_uncorrected_volatile", "ecc_uncorrected_aggregate", "retired_pending", "remap_pending",
    "remap_failed", "pcie_gen", "pcie_gen_max", "pcie_width", "pcie_width_max", "throttle", "temp", "power_mw",
    "persistence", "nvlink_down",
};
#define NVLINKS 18

struct gpu_script {
    char name[96], uuid[96];
    int util, mem_util, util_rc;
    unsigned long long total, used, reserved;
    int mem_rc, mem_v2_rc;
    int nprocs;
    unsigned int pids[MAXP];
    unsigned long long pmem[MAXP];
    int procs_rc, name_rc, uuid_rc, handle_rc;
    int lost, mig, mig_rc;
    unsigned long long events;
    int events_rc;
    int xid, xid_seq;
    unsigned int has;                 /* bit per health field below: set in the script */
    unsigned long long hv[H_N];
};

struct script {
    int init_rc, count, count_rc, cuda;
    char driver[80];
    struct gpu_script g[MAXG];
};

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static struct script S;
static struct fake_dev devs[MAXG];
static struct fake_set sets[8];
static int xid_delivered[MAXG];
static int refcount;
static int loaded;
static struct stat last_st;
static char last_path[4096];

/* call counters, so tests can see what the probe calls per poll */
static const char *fn_names[] = {
    "nvmlInitWithFlags", "nvmlShutdown", "nvmlDeviceGetCount_v2", "nvmlDeviceGetHandleByIndex_v2",
    "nvmlDeviceGetName", "nvmlDeviceGetUUID", "nvmlDeviceGetUtilizationRates",
    "nvmlDeviceGetMemoryInfo", "nvmlDeviceGetMemoryInfo_v2",
    "nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetComputeRunningProcesses_v2",
    "nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetMigMode",
    "nvmlEventSetCreate", "nvmlDeviceRegisterEvents", "nvmlEventSetWait_v2",
    "nvmlDeviceGetSupportedEventTypes", "nvmlEventSetFree", "nvmlSystemGetDriverVersion",
    "nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons",
    "nvmlDeviceGetNvLinkState", "health",
};
enum {
    F_INIT, F_SHUTDOWN, F_COUNT, F_HANDLE, F_NAME, F_UUID, F_UTIL, F_MEM, F_MEM2, F_PROC1, F_PROC2,
    F_PROC3, F_MIG, F_SETCREATE, F_REGISTER, F_WAIT, F_SUPPORTED, F_SETFREE, F_DRIVER, F_CLK_EVENT,
    F_CLK_THROTTLE, F_NVLINK, F_HEALTH, F_N
};
static long counts[F_N];

static void defaults(void)
{
    memset(&S, 0, sizeof S);
    S.count = 1;
    S.cuda = 12040;
    strcpy(S.driver, "550.54.15");
    for (int i = 0; i < MAXG; i++) {
        struct gpu_script *g = &S.g[i];
        snprintf(g->name, sizeof g->name, "NVIDIA H100 80GB HBM3");
        snprintf(g->uuid, sizeof g->uuid, "GPU-fa4e0000-0000-0000-0000-%012d", i);
        g->total = 85520809984ULL;
        g->events = XID_CRITICAL;
    }
}

static void parse_procs(struct gpu_script *g, const char *v)
{
    g->nprocs = 0;
    while (*v && g->nprocs < MAXP) {
        char *end;
        unsigned long pid = strtoul(v, &end, 10);
        if (end == v) break;
        unsigned long long mem = 0;
        if (*end == ':') {
            end++;
            if (strncmp(end, "NA", 2) == 0) { mem = ~0ULL; end += 2; }
            else mem = strtoull(end, &end, 0);
        }
        g->pids[g->nprocs] = (unsigned int)pid;
        g->pmem[g->nprocs] = mem;
        g->nprocs++;
        v = end;
        while (*v == ',' || *v == ' ') v++;
    }
}

static void set_gpu(struct gpu_script *g, const char *k, const char *v)
{
    long long n = strtoll(v, NULL, 0);
    unsigned long long u = strtoull(v, NULL, 0);
    if (!strcmp(k, "name")) snprintf(g->name, sizeof g->name, "%s", v);
    else if (!strcmp(k, "uuid")) snprintf(g->uuid, sizeof g->uuid, "%s", v);
    else if (!strcmp(k, "util")) g->util = (int)n;
    else if (!strcmp(k, "mem_util")) g->mem_util = (int)n;
    else if (!strcmp(k, "util_rc")) g->util_rc = (int)n;
    else if (!strcmp(k, "total")) g->total = u;
    else if (!strcmp(k, "used")) g->used = u;
    else if (!strcmp(k, "reserved")) g->reserved = u;
    else if (!strcmp(k, "mem_rc")) g->mem_rc = (int)n;
    else if (!strcmp(k, "mem_v2_rc")) g->mem_v2_rc = (int)n;
    else if (!strcmp(k, "procs")) parse_procs(g, v);
    else if (!strcmp(k, "procs_rc")) g->procs_rc = (int)n;
    else if (!strcmp(k, "name_rc")) g->name_rc = (int)n;
    else if (!strcmp(k, "uuid_rc")) g->uuid_rc = (int)n;
    else if (!strcmp(k, "handle_rc")) g->handle_rc = (int)n;
    else if (!strcmp(k, "lost")) g->lost = (int)n;
    else if (!strcmp(k, "mig")) g->mig = (int)n;
    else if (!strcmp(k, "mig_rc")) g->mig_rc = (int)n;
    else if (!strcmp(k, "events")) g->events = u;
    else if (!strcmp(k, "events_rc")) g->events_rc = (int)n;
    else if (!strcmp(k, "xid")) g->xid = (int)n;
    else if (!strcmp(k, "xid_seq")) g->xid_seq = (int)n;
    else {
        for (int h = 0; h < H_N; h++) {
            if (!strcmp(k, h_keys[h])) {
                g->has |= 1u << h;
                g->hv[h] = u;
            }
        }
    }
}

static void parse(FILE *f)
{
    char line[8192];
    defaults();
    while (fgets(line, sizeof line, f)) {
        line[strcspn(line, "\r\n")] = 0;
        if (line[0] == '#' || !line[0]) continue;
        char *eq = strchr(line, '=');
        if (!eq) continue;
        *eq = 0;
        const char *k = line, *v = eq + 1;
        if (!strcmp(k, "init")) S.init_rc = atoi(v);
        else if (!strcmp(k, "count")) S.count = atoi(v) < 0 ? 0 : (atoi(v) > MAXG ? MAXG : atoi(v));
        else if (!strcmp(k, "count_rc")) S.count_rc = atoi(v);
        else if (!strcmp(k, "cuda")) S.cuda = atoi(v);
        else if (!strcmp(k, "driver")) snprintf(S.driver, sizeof S.driver, "%s", v);
        else if (!strncmp(k, "gpu.", 4)) {
            char *dot;
            long i = strtol(k + 4, &dot, 10);
            if (*dot == '.' && i >= 0 && i < MAXG) set_gpu(&S.g[i], dot + 1, v);
        }
    }
}

/* re-read the script when it changed; called with mu held */
static void refresh(void)
{
    const char *p = getenv("FAKE_NVML_SCRIPT");
    struct stat st;
    if (!p || stat(p, &st) != 0) {
        if (!loaded) { defaults(); loaded = 1; }
        return;
    }
    if (loaded && !strcmp(p, last_path) && st.st_ino == last_st.st_ino && st.st_size == last_st.st_size &&
        st.st_mtim.tv_sec == last_st.st_mtim.tv_sec && st.st_mtim.tv_nsec == last_st.st_mtim.tv_nsec)
        return;
    FILE *f = fopen(p, "r");
    if (!f) return;
    parse(f);
    fclose(f);
    last_st = st;
    snprintf(last_path, sizeof last_path, "%s", p);
    loaded = 1;
}

#define ENTER(fn) pthread_mutex_lock(&mu); counts[fn]++; refresh()
#define LEAVE(rc) do { nvmlReturn_t r_ = (rc); pthread_mutex_unlock(&mu); return r_; } while (0)

/* device handle -> script, or an error code; called with mu held */
static int dev_index(nvmlDevice_t d, nvmlReturn_t *rc)
{
    if (refcount <= 0) { *rc = NVML_ERROR_UNINITIALIZED; return -1; }
    if (d < devs || d >= devs + MAXG || d->index >= S.count) { *rc = NVML_ERROR_INVALID_ARGUMENT; return -1; }
    if (S.g[d->index].lost) { *rc = NVML_ERROR_GPU_IS_LOST; return -1; }
    *rc = NVML_SUCCESS;
    return d->index;
}

/* ---- test helpers ------------------------------------------------------------------------- */
void fake_nvml_reset(void)
{
    pthread_mutex_lock(&mu);
    memset(counts, 0, sizeof counts);
    memset(xid_delivered, 0, sizeof xid_delivered);
    memset(sets, 0, sizeof sets);
    refcount = 0;
    loaded = 0;
    pthread_mutex_unlock(&mu);
}

long fake_nvml_count(const char *name)
{
    for (int i = 0; i < F_N; i++)
        if (!strcmp(fn_names[i], name)) return counts[i];
    return -1;
}

int fake_nvml_initialized(void) { return refcount; }

/* ---- NVML ----------------------------------------------------------------------------------- */
const char *nvmlErrorString(nvmlReturn_t r)
{
    switch (r) {
    case 0: return "Success";
    case 1: return "Uninitialized";
    case 2: return "Invalid Argument";
    case 3: return "Not Supported";
    case 4: return "Insufficient Permissions";
    case 7: return "Insufficient Size";
    case 9: return "Driver Not Loaded";
    case 10: return "Timeout";
    case 15: return "GPU is lost";
    case 18: return "RM has detected an NVML/RM version mismatch.";
    case 25: return "Argument version mismatch";
    default: return "Unknown Error";
    }
}

nvmlReturn_t nvmlInitWithFlags(unsigned int flags)
{
    (void)flags;
    ENTER(F_INIT);
    if (S.init_rc) LEAVE(S.init_rc);
    for (int i = 0; i < MAXG; i++) devs[i].index = i;
    refcount++;
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }
nvmlReturn_t nvmlInit(void) { return nvmlInitWithFlags(0); }

nvmlReturn_t nvmlShutdown(void)
{
    ENTER(F_SHUTDOWN);
    if (refcount <= 0) LEAVE(NVML_ERROR_UNINITIALIZED);
    refcount--;
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length)
{
    ENTER(F_DRIVER);
    if (refcount <= 0) LEAVE(NVML_ERROR_UNINITIALIZED);
    if (!version || length < strlen(S.driver) + 1) LEAVE(NVML_ERROR_INSUFFICIENT_SIZE);
    strcpy(version, S.driver);
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count)
{
    ENTER(F_COUNT);
    if (refcount <= 0) LEAVE(NVML_ERROR_UNINITIALIZED);
    if (!count) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    if (S.count_rc) LEAVE(S.count_rc);
    *count = (unsigned int)S.count;
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetCount(unsigned int *count) { return nvmlDeviceGetCount_v2(count); }

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device)
{
    ENTER(F_HANDLE);
    if (refcount <= 0) LEAVE(NVML_ERROR_UNINITIALIZED);
    if (!device || index >= (unsigned int)S.count) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    if (S.g[index].handle_rc) LEAVE(S.g[index].handle_rc);
    *device = &devs[index];
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t *device)
{
    return nvmlDeviceGetHandleByIndex_v2(index, device);
}

static nvmlReturn_t copy_str(const char *src, char *dst, unsigned int length)
{
    if (!dst) return NVML_ERROR_INVALID_ARGUMENT;
    if (length < strlen(src) + 1) return NVML_ERROR_INSUFFICIENT_SIZE;
    strcpy(dst, src);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t d, char *name, unsigned int length)
{
    nvmlReturn_t rc;
    ENTER(F_NAME);
    int i = dev_index(d, &rc);
    if (i < 0) LEAVE(rc);
    if (S.g[i].name_rc) LEAVE(S.g[i].name_rc);
    LEAVE(copy_str(S.g[i].name, name, length));
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t d, char *uuid, unsigned int length)
{
    nvmlReturn_t rc;
    ENTER(F_UUID);
    int i = dev_index(d, &rc);
    if (i < 0) LEAVE(rc);
    if (S.g[i].uuid_rc) LEAVE(S.g[i].uuid_rc);
    LEAVE(copy_str(S.g[i].uuid, uuid, length));
}

nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t d, nvmlUtilization_t *u)
{
    nvmlReturn_t rc;
    ENTER(F_UTIL);
    int i = dev_index(d, &rc);
    if (i < 0) LEAVE(rc);
    if (!u) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    if (S.g[i].mig) LEAVE(NVML_ERROR_NOT_SUPPORTED);
    if (S.g[i].util_rc) LEAVE(S.g[i].util_rc);
    u->gpu = (unsigned int)S.g[i].util;
    u->memory = (unsigned int)S.g[i].mem_util;
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t d, nvmlMemory_t *m)
{
    nvmlReturn_t rc;
    ENTER(F_MEM);
    int i = dev_index(d, &rc);
    if (i < 0) LEAVE(rc);
    if (!m) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    if (S.g[i].mem_rc) LEAVE(S.g[i].mem_rc);
    /* v1 counts driver-reserved memory as used, as the real one does */
    m->total = S.g[i].total;
    m->used = S.g[i].used + S.g[i].reserved;
    m->free = m->total > m->used ? m->total - m->used : 0;
    LEAVE(NVML_SUCCESS);
}

#ifndef FAKE_OLD_DRIVER
nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t d, nvmlMemory_v2_t *m)
{
    nvmlReturn_t rc;
    ENTER(F_MEM2);
    int i = dev_index(d, &rc);
    if (i < 0) LEAVE(rc);
    if (!m) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    if (m->version != NVML_MEMORY_V2_VERSION) LEAVE(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    if (S.g[i].mem_v2_rc) LEAVE(S.g[i].mem_v2_rc);
    if (S.g[i].mem_rc) LEAVE(S.g[i].mem_rc);
    m->total = S.g[i].total;
    m->reserved = S.g[i].reserved;
    m->used = S.g[i].used;
    m->free = m->total > m->used + m->reserved ? m->total - m->used - m->reserved : 0;
    LEAVE(NVML_SUCCESS);
}
#endif

/* the two-call protocol: a too-small buffer returns INSUFFICIENT_SIZE with the needed count */
static nvmlReturn_t procs_common(int which, nvmlDevice_t d, unsigned int *count, void *infos, int v1)
{
    nvmlReturn_t rc;
    ENTER(which);
    int i = dev_index(d, &rc);
    if (i < 0) LEAVE(rc);
    if (!count) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    struct gpu_script *g = &S.g[i];
    if (g->procs_rc) LEAVE(g->procs_rc);
    unsigned int n = (unsigned int)g->nprocs;
    if (*count < n || (n > 0 && !infos)) {
        *count = n;
        LEAVE(NVML_ERROR_INSUFFICIENT_SIZE);
    }
    for (unsigned int k = 0; k < n; k++) {
        if (v1) {
            nvmlProcessInfo_v1_t *p = (nvmlProcessInfo_v1_t *)infos + k;
            p->pid = g->pids[k];
            p->usedGpuMemory = g->pmem[k];
        } else {
            nvmlProcessInfo_t *p = (nvmlProcessInfo_t *)infos + k;
            p->pid = g->pids[k];
            p->usedGpuMemory = g->pmem[k];
            p->gpuInstanceId = 0xFFFFFFFFu;
            p->computeInstanceId = 0xFFFFFFFFu;
        }
    }
    *count = n;
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetComputeRunningProcesses(nvmlDevice_t d, unsigned int *c, nvmlProcessInfo_v1_t *p)
{
    return procs_common(F_PROC1, d, c, p, 1);
}

#ifndef FAKE_OLD_DRIVER
nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t d, unsigned int *c, nvmlProcessInfo_t *p)
{
    return procs_common(F_PROC2, d, c, p, 0);
}

nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t d, unsigned int *c, nvmlProcessInfo_t *p)
{
    return procs_common(F_PROC3, d, c, p, 0);
}
#endif

nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t d, unsigned int *current, unsigned int *pending)
{
    nvmlReturn_t rc;
    ENTER(F_MIG);
    int i = dev_index(d, &rc);
    if (i < 0) LEAVE(rc);
    if (!current || !pending) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    if (S.g[i].mig_rc) LEAVE(S.g[i].mig_rc);
    *current = *pending = S.g[i].mig ? 1u : 0u;
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetSupportedEventTypes(nvmlDevice_t d, unsigned long long *types)
{
    nvmlReturn_t rc;
    ENTER(F_SUPPORTED);
    int i = dev_index(d, &rc);
    if (i < 0) LEAVE(rc);
    if (!types) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    if (S.g[i].events_rc) LEAVE(S.g[i].events_rc);
    *types = S.g[i].events;
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *set)
{
    ENTER(F_SETCREATE);
    if (refcount <= 0) LEAVE(NVML_ERROR_UNINITIALIZED);
    if (!set) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    for (int k = 0; k < 8; k++) {
        if (!sets[k].used) {
            memset(&sets[k], 0, sizeof sets[k]);
            sets[k].used = 1;
            *set = &sets[k];
            LEAVE(NVML_SUCCESS);
        }
    }
    LEAVE(NVML_ERROR_INVALID_ARGUMENT);
}

static int valid_set(nvmlEventSet_t s) { return s >= sets && s < sets + 8 && s->used; }

nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t d, unsigned long long types, nvmlEventSet_t set)
{
    nvmlReturn_t rc;
    ENTER(F_REGISTER);
    int i = dev_index(d, &rc);
    if (i < 0) LEAVE(rc);
    if (!valid_set(set)) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    if (S.g[i].events_rc) LEAVE(S.g[i].events_rc);
    if (types & ~S.g[i].events) LEAVE(NVML_ERROR_NOT_SUPPORTED);
    set->mask[i] |= types;
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms)
{
    (void)timeoutms; /* never sleeps: an event is either pending or the wait times out at once */
    ENTER(F_WAIT);
    if (refcount <= 0) LEAVE(NVML_ERROR_UNINITIALIZED);
    if (!valid_set(set) || !data) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    for (int i = 0; i < S.count; i++) {
        struct gpu_script *g = &S.g[i];
        if ((set->mask[i] & XID_CRITICAL) && g->xid_seq > xid_delivered[i]) {
            xid_delivered[i] = g->xid_seq;
            data->device = &devs[i];
            data->eventType = XID_CRITICAL;
            data->eventData = (unsigned long long)g->xid;
            data->gpuInstanceId = 0xFFFFFFFFu;
            data->computeInstanceId = 0xFFFFFFFFu;
            LEAVE(NVML_SUCCESS);
        }
    }
    LEAVE(NVML_ERROR_TIMEOUT);
}

nvmlReturn_t nvmlEventSetWait(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms)
{
    return nvmlEventSetWait_v2(set, data, timeoutms);
}

nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set)
{
    ENTER(F_SETFREE);
    if (!valid_set(set)) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    set->used = 0;
    LEAVE(NVML_SUCCESS);
}

/* ---- health -------------------------------------------------------------------------------- */
/* one scripted field of a device, or NOT_SUPPORTED when the script leaves it unset */
#define HEALTH_FIELD(fn_counter, field, out_expr)                              \
    nvmlReturn_t rc;                                                           \
    ENTER(fn_counter);                                                         \
    int i = dev_index(d, &rc);                                                 \
    if (i < 0) LEAVE(rc);                                                      \
    if (!(S.g[i].has & (1u << (field)))) LEAVE(NVML_ERROR_NOT_SUPPORTED);      \
    out_expr;                                                                  \
    LEAVE(NVML_SUCCESS)

#define F_NONE F_HEALTH /* the other health calls share one counter ("health") */

nvmlReturn_t nvmlDeviceGetEccMode(nvmlDevice_t d, int *current, int *pending)
{
    if (!current || !pending) return NVML_ERROR_INVALID_ARGUMENT;
    HEALTH_FIELD(F_NONE, H_ECC_MODE, (*current = *pending = (int)S.g[i].hv[H_ECC_MODE]));
}

/* errorType 1 = uncorrected; counterType 0 = volatile, 1 = aggregate. Corrected counts: NOT_SUPPORTED. */
nvmlReturn_t nvmlDeviceGetTotalEccErrors(nvmlDevice_t d, int errorType, int counterType, unsigned long long *count)
{
    nvmlReturn_t rc;
    ENTER(F_NONE);
    int i = dev_index(d, &rc);
    if (i < 0) LEAVE(rc);
    if (!count || counterType < 0 || counterType > 1) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    int field = counterType == 0 ? H_ECC_VOL : H_ECC_AGG;
    if (errorType != 1 || !(S.g[i].has & (1u << field))) LEAVE(NVML_ERROR_NOT_SUPPORTED);
    *count = S.g[i].hv[field];
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetRetiredPagesPendingStatus(nvmlDevice_t d, int *pending)
{
    if (!pending) return NVML_ERROR_INVALID_ARGUMENT;
    HEALTH_FIELD(F_NONE, H_RETIRED, (*pending = S.g[i].hv[H_RETIRED] ? 1 : 0));
}

nvmlReturn_t nvmlDeviceGetRemappedRows(nvmlDevice_t d, unsigned int *corr, unsigned int *unc,
                                       unsigned int *pending, unsigned int *failed)
{
    nvmlReturn_t rc;
    ENTER(F_NONE);
    int i = dev_index(d, &rc);
    if (i < 0) LEAVE(rc);
    if (!corr || !unc || !pending || !failed) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    if (!(S.g[i].has & ((1u << H_REMAP_PENDING) | (1u << H_REMAP_FAILED)))) LEAVE(NVML_ERROR_NOT_SUPPORTED);
    *corr = 0;
    *unc = 0;
    *pending = S.g[i].hv[H_REMAP_PENDING] ? 1u : 0u;
    *failed = S.g[i].hv[H_REMAP_FAILED] ? 1u : 0u;
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetCurrPcieLinkGeneration(nvmlDevice_t d, unsigned int *v)
{
    if (!v) return NVML_ERROR_INVALID_ARGUMENT;
    HEALTH_FIELD(F_NONE, H_PCIE_GEN, (*v = (unsigned int)S.g[i].hv[H_PCIE_GEN]));
}

nvmlReturn_t nvmlDeviceGetMaxPcieLinkGeneration(nvmlDevice_t d, unsigned int *v)
{
    if (!v) return NVML_ERROR_INVALID_ARGUMENT;
    HEALTH_FIELD(F_NONE, H_PCIE_GEN_MAX, (*v = (unsigned int)S.g[i].hv[H_PCIE_GEN_MAX]));
}

nvmlReturn_t nvmlDeviceGetCurrPcieLinkWidth(nvmlDevice_t d, unsigned int *v)
{
    if (!v) return NVML_ERROR_INVALID_ARGUMENT;
    HEALTH_FIELD(F_NONE, H_PCIE_WIDTH, (*v = (unsigned int)S.g[i].hv[H_PCIE_WIDTH]));
}

nvmlReturn_t nvmlDeviceGetMaxPcieLinkWidth(nvmlDevice_t d, unsigned int *v)
{
    if (!v) return NVML_ERROR_INVALID_ARGUMENT;
    HEALTH_FIELD(F_NONE, H_PCIE_WIDTH_MAX, (*v = (unsigned int)S.g[i].hv[H_PCIE_WIDTH_MAX]));
}

#ifndef FAKE_OLD_DRIVER
nvmlReturn_t nvmlDeviceGetCurrentClocksEventReasons(nvmlDevice_t d, unsigned long long *v)
{
    if (!v) return NVML_ERROR_INVALID_ARGUMENT;
    HEALTH_FIELD(F_CLK_EVENT, H_THROTTLE, (*v = S.g[i].hv[H_THROTTLE]));
}
#endif

nvmlReturn_t nvmlDeviceGetCurrentClocksThrottleReasons(nvmlDevice_t d, unsigned long long *v)
{
    if (!v) return NVML_ERROR_INVALID_ARGUMENT;
    HEALTH_FIELD(F_CLK_THROTTLE, H_THROTTLE, (*v = S.g[i].hv[H_THROTTLE]));
}

nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t d, int sensor, unsigned int *v)
{
    if (!v) return NVML_ERROR_INVALID_ARGUMENT;
    if (sensor != 0) return NVML_ERROR_NOT_SUPPORTED;
    HEALTH_FIELD(F_NONE, H_TEMP, (*v = (unsigned int)S.g[i].hv[H_TEMP]));
}

#ifndef FAKE_OLD_DRIVER
typedef struct { unsigned int version; int sensorType; int temperature; } nvmlTemperature_v1_t;
nvmlReturn_t nvmlDeviceGetTemperatureV(nvmlDevice_t d, nvmlTemperature_v1_t *t)
{
    if (!t) return NVML_ERROR_INVALID_ARGUMENT;
    if (t->version != (unsigned int)(sizeof(nvmlTemperature_v1_t) | (1u << 24)))
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    if (t->sensorType != 0) return NVML_ERROR_NOT_SUPPORTED;
    HEALTH_FIELD(F_NONE, H_TEMP, (t->temperature = (int)S.g[i].hv[H_TEMP]));
}
#endif

nvmlReturn_t nvmlDeviceGetPowerUsage(nvmlDevice_t d, unsigned int *v)
{
    if (!v) return NVML_ERROR_INVALID_ARGUMENT;
    HEALTH_FIELD(F_NONE, H_POWER, (*v = (unsigned int)S.g[i].hv[H_POWER]));
}

nvmlReturn_t nvmlDeviceGetPersistenceMode(nvmlDevice_t d, int *v)
{
    if (!v) return NVML_ERROR_INVALID_ARGUMENT;
    HEALTH_FIELD(F_NONE, H_PERSIST, (*v = S.g[i].hv[H_PERSIST] ? 1 : 0));
}

nvmlReturn_t nvmlDeviceGetNvLinkState(nvmlDevice_t d, unsigned int link, unsigned int *active)
{
    if (!active) return NVML_ERROR_INVALID_ARGUMENT;
    if (link >= NVLINKS) {
        nvmlReturn_t rc;
        ENTER(F_NVLINK);
        if (dev_index(d, &rc) < 0) LEAVE(rc);
        LEAVE(NVML_ERROR_NOT_SUPPORTED);
    }
    HEALTH_FIELD(F_NVLINK, H_NVLINK_DOWN, (*active = link < S.g[i].hv[H_NVLINK_DOWN] ? 0u : 1u));
}

nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *v)
{
    ENTER(F_NONE);
    if (refcount <= 0) LEAVE(NVML_ERROR_UNINITIALIZED);
    if (!v) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    if (S.cuda <= 0) LEAVE(NVML_ERROR_NOT_SUPPORTED);
    *v = S.cuda;
    LEAVE(NVML_SUCCESS);
}

#ifndef FAKE_OLD_DRIVER
nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *v) { return nvmlSystemGetCudaDriverVersion(v); }
#endif
