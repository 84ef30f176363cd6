/*
 * A KFD workload for the stand-in module (tests/kfd_module): what a ROCm process holds, made
 * with the ioctls libhsakmt issues, so that real CRIU and the plugin dump and restore it.
 *
 *   workload DIR [share] [count]
 *
 * Per GPU of /dev/kfd (GET_PROCESS_APERTURES_NEW): ACQUIRE_VM with its render node, a 4 MiB
 * VRAM BO and a 1 MiB GTT BO mapped for the CPU at their GPU addresses (MAP_FIXED through the
 * render node, as libhsakmt maps them), a doorbell slice mapped at its GPU address through
 * /dev/kfd (as libhsakmt does) and the MMIO page mapped through /dev/kfd wherever mmap puts
 * it (libhsakmt maps it at its GPU address too: elsewhere tests that the plugin finds the
 * mapping by its offset alone), a compute queue whose ring is the GTT BO (the stand-in adds
 * one to its first word every 10 ms while the queue runs), and an event. The BOs hold a
 * pattern.
 *
 * With "share", a child process (forked before any of that) gets a dma-buf of GPU 0's VRAM
 * BO (EXPORT_DMABUF) over a socket and keeps it open, as a process sharing GPU memory does.
 *
 * With "count", the parent appends one more number to DIR/counter every 20 ms (1, 2, ...), as a
 * shell loop in a container does: how a test sees that a restored process goes on from where
 * it was.
 *
 * At SIGUSR1 each process writes DIR/status-<pid> (atomically), one "key value" per line:
 * the BOs' checksums and whether the pattern holds, each doorbell and MMIO page's GPU id as
 * the device wrote it, the queue counters, and for the child what it reads through the
 * dma-buf and the marker it writes there; the parent then reports the marker it sees. At
 * SIGTERM both exit.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>
#include <linux/kfd_ioctl.h>

#ifndef AMDKFD_IOC_EXPORT_DMABUF
struct kfd_ioctl_export_dmabuf_args {
	uint64_t handle;
	uint32_t flags;
	uint32_t dmabuf_fd;
};
#define AMDKFD_IOC_EXPORT_DMABUF AMDKFD_IOWR(0x24, struct kfd_ioctl_export_dmabuf_args)
#endif

#define MAX_GPUS 4
#define VRAM_BYTES (4u << 20)
#define GTT_BYTES (1u << 20)
#define DOORBELL_BYTES 8192
#define MARKER_AT 4096 /* a word of GPU 0's VRAM BO the two processes write to each other */

struct gpu {
	uint32_t id;
	int render;
	uint8_t *vram, *gtt;
	volatile uint32_t *doorbell, *mmio;
};

static struct gpu gpus[MAX_GPUS];
static int ngpus, kfd = -1;
static const char *dir;
static volatile sig_atomic_t want_status, want_exit;

static void die(const char *what)
{
	fprintf(stderr, "workload %d: %s: %s\n", getpid(), what, strerror(errno));
	exit(2);
}

static uint32_t pattern(int g, size_t i)
{
	uint32_t x = (uint32_t)(i * 2654435761u) ^ (0x9e3779b9u * (uint32_t)(g + 1));

	return x ^ (x >> 13);
}

static uint64_t fnv(const uint8_t *p, size_t n)
{
	uint64_t h = 1469598103934665603ull;

	while (n--)
		h = (h ^ *p++) * 1099511628211ull;
	return h;
}

/* The BO's words from `from` on follow the pattern. */
static int pattern_ok(const uint8_t *bo, size_t bytes, size_t from, int g)
{
	const uint32_t *w = (const uint32_t *)bo;
	size_t i;

	for (i = from / 4; i < bytes / 4; i++)
		if (i != MARKER_AT / 4 && w[i] != pattern(g, i))
			return 0;
	return 1;
}

static void fill(uint8_t *bo, size_t bytes, size_t from, int g)
{
	uint32_t *w = (uint32_t *)bo;
	size_t i;

	for (i = from / 4; i < bytes / 4; i++)
		w[i] = pattern(g, i);
}

static void xioctl(int fd, unsigned long req, void *arg, const char *what)
{
	if (ioctl(fd, req, arg) != 0)
		die(what);
}

