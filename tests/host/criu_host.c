/*
 * An emulated CRIU host for tests/host_harness.rs.
 *
 * It loads a plugin the way criu/plugin.c does (dlopen RTLD_LAZY, CR_PLUGIN_DESC, verify,
 * init, hook chains built after init, exit, dlclose) and exports, with -rdynamic, the CRIU
 * symbols the family it emulates has. One source, several builds:
 *
 *   -DHOST_HOOKS=N          CR_PLUGIN_HOOK__MAX: 7 (<3.17), 10 (3.17-3.19), 12 (4.0-4.1),
 *                           13 (4.2), 15 (criu-dev before 4.3), 17 (4.3)
 *   -DHOST_RETRY=0|1        RESTORE_EXT_FILE(int id, bool *retry_needed) (criu-dev, 4.3)
 *   -DHOST_OPTIONS=0|1      exports criu_plugin_get_options (4.3), with the options given by
 *                           --plugin-option
 *   -DHOST_V40_FREEZE=0|1   exports dont_use_freeze_cgroup (4.0 only)
 *   -DHOST_V41_API=0|1      exports set_compel_interrupt_only_mode and the inventory plugin
 *                           list functions (4.1 and later)
 *
 * The legacy hook names the family knows sit in this program's read-only data, as they do in
 * criu's: that is how the plugin tells hosts apart.
 *
 * Usage: criu_host [--out FILE] [--images DIR] [--inventory LIST] [--final-state N]
 *                  [--plugin-option PLUGIN.NAME[=VALUE]]... PLUGIN STAGE[,STAGE...]
 *        criu_host [--out FILE] --script PLUGIN OP[,OP...]
 *
 * --script calls the plugin's hooks in an order of the caller's choice, with no seizing, to
 * check that odd orders lose nothing. OP is init:STAGE, pause:PID, checkpoint:PID or
 * exit:STAGE_NUMBER:RET (a raw stage number, so that unknown ones can be passed).
 *
 * Each STAGE (dump, pre-dump, restore) is one load/init/hooks/exit/unload cycle in this same
 * process, as one `criu swrk` serving several requests. --inventory gives the plugin list of
 * the image being restored (comma separated; an empty string is a present but empty list;
 * without the option the image has no list, as images written before 4.1).
 *
 * Everything is reported one line at a time to FILE (default stdout):
 *   legacy <name>                     a hook name the host knows
 *   load <n> stage=<stage>            a new cycle
 *   desc name=.. version=0x.. max_hooks=.. slots=..
 *   init rc=<n>
 *   hook <NAME> rc=<n> [details]      one line per hook call
 *   LOG <level> <text>                one print_on_level call (text without its final newline)
 *   LOG-NO-NEWLINE <level> <text>     a message that did not end in a newline
 *   inventory-claim <name> n=<n> -> true|false, inventory-add <name>
 *   Missing required plugin: <name>
 *   exit stage=<n> ret=<n>            the plugin's exit is about to be called
 *   unloaded resident=yes|no
 *   result ok | result fail <why>
 * Exit status: 0 success, 1 what CRIU would fail, 2 usage or system errors.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "criu_plugin_abi.h"

#ifndef HOST_HOOKS
#error "build with -DHOST_HOOKS=<hook count of the emulated CRIU>"
#endif
#ifndef HOST_RETRY
#define HOST_RETRY 0
#endif
#ifndef HOST_V40_FREEZE
#define HOST_V40_FREEZE 0
#endif
#ifndef HOST_V41_API
#define HOST_V41_API 0
#endif
#ifndef HOST_OPTIONS
#define HOST_OPTIONS 0
#endif

#if HOST_RETRY && HOST_HOOKS < 15
#error "only criu-dev has RESTORE_EXT_FILE with retry_needed"
#endif

/* The names criu_gen_plugin_desc() looks up; exactly the set the emulated family has. */
static const char *const legacy_names[] = {
	"cr_plugin_dump_unix_sk",
	"cr_plugin_restore_unix_sk",
	"cr_plugin_dump_file",
	"cr_plugin_restore_file",
	"cr_plugin_dump_ext_mount",
	"cr_plugin_restore_ext_mount",
	"cr_plugin_dump_ext_link",
#if HOST_HOOKS >= 10
	"cr_plugin_handle_device_vma",
	"cr_plugin_update_vma_map",
	"cr_plugin_resume_devices_late",
#endif
#if HOST_HOOKS >= 12
	"cr_plugin_pause_devices",
	"cr_plugin_checkpoint_devices",
#endif
#if HOST_HOOKS >= 13
	"cr_plugin_post_forking",
#endif
#if HOST_HOOKS >= 15
	"cr_plugin_restore_init",
	"cr_plugin_dump_devices_late",
#endif
#if HOST_HOOKS >= 17
	/* 4.3 gives DUMP_FINISH no legacy name. */
	"cr_plugin_update_inetsk",
#endif
};

