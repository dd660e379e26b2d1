/* A GPU workload for the real-node e2e, in a small image: it opens every
 * GPU device node its container was given (/dev/nvidia<N>, as a CUDA
 * process holds its GPU), says which on stdout, and holds them until
 * SIGTERM, as a serving process would until the kubelet stops it. Static,
 * so that the image needs nothing but itself.
 *
 * `gpu-workload --crash-in DIR/FILE NAME` is a tenant forging a kernel log
 * line instead: it copies itself to FILE, runs that copy under the process
 * name NAME, and crashes in it, so that the kernel prints
 * `NAME[PID]: segfault at ... in FILE[...]`. */
#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <unistd.h>

/* Copies this program to `path` and runs it there as `--crash-as name`. */
static int crash_in(const char *path, const char *name) {
    int in = open("/proc/self/exe", O_RDONLY);
    int out = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0755);
    if (in < 0 || out < 0) {
        perror(path);
        return 1;
    }
    char buf[65536];
    ssize_t n;
    while ((n = read(in, buf, sizeof buf)) > 0)
        if (write(out, buf, (size_t)n) != n) {
            perror(path);
            return 1;
        }
    close(in);
    close(out);
    char *const args[] = {(char *)path, "--crash-as", (char *)name, NULL};
    execv(path, args);
    perror(path);
    return 1;
}

/* Takes `name` as this process's name, then faults. */
static int crash_as(const char *name) {
    prctl(PR_SET_NAME, name, 0, 0, 0);
    fflush(stdout);
    volatile int *nowhere = NULL;
    *nowhere = 1;
    return 0;
}

static volatile sig_atomic_t stop;

static void on_term(int sig) {
    (void)sig;
    stop = 1;
}

int main(int argc, char **argv) {
    if (argc == 4 && strcmp(argv[1], "--crash-in") == 0)
        return crash_in(argv[2], argv[3]);
    if (argc == 3 && strcmp(argv[1], "--crash-as") == 0)
        return crash_as(argv[2]);
    signal(SIGTERM, on_term);
    signal(SIGINT, on_term);
    DIR *dev = opendir("/dev");
    if (!dev) {
        perror("/dev");
        return 1;
    }
    int held = 0;
    struct dirent *e;
    while ((e = readdir(dev))) {
        const char *n = e->d_name;
        /* nvidia0, nvidia1, ...: not nvidiactl, nvidia-uvm */
        if (strncmp(n, "nvidia", 6) != 0 || n[6] < '0' || n[6] > '9')
            continue;
        char path[300];
        snprintf(path, sizeof path, "/dev/%s", n);
        if (open(path, O_RDONLY) < 0) {
            perror(path);
            return 1;
        }
        printf("holding %s\n", path);
        held++;
    }
    closedir(dev);
    if (held == 0) {
        fprintf(stderr, "no GPU device node in /dev\n");
        return 1;
    }
    fflush(stdout);
    while (!stop)
        pause();
    printf("stopping\n");
    return 0;
}
