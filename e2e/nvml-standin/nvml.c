/*
 * A stand-in for libnvidia-ml.so.1: only the calls gpuhealth-agent makes
 * (through the nvml-wrapper crate), answered from the simulated GPUs under
 * $NVML_STANDIN_ROOT (state.h). Like the driver, it keeps a GPU's device
 * node open while a handle on it is held, from the first handle until the
 * last nvmlShutdown, so that nvidia-smi (the stand-in too) refuses to reset
 * a GPU that any process still holds.
 *
 * Types and numbers follow NVML's public header (nvml.h).
 */
#include <fcntl.h>
#include <pthread.h>
#include <sys/stat.h>

#include "state.h"

typedef int nvmlReturn_t;
enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3,
    NVML_ERROR_NOT_FOUND = 6,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_DRIVER_NOT_LOADED = 9,
    NVML_ERROR_TIMEOUT = 10,
    NVML_ERROR_GPU_IS_LOST = 15,
    NVML_ERROR_UNKNOWN = 999,
};

#define MAX_MIG 8
#define EVENT_XID_CRITICAL 8ULL
#define FIELD_RECOVERY_ACTION 230
#define FIELD_REMAPPED_PENDING 144
#define FIELD_REMAPPED_FAILURE 145
#define VALUE_UNSIGNED_INT 1
#define NO_INSTANCE 0xFFFFFFFFu

struct device {
    int index;
    int mig; /* 0: the GPU; n > 0: its MIG device n - 1 */
};
typedef struct device *nvmlDevice_t;

typedef struct {
    char busIdLegacy[16];
    unsigned int domain, bus, device, pciDeviceId, pciSubSystemId;
    char busId[32];
} nvmlPciInfo_t;

typedef union {
    double dVal;
    int siVal;
    unsigned int uiVal;
    unsigned long ulVal;
    unsigned long long ullVal;
    long long sllVal;
    unsigned short usVal;
} nvmlValue_t;

typedef struct {
    unsigned int fieldId, scopeId;
    long long timestamp, latencyUsec;
    int valueType;
    nvmlReturn_t nvmlReturn;
    nvmlValue_t value;
} nvmlFieldValue_t;

typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId, computeInstanceId;
} nvmlProcessInfo_t;

typedef struct {
    nvmlDevice_t device;
    unsigned long long eventType, eventData;
    unsigned int gpuInstanceId, computeInstanceId;
} nvmlEventData_t;

struct event_set {
    int registered[MAX_GPUS];
    long offset; /* into `events`: only what comes after registration */
};
typedef struct event_set *nvmlEventSet_t;

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static int init_count;
static int ctl_fd = -1;
static int dev_fd[MAX_GPUS];
static struct device devices[MAX_GPUS][MAX_MIG + 1];

static void close_all(void) {
    if (ctl_fd >= 0)
        close(ctl_fd);
    ctl_fd = -1;
    for (int i = 0; i < MAX_GPUS; i++) {
        if (dev_fd[i] > 0)
            close(dev_fd[i]);
        dev_fd[i] = 0;
    }
}

nvmlReturn_t nvmlInit_v2(void) {
    char path[PATH_MAX];
    if (!standin_root())
        return NVML_ERROR_DRIVER_NOT_LOADED;
    pthread_mutex_lock(&mu);
    if (init_count == 0) {
        standin_path(path, sizeof path, "dev/nvidiactl");
        ctl_fd = open(path, O_RDONLY | O_CLOEXEC);
        if (ctl_fd < 0) {
            pthread_mutex_unlock(&mu);
            return NVML_ERROR_DRIVER_NOT_LOADED;
        }
    }
    init_count++;
    pthread_mutex_unlock(&mu);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlShutdown(void) {
    pthread_mutex_lock(&mu);
    if (init_count == 0) {
        pthread_mutex_unlock(&mu);
        return NVML_ERROR_UNINITIALIZED;
    }
    if (--init_count == 0)
        close_all();
    pthread_mutex_unlock(&mu);
    return NVML_SUCCESS;
}

const char *nvmlErrorString(nvmlReturn_t r) {
    switch (r) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case NVML_ERROR_TIMEOUT: return "Timeout";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    default: return "Unknown Error";
    }
}