_Static_assert(sizeof(legacy_names) / sizeof(legacy_names[0]) + (HOST_HOOKS >= 17) == HOST_HOOKS,
	       "HOST_HOOKS must be 7, 10, 12, 13, 15 or 17");

/* Upper-case labels for the report (not the legacy names: those must not leak into rodata). */
static const char *const hook_labels[HOOK_SLOTS] = {
	"DUMP_UNIX_SK",	    "RESTORE_UNIX_SK",	   "DUMP_EXT_FILE",	 "RESTORE_EXT_FILE",
	"DUMP_EXT_MOUNT",   "RESTORE_EXT_MOUNT",   "DUMP_EXT_LINK",	 "HANDLE_DEVICE_VMA",
	"UPDATE_VMA_MAP",   "RESUME_DEVICES_LATE", "PAUSE_DEVICES",	 "CHECKPOINT_DEVICES",
	"POST_FORKING",	    "RESTORE_INIT",	   "DUMP_DEVICES_LATE",	 "UPDATE_INETSK",
	"DUMP_FINISH",
};

/* ---- the report ---------------------------------------------------------------------- */

static int report_fd = STDOUT_FILENO;

/* One write per line, so lines from forked tasks never interleave. */
static void report(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void report(const char *fmt, ...)
{
	char line[9216];
	va_list ap;
	int n;

	va_start(ap, fmt);
	n = vsnprintf(line, sizeof(line) - 1, fmt, ap);
	va_end(ap);
	if (n < 0)
		return;
	if ((size_t)n > sizeof(line) - 2)
		n = sizeof(line) - 2;
	line[n++] = '\n';
	if (write(report_fd, line, n) != n)
		_exit(2);
}

/* ---- what every CRIU exports ---------------------------------------------------------- */

/* struct cr_options: only the first member, final_state, has the same offset everywhere. */
struct host_options {
	int final_state;
	char rest[508];
};
struct host_options opts = { .final_state = 2 };

static unsigned int host_loglevel = 4;
static int image_dir_fd = -1;
static volatile int printing;

unsigned int log_get_loglevel(void)
{
	return host_loglevel;
}

/* Like CRIU's: formats into one static buffer (so it is not reentrant) and never adds a newline. */
void print_on_level(unsigned int loglevel, const char *format, ...)
{
	static char buf[8192];
	char text[sizeof(buf) * 2];
	size_t len, i, o = 0;
	bool newline;
	va_list ap;

	if (__atomic_exchange_n(&printing, 1, __ATOMIC_ACQ_REL))
		report("LOG-REENTERED %u", loglevel);

	va_start(ap, format);
	vsnprintf(buf, sizeof(buf), format, ap);
	va_end(ap);

	len = strlen(buf);
	newline = len > 0 && buf[len - 1] == '\n';
	if (newline)
		len--;
	for (i = 0; i < len && o + 2 < sizeof(text); i++) {
		if (buf[i] == '\n') {
			text[o++] = '\\';
			text[o++] = 'n';
		} else {
			text[o++] = buf[i];
		}
	}
	text[o] = '\0';
	report("%s %u %s", newline ? "LOG" : "LOG-NO-NEWLINE", loglevel, text);

	__atomic_store_n(&printing, 0, __ATOMIC_RELEASE);
}

int criu_get_image_dir(void)
{
	return image_dir_fd;
}

bool alarm_timeouted(void)
{
	return false;
}

/* ---- what some families export -------------------------------------------------------- */

#if HOST_V40_FREEZE
void dont_use_freeze_cgroup(void)
{
	report("host dont_use_freeze_cgroup");
}
#endif

#define MAX_INVENTORY 16

#if HOST_V41_API
void set_compel_interrupt_only_mode(void)
{
	report("host set_compel_interrupt_only_mode");
}

/* -1 = the image has no list (written before 4.1): every claim succeeds. */
static int inventory_count = -1;
static char *inventory[MAX_INVENTORY];
static char *added[MAX_INVENTORY];
static int added_count;

int add_inventory_plugin(const char *name)
{
	report("inventory-add %s", name);
	if (added_count == MAX_INVENTORY)
		return -1;
	added[added_count] = strdup(name);
	return added[added_count++] ? 0 : -1;
}

bool check_and_remove_inventory_plugin(const char *name, size_t n)
{
	int i;

	if (inventory_count < 0) {
		report("inventory-claim %s n=%zu -> true (no list)", name, n);
		return true;
	}
	for (i = 0; i < inventory_count; i++) {
		if (inventory[i] && strncmp(name, inventory[i], n) == 0) {
			free(inventory[i]);
			inventory[i] = NULL;
			report("inventory-claim %s n=%zu -> true", name, n);
			return true;
		}
	}
	report("inventory-claim %s n=%zu -> false", name, n);
	return false;
}

/* check_img_inventory(): each restore request reads its image's list afresh. */
static void inventory_load(const char *list)
{
	char *copy, *save = NULL, *tok;
	int i;

	for (i = 0; i < inventory_count; i++)
		free(inventory[i]);
	inventory_count = -1;
	if (!list)
		return;
	copy = strdup(list);
	inventory_count = 0;
	for (tok = strtok_r(copy, ",", &save); tok && inventory_count < MAX_INVENTORY;
	     tok = strtok_r(NULL, ",", &save))
		inventory[inventory_count++] = strdup(tok);
	free(copy);
}

/* check_inventory_plugins(): every entry nobody claimed fails the restore. */
static int inventory_check(void)
{
	int i, missing = 0;

	for (i = 0; i < inventory_count; i++) {
		if (inventory[i]) {
			report("Missing required plugin: %s", inventory[i]);
			missing++;
		}
	}
	return missing ? -1 : 0;
}

static void inventory_written(void)
{
	char line[1024] = "";
	int i;

	for (i = 0; i < added_count; i++) {
		strncat(line, i ? "," : "", sizeof(line) - strlen(line) - 1);
		strncat(line, added[i], sizeof(line) - strlen(line) - 1);
		free(added[i]);
	}
	added_count = 0;
	report("inventory-written [%s]", line);
}
#endif

#define MAX_OPTIONS 32

#if HOST_OPTIONS
/* Like 4.3's: argv[0] a placeholder, "--PLUGIN.NAME[=VALUE]" entries, argv[argc] NULL. */
static char *plugin_argv[MAX_OPTIONS + 2] = { "criu-plugin-options" };
static int plugin_argc = 1;

int criu_plugin_get_options(int *argc, char ***argv)
{
	report("host criu_plugin_get_options argc=%d", plugin_argc);
	*argc = plugin_argc;
	*argv = plugin_argv;
	return 0;
}

static void add_plugin_option(const char *opt)
{
	char *s;

	if (plugin_argc == MAX_OPTIONS + 1 || asprintf(&s, "--%s", opt) < 0)
		exit(2);
	plugin_argv[plugin_argc++] = s;
	plugin_argv[plugin_argc] = NULL;
}
#endif

/* ---- the plugin as CRIU holds it ------------------------------------------------------ */

struct loaded {
	void *handle;
	struct gpu_plugin_desc *desc;
	unsigned int nr_hooks;
	void *chain[HOOK_SLOTS]; /* like hook_chain[]: filled after init, only i < max_hooks */
};

enum stage_kind { ST_DUMP = STAGE_DUMP, ST_PRE_DUMP = STAGE_PRE_DUMP, ST_RESTORE = STAGE_RESTORE };

static int parse_stage(const char *s, enum stage_kind *out)
{
	if (!strcmp(s, "dump"))
		*out = ST_DUMP;
	else if (!strcmp(s, "pre-dump"))
		*out = ST_PRE_DUMP;
	else if (!strcmp(s, "restore"))
		*out = ST_RESTORE;
	else
		return -1;
	return 0;
}

/*
 * The hook in slot `idx` if CRIU would call it: the host knows the slot, the plugin's
 * max_hooks covers it and the slot is set. Reports why not otherwise.
 */
static void *hook(const struct loaded *p, int idx)
{
	if (idx >= HOST_HOOKS)
		return NULL;
	if ((unsigned int)idx >= p->nr_hooks) {
		report("hook %s not-called beyond-max-hooks", hook_labels[idx]);
		return NULL;
	}
	if (!p->chain[idx])
		report("hook %s unregistered", hook_labels[idx]);
	return p->chain[idx];
}

/* run_plugins(): -ENOTSUP means "not mine"; other negative values fail the operation. */
static int failed_rc(int rc)
{
	return rc < 0 && rc != -ENOTSUP;
}

/* A hook of one int: a pid (`who` names the task in the report) or, with `who` NULL, a value. */
static int call_pid_hook(const struct loaded *p, int idx, int pid, const char *who)
{
	hook_pid_fn f = (hook_pid_fn)hook(p, idx);
	int rc;

	if (!f)
		return 0;
	rc = f(pid);
	if (who)
		report("hook %s rc=%d target=%s", hook_labels[idx], rc, who);
	else
		report("hook %s rc=%d arg=%d", hook_labels[idx], rc, pid);
	return failed_rc(rc);
}

static int call_void_hook(const struct loaded *p, int idx)
{
	hook_void_fn f = (hook_void_fn)hook(p, idx);
	int rc;

	if (!f)
		return 0;
	rc = f();
	report("hook %s rc=%d", hook_labels[idx], rc);
	return failed_rc(rc);
}

static __attribute__((unused)) int call_int_hook(const struct loaded *p, int idx, int arg)
{
	return call_pid_hook(p, idx, arg, NULL);
}

static int call_device_vma(const struct loaded *p, int fd, const char *what)
{
	hook_handle_device_vma_fn f = (hook_handle_device_vma_fn)hook(p, HOOK_HANDLE_DEVICE_VMA);
	struct stat st;
	int rc;

	if (!f)
		return 0;
	if (fstat(fd, &st)) {
		report("result fail fstat %s: %s", what, strerror(errno));
		exit(2);
	}
	rc = f(fd, &st);
	/* A claimed (>= 0) mapping of a non-GPU process would be wrong; -ENOTSUP is "not mine". */
	report("hook HANDLE_DEVICE_VMA rc=%d target=%s", rc, what);
	return failed_rc(rc);
}

/* CRIU forks the tasks it restores; RESTORE_EXT_FILE and UPDATE_VMA_MAP run inside them. */
static void restored_task_hooks(const struct loaded *p)
{
	void *ext = hook(p, HOOK_RESTORE_EXT_FILE);
	hook_update_vma_map_fn vma = (hook_update_vma_map_fn)hook(p, HOOK_UPDATE_VMA_MAP);
	int status = 0;
	pid_t t;

	if (!ext && !vma)
		return;
	t = fork();
	if (t < 0) {
		report("result fail fork: %s", strerror(errno));
		exit(2);
	}
	if (t == 0) {
		int failed = 0;

		if (ext) {
			unsigned char raw;
			bool flag;
			int rc;

			/* The host's flag starts out as garbage: the plugin must write it. */
			memset(&flag, 0xAA, sizeof(flag));
#if HOST_RETRY
			rc = ((hook_restore_ext_file_retry_fn)ext)(7, &flag);
			memcpy(&raw, &flag, 1);
			report("hook RESTORE_EXT_FILE rc=%d retry=%u", rc, raw);
#else
			/*
			 * An older host passes only the id. The call goes through the two-argument
			 * type so that the second argument register holds a pointer to a canary: a
			 * one-argument hook ignores it (the canary stays 0xAA); a two-argument hook,
			 * which would scribble through a garbage register in real CRIU, writes it.
			 * Calling through a wider type is outside ISO C but well defined by the
			 * x86-64 and AArch64 calling conventions, and it is the only way to see the
			 * arity from outside.
			 */
			rc = ((hook_restore_ext_file_retry_fn)ext)(7, &flag);
			memcpy(&raw, &flag, 1);
			report("hook RESTORE_EXT_FILE rc=%d canary=%u", rc, raw);
#endif
			/* >= 0 would be an fd the plugin claims to have restored. */
			failed |= rc != -ENOTSUP;
		}
		if (vma) {
			uint64_t new_pgoff = 0x1234;
			int plugin_fd = -1, rc;

			rc = vma("/dev/zero", 0x7f0000000000ull, 0x1234, &new_pgoff, &plugin_fd);
			report("hook UPDATE_VMA_MAP rc=%d new_pgoff=0x%llx plugin_fd=%d", rc,
			       (unsigned long long)new_pgoff, plugin_fd);
			failed |= rc == 1 || plugin_fd != -1;
		}
		_exit(failed ? 1 : 0);
	}
	if (waitpid(t, &status, 0) != t) {
		report("result fail waitpid: %s", strerror(errno));
		exit(2);
	}
	report("task exited status=%d", WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status));
}

