/* The pod sandbox's process on the real e2e node, as the kubelet's pause
 * image runs: it waits, reaping nothing, until it is told to stop. */
#include <signal.h>
#include <unistd.h>

static void stop(int sig) {
    (void)sig;
    _exit(0);
}

int main(void) {
    signal(SIGTERM, stop);
    signal(SIGINT, stop);
    for (;;)
        pause();
}
