/*
 * The CRIU plugin ABI as this project understands it, written for layout tests and for the
 * emulated CRIU hosts in tests/. It declares what CRIU's criu/include/criu-plugin.h declares,
 * in this project's own words; hook slots follow criu-dev (November 2025).
 */
#ifndef CRIU_GPU_PLUGIN_ABI_H
#define CRIU_GPU_PLUGIN_ABI_H

#include <stdbool.h>
#include <stdint.h>
#include <sys/stat.h>

#define GPU_PLUGIN_ABI_VERSION 0x0200u     /* CRIU_PLUGIN_VERSION */
#define GPU_PLUGIN_ABI_VERSION_OLD 0x0100u /* freed by the host on unload */

enum gpu_plugin_stage { STAGE_DUMP = 0, STAGE_PRE_DUMP = 1, STAGE_RESTORE = 2 };

enum gpu_plugin_hook {
	HOOK_DUMP_UNIX_SK = 0,
	HOOK_RESTORE_UNIX_SK = 1,
	HOOK_DUMP_EXT_FILE = 2,
	HOOK_RESTORE_EXT_FILE = 3,
	HOOK_DUMP_EXT_MOUNT = 4,
	HOOK_RESTORE_EXT_MOUNT = 5,
	HOOK_DUMP_EXT_LINK = 6,
	HOOK_HANDLE_DEVICE_VMA = 7,    /* 3.17 */
	HOOK_UPDATE_VMA_MAP = 8,       /* 3.17 */
	HOOK_RESUME_DEVICES_LATE = 9,  /* 3.17 */
	HOOK_PAUSE_DEVICES = 10,       /* 4.0 */
	HOOK_CHECKPOINT_DEVICES = 11,  /* 4.0 */
	HOOK_POST_FORKING = 12,        /* 4.2 */
	HOOK_RESTORE_INIT = 13,        /* criu-dev */
	HOOK_DUMP_DEVICES_LATE = 14,   /* criu-dev */
	HOOK_UPDATE_INETSK = 15,       /* 4.3 */
	HOOK_DUMP_FINISH = 16,         /* 4.3 */
	HOOK_SLOTS = 17,
};

typedef int (*hook_pid_fn)(int pid);
typedef int (*hook_fd_id_fn)(int fd, int id);
typedef int (*hook_restore_ext_file_fn)(int id);
typedef int (*hook_restore_ext_file_retry_fn)(int id, bool *retry_needed);
typedef int (*hook_handle_device_vma_fn)(int fd, const struct stat *st);
typedef int (*hook_update_vma_map_fn)(const char *path, uint64_t addr, uint64_t old_pgoff,
				      uint64_t *new_pgoff, int *plugin_fd);
typedef int (*hook_void_fn)(void);

struct gpu_plugin_desc {
	const char *name;
	int (*init)(int stage);
	void (*exit)(int stage, int ret);
	unsigned int version;
	unsigned int max_hooks;
	void *hooks[HOOK_SLOTS];
};

#endif