static pid_t spawn_sleeper(void)
{
	pid_t pid = fork();

	if (pid < 0) {
		report("result fail fork: %s", strerror(errno));
		exit(2);
	}
	if (pid == 0) {
		for (;;)
			pause();
	}
	return pid;
}

static void reap(pid_t pid)
{
	kill(pid, SIGKILL);
	waitpid(pid, NULL, 0);
}

static int dump_hooks(const struct loaded *p, enum stage_kind stage)
{
	pid_t child = spawn_sleeper();
	int devzero = open("/dev/zero", O_RDWR | O_CLOEXEC);
	int memfd = memfd_create("criu-host-vma", MFD_CLOEXEC);
	int efd = eventfd(0, EFD_CLOEXEC);
	void *map = MAP_FAILED;
	int failed = 0;

	if (devzero < 0 || memfd < 0 || efd < 0 || ftruncate(memfd, 4096)) {
		report("result fail setup: %s", strerror(errno));
		reap(child);
		exit(2);
	}
	/* A shared mapping of the memfd, as a task would have it. */
	map = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, memfd, 0);

	/* collect_pstree: PAUSE_DEVICES for the root and each child found. */
	failed |= call_pid_hook(p, HOOK_PAUSE_DEVICES, child, "child");
	failed |= call_pid_hook(p, HOOK_PAUSE_DEVICES, getpid(), "self");
	/* 4.0 checkpoints inside collect_pstree, so in pre-dump as well; 4.1+ in dump only. */
	if (stage == ST_DUMP || HOST_V40_FREEZE) {
		failed |= call_pid_hook(p, HOOK_CHECKPOINT_DEVICES, child, "child");
		failed |= call_pid_hook(p, HOOK_CHECKPOINT_DEVICES, getpid(), "self");
	}
	/* collect_mappings: odd mappings, in dump and pre-dump. */
	failed |= call_device_vma(p, devzero, "devzero");
	failed |= call_device_vma(p, memfd, "memfd");
	if (stage == ST_DUMP) {
		hook_fd_id_fn f = (hook_fd_id_fn)hook(p, HOOK_DUMP_EXT_FILE);

		if (f) {
			int rc = f(efd, 7);

			report("hook DUMP_EXT_FILE rc=%d target=eventfd", rc);
			failed |= failed_rc(rc);
		}
		failed |= call_pid_hook(p, HOOK_DUMP_DEVICES_LATE, child, "child");
#if HOST_HOOKS >= 17
		/* 4.3: before the tasks are released; ret is the dump's result so far. */
		failed |= call_int_hook(p, HOOK_DUMP_FINISH, failed ? -1 : 0);
#endif
#if HOST_V41_API
		inventory_written();
#endif
	}

	if (map != MAP_FAILED)
		munmap(map, 4096);
	close(devzero);
	close(memfd);
	close(efd);
	reap(child);
	return failed ? -1 : 0;
}

