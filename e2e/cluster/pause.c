/* The pod sandbox process of the test cluster (registry.k8s.io/pause is not reachable here): holds
 * the pod's namespaces, reaps orphans, and exits on SIGINT or SIGTERM. Built static by cluster.sh. */
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

static void quit(int sig) { _exit(sig == SIGTERM ? 0 : 2); }

static void reap(int sig) {
	(void)sig;
	while (waitpid(-1, NULL, WNOHANG) > 0) {
	}
}

int main(void) {
	struct sigaction on_quit = {.sa_handler = quit};
	struct sigaction on_child = {.sa_handler = reap, .sa_flags = SA_NOCLDSTOP};
	if (sigaction(SIGINT, &on_quit, NULL) < 0 || sigaction(SIGTERM, &on_quit, NULL) < 0 ||
	    sigaction(SIGCHLD, &on_child, NULL) < 0)
		return 1;
	for (;;)
		pause();
}