static int initialised(void) {
    pthread_mutex_lock(&mu);
    int n = init_count;
    pthread_mutex_unlock(&mu);
    return n > 0;
}

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    char path[PATH_MAX], v[80] = "580.95.05";
    if (!initialised())
        return NVML_ERROR_UNINITIALIZED;
    standin_path(path, sizeof path, "driver");
    FILE *f = fopen(path, "r");
    if (f) {
        if (fgets(v, sizeof v, f))
            v[strcspn(v, "\r\n")] = 0;
        fclose(f);
    }
    if (strlen(v) + 1 > length)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    strcpy(version, v);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) {
    if (!initialised())
        return NVML_ERROR_UNINITIALIZED;
    *count = (unsigned int)gpu_count();
    return NVML_SUCCESS;
}

/* The checks every call on a device makes: initialised, present, not
 * hung (a hung GPU blocks here), not lost. */
static nvmlReturn_t usable(nvmlDevice_t d) {
    if (!initialised())
        return NVML_ERROR_UNINITIALIZED;
    if (!d || d->index < 0 || d->index >= gpu_count())
        return NVML_ERROR_INVALID_ARGUMENT;
    wait_while_hung(d->index);
    if (gpu_get_num(d->index, "lost", 0) == 1)
        return NVML_ERROR_GPU_IS_LOST;
    return NVML_SUCCESS;
}

/* A handle holds the GPU's device node open until NVML shuts down. */
static nvmlReturn_t take(int index, nvmlDevice_t *out) {
    char path[PATH_MAX], rel[32];
    struct device d = {index, 0};
    nvmlReturn_t r = usable(&d);
    if (r != NVML_SUCCESS)
        return r;
    snprintf(rel, sizeof rel, "dev/nvidia%lld", gpu_get_num(index, "minor", index));
    standin_path(path, sizeof path, rel);
    pthread_mutex_lock(&mu);
    if (dev_fd[index] <= 0) {
        int fd = open(path, O_RDONLY | O_CLOEXEC);
        if (fd < 0) {
            pthread_mutex_unlock(&mu);
            return NVML_ERROR_GPU_IS_LOST;
        }
        dev_fd[index] = fd;
    }
    devices[index][0] = d;
    *out = &devices[index][0];
    pthread_mutex_unlock(&mu);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    if (!initialised())
        return NVML_ERROR_UNINITIALIZED;
    if (!device || index >= (unsigned int)gpu_count())
        return NVML_ERROR_INVALID_ARGUMENT;
    return take((int)index, device);
}

nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device) {
    char v[128];
    if (!initialised())
        return NVML_ERROR_UNINITIALIZED;
    for (int i = 0; i < gpu_count(); i++)
        if (gpu_get(i, "uuid", v, sizeof v) == 0 && strcmp(v, uuid) == 0)
            return take(i, device);
    return NVML_ERROR_NOT_FOUND;
}

static nvmlReturn_t copy_out(const char *v, char *out, unsigned int length) {
    if (strlen(v) + 1 > length)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    strcpy(out, v);
    return NVML_SUCCESS;
}

/* The MIG device `n` (from 0) of a GPU: its UUID, from the `mig` list. */
static int mig_uuid(int index, int n, char *out, size_t len) {
    char list[1024];
    if (gpu_get(index, "mig", list, sizeof list) != 0)
        return -1;
    char *save = NULL;
    int i = 0;
    for (char *tok = strtok_r(list, ",", &save); tok; tok = strtok_r(NULL, ",", &save), i++)
        if (i == n) {
            snprintf(out, len, "%s", tok);
            return 0;
        }
    return -1;
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t d, char *uuid, unsigned int length) {
    char v[128];
    nvmlReturn_t r = usable(d);
    if (r != NVML_SUCCESS)
        return r;
    if (d->mig > 0) {
        if (mig_uuid(d->index, d->mig - 1, v, sizeof v) != 0)
            return NVML_ERROR_INVALID_ARGUMENT;
    } else if (gpu_get(d->index, "uuid", v, sizeof v) != 0) {
        return NVML_ERROR_UNKNOWN;
    }
    return copy_out(v, uuid, length);
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t d, char *name, unsigned int length) {
    char v[96] = "NVIDIA H200";
    nvmlReturn_t r = usable(d);
    if (r != NVML_SUCCESS)
        return r;
    gpu_get(d->index, "name", v, sizeof v);
    return copy_out(v, name, length);
}

nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t d, unsigned int *minor) {
    nvmlReturn_t r = usable(d);
    if (r != NVML_SUCCESS)
        return r;
    *minor = (unsigned int)gpu_get_num(d->index, "minor", d->index);
    return NVML_SUCCESS;
}

/* The GPU's `persistence` key: 1 on (nvidia-persistenced, where it runs,
 * then holds its device node), 0 or absent off. NVML_FEATURE_DISABLED is
 * 0, NVML_FEATURE_ENABLED 1. */