static int restore_hooks(const struct loaded *p)
{
	pid_t root;
	int failed = 0;

	/* restore_root_task: fork the root, then POST_FORKING while tasks restore. */
	root = spawn_sleeper();
	failed |= call_void_hook(p, HOOK_POST_FORKING);
	restored_task_hooks(p);
	/* Errors of RESUME_DEVICES_LATE are only logged by CRIU. */
	call_pid_hook(p, HOOK_RESUME_DEVICES_LATE, root, "child");
	reap(root);
	return failed ? -1 : 0;
}

static int is_resident(const char *path)
{
	void *h = dlopen(path, RTLD_LAZY | RTLD_NOLOAD);

	if (!h)
		return 0;
	dlclose(h);
	return 1;
}

static void unload(struct loaded *p, const char *path)
{
	dlclose(p->handle);
	report("unloaded resident=%s", is_resident(path) ? "yes" : "no");
}

/* cr_plugin_fini(): exit(stage, ret) then dlclose. */
static void fini(struct loaded *p, const char *path, enum stage_kind stage, int ret)
{
	if (p->desc->exit) {
		report("exit stage=%d ret=%d", (int)stage, ret);
		p->desc->exit((int)stage, ret);
		report("exit returned");
	}
	unload(p, path);
}

static const char *inventory_list;

