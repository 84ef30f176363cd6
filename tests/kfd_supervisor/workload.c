/* A GPU workload for the KFD supervisor: opens /dev/kfd and a render node, asks the KFD
 * version, binds the GPU's VM to the render node and reads the process apertures, as
 * libhsakmt does at start, then waits. Every answer comes from the supervisor's simulator.
 *
 * With KFD_SUPERVISOR_FDS=CTL,PROG in the environment, the set-up runs on a thread of its own
 * that first installs the supervisor's filter (the program is in memfd PROG) and sends the
 * listener over socket CTL; the thread ends before "ready" and both fds are closed, so that no
 * thread has a filter or a socket to the supervisor when CRIU dumps the process.
 *
 * With KFD_SUPERVISOR_ADDR=NAME as well, it keeps the filter program and, at each SIGUSR2,
 * starts a thread that installs the filter again, sends the new listener to the supervisor's
 * socket at the abstract address NAME and asks the KFD version on that thread: how a process
 * whose set-up thread is gone (as after `criu dump --leave-running` or a failed dump) gets
 * its KFD calls answered again.
 *
 * Usage: workload GPU_ID RENDER_PATH [GPU_ID RENDER_PATH]...
 * Binds the VM of every GPU to its render node. Prints one line per step, then "ready";
 * after that, each SIGUSR1 makes it print "alive N" (N counts the signals) and ask the KFD
 * version once more on the main thread, each SIGUSR2 "again N" and the same from a thread
 * with a fresh filter. */
#include <errno.h>
#include <stddef.h>
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <pthread.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <unistd.h>

struct get_version { uint32_t major, minor; };
struct acquire_vm { uint32_t drm_fd, gpu_id; };
struct apertures { uint64_t lds_base, lds_limit, scratch_base, scratch_limit, gpuvm_base, gpuvm_limit; uint32_t gpu_id, pad; };
struct apertures_new { uint64_t ptr; uint32_t num_of_nodes, pad; };

#define KFD_IOC(dir, nr, type) _IOC(dir, 'K', nr, sizeof(type))
#define GET_VERSION KFD_IOC(_IOC_READ, 0x01, struct get_version)
#define ACQUIRE_VM KFD_IOC(_IOC_WRITE, 0x15, struct acquire_vm)
#define APERTURES_NEW KFD_IOC(_IOC_READ | _IOC_WRITE, 0x14, struct apertures_new)

static volatile sig_atomic_t usr1, usr2;
static void on_usr1(int sig) { (void)sig; usr1++; }
static void on_usr2(int sig) { (void)sig; usr2++; }

static int ctl_fd = -1, prog_fd = -1;
static struct sock_fprog prog;
static struct sockaddr_un sup_addr;
static socklen_t sup_addr_len;

/* Reads the filter program from memfd PROG_FD into memory (kept for SIGUSR2). */
static int read_program(void)
{
	struct stat st;
	if (fstat(prog_fd, &st) < 0)
		return -1;
	struct sock_filter *insns = malloc(st.st_size);
	if (!insns || pread(prog_fd, insns, st.st_size, 0) != st.st_size)
		return -1;
	prog.len = st.st_size / sizeof(*insns);
	prog.filter = insns;
	return 0;
}

/* Installs the filter on the calling thread and sends its listener over socket SOCK, to
 * address TO where given. */
static int install_filter(int sock, const struct sockaddr_un *to, socklen_t to_len)
{
	int listener = syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_NEW_LISTENER, &prog);
	if (listener < 0)
		return -1;
	char tag = 'W';
	struct iovec iov = { .iov_base = &tag, .iov_len = 1 };
	union { struct cmsghdr h; char buf[CMSG_SPACE(sizeof(int))]; } c;
	memset(&c, 0, sizeof(c));
	struct msghdr msg = { .msg_name = (void *)to, .msg_namelen = to ? to_len : 0, .msg_iov = &iov, .msg_iovlen = 1, .msg_control = c.buf, .msg_controllen = sizeof(c.buf) };
	struct cmsghdr *h = CMSG_FIRSTHDR(&msg);
	h->cmsg_level = SOL_SOCKET;
	h->cmsg_type = SCM_RIGHTS;
	h->cmsg_len = CMSG_LEN(sizeof(int));
	memcpy(CMSG_DATA(h), &listener, sizeof(int));
	int rc = sendmsg(sock, &msg, 0);
	close(listener);
	return rc < 0 ? -1 : 0;
}

#define MAX_GPUS 8
static uint32_t gpu_ids[MAX_GPUS];
static const char *render_paths[MAX_GPUS];
static int gpus;
static int kfd = -1;

static int set_up(void);

static void *set_up_thread(void *arg)
{
	(void)arg;
	if (install_filter(ctl_fd, NULL, 0) < 0) {
		printf("installing the filter: %s\n", strerror(errno));
		return (void *)1;
	}
	return set_up() ? (void *)1 : NULL;
}

/* SIGUSR2's thread: a fresh filter, its listener sent to the supervisor's address, then one
 * KFD call. The thread (and with it the filter) ends after it. */
