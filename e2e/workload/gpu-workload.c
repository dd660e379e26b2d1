/* A GPU workload for the real-node e2e, in a small image: it opens every
 * GPU device node its container was given (/dev/nvidia<N>, as a CUDA
 * process holds its GPU), says which on stdout, and holds them until
 * SIGTERM, as a serving process would until the kubelet stops it. Static,
 * so that the image needs nothing but itself. */
#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

static volatile sig_atomic_t stop;

static void on_term(int sig) {
    (void)sig;
    stop = 1;
}

int main(void) {
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