static int one_cycle(const char *path, enum stage_kind stage)
{
	struct loaded p = { 0 };
	unsigned int max_before;
	int ret, i;

#if HOST_V41_API
	if (stage == ST_RESTORE)
		inventory_load(inventory_list);
#endif
	/* cr_lib_load(): local scope, lazy binding, constructors run in here. */
	p.handle = dlopen(path, RTLD_LAZY);
	if (!p.handle) {
		report("result fail dlopen: %s", dlerror());
		return 1;
	}
	p.desc = dlsym(p.handle, "CR_PLUGIN_DESC");
	if (!p.desc) {
		/* Our plugin must never take the legacy path (WARN every run, deprecated). */
		report("result fail no CR_PLUGIN_DESC");
		dlclose(p.handle);
		return 1;
	}
	{
		char slots[128] = "";

		for (i = 0; i < (int)p.desc->max_hooks && i < HOST_HOOKS; i++) {
			if (p.desc->hooks[i]) {
				size_t l = strlen(slots);
				snprintf(slots + l, sizeof(slots) - l, "%s%d", l ? "," : "", i);
			}
		}
		report("desc name=%s version=0x%x max_hooks=%u slots=%s",
		       p.desc->name ? p.desc->name : "(null)", p.desc->version, p.desc->max_hooks,
		       slots);
	}
	/* verify_plugin() */
	if (p.desc->version > GPU_PLUGIN_ABI_VERSION || p.desc->max_hooks > HOST_HOOKS) {
		report("Corrupted plugin %s", path);
		report("result fail corrupted");
		dlclose(p.handle);
		return 1;
	}
	if (p.desc->version == GPU_PLUGIN_ABI_VERSION_OLD) {
		/* CRIU would free() this static descriptor in cr_plugin_fini and crash. */
		report("result fail version 0x100 descriptor would be freed by the host");
		dlclose(p.handle);
		return 1;
	}

	max_before = p.desc->max_hooks;
	ret = p.desc->init ? p.desc->init((int)stage) : 0;
	report("init rc=%d", ret);
	if (ret) {
		/* Unlinked and closed; exit is not called. */
		report("Failed in init(%d)", (int)stage);
		unload(&p, path);
		report("result fail init");
		return 1;
	}
	if (p.desc->max_hooks > max_before) {
		report("result fail init raised max_hooks from %u to %u", max_before,
		       p.desc->max_hooks);
		unload(&p, path);
		return 1;
	}
	/* Hook chains are built only after init, for i < max_hooks. */
	p.nr_hooks = p.desc->max_hooks;
	for (i = 0; i < (int)p.nr_hooks && i < HOOK_SLOTS; i++)
		p.chain[i] = p.desc->hooks[i];

	if (stage == ST_RESTORE) {
#if HOST_V41_API
		if (inventory_check()) {
			fini(&p, path, stage, -1);
			report("result fail inventory");
			return 1;
		}
#endif
		if (call_void_hook(&p, HOOK_RESTORE_INIT)) {
			fini(&p, path, stage, -1);
			report("result fail RESTORE_INIT");
			return 1;
		}
		ret = restore_hooks(&p);
	} else {
		ret = dump_hooks(&p, stage);
	}

	if (stage == ST_PRE_DUMP) {
		/* Pre-dump never calls exit; the plugin is dropped with the process (or request). */
		unload(&p, path);
	} else {
		fini(&p, path, stage, ret);
	}
	if (ret) {
		report("result fail hooks");
		return 1;
	}
	report("result ok");
	return 0;
}