static void *again_thread(void *arg)
{
	int n = (int)(intptr_t)arg;
	int sock = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
	if (sock < 0 || !prog.filter || install_filter(sock, &sup_addr, sup_addr_len) < 0) {
		printf("again %d: installing the filter: %s\n", n, strerror(errno));
		if (sock >= 0)
			close(sock);
		return NULL;
	}
	close(sock);
	struct get_version v = {0};
	int rc = ioctl(kfd, GET_VERSION, &v);
	printf("again %d: GET_VERSION %s %u.%u\n", n, rc < 0 ? strerror(errno) : "ok", v.major, v.minor);
	return NULL;
}

int main(int argc, char **argv)
{
	if (argc < 3 || argc % 2 != 1 || argc > 1 + 2 * MAX_GPUS) {
		fprintf(stderr, "usage: %s GPU_ID RENDER_PATH [GPU_ID RENDER_PATH]...\n", argv[0]);
		return 2;
	}
	setvbuf(stdout, NULL, _IONBF, 0);
	for (gpus = 0; 1 + 2 * gpus < argc; gpus++) {
		gpu_ids[gpus] = strtoul(argv[1 + 2 * gpus], NULL, 0);
		render_paths[gpus] = argv[2 + 2 * gpus];
	}
	const char *fds = getenv("KFD_SUPERVISOR_FDS");
	if (fds) {
		if (sscanf(fds, "%d,%d", &ctl_fd, &prog_fd) != 2 || read_program() < 0)
			return 2;
		const char *addr = getenv("KFD_SUPERVISOR_ADDR");
		if (addr) {
			size_t len = strlen(addr);
			if (len + 1 > sizeof(sup_addr.sun_path))
				return 2;
			sup_addr.sun_family = AF_UNIX;
			/* An abstract address: a NUL, then the name (not NUL-terminated). */
			memcpy(sup_addr.sun_path + 1, addr, len);
			sup_addr_len = offsetof(struct sockaddr_un, sun_path) + 1 + len;
		}
		pthread_t t;
		void *failed;
		if (pthread_create(&t, NULL, set_up_thread, NULL) || pthread_join(t, &failed) || failed)
			return 1;
		close(ctl_fd);
		close(prog_fd);
	} else if (set_up()) {
		return 1;
	}
	signal(SIGUSR1, on_usr1);
	signal(SIGUSR2, on_usr2);
	printf("ready\n");
	int seen = 0, seen2 = 0;
	for (;;) {
		pause();
		while (seen2 < usr2) {
			seen2++;
			pthread_t t;
			if (pthread_create(&t, NULL, again_thread, (void *)(intptr_t)seen2) || pthread_join(t, NULL))
				printf("again %d: no thread\n", seen2);
		}
		while (seen < usr1) {
			seen++;
			struct get_version again = {0};
			int rc = ioctl(kfd, GET_VERSION, &again);
			printf("alive %d: GET_VERSION %s %u.%u\n", seen, rc < 0 ? strerror(errno) : "ok", again.major, again.minor);
		}
	}
}

static int set_up(void)
{
	kfd = open("/dev/kfd", O_RDWR | O_CLOEXEC);
	if (kfd < 0) {
		printf("open /dev/kfd: %s\n", strerror(errno));
		return 1;
	}
	struct get_version v = {0};
	if (ioctl(kfd, GET_VERSION, &v) < 0) {
		printf("GET_VERSION: %s\n", strerror(errno));
		return 1;
	}
	printf("version %u.%u\n", v.major, v.minor);
	int render[MAX_GPUS];
	for (int g = 0; g < gpus; g++) {
		render[g] = open(render_paths[g], O_RDWR | O_CLOEXEC);
		if (render[g] < 0) {
			printf("open %s: %s\n", render_paths[g], strerror(errno));
			return 1;
		}
		struct acquire_vm a = { .drm_fd = render[g], .gpu_id = gpu_ids[g] };
		if (ioctl(kfd, ACQUIRE_VM, &a) < 0) {
			printf("ACQUIRE_VM: %s\n", strerror(errno));
			return 1;
		}
		printf("acquired vm of gpu 0x%x\n", gpu_ids[g]);
	}
	struct apertures_new n = {0};
	if (ioctl(kfd, APERTURES_NEW, &n) < 0) {
		printf("APERTURES_NEW: %s\n", strerror(errno));
		return 1;
	}
	struct apertures ap[64];
	memset(ap, 0, sizeof(ap));
	n.num_of_nodes = n.num_of_nodes > 64 ? 64 : n.num_of_nodes;
	n.ptr = (uintptr_t)ap;
	if (ioctl(kfd, APERTURES_NEW, &n) < 0) {
		printf("APERTURES_NEW: %s\n", strerror(errno));
		return 1;
	}
	for (uint32_t i = 0; i < n.num_of_nodes; i++)
		printf("aperture gpu 0x%x lds 0x%llx scratch 0x%llx gpuvm 0x%llx-0x%llx\n", ap[i].gpu_id,
		       (unsigned long long)ap[i].lds_base, (unsigned long long)ap[i].scratch_base,
		       (unsigned long long)ap[i].gpuvm_base, (unsigned long long)ap[i].gpuvm_limit);
	/* The render file is not needed once the VM is bound (as KFD keeps its own reference). */
	for (int g = 0; g < gpus; g++)
		close(render[g]);
	return 0;
}
