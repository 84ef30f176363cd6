/*
 * A stand-in plugin with a chosen descriptor version and hook count, used to prove that the
 * emulated host refuses what CRIU refuses (and so that its acceptance of the real plugin means
 * something). Build with -DFAKE_VERSION=0x... -DFAKE_MAX_HOOKS=n.
 */
#include <stddef.h>

#include "criu_plugin_abi.h"

static int fake_init(int stage)
{
	(void)stage;
	return 0;
}

static void fake_exit(int stage, int ret)
{
	(void)stage;
	(void)ret;
}

struct gpu_plugin_desc CR_PLUGIN_DESC = {
	.name = "fake_plugin",
	.init = fake_init,
	.exit = fake_exit,
	.version = FAKE_VERSION,
	.max_hooks = FAKE_MAX_HOOKS,
};