static uint64_t alloc_bo(struct gpu *g, uint64_t va, uint64_t size, uint32_t flags,
			 uint64_t *offset)
{
	struct kfd_ioctl_alloc_memory_of_gpu_args a = {
		.va_addr = va, .size = size, .gpu_id = g->id, .flags = flags,
	};
	struct kfd_ioctl_map_memory_to_gpu_args m = { 0 };

	xioctl(kfd, AMDKFD_IOC_ALLOC_MEMORY_OF_GPU, &a, "ALLOC_MEMORY_OF_GPU");
	m.handle = a.handle;
	m.device_ids_array_ptr = (uint64_t)(uintptr_t)&g->id;
	m.n_devices = 1;
	xioctl(kfd, AMDKFD_IOC_MAP_MEMORY_TO_GPU, &m, "MAP_MEMORY_TO_GPU");
	*offset = a.mmap_offset;
	return a.handle;
}

/* A free, 2 MiB aligned range of the address space for a GPU's BOs (libhsakmt reserves its
 * apertures the same way). */
static uint8_t *reserve(size_t bytes)
{
	uint8_t *p = mmap(NULL, bytes + (2u << 20), PROT_NONE,
			  MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);

	if (p == MAP_FAILED)
		die("reserve");
	return (uint8_t *)(((uintptr_t)p + (2u << 20) - 1) & ~(uintptr_t)((2u << 20) - 1));
}

static void set_up_gpu(int i)
{
	struct gpu *g = &gpus[i];
	struct kfd_ioctl_acquire_vm_args vm = { 0 };
	struct kfd_ioctl_create_queue_args q = { 0 };
	struct kfd_ioctl_create_event_args e = { 0 };
	char path[64];
	uint8_t *base = reserve(VRAM_BYTES + GTT_BYTES + DOORBELL_BYTES + 4096);
	uint64_t off;
	void *p;

	snprintf(path, sizeof(path), "/dev/dri/renderD%d", 128 + i);
	g->render = open(path, O_RDWR | O_CLOEXEC);
	if (g->render < 0)
		die(path);
	vm.drm_fd = g->render;
	vm.gpu_id = g->id;
	xioctl(kfd, AMDKFD_IOC_ACQUIRE_VM, &vm, "ACQUIRE_VM");

	alloc_bo(g, (uintptr_t)base, VRAM_BYTES,
		 KFD_IOC_ALLOC_MEM_FLAGS_VRAM | KFD_IOC_ALLOC_MEM_FLAGS_WRITABLE, &off);
	p = mmap(base, VRAM_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, g->render, off);
	if (p == MAP_FAILED)
		die("mmap VRAM BO");
	g->vram = p;
	alloc_bo(g, (uintptr_t)base + VRAM_BYTES, GTT_BYTES,
		 KFD_IOC_ALLOC_MEM_FLAGS_GTT | KFD_IOC_ALLOC_MEM_FLAGS_WRITABLE, &off);
	p = mmap(base + VRAM_BYTES, GTT_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED,
		 g->render, off);
	if (p == MAP_FAILED)
		die("mmap GTT BO");
	g->gtt = p;
	alloc_bo(g, (uintptr_t)base + VRAM_BYTES + GTT_BYTES, DOORBELL_BYTES,
		 KFD_IOC_ALLOC_MEM_FLAGS_DOORBELL | KFD_IOC_ALLOC_MEM_FLAGS_WRITABLE, &off);
	p = mmap(base + VRAM_BYTES + GTT_BYTES, DOORBELL_BYTES, PROT_READ | PROT_WRITE,
		 MAP_SHARED | MAP_FIXED, kfd, off);
	if (p == MAP_FAILED)
		die("mmap doorbells");
	g->doorbell = p;
	alloc_bo(g, (uintptr_t)base + VRAM_BYTES + GTT_BYTES + DOORBELL_BYTES, 4096,
		 KFD_IOC_ALLOC_MEM_FLAGS_MMIO_REMAP | KFD_IOC_ALLOC_MEM_FLAGS_WRITABLE, &off);
	p = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, kfd, off);
	if (p == MAP_FAILED)
		die("mmap MMIO page");
	g->mmio = p;

	fill(g->vram, VRAM_BYTES, 0, i);
	fill(g->gtt, GTT_BYTES, 4096, i);

	q.ring_base_address = (uintptr_t)g->gtt;
	q.ring_size = 4096;
	q.gpu_id = g->id;
	q.queue_type = KFD_IOC_QUEUE_TYPE_COMPUTE_AQL;
	q.queue_percentage = 100;
	xioctl(kfd, AMDKFD_IOC_CREATE_QUEUE, &q, "CREATE_QUEUE");
	e.event_type = KFD_IOC_EVENT_SIGNAL;
	e.node_id = i + 1;
	xioctl(kfd, AMDKFD_IOC_CREATE_EVENT, &e, "CREATE_EVENT");
}