/* --script: one load, the hooks in the given order, then unload. */
static int run_script(const char *path, char *ops)
{
	struct loaded p = { 0 };
	char *save = NULL, *tok;
	int i;

	p.handle = dlopen(path, RTLD_LAZY);
	p.desc = p.handle ? dlsym(p.handle, "CR_PLUGIN_DESC") : NULL;
	if (!p.desc) {
		report("result fail cannot load %s", path);
		return 2;
	}
	for (tok = strtok_r(ops, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
		enum stage_kind stage;
		int a = 0, b = 0;

		if (!strncmp(tok, "init:", 5) && !parse_stage(tok + 5, &stage)) {
			report("init rc=%d", p.desc->init((int)stage));
			p.nr_hooks = p.desc->max_hooks;
			for (i = 0; i < (int)p.nr_hooks && i < HOOK_SLOTS; i++)
				p.chain[i] = p.desc->hooks[i];
		} else if (sscanf(tok, "pause:%d", &a) == 1) {
			call_pid_hook(&p, HOOK_PAUSE_DEVICES, a, "script");
		} else if (sscanf(tok, "checkpoint:%d", &a) == 1) {
			call_pid_hook(&p, HOOK_CHECKPOINT_DEVICES, a, "script");
		} else if (sscanf(tok, "exit:%d:%d", &a, &b) == 2) {
			report("exit stage=%d ret=%d", a, b);
			p.desc->exit(a, b);
			report("exit returned");
		} else {
			report("result fail bad op %s", tok);
			return 2;
		}
	}
	unload(&p, path);
	report("result ok");
	return 0;
}

static void usage(void)
{
	fprintf(stderr, "usage: criu_host [--out FILE] [--images DIR] [--inventory LIST] "
			"[--final-state N] [--plugin-option OPT]... PLUGIN STAGE[,STAGE...]\n");
	exit(2);
}

int main(int argc, char **argv)
{
	const char *images = ".", *plugin, *env;
	char *stages, *save = NULL, *tok;
	int i, n = 0, rc = 0, script = 0;

	for (i = 1; i < argc && argv[i][0] == '-' && argv[i][1] == '-'; i += 2) {
		if (i + 1 >= argc)
			usage();
		if (!strcmp(argv[i], "--out")) {
			report_fd = open(argv[i + 1], O_WRONLY | O_CREAT | O_TRUNC | O_APPEND | O_CLOEXEC,
					 0644);
			if (report_fd < 0) {
				perror("open report");
				return 2;
			}
		} else if (!strcmp(argv[i], "--images")) {
			images = argv[i + 1];
		} else if (!strcmp(argv[i], "--inventory")) {
			inventory_list = argv[i + 1];
		} else if (!strcmp(argv[i], "--final-state")) {
			opts.final_state = atoi(argv[i + 1]);
		} else if (!strcmp(argv[i], "--plugin-option")) {
#if HOST_OPTIONS
			add_plugin_option(argv[i + 1]);
#else
			report("result fail --plugin-option needs a 4.3 host");
			return 2;
#endif
		} else if (!strcmp(argv[i], "--script")) {
			script = 1;
			i--; /* takes no value */
		} else {
			usage();
		}
	}
	if (argc - i != 2)
		usage();
	plugin = argv[i];
	stages = argv[i + 1];

	env = getenv("HOST_LOGLEVEL");
	if (env)
		host_loglevel = (unsigned int)strtoul(env, NULL, 10);
	image_dir_fd = open(images, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
	if (image_dir_fd < 0) {
		report("result fail images dir %s: %s", images, strerror(errno));
		return 2;
	}
#if !HOST_V41_API
	if (inventory_list) {
		report("result fail --inventory needs a 4.1+ host");
		return 2;
	}
#endif

	if (script)
		return run_script(plugin, stages);
	for (i = 0; i < (int)(sizeof(legacy_names) / sizeof(legacy_names[0])); i++)
		report("legacy %s", legacy_names[i]);
	report("host hooks=%d retry=%d v40_freeze=%d v41_api=%d", HOST_HOOKS, HOST_RETRY,
	       HOST_V40_FREEZE, HOST_V41_API);

	for (tok = strtok_r(stages, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
		enum stage_kind stage;

		if (parse_stage(tok, &stage))
			usage();
		report("load %d stage=%s", ++n, tok);
		rc = one_cycle(plugin, stage);
		if (rc)
			break;
	}
	return rc;
}