nvmlReturn_t nvmlDeviceGetPersistenceMode(nvmlDevice_t d, int *mode) {
    nvmlReturn_t r = usable(d);
    if (r != NVML_SUCCESS)
        return r;
    if (gpu_unsupported(d->index, "persistence"))
        return NVML_ERROR_NOT_SUPPORTED;
    *mode = gpu_get_num(d->index, "persistence", 0) == 1;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t d, nvmlPciInfo_t *pci) {
    char v[64];
    unsigned int domain = 0, bus = 0, dev = 0, fn = 0;
    nvmlReturn_t r = usable(d);
    if (r != NVML_SUCCESS)
        return r;
    if (gpu_get(d->index, "pci", v, sizeof v) != 0 ||
        sscanf(v, "%x:%x:%x.%x", &domain, &bus, &dev, &fn) < 3)
        return NVML_ERROR_UNKNOWN;
    memset(pci, 0, sizeof *pci);
    snprintf(pci->busId, sizeof pci->busId, "%08X:%02X:%02X.%X", domain, bus, dev, fn);
    snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, "%04X:%02X:%02X.%X", domain, bus, dev, fn);
    pci->domain = domain;
    pci->bus = bus;
    pci->device = dev;
    pci->pciDeviceId = 0x233510DE;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetFieldValues(nvmlDevice_t d, int count, nvmlFieldValue_t *values) {
    nvmlReturn_t r = usable(d);
    if (r != NVML_SUCCESS)
        return r;
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    for (int i = 0; i < count; i++) {
        const char *key = NULL;
        switch (values[i].fieldId) {
        case FIELD_RECOVERY_ACTION: key = "recovery_action"; break;
        case FIELD_REMAPPED_PENDING: key = "remap_pending"; break;
        case FIELD_REMAPPED_FAILURE: key = "remap_failure"; break;
        }
        values[i].timestamp = (long long)now.tv_sec * 1000000 + now.tv_nsec / 1000;
        if (!key || gpu_unsupported(d->index, key)) {
            values[i].nvmlReturn = NVML_ERROR_NOT_SUPPORTED;
            continue;
        }
        values[i].nvmlReturn = NVML_SUCCESS;
        values[i].valueType = VALUE_UNSIGNED_INT;
        values[i].value.uiVal = (unsigned int)gpu_get_num(d->index, key, 0);
    }
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetRetiredPagesPendingStatus(nvmlDevice_t d, int *pending) {
    nvmlReturn_t r = usable(d);
    if (r != NVML_SUCCESS)
        return r;
    /* Hopper and later retire no pages: they remap rows. */
    if (gpu_get_num(d->index, "pages_pending", -1) < 0)
        return NVML_ERROR_NOT_SUPPORTED;
    *pending = (int)gpu_get_num(d->index, "pages_pending", 0);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetTotalEccErrors(nvmlDevice_t d, int errorType, int counterType,
                                         unsigned long long *count) {
    nvmlReturn_t r = usable(d);
    if (r != NVML_SUCCESS)
        return r;
    /* errorType 1: uncorrected; counterType 0: volatile. */
    *count = (errorType == 1 && counterType == 0)
                 ? (unsigned long long)gpu_get_num(d->index, "ecc_uncorrected", 0)
                 : 0;
    return NVML_SUCCESS;
}

static nvmlReturn_t processes(nvmlDevice_t d, const char *key, unsigned int *count,
                              nvmlProcessInfo_t *infos) {
    char list[1024];
    unsigned int pids[64], n = 0;
    nvmlReturn_t r = usable(d);
    if (r != NVML_SUCCESS)
        return r;
    if (gpu_get(d->index, key, list, sizeof list) == 0) {
        char *save = NULL;
        for (char *tok = strtok_r(list, ",", &save); tok && n < 64; tok = strtok_r(NULL, ",", &save))
            pids[n++] = (unsigned int)strtoul(tok, NULL, 10);
    }
    if (*count < n || (!infos && n > 0)) {
        *count = n;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    for (unsigned int i = 0; i < n; i++) {
        infos[i].pid = pids[i];
        infos[i].usedGpuMemory = 1ULL << 30;
        infos[i].gpuInstanceId = NO_INSTANCE;
        infos[i].computeInstanceId = NO_INSTANCE;
    }
    *count = n;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t d, unsigned int *count,
                                                     nvmlProcessInfo_t *infos) {
    return processes(d, "processes", count, infos);
}

nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v3(nvmlDevice_t d, unsigned int *count,
                                                      nvmlProcessInfo_t *infos) {
    return processes(d, "graphics_processes", count, infos);
}

static int mig_count(int index) {
    char v[128];
    int n = 0;
    while (n < MAX_MIG && mig_uuid(index, n, v, sizeof v) == 0)
        n++;
    return n;
}

nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t d, unsigned int *current, unsigned int *pending) {
    nvmlReturn_t r = usable(d);
    if (r != NVML_SUCCESS)
        return r;
    *current = *pending = mig_count(d->index) > 0;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMaxMigDeviceCount(nvmlDevice_t d, unsigned int *count) {
    nvmlReturn_t r = usable(d);
    if (r != NVML_SUCCESS)
        return r;
    *count = mig_count(d->index) > 0 ? MAX_MIG : 0;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMigDeviceHandleByIndex(nvmlDevice_t d, unsigned int n, nvmlDevice_t *mig) {
    nvmlReturn_t r = usable(d);
    if (r != NVML_SUCCESS)
        return r;
    if (n >= MAX_MIG)
        return NVML_ERROR_INVALID_ARGUMENT;
    if ((int)n >= mig_count(d->index))
        return NVML_ERROR_NOT_FOUND;
    pthread_mutex_lock(&mu);
    devices[d->index][n + 1] = (struct device){d->index, (int)n + 1};
    *mig = &devices[d->index][n + 1];
    pthread_mutex_unlock(&mu);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetDeviceHandleFromMigDeviceHandle(nvmlDevice_t mig, nvmlDevice_t *parent) {
    nvmlReturn_t r = usable(mig);
    if (r != NVML_SUCCESS)
        return r;
    if (mig->mig == 0)
        return NVML_ERROR_INVALID_ARGUMENT;
    *parent = &devices[mig->index][0];
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceIsMigDeviceHandle(nvmlDevice_t d, unsigned int *is_mig) {
    nvmlReturn_t r = usable(d);
    if (r != NVML_SUCCESS)
        return r;
    *is_mig = d->mig > 0;
    return NVML_SUCCESS;
}

static long events_size(void) {
    char path[PATH_MAX];
    struct stat st;
    standin_path(path, sizeof path, "events");
    return stat(path, &st) == 0 ? (long)st.st_size : 0;
}

nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *set) {
    if (!initialised())
        return NVML_ERROR_UNINITIALIZED;
    *set = calloc(1, sizeof **set);
    if (!*set)
        return NVML_ERROR_UNKNOWN;
    (*set)->offset = -1;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t d, unsigned long long types, nvmlEventSet_t set) {
    nvmlReturn_t r = usable(d);
    if (r != NVML_SUCCESS)
        return r;
    if (!set)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (types & EVENT_XID_CRITICAL)
        set->registered[d->index] = 1;
    /* Events from before registration are not reported, as with NVML. */
    if (set->offset < 0)
        set->offset = events_size();
    return NVML_SUCCESS;
}

/* The next registered event after the set's offset, if a whole line is there. */
static int next_event(nvmlEventSet_t set, nvmlEventData_t *data) {
    char path[PATH_MAX], line[128];
    int found = 0;
    standin_path(path, sizeof path, "events");
    FILE *f = fopen(path, "r");
    if (!f)
        return 0;
    if (fseek(f, set->offset < 0 ? 0 : set->offset, SEEK_SET) == 0) {
        while (!found && fgets(line, sizeof line, f)) {
            if (!strchr(line, '\n'))
                break; /* half-written: read it next time */
            set->offset += (long)strlen(line);
            int index;
            unsigned long long xid;
            if (sscanf(line, "%d %llu", &index, &xid) != 2 || index < 0 || index >= MAX_GPUS ||
                !set->registered[index])
                continue;
            pthread_mutex_lock(&mu);
            devices[index][0] = (struct device){index, 0};
            data->device = &devices[index][0];
            pthread_mutex_unlock(&mu);
            data->eventType = EVENT_XID_CRITICAL;
            data->eventData = xid;
            data->gpuInstanceId = NO_INSTANCE;
            data->computeInstanceId = NO_INSTANCE;
            found = 1;
        }
    }
    fclose(f);
    return found;
}

nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeout_ms) {
    if (!initialised())
        return NVML_ERROR_UNINITIALIZED;
    if (!set || !data)
        return NVML_ERROR_INVALID_ARGUMENT;
    for (unsigned int waited = 0;; waited += 20) {
        if (next_event(set, data))
            return NVML_SUCCESS;
        if (waited >= timeout_ms)
            return NVML_ERROR_TIMEOUT;
        sleep_ms(20);
    }
}

nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set) {
    free(set);
    return NVML_SUCCESS;
}