static FILE *status_open(char *tmp, size_t n)
{
	FILE *f;

	snprintf(tmp, n, "%s/.status-%d", dir, getpid());
	f = fopen(tmp, "w");
	if (!f)
		die("status file");
	return f;
}

static void status_close(FILE *f, const char *tmp)
{
	char final[512];

	snprintf(final, sizeof(final), "%s/status-%d", dir, getpid());
	fclose(f);
	if (rename(tmp, final) != 0)
		die("rename status");
}

static void parent_status(pid_t child)
{
	char tmp[512];
	FILE *f = status_open(tmp, sizeof(tmp));
	int i;

	fprintf(f, "gpus %d\nchild %d\n", ngpus, (int)child);
	for (i = 0; i < ngpus; i++) {
		struct gpu *g = &gpus[i];

		fprintf(f, "gpu%d_id %u\n", i, g->id);
		fprintf(f, "gpu%d_vram_addr %p\ngpu%d_gtt_addr %p\n", i, (void *)g->vram, i,
			(void *)g->gtt);
		fprintf(f, "gpu%d_vram_sum %016llx\n", i,
			(unsigned long long)fnv(g->vram + MARKER_AT + 4, VRAM_BYTES - MARKER_AT - 4));
		fprintf(f, "gpu%d_gtt_sum %016llx\n", i,
			(unsigned long long)fnv(g->gtt + 4096, GTT_BYTES - 4096));
		fprintf(f, "gpu%d_vram_pattern %d\n", i, pattern_ok(g->vram, VRAM_BYTES, 0, i));
		fprintf(f, "gpu%d_gtt_pattern %d\n", i, pattern_ok(g->gtt, GTT_BYTES, 4096, i));
		fprintf(f, "gpu%d_doorbell %x %u\n", i, g->doorbell[0], g->doorbell[1]);
		fprintf(f, "gpu%d_mmio %x %u\n", i, g->mmio[0], g->mmio[1]);
		fprintf(f, "gpu%d_counter %llu\n", i,
			(unsigned long long)*(volatile uint64_t *)g->gtt);
	}
	fprintf(f, "marker %08x\n", *(volatile uint32_t *)(gpus[0].vram + MARKER_AT));
	status_close(f, tmp);
}

/* The child: a dma-buf of GPU 0's VRAM BO, open; read and written through a mapping made
 * only while it reports. */
static void child_status(int buf, uint32_t *marker)
{
	char tmp[512];
	FILE *f = status_open(tmp, sizeof(tmp));
	uint8_t *p = mmap(NULL, VRAM_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, buf, 0);

	if (p == MAP_FAILED) {
		fprintf(f, "dmabuf_mmap_errno %d\n", errno);
	} else {
		fprintf(f, "dmabuf_pattern %d\n", pattern_ok(p, VRAM_BYTES, 0, 0));
		fprintf(f, "dmabuf_sum %016llx\n",
			(unsigned long long)fnv(p + MARKER_AT + 4, VRAM_BYTES - MARKER_AT - 4));
		fprintf(f, "dmabuf_marker_seen %08x\n", *(volatile uint32_t *)(p + MARKER_AT));
		*marker += 1;
		*(volatile uint32_t *)(p + MARKER_AT) = *marker;
		fprintf(f, "dmabuf_marker_written %08x\n", *marker);
		munmap(p, VRAM_BYTES);
	}
	status_close(f, tmp);
}

static void count_one_more(unsigned long n)
{
	char path[4096];
	FILE *f;

	snprintf(path, sizeof(path), "%s/counter", dir);
	f = fopen(path, "a");
	if (!f)
		die("counter");
	fprintf(f, "%lu\n", n);
	fclose(f);
}

static void on_usr1(int s)
{
	(void)s;
	want_status = 1;
}

static void on_term(int s)
{
	(void)s;
	want_exit = 1;
}

static void child(int sock)
{
	char c;
	struct msghdr msg = { 0 };
	struct iovec iov = { &c, 1 };
	union { struct cmsghdr h; char b[CMSG_SPACE(sizeof(int))]; } u;
	uint32_t marker = 0xc0de0000u;
	int buf;

	msg.msg_iov = &iov;
	msg.msg_iovlen = 1;
	msg.msg_control = u.b;
	msg.msg_controllen = sizeof(u.b);
	if (recvmsg(sock, &msg, 0) != 1 || !CMSG_FIRSTHDR(&msg))
		die("receive the dma-buf");
	memcpy(&buf, CMSG_DATA(CMSG_FIRSTHDR(&msg)), sizeof(int));
	close(sock);
	while (!want_exit) {
		if (want_status) {
			want_status = 0;
			child_status(buf, &marker);
		}
		usleep(20000);
	}
	exit(0);
}

