/*
 * A program that is not CRIU: built without -rdynamic and without any of CRIU's symbols or
 * hook names, it loads the plugin with RTLD_NOW, reads the descriptor, calls init, a couple of
 * hooks and exit, and unloads it. The plugin must see an unknown host and stay harmless.
 *
 * Usage: plain_dlopen PLUGIN. Reports on stdout, one line each:
 *   desc version=0x.. max_hooks=..  |  init rc=..  |  hook <NAME> rc=..  |  exit  |  done
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "criu_plugin_abi.h"

static void *slot(const struct gpu_plugin_desc *d, int idx)
{
	return (unsigned int)idx < d->max_hooks && idx < HOOK_SLOTS ? d->hooks[idx] : NULL;
}

int main(int argc, char **argv)
{
	struct gpu_plugin_desc *d;
	void *h, *f;
	int rc, efd;

	if (argc != 2) {
		fprintf(stderr, "usage: plain_dlopen PLUGIN\n");
		return 2;
	}
	h = dlopen(argv[1], RTLD_NOW);
	if (!h) {
		printf("dlopen failed: %s\n", dlerror());
		return 1;
	}
	d = dlsym(h, "CR_PLUGIN_DESC");
	if (!d) {
		printf("no descriptor\n");
		return 1;
	}
	printf("desc version=0x%x max_hooks=%u\n", d->version, d->max_hooks);
	fflush(stdout);

	rc = d->init ? d->init(STAGE_DUMP) : 0;
	printf("init rc=%d\n", rc);
	fflush(stdout);

	f = slot(d, HOOK_PAUSE_DEVICES);
	if (f) {
		printf("hook PAUSE_DEVICES rc=%d\n", ((hook_pid_fn)f)(getpid()));
		fflush(stdout);
	}
	f = slot(d, HOOK_DUMP_EXT_FILE);
	efd = eventfd(0, EFD_CLOEXEC);
	if (f && efd >= 0) {
		printf("hook DUMP_EXT_FILE rc=%d\n", ((hook_fd_id_fn)f)(efd, 1));
		fflush(stdout);
	}
	if (d->exit) {
		d->exit(STAGE_DUMP, 0);
		printf("exit\n");
	}
	dlclose(h);
	printf("done\n");
	return 0;
}
