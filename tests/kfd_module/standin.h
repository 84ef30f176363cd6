/* SPDX-License-Identifier: GPL-2.0 */
/*
 * The stand-in KFD: shared declarations of main.c (devices, parameters), render.c (the DRM
 * render nodes: GEM objects, their dma-bufs, the amdgpu ioctls the checkpoint plugin's SDMA
 * engine issues) and kfd.c (/dev/kfd: processes, BOs, queues, events, the CRIU operations).
 *
 * A test fixture that behaves like amdkfd and amdgpu where the plugin and CRIU depend on it;
 * it drives no hardware and claims no hardware support.
 */
#ifndef KFD_STANDIN_H
#define KFD_STANDIN_H

#include <linux/atomic.h>
#include <linux/kref.h>
#include <linux/list.h>
#include <linux/mutex.h>
#include <linux/version.h>
#include <drm/drm_device.h>
#include <drm/drm_file.h>
#include <drm/drm_gem.h>
#include <drm/amdgpu_drm.h>
#include <linux/kfd_ioctl.h>

#define STANDIN_MAX_GPUS 4
/* What DEV_INFO reports: a gfx9 ("AI") part, whose SDMA COPY_LINEAR count is length - 1. */
#define STANDIN_FAMILY AMDGPU_FAMILY_AI
#define STANDIN_VA_START (2ULL << 20)
#define STANDIN_VA_END (1ULL << 47)
/* A process's doorbell slice on gfx9: 1024 doorbells of 8 bytes. */
#define STANDIN_DOORBELL_SLICE (2 * PAGE_SIZE)
/* The first word of a doorbell or MMIO page: this magic, then the GPU's id (tests read it). */
#define STANDIN_PAGE_MAGIC 0x4b464453u /* "SDFK" */

/* amdkfd's mmap offset encoding. */
#define STANDIN_MMAP_TYPE_SHIFT 62
#define STANDIN_MMAP_TYPE_MASK (3ULL << STANDIN_MMAP_TYPE_SHIFT)
#define STANDIN_MMAP_TYPE_DOORBELL (3ULL << STANDIN_MMAP_TYPE_SHIFT)
#define STANDIN_MMAP_TYPE_EVENTS (2ULL << STANDIN_MMAP_TYPE_SHIFT)
#define STANDIN_MMAP_TYPE_MMIO (0ULL << STANDIN_MMAP_TYPE_SHIFT)
#define STANDIN_MMAP_GPU_ID_SHIFT 46
#define STANDIN_MMAP_GPU_ID(id) (((u64)(id) & 0xffff) << STANDIN_MMAP_GPU_ID_SHIFT)
#define STANDIN_MMAP_GET_GPU_ID(off) (((off) >> STANDIN_MMAP_GPU_ID_SHIFT) & 0xffff)

/* Linux 6.2 added the export ioctl (KFD 1.12); the stand-in has it on every kernel. */
#ifndef AMDKFD_IOC_EXPORT_DMABUF
struct kfd_ioctl_export_dmabuf_args {
	__u64 handle;
	__u32 flags;
	__u32 dmabuf_fd;
};
#define AMDKFD_IOC_EXPORT_DMABUF AMDKFD_IOWR(0x24, struct kfd_ioctl_export_dmabuf_args)
#endif

/* One GPU: a DRM device with a render node. */
struct standin_gpu {
	struct drm_device drm;
	struct platform_device *pdev;
	unsigned int index;
	u32 gpu_id;
	u64 vram_size;
	atomic64_t vram_used;
};

/* A GEM object: kernel memory (VRAM and GTT BOs, the copy engine's buffers) or user memory
 * (GEM_USERPTR), never both. */
struct standin_bo {
	struct drm_gem_object base;
	void *vaddr;
	u64 userptr;
	struct mm_struct *mm;
	bool vram;
	struct standin_gpu *gpu;
};

/* A VA mapping in a render file's VM. */
struct standin_va {
	struct list_head link;
	struct standin_bo *bo; /* holds a reference */
	u64 va, size, offset;
};

/* What a render-node file holds beyond DRM's own: its VM, submission contexts, the last fault. */
struct standin_file {
	struct standin_gpu *gpu;
	struct mutex lock;
	struct list_head vas;
	struct idr ctxs;
	u64 seq;
	u64 fault_addr;
	u32 fault_status;
	bool bound; /* to a KFD process (ACQUIRE_VM or RESTORE); under standin_kfd_lock */
};

extern struct standin_gpu *standin_gpus[STANDIN_MAX_GPUS];
extern unsigned int standin_ngpus;
extern struct mutex standin_kfd_lock;

static inline struct standin_bo *to_standin_bo(struct drm_gem_object *obj)
{
	return container_of(obj, struct standin_bo, base);
}

struct standin_gpu *standin_gpu_by_id(u32 gpu_id);

/* render.c */
int standin_render_init(void);
void standin_render_exit(void);
int standin_gpu_register(struct standin_gpu **out, unsigned int index, u32 gpu_id, u64 vram);
void standin_gpu_unregister(struct standin_gpu *gpu);
struct standin_bo *standin_bo_create(struct standin_gpu *gpu, u64 size, bool vram);
/* The render file behind a struct file, or NULL when it is not one of ours. */
struct drm_file *standin_render_file(struct file *filp);

/* kfd.c */
int standin_kfd_init(void);
void standin_kfd_exit(void);

#endif
