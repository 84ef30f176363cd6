/* A GPU workload for the KFD supervisor: opens /dev/kfd and a render node, asks the KFD
 * version, binds the GPU's VM to the render node and reads the process apertures, as
 * libhsakmt does at start, then waits. Every answer comes from the supervisor's simulator.
 *
 * Usage: workload GPU_ID RENDER_PATH
 * Prints one line per step, then "ready"; after that, each SIGUSR1 makes it print
 * "alive N" (N counts the signals) and ask the KFD version once more. */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <unistd.h>

struct get_version { uint32_t major, minor; };
struct acquire_vm { uint32_t drm_fd, gpu_id; };
struct apertures { uint64_t lds_base, lds_limit, scratch_base, scratch_limit, gpuvm_base, gpuvm_limit; uint32_t gpu_id, pad; };
struct apertures_new { uint64_t ptr; uint32_t num_of_nodes, pad; };

#define KFD_IOC(dir, nr, type) _IOC(dir, 'K', nr, sizeof(type))
#define GET_VERSION KFD_IOC(_IOC_READ, 0x01, struct get_version)
#define ACQUIRE_VM KFD_IOC(_IOC_WRITE, 0x15, struct acquire_vm)
#define APERTURES_NEW KFD_IOC(_IOC_READ | _IOC_WRITE, 0x14, struct apertures_new)

static volatile sig_atomic_t usr1;
static void on_usr1(int sig) { (void)sig; usr1++; }

int main(int argc, char **argv)
{
	if (argc != 3) {
		fprintf(stderr, "usage: %s GPU_ID RENDER_PATH\n", argv[0]);
		return 2;
	}
	setvbuf(stdout, NULL, _IONBF, 0);
	uint32_t gpu_id = strtoul(argv[1], NULL, 0);
	int kfd = open("/dev/kfd", O_RDWR | O_CLOEXEC);
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
	int render = open(argv[2], O_RDWR | O_CLOEXEC);
	if (render < 0) {
		printf("open %s: %s\n", argv[2], strerror(errno));
		return 1;
	}
	struct acquire_vm a = { .drm_fd = render, .gpu_id = gpu_id };
	if (ioctl(kfd, ACQUIRE_VM, &a) < 0) {
		printf("ACQUIRE_VM: %s\n", strerror(errno));
		return 1;
	}
	printf("acquired vm of gpu 0x%x\n", gpu_id);
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
	close(render);
	signal(SIGUSR1, on_usr1);
	printf("ready\n");
	int seen = 0;
	for (;;) {
		pause();
		while (seen < usr1) {
			seen++;
			struct get_version again = {0};
			int rc = ioctl(kfd, GET_VERSION, &again);
			printf("alive %d: GET_VERSION %s %u.%u\n", seen, rc < 0 ? strerror(errno) : "ok", again.major, again.minor);
		}
	}
}
