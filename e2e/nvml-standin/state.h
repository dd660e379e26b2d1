/*
 * The simulated GPUs that the NVML stand-in (libnvidia-ml.so.1) and the
 * nvidia-smi stand-in share with a test, under $NVML_STANDIN_ROOT:
 *
 *   gpu/<index>      one GPU, `key=value` lines (see README.md)
 *   dev/nvidiactl    the control device, opened while NVML is initialised
 *   dev/nvidia<N>    GPU N's device node (N = its `minor`), opened while a
 *                    handle on it is held: what the driver counts, and what
 *                    refuses a reset
 *   events           `<index> <xid>` lines appended by a test: Xid events
 *   resets           one line per reset nvidia-smi carried out
 *
 * nvidia-persistenced's socket is where the real one's is,
 * /var/run/nvidia-persistenced/socket (which a container reaches only
 * through a /var/run -> /run link, as the toolkit mounts it under /run),
 * unless $NVML_STANDIN_PERSISTENCED_SOCKET says otherwise (tests that run
 * several hosts on one machine).
 *
 * Without $NVML_STANDIN_ROOT (a driver root a container mounts, where no
 * runtime sets the environment), the state is `var/lib/nvml-standin` in the
 * root the running binary was installed in: the part of its path before
 * its last `/usr/`.
 *
 * Files are read afresh on every call, so a test changes a GPU at any time.
 */
#ifndef STANDIN_STATE_H
#define STANDIN_STATE_H

#include <dlfcn.h>
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>
#include <unistd.h>

#define MAX_GPUS 64

static inline const char *standin_root(void) {
    static char derived[PATH_MAX];
    const char *root = getenv("NVML_STANDIN_ROOT");
    if (root && *root)
        return root;
    Dl_info self;
    /* The library's path as loaded, or the program's argv[0]. */
    if (!*derived && dladdr((void *)standin_root, &self) && self.dli_fname) {
        const char *usr = NULL;
        for (const char *at = self.dli_fname; (at = strstr(at, "/usr/")); at++)
            usr = at;
        if (usr)
            snprintf(derived, sizeof derived, "%.*s/var/lib/nvml-standin",
                     (int)(usr - self.dli_fname), self.dli_fname);
    }
    return *derived ? derived : NULL;
}

static inline void standin_path(char *out, size_t n, const char *rel) {
    snprintf(out, n, "%s/%s", standin_root(), rel);
}

static inline int gpu_file(char *out, size_t n, int index) {
    return snprintf(out, n, "%s/gpu/%d", standin_root(), index) < (int)n ? 0 : -1;
}

static inline int gpu_count(void) {
    char path[PATH_MAX];
    int n = 0;
    while (n < MAX_GPUS && gpu_file(path, sizeof path, n) == 0 && access(path, F_OK) == 0)
        n++;
    return n;
}

/* Copies GPU `index`'s value for `key` into `out`; 0 when present. */
static inline int gpu_get(int index, const char *key, char *out, size_t n) {
    char path[PATH_MAX], line[1024];
    size_t klen = strlen(key);
    int found = -1;
    if (gpu_file(path, sizeof path, index) != 0)
        return -1;
    FILE *f = fopen(path, "r");
    if (!f)
        return -1;
    while (fgets(line, sizeof line, f)) {
        if (strncmp(line, key, klen) == 0 && line[klen] == '=') {
            char *v = line + klen + 1;
            v[strcspn(v, "\r\n")] = 0;
            snprintf(out, n, "%s", v);
            found = 0;
            break;
        }
    }
    fclose(f);
    return found;
}

static inline long long gpu_get_num(int index, const char *key, long long fallback) {
    char v[64];
    if (gpu_get(index, key, v, sizeof v) != 0 || !*v)
        return fallback;
    return strtoll(v, NULL, 0);
}

static inline int gpu_unsupported(int index, const char *key) {
    char v[64];
    return gpu_get(index, key, v, sizeof v) == 0 && strcmp(v, "unsupported") == 0;
}

/* Sets `key` to `value` in GPU `index`'s file, atomically (rename). */
static inline int gpu_set(int index, const char *key, const char *value) {
    char path[PATH_MAX], tmp[PATH_MAX + 16], line[1024];
    size_t klen = strlen(key);
    int done = 0;
    if (gpu_file(path, sizeof path, index) != 0)
        return -1;
    snprintf(tmp, sizeof tmp, "%s.tmp%d", path, (int)getpid());
    FILE *in = fopen(path, "r");
    FILE *out = fopen(tmp, "w");
    if (!in || !out) {
        if (in) fclose(in);
        if (out) fclose(out);
        return -1;
    }
    while (fgets(line, sizeof line, in)) {
        if (strncmp(line, key, klen) == 0 && line[klen] == '=') {
            fprintf(out, "%s=%s\n", key, value);
            done = 1;
        } else {
            fputs(line, out);
        }
    }
    if (!done)
        fprintf(out, "%s=%s\n", key, value);
    fclose(in);
    if (fclose(out) != 0)
        return -1;
    return rename(tmp, path);
}

static inline const char *persistenced_socket(void) {
    const char *path = getenv("NVML_STANDIN_PERSISTENCED_SOCKET");
    return (path && *path) ? path : "/var/run/nvidia-persistenced/socket";
}

static inline void sleep_ms(long ms) {
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

/* A GPU whose `hang` is 1 blocks every call on it, as a wedged driver does. */
static inline void wait_while_hung(int index) {
    while (gpu_get_num(index, "hang", 0) == 1)
        sleep_ms(50);
}

/* The GPU whose uuid, PCI bus id or index is `id`; -1 if none. */
static inline int gpu_find(const char *id) {
    char v[128];
    int n = gpu_count();
    for (int i = 0; i < n; i++) {
        if (gpu_get(i, "uuid", v, sizeof v) == 0 && strcasecmp(v, id) == 0)
            return i;
        if (gpu_get(i, "pci", v, sizeof v) == 0 && strcasecmp(v, id) == 0)
            return i;
    }
    char *end;
    long i = strtol(id, &end, 10);
    if (*id && !*end && i >= 0 && i < n)
        return (int)i;
    return -1;
}

#endif
