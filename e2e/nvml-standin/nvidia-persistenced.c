/*
 * A stand-in for nvidia-persistenced on the simulated GPUs under
 * $NVML_STANDIN_ROOT (state.h). Like the real daemon, which the GPU
 * Operator's driver container runs: at start it turns persistence mode on
 * for every GPU and holds each GPU's device node open, so that the driver
 * refuses a reset ("In use by another client") while it does; and it
 * answers `nvidia-smi -i <GPU> -pm 0|1` on its socket by letting that GPU
 * go (persistence off) or holding it again (on). Its command name is the
 * real one's, as /proc/<pid>/comm shows it ("nvidia-persiste").
 *
 * Protocol on its socket (state.h): one line `<index> <0|1>\n` per
 * connection, answered `ok\n` or `error <why>\n`.
 */
#include <fcntl.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/un.h>

#include "state.h"

static int held[MAX_GPUS];
static volatile sig_atomic_t stop;

static void on_term(int sig) {
    (void)sig;
    stop = 1;
}

/* Holds (on) or lets go of (off) GPU `index`'s device node, and records
 * its persistence mode as the driver would. */
static int set_mode(int index, int on) {
    char rel[32], dev[PATH_MAX];
    snprintf(rel, sizeof rel, "dev/nvidia%lld", gpu_get_num(index, "minor", index));
    standin_path(dev, sizeof dev, rel);
    if (on && held[index] < 0) {
        held[index] = open(dev, O_RDONLY | O_CLOEXEC);
        if (held[index] < 0)
            return -1;
    } else if (!on && held[index] >= 0) {
        close(held[index]);
        held[index] = -1;
    }
    return gpu_set(index, "persistence", on ? "1" : "0");
}

int main(void) {
    if (!standin_root()) {
        fprintf(stderr, "nvidia-persistenced: NVML_STANDIN_ROOT is not set\n");
        return 1;
    }
    /* Without SA_RESTART, so that a signal ends the wait in accept(). */
    struct sigaction stop_on = {.sa_handler = on_term};
    sigaction(SIGTERM, &stop_on, NULL);
    sigaction(SIGINT, &stop_on, NULL);
    int n = gpu_count();
    for (int i = 0; i < MAX_GPUS; i++)
        held[i] = -1;
    for (int i = 0; i < n; i++) {
        if (set_mode(i, 1) != 0) {
            perror("nvidia-persistenced: holding a GPU");
            return 1;
        }
    }
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    const char *path = persistenced_socket();
    snprintf(addr.sun_path, sizeof addr.sun_path, "%s", path);
    unlink(path);
    int sock = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (sock < 0 || bind(sock, (struct sockaddr *)&addr, sizeof addr) != 0 || listen(sock, 8) != 0) {
        perror("nvidia-persistenced: its socket");
        return 1;
    }
    printf("nvidia-persistenced: holding %d GPU(s)\n", n);
    fflush(stdout);
    while (!stop) {
        int c = accept(sock, NULL, NULL);
        if (c < 0)
            continue;
        char line[64] = "";
        ssize_t got = read(c, line, sizeof line - 1);
        int index = -1, on = -1;
        const char *answer = "ok\n";
        if (got <= 0 || sscanf(line, "%d %d", &index, &on) != 2 || index < 0 || index >= n ||
            (on != 0 && on != 1))
            answer = "error bad request\n";
        else if (set_mode(index, on) != 0)
            answer = "error cannot open the device node\n";
        if (write(c, answer, strlen(answer)) < 0) {
        }
        close(c);
    }
    unlink(path);
    return 0;
}
