/*
 * A stand-in for nvidia-smi: `--gpu-reset -i <UUID|PCI|index>` (or `-r`),
 * on the simulated GPUs under $NVML_STANDIN_ROOT (state.h). As the driver
 * does, it refuses to reset a GPU that a process still holds: one with the
 * GPU's device node open, or a compute process on it. The GPU's `reset`
 * key says how a reset it attempts ends: `ok` (the default), `fail`, or
 * `hang` (it never returns). `-pm 0|1 -i <GPU>` sets persistence mode,
 * through the nvidia-persistenced stand-in where it runs.
 */
#include <dirent.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>

#include "state.h"

/* PIDs of the processes, other than this one, that hold `dev` open. */
static int holders(const struct stat *dev, int *pids, int max) {
    int n = 0;
    DIR *proc = opendir("/proc");
    if (!proc)
        return 0;
    struct dirent *p;
    while ((p = readdir(proc)) && n < max) {
        int pid = atoi(p->d_name);
        if (pid <= 0 || pid == getpid())
            continue;
        char fds[64];
        snprintf(fds, sizeof fds, "/proc/%d/fd", pid);
        DIR *d = opendir(fds);
        if (!d)
            continue;
        struct dirent *f;
        while ((f = readdir(d))) {
            char link[PATH_MAX];
            struct stat st;
            snprintf(link, sizeof link, "%s/%s", fds, f->d_name);
            if (f->d_name[0] != '.' && stat(link, &st) == 0 && st.st_dev == dev->st_dev &&
                st.st_ino == dev->st_ino) {
                pids[n++] = pid;
                break;
            }
        }
        closedir(d);
    }
    closedir(proc);
    return n;
}

static void log_reset(const char *uuid, const char *outcome) {
    char path[PATH_MAX];
    standin_path(path, sizeof path, "resets");
    FILE *f = fopen(path, "a");
    if (f) {
        fprintf(f, "%s %s\n", uuid, outcome);
        fclose(f);
    }
}

static int reset(const char *id) {
    char uuid[128] = "", pci[64] = "", how[16] = "ok", list[256] = "", rel[32], dev[PATH_MAX];
    int index = gpu_find(id);
    if (index < 0) {
        printf("No devices were found matching %s\n", id);
        return 6;
    }
    gpu_get(index, "uuid", uuid, sizeof uuid);
    gpu_get(index, "pci", pci, sizeof pci);
    gpu_get(index, "reset", how, sizeof how);
    if (strcmp(how, "hang") == 0) {
        for (;;)
            sleep(3600);
    }
    snprintf(rel, sizeof rel, "dev/nvidia%lld", gpu_get_num(index, "minor", index));
    standin_path(dev, sizeof dev, rel);
    struct stat st;
    int pids[32], n = stat(dev, &st) == 0 ? holders(&st, pids, 32) : 0;
    gpu_get(index, "processes", list, sizeof list);
    if (n > 0 || *list) {
        printf("GPU %s is currently in use by another process.\n\n", pci);
        printf("1 device is currently being used by one or more other processes (e.g., Fabric "
               "Manager, CUDA application, graphics application such as an X server, or a "
               "monitoring application such as another instance of nvidia-smi). Please first "
               "kill all processes using this device and all compute applications running in "
               "the system.\n");
        log_reset(uuid, "refused");
        return 255;
    }
    if (strcmp(how, "fail") == 0) {
        printf("Unable to reset GPU %s: Unknown Error\n", pci);
        log_reset(uuid, "failed");
        return 255;
    }
    gpu_set(index, "recovery_action", "0");
    gpu_set(index, "remap_pending", "0");
    gpu_set(index, "ecc_uncorrected", "0");
    log_reset(uuid, "ok");
    printf("GPU %s was successfully reset.\nAll done.\n", pci);
    return 0;
}

/* `-pm 0|1` on GPU `id`: asks the nvidia-persistenced stand-in where it
 * runs (it lets the GPU go, or holds it again), else sets the mode itself,
 * as the driver's legacy persistence mode does. */
static int persistence_mode(const char *id, int on) {
    char pci[64] = "", answer[128] = "";
    int index = gpu_find(id);
    if (index < 0) {
        printf("No devices were found matching %s\n", id);
        return 6;
    }
    gpu_get(index, "pci", pci, sizeof pci);
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    snprintf(addr.sun_path, sizeof addr.sun_path, "%s", persistenced_socket());
    int sock = socket(AF_UNIX, SOCK_STREAM, 0);
    if (sock >= 0 && connect(sock, (struct sockaddr *)&addr, sizeof addr) == 0) {
        char request[32];
        int len = snprintf(request, sizeof request, "%d %d\n", index, on);
        if (write(sock, request, (size_t)len) != len || read(sock, answer, sizeof answer - 1) <= 0 ||
            strncmp(answer, "ok", 2) != 0) {
            printf("Failed to set persistence mode for GPU %s: nvidia-persistenced: %s\n", pci,
                   *answer ? answer : "no answer");
            close(sock);
            return 255;
        }
        close(sock);
    } else {
        if (sock >= 0)
            close(sock);
        gpu_set(index, "persistence", on ? "1" : "0");
    }
    printf("%s persistence mode for GPU %s.\nAll done.\n", on ? "Enabled" : "Disabled", pci);
    return 0;
}

int main(int argc, char **argv) {
    const char *id = NULL, *pm = NULL;
    int resetting = 0;
    if (!standin_root()) {
        fprintf(stderr, "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA "
                        "driver. Make sure that the latest NVIDIA driver is installed and running.\n");
        return 9;
    }
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--gpu-reset") == 0 || strcmp(argv[i], "-r") == 0)
            resetting = 1;
        else if ((strcmp(argv[i], "-i") == 0 || strcmp(argv[i], "--id") == 0) && i + 1 < argc)
            id = argv[++i];
        else if (strncmp(argv[i], "--id=", 5) == 0)
            id = argv[i] + 5;
        else if ((strcmp(argv[i], "-pm") == 0 || strcmp(argv[i], "--persistence-mode") == 0) &&
                 i + 1 < argc)
            pm = argv[++i];
        else if (strncmp(argv[i], "--persistence-mode=", 19) == 0)
            pm = argv[i] + 19;
    }
    if (pm && id)
        return persistence_mode(id, strcmp(pm, "1") == 0 || strcasecmp(pm, "ENABLED") == 0);
    if (pm) {
        fprintf(stderr, "this stand-in sets persistence mode on one GPU at a time: give -i\n");
        return 2;
    }
    if (resetting && id)
        return reset(id);
    if (resetting) {
        fprintf(stderr, "this stand-in resets one GPU at a time: give -i\n");
        return 2;
    }
    for (int i = 0; i < gpu_count(); i++) {
        char uuid[128] = "", name[96] = "NVIDIA H200";
        gpu_get(i, "uuid", uuid, sizeof uuid);
        gpu_get(i, "name", name, sizeof name);
        printf("GPU %d: %s (UUID: %s)\n", i, name, uuid);
    }
    return 0;
}