int main(int argc, char **argv)
{
	struct kfd_ioctl_get_version_args v = { 0 };
	struct kfd_ioctl_get_process_apertures_new_args ap = { 0 };
	struct kfd_process_device_apertures apd[MAX_GPUS];
	struct sigaction sa = { 0 };
	int share = 0, count = 0, sv[2], i;
	unsigned long counted = 0;
	pid_t kid = 0;

	if (argc < 2) {
		fprintf(stderr, "usage: workload DIR [share] [count]\n");
		return 2;
	}
	dir = argv[1];
	for (i = 2; i < argc; i++) {
		if (strcmp(argv[i], "share") == 0) {
			share = 1;
		} else if (strcmp(argv[i], "count") == 0) {
			count = 1;
		} else {
			fprintf(stderr, "workload: unknown argument %s\n", argv[i]);
			return 2;
		}
	}
	sa.sa_handler = on_usr1;
	sigaction(SIGUSR1, &sa, NULL);
	sa.sa_handler = on_term;
	sigaction(SIGTERM, &sa, NULL);
	if (share) {
		if (socketpair(AF_UNIX, SOCK_SEQPACKET, 0, sv) != 0)
			die("socketpair");
		kid = fork();
		if (kid < 0)
			die("fork");
		if (kid == 0) {
			close(sv[0]);
			child(sv[1]);
		}
		close(sv[1]);
	}

	kfd = open("/dev/kfd", O_RDWR | O_CLOEXEC);
	if (kfd < 0)
		die("/dev/kfd");
	xioctl(kfd, AMDKFD_IOC_GET_VERSION, &v, "GET_VERSION");
	xioctl(kfd, AMDKFD_IOC_GET_PROCESS_APERTURES_NEW, &ap, "GET_PROCESS_APERTURES_NEW");
	if (ap.num_of_nodes == 0 || ap.num_of_nodes > MAX_GPUS) {
		errno = ENODEV;
		die("GPU count");
	}
	ap.kfd_process_device_apertures_ptr = (uint64_t)(uintptr_t)apd;
	xioctl(kfd, AMDKFD_IOC_GET_PROCESS_APERTURES_NEW, &ap, "GET_PROCESS_APERTURES_NEW");
	ngpus = ap.num_of_nodes;
	for (i = 0; i < ngpus; i++) {
		gpus[i].id = apd[i].gpu_id;
		set_up_gpu(i);
	}
	*(volatile uint32_t *)(gpus[0].vram + MARKER_AT) = 0xfeed0001u;
	if (share) {
		struct kfd_ioctl_export_dmabuf_args ex = { 0 };
		struct kfd_ioctl_alloc_memory_of_gpu_args none = { 0 };
		char c = 'b';
		struct iovec iov = { &c, 1 };
		union { struct cmsghdr h; char b[CMSG_SPACE(sizeof(int))]; } u;
		struct msghdr msg = { 0 };
		struct cmsghdr *cm;

		(void)none;
		/* GPU 0's VRAM BO is the first allocation: idr handle 1. */
		ex.handle = ((uint64_t)gpus[0].id << 32) | 1;
		ex.flags = O_RDWR | O_CLOEXEC;
		xioctl(kfd, AMDKFD_IOC_EXPORT_DMABUF, &ex, "EXPORT_DMABUF");
		msg.msg_iov = &iov;
		msg.msg_iovlen = 1;
		msg.msg_control = u.b;
		msg.msg_controllen = sizeof(u.b);
		cm = CMSG_FIRSTHDR(&msg);
		cm->cmsg_level = SOL_SOCKET;
		cm->cmsg_type = SCM_RIGHTS;
		cm->cmsg_len = CMSG_LEN(sizeof(int));
		memcpy(CMSG_DATA(cm), &ex.dmabuf_fd, sizeof(int));
		if (sendmsg(sv[0], &msg, 0) != 1)
			die("send the dma-buf");
		close(ex.dmabuf_fd);
		close(sv[0]);
	}
	want_status = 1;
	while (!want_exit) {
		if (want_status) {
			want_status = 0;
			parent_status(kid);
		}
		if (count)
			count_one_more(++counted);
		usleep(20000);
	}
	if (kid > 0) {
		kill(kid, SIGTERM);
		waitpid(kid, NULL, 0);
	}
	return 0;
}
