// SPDX-License-Identifier: GPL-2.0
/*
 * The stand-in /dev/kfd: KFD processes with their per-GPU data, BOs, queues and events, and
 * the CRIU operations, following amdkfd where the checkpoint plugin and CRIU depend on it:
 *
 * - A process is its mm: the first open of /dev/kfd by an mm makes it, with one device per
 *   GPU; later opens (CRIU re-opening /dev/kfd for a restored mapping) get the same one. Its
 *   ioctls must come from that mm (EBADF otherwise), except CRIU_OP, which CRIU issues on the
 *   fd it took from the process: it must come from the process's main thread's group or from
 *   that thread's tracer (EBADF otherwise, as amdkfd's ptrace_parent check) and needs
 *   CAP_CHECKPOINT_RESTORE or CAP_SYS_ADMIN.
 * - ACQUIRE_VM binds a render-node file of the same GPU; BOs of VRAM and GTT are GEM objects
 *   of that GPU with a handle in that file and its fake mmap offset (mapped through the
 *   render node), doorbells and the MMIO page are mapped through /dev/kfd at
 *   TYPE | gpu id << 46, the gpu id being the GPU's own (not the process's view after a
 *   restore onto other GPUs), as amdkfd encodes them.
 * - Queues "run" while the process is not evicted: every 10 ms each queue adds one to the
 *   64-bit word at its ring address (in a BO of the process), a device-side counter a test
 *   can watch stop during a dump and go on after a restore.
 * - CRIU_OP: PROCESS_INFO evicts the queues and sizes the arrays; CHECKPOINT (evicted only,
 *   sizes exactly those of PROCESS_INFO) fills the buckets, exports a dma-buf of every BO
 *   with contents into the caller and writes the private data; UNPAUSE undoes one eviction;
 *   RESTORE (in the restored process, on a fresh KFD process) checks everything, then makes
 *   the BOs on the GPUs of the device buckets' render files, with new offsets and dma-bufs
 *   in the caller, and leaves the queues evicted; RESUME (from any process, by pid) starts
 *   them. A failed operation leaves nothing behind: its dma-buf fds are closed again.
 *
 * Private data (little-endian, written and read in this order; version 1):
 *   u32 magic "SDFK", u32 version, u32 xnack, u32 devices
 *   per device: u32 user gpu id, u32 0
 *   per BO:     u64 user address, u32 idr handle, u32 mapped count, u32 mapped[8]
 *   per object: u32 kind (0 queue, 1 event), then
 *     queue: u32 id, gpu id, type, ring size, u64 ring address, u64 write and read pointer,
 *            u32 MQD length (64), the MQD bytes
 *     event: u32 id, type, auto reset, signaled
 */
#include <linux/fdtable.h>
#include <linux/file.h>
#include <linux/fs.h>
#include <linux/device.h>
#include <linux/mm.h>
#include <linux/pid.h>
#include <linux/pid_namespace.h>
#include <linux/ptrace.h>
#include <linux/sched/mm.h>
#include <linux/slab.h>
#include <linux/uaccess.h>
#include <linux/workqueue.h>
#include <drm/drm_prime.h>
#include "standin.h"

#define PRIV_MAGIC STANDIN_PAGE_MAGIC
#define PRIV_VERSION 1
#define MAX_MAPPED 8
#define MQD_BYTES 64
#define MAX_BOS 65536
#define MAX_QUEUES 128
#define MAX_EVENTS 4096
#define MAX_PRIV (16 << 20)
#define OBJ_QUEUE 0
#define OBJ_EVENT 1
#define TICK_MS 10

#if LINUX_VERSION_CODE < KERNEL_VERSION(6, 3, 0)
#define standin_vm_flags_set(vma, f) ((vma)->vm_flags |= (f))
#else
#define standin_vm_flags_set(vma, f) vm_flags_set(vma, f)
#endif

struct standin_pdd {
	struct standin_gpu *gpu;
	u32 user_gpu_id;
	struct file *drm_filp; /* the bound render file, referenced */
	struct drm_file *drm_file;
	struct page *doorbells; /* the process's doorbell slice on this GPU */
	struct page *mmio;
};

struct standin_kbo {
	struct list_head link;
	u32 idr;
	struct standin_pdd *pdd;
	u64 va, size, offset, user_addr;
	u32 flags;
	struct standin_bo *bo; /* VRAM and GTT: referenced; its handle in the pdd's file */
	u32 gem_handle;
	u32 mapped[MAX_MAPPED], n_mapped;
};

struct standin_queue {
	struct list_head link;
	u32 id, gpu_id, type, ring_size;
	u64 ring_base, wptr, rptr;
	u8 mqd[MQD_BYTES];
};

struct standin_event {
	struct list_head link;
	u32 id, type, auto_reset, signaled;
};

struct standin_proc {
	struct kref ref;
	struct list_head link;
	struct mm_struct *mm;
	struct pid *lead;
	struct standin_pdd pdds[STANDIN_MAX_GPUS];
	unsigned int npdds;
	struct list_head bos, queues, events;
	struct idr bo_ids;
	u32 next_queue, next_event, nqueues, nevents, nbos;
	u32 evicted;
	bool awaiting_resume, restored, xnack, dying;
	struct delayed_work tick;
};

static LIST_HEAD(procs);
/* The queues' ticks run on a workqueue of the module's own, drained at unload. */
static struct workqueue_struct *tick_wq;

/* ---- processes ---------------------------------------------------------------------------- */

static struct standin_kbo *kbo_at(struct standin_proc *p, u64 addr, u64 len)
{
	struct standin_kbo *k;

	list_for_each_entry(k, &p->bos, link)
		if (k->bo && addr >= k->va && addr + len <= k->va + k->size)
			return k;
	return NULL;
}

static void tick(struct work_struct *w)
{
	struct standin_proc *p = container_of(to_delayed_work(w), struct standin_proc, tick);
	struct standin_queue *q;
	struct standin_kbo *k;

	mutex_lock(&standin_kfd_lock);
	if (p->dying) {
		mutex_unlock(&standin_kfd_lock);
		return;
	}
	if (p->evicted == 0 && !p->awaiting_resume) {
		list_for_each_entry(q, &p->queues, link) {
			k = kbo_at(p, q->ring_base, 8);
			if (k)
				(*(u64 *)(k->bo->vaddr + (q->ring_base - k->va)))++;
		}
	}
	queue_delayed_work(tick_wq, &p->tick, msecs_to_jiffies(TICK_MS));
	mutex_unlock(&standin_kfd_lock);
}

static void fill_page(struct page *pg, u32 gpu_id)
{
	u32 *w = page_address(pg);

	w[0] = STANDIN_PAGE_MAGIC;
	w[1] = gpu_id;
}

static struct standin_proc *proc_create(void)
{
	struct standin_proc *p = kzalloc(sizeof(*p), GFP_KERNEL);
	unsigned int i;

	if (!p)
		return NULL;
	kref_init(&p->ref);
	INIT_LIST_HEAD(&p->bos);
	INIT_LIST_HEAD(&p->queues);
	INIT_LIST_HEAD(&p->events);
	idr_init_base(&p->bo_ids, 1);
	INIT_DELAYED_WORK(&p->tick, tick);
	for (i = 0; i < standin_ngpus; i++) {
		struct standin_pdd *d = &p->pdds[i];

		d->gpu = standin_gpus[i];
		d->user_gpu_id = d->gpu->gpu_id;
		d->doorbells = alloc_pages(GFP_KERNEL | __GFP_ZERO, get_order(STANDIN_DOORBELL_SLICE));
		d->mmio = alloc_page(GFP_KERNEL | __GFP_ZERO);
		p->npdds++;
		if (!d->doorbells || !d->mmio)
			goto fail;
		fill_page(d->doorbells, d->gpu->gpu_id);
		fill_page(d->mmio, d->gpu->gpu_id);
	}
	p->mm = current->mm;
	mmgrab(p->mm);
	p->lead = get_task_pid(current->group_leader, PIDTYPE_PID);
	return p;
fail:
	for (i = 0; i < p->npdds; i++) {
		if (p->pdds[i].doorbells)
			__free_pages(p->pdds[i].doorbells, get_order(STANDIN_DOORBELL_SLICE));
		if (p->pdds[i].mmio)
			__free_page(p->pdds[i].mmio);
	}
	kfree(p);
	return NULL;
}

static void kbo_free(struct standin_kbo *k)
{
	if (k->bo) {
		if (k->pdd->drm_file)
			drm_gem_handle_delete(k->pdd->drm_file, k->gem_handle);
		drm_gem_object_put(&k->bo->base);
	}
	kfree(k);
}

static void pdd_unbind(struct standin_pdd *d)
{
	if (!d->drm_filp)
		return;
	((struct standin_file *)d->drm_file->driver_priv)->bound = false;
	fput(d->drm_filp);
	d->drm_filp = NULL;
	d->drm_file = NULL;
}

/* Frees a process no file refers to any more (not on the list, its work stopped). */
static void proc_destroy(struct standin_proc *p)
{
	struct standin_kbo *k, *kn;
	struct standin_queue *q, *qn;
	struct standin_event *e, *en;
	unsigned int i;

	list_for_each_entry_safe(k, kn, &p->bos, link)
		kbo_free(k);
	list_for_each_entry_safe(q, qn, &p->queues, link)
		kfree(q);
	list_for_each_entry_safe(e, en, &p->events, link)
		kfree(e);
	for (i = 0; i < p->npdds; i++) {
		pdd_unbind(&p->pdds[i]);
		__free_pages(p->pdds[i].doorbells, get_order(STANDIN_DOORBELL_SLICE));
		__free_page(p->pdds[i].mmio);
	}
	idr_destroy(&p->bo_ids);
	put_pid(p->lead);
	mmdrop(p->mm);
	kfree(p);
}

static void proc_noop_release(struct kref *ref)
{
}

static void proc_put(struct standin_proc *p)
{
	bool last;

	mutex_lock(&standin_kfd_lock);
	last = kref_put(&p->ref, proc_noop_release);
	if (last) {
		list_del(&p->link);
		p->dying = true;
	}
	mutex_unlock(&standin_kfd_lock);
	if (last) {
		cancel_delayed_work_sync(&p->tick);
		proc_destroy(p);
	}
}

static struct standin_pdd *pdd_by_user_id(struct standin_proc *p, u32 gpu_id)
{
	unsigned int i;

	for (i = 0; i < p->npdds; i++)
		if (p->pdds[i].user_gpu_id == gpu_id)
			return &p->pdds[i];
	return NULL;
}

static struct standin_pdd *pdd_by_gpu(struct standin_proc *p, u32 actual_id)
{
	unsigned int i;

	for (i = 0; i < p->npdds; i++)
		if (p->pdds[i].gpu->gpu_id == actual_id)
			return &p->pdds[i];
	return NULL;
}

/* ---- the file ------------------------------------------------------------------------------ */

static int kfd_open(struct inode *inode, struct file *filp)
{
	struct standin_proc *p;

	if (!current->mm)
		return -EINVAL;
	mutex_lock(&standin_kfd_lock);
	list_for_each_entry(p, &procs, link) {
		if (p->mm == current->mm) {
			kref_get(&p->ref);
			goto found;
		}
	}
	p = proc_create();
	if (!p) {
		mutex_unlock(&standin_kfd_lock);
		return -ENOMEM;
	}
	list_add(&p->link, &procs);
	queue_delayed_work(tick_wq, &p->tick, msecs_to_jiffies(TICK_MS));
found:
	mutex_unlock(&standin_kfd_lock);
	filp->private_data = p;
	return 0;
}

static int kfd_release(struct inode *inode, struct file *filp)
{
	proc_put(filp->private_data);
	return 0;
}

static int kfd_mmap(struct file *filp, struct vm_area_struct *vma)
{
	struct standin_proc *p = filp->private_data;
	u64 off = (u64)vma->vm_pgoff << PAGE_SHIFT;
	unsigned long size = vma->vm_end - vma->vm_start;
	struct standin_pdd *d;
	struct page *pg;
	int ret = -EINVAL;

	if (p->mm != current->mm)
		return -EBADF;
	mutex_lock(&standin_kfd_lock);
	d = pdd_by_gpu(p, STANDIN_MMAP_GET_GPU_ID(off));
	if (!d)
		goto out;
	switch (off & STANDIN_MMAP_TYPE_MASK) {
	case STANDIN_MMAP_TYPE_DOORBELL:
		if (size > STANDIN_DOORBELL_SLICE)
			goto out;
		pg = d->doorbells;
		break;
	case STANDIN_MMAP_TYPE_MMIO:
		if (size != PAGE_SIZE || (vma->vm_flags & VM_EXEC))
			goto out;
		pg = d->mmio;
		break;
	default:
		goto out; /* the events page is not modelled */
	}
	/* The flags amdkfd gives doorbell and MMIO mappings. */
	standin_vm_flags_set(vma, VM_IO | VM_DONTCOPY | VM_DONTEXPAND | VM_NORESERVE |
					  VM_DONTDUMP | VM_PFNMAP);
	ret = remap_pfn_range(vma, vma->vm_start, page_to_pfn(pg), size, vma->vm_page_prot);
out:
	mutex_unlock(&standin_kfd_lock);
	return ret;
}

/* ---- ioctls ------------------------------------------------------------------------------- */

static int get_version(struct standin_proc *p, void *data)
{
	struct kfd_ioctl_get_version_args *a = data;

	a->major_version = KFD_IOCTL_MAJOR_VERSION;
	a->minor_version = KFD_IOCTL_MINOR_VERSION;
	return 0;
}

static int get_apertures(struct standin_proc *p, void *data)
{
	struct kfd_ioctl_get_process_apertures_new_args *a = data;
	struct kfd_process_device_apertures ap;
	unsigned int i, n = min_t(u32, a->num_of_nodes, p->npdds);

	if (a->num_of_nodes == 0) {
		a->num_of_nodes = p->npdds;
		return 0;
	}
	for (i = 0; i < n; i++) {
		memset(&ap, 0, sizeof(ap));
		ap.gpu_id = p->pdds[i].user_gpu_id;
		ap.gpuvm_base = STANDIN_VA_START;
		ap.gpuvm_limit = STANDIN_VA_END - 1;
		if (copy_to_user(u64_to_user_ptr(a->kfd_process_device_apertures_ptr +
						 i * sizeof(ap)), &ap, sizeof(ap)))
			return -EFAULT;
	}
	a->num_of_nodes = n;
	return 0;
}

static int acquire_vm(struct standin_proc *p, void *data)
{
	struct kfd_ioctl_acquire_vm_args *a = data;
	struct standin_pdd *d = pdd_by_user_id(p, a->gpu_id);
	struct drm_file *file;
	struct standin_file *sf;
	struct file *filp;

	if (!d)
		return -EINVAL;
	filp = fget(a->drm_fd);
	if (!filp)
		return -EINVAL;
	file = standin_render_file(filp);
	sf = file ? file->driver_priv : NULL;
	if (!sf || sf->gpu != d->gpu) {
		fput(filp);
		return -EINVAL;
	}
	if (d->drm_filp) {
		/* amdkfd: the same file again is fine, another is not */
		bool same = d->drm_file == file;

		fput(filp);
		return same ? 0 : -EBUSY;
	}
	if (sf->bound) {
		fput(filp);
		return -EBUSY;
	}
	sf->bound = true;
	d->drm_filp = filp;
	d->drm_file = file;
	return 0;
}

static bool overlaps(struct standin_proc *p, u64 va, u64 size)
{
	struct standin_kbo *k;

	list_for_each_entry(k, &p->bos, link)
		if ((k->flags & (KFD_IOC_ALLOC_MEM_FLAGS_VRAM | KFD_IOC_ALLOC_MEM_FLAGS_GTT |
				 KFD_IOC_ALLOC_MEM_FLAGS_USERPTR)) &&
		    va < k->va + k->size && k->va < va + size)
			return true;
	return false;
}

#define KIND_FLAGS (KFD_IOC_ALLOC_MEM_FLAGS_VRAM | KFD_IOC_ALLOC_MEM_FLAGS_GTT | \
		    KFD_IOC_ALLOC_MEM_FLAGS_USERPTR | KFD_IOC_ALLOC_MEM_FLAGS_DOORBELL | \
		    KFD_IOC_ALLOC_MEM_FLAGS_MMIO_REMAP)

/* Makes a BO of `d` (whose file is bound); `offset` is in: the user address of USERPTR. */
static struct standin_kbo *kbo_make(struct standin_proc *p, struct standin_pdd *d, u64 va,
				    u64 size, u32 flags, u64 user_addr, int idr_want, int *err)
{
	struct standin_kbo *k;
	u32 kind = flags & KIND_FLAGS;
	int ret;

	*err = -EINVAL;
	if (hweight32(kind) != 1 || size == 0 || !PAGE_ALIGNED(size) || !PAGE_ALIGNED(va) ||
	    va + size < va || p->nbos >= MAX_BOS)
		return NULL;
	if (kind == KFD_IOC_ALLOC_MEM_FLAGS_DOORBELL && size != STANDIN_DOORBELL_SLICE)
		return NULL;
	if (kind == KFD_IOC_ALLOC_MEM_FLAGS_MMIO_REMAP && size != PAGE_SIZE)
		return NULL;
	if (kind & (KFD_IOC_ALLOC_MEM_FLAGS_VRAM | KFD_IOC_ALLOC_MEM_FLAGS_GTT |
		    KFD_IOC_ALLOC_MEM_FLAGS_USERPTR) && overlaps(p, va, size))
		return NULL;
	k = kzalloc(sizeof(*k), GFP_KERNEL);
	*err = -ENOMEM;
	if (!k)
		return NULL;
	k->pdd = d;
	k->va = va;
	k->size = size;
	k->flags = flags;
	if (kind & (KFD_IOC_ALLOC_MEM_FLAGS_VRAM | KFD_IOC_ALLOC_MEM_FLAGS_GTT)) {
		k->bo = standin_bo_create(d->gpu, size, kind == KFD_IOC_ALLOC_MEM_FLAGS_VRAM);
		if (IS_ERR(k->bo)) {
			*err = PTR_ERR(k->bo);
			kfree(k);
			return NULL;
		}
		ret = drm_gem_handle_create(d->drm_file, &k->bo->base, &k->gem_handle);
		if (ret) {
			drm_gem_object_put(&k->bo->base);
			kfree(k);
			*err = ret;
			return NULL;
		}
		k->offset = drm_vma_node_offset_addr(&k->bo->base.vma_node);
	} else if (kind == KFD_IOC_ALLOC_MEM_FLAGS_DOORBELL) {
		k->offset = STANDIN_MMAP_TYPE_DOORBELL | STANDIN_MMAP_GPU_ID(d->gpu->gpu_id);
	} else if (kind == KFD_IOC_ALLOC_MEM_FLAGS_MMIO_REMAP) {
		k->offset = STANDIN_MMAP_TYPE_MMIO | STANDIN_MMAP_GPU_ID(d->gpu->gpu_id);
	} else {
		k->offset = user_addr;
		k->user_addr = user_addr;
	}
	ret = idr_want > 0 ? idr_alloc(&p->bo_ids, k, idr_want, idr_want + 1, GFP_KERNEL)
			   : idr_alloc(&p->bo_ids, k, 1, 0, GFP_KERNEL);
	if (ret < 0) {
		*err = ret == -ENOSPC ? -EINVAL : ret;
		kbo_free(k);
		return NULL;
	}
	k->idr = ret;
	list_add_tail(&k->link, &p->bos);
	p->nbos++;
	return k;
}

static void kbo_remove(struct standin_proc *p, struct standin_kbo *k)
{
	idr_remove(&p->bo_ids, k->idr);
	list_del(&k->link);
	p->nbos--;
	kbo_free(k);
}

static int alloc_memory(struct standin_proc *p, void *data)
{
	struct kfd_ioctl_alloc_memory_of_gpu_args *a = data;
	struct standin_pdd *d = pdd_by_user_id(p, a->gpu_id);
	struct standin_kbo *k;
	int err;

	if (!d || !d->drm_file)
		return -EINVAL; /* amdkfd: no VM before ACQUIRE_VM */
	k = kbo_make(p, d, a->va_addr, a->size, a->flags, a->mmap_offset, 0, &err);
	if (!k)
		return err;
	a->handle = ((u64)a->gpu_id << 32) | k->idr;
	a->mmap_offset = k->offset;
	return 0;
}

static struct standin_kbo *kbo_by_handle(struct standin_proc *p, u64 handle)
{
	struct standin_kbo *k = idr_find(&p->bo_ids, (u32)handle);

	if (!k || k->pdd->user_gpu_id != (u32)(handle >> 32))
		return NULL;
	return k;
}

static int free_memory(struct standin_proc *p, void *data)
{
	struct kfd_ioctl_free_memory_of_gpu_args *a = data;
	struct standin_kbo *k = kbo_by_handle(p, a->handle);

	if (!k)
		return -EINVAL;
	kbo_remove(p, k);
	return 0;
}

static int map_memory(struct standin_proc *p, void *data, bool map)
{
	struct kfd_ioctl_map_memory_to_gpu_args *a = data;
	struct standin_kbo *k = kbo_by_handle(p, a->handle);
	u32 ids[MAX_MAPPED], i, j;

	if (!k || a->n_devices == 0 || a->n_devices > MAX_MAPPED)
		return -EINVAL;
	if (copy_from_user(ids, u64_to_user_ptr(a->device_ids_array_ptr),
			   a->n_devices * sizeof(u32)))
		return -EFAULT;
	for (i = 0; i < a->n_devices; i++) {
		struct standin_pdd *d = pdd_by_user_id(p, ids[i]);

		if (!d || !d->drm_file)
			return -EINVAL;
	}
	for (i = 0; i < a->n_devices; i++) {
		for (j = 0; j < k->n_mapped && k->mapped[j] != ids[i]; j++)
			;
		if (map && j == k->n_mapped)
			k->mapped[k->n_mapped++] = ids[i];
		else if (!map && j < k->n_mapped)
			k->mapped[j] = k->mapped[--k->n_mapped];
	}
	a->n_success = a->n_devices;
	return 0;
}

static int create_queue(struct standin_proc *p, void *data)
{
	struct kfd_ioctl_create_queue_args *a = data;
	struct standin_pdd *d = pdd_by_user_id(p, a->gpu_id);
	struct standin_queue *q;

	if (!d || !d->drm_file || p->nqueues >= MAX_QUEUES)
		return -EINVAL;
	/* amdkfd (6.12 on) checks the ring lies in a BO of the process. */
	if (a->ring_size < 1024 || !is_power_of_2(a->ring_size) ||
	    !kbo_at(p, a->ring_base_address, a->ring_size))
		return -EINVAL;
	q = kzalloc(sizeof(*q), GFP_KERNEL);
	if (!q)
		return -ENOMEM;
	q->id = p->next_queue++;
	q->gpu_id = a->gpu_id;
	q->type = a->queue_type;
	q->ring_base = a->ring_base_address;
	q->ring_size = a->ring_size;
	q->wptr = a->write_pointer_address;
	q->rptr = a->read_pointer_address;
	memcpy(q->mqd, a, min_t(size_t, sizeof(*a), MQD_BYTES));
	list_add_tail(&q->link, &p->queues);
	p->nqueues++;
	a->queue_id = q->id;
	a->doorbell_offset = STANDIN_MMAP_TYPE_DOORBELL | STANDIN_MMAP_GPU_ID(d->gpu->gpu_id) |
			     (q->id * 8);
	return 0;
}

static int destroy_queue(struct standin_proc *p, void *data)
{
	struct kfd_ioctl_destroy_queue_args *a = data;
	struct standin_queue *q;

	list_for_each_entry(q, &p->queues, link) {
		if (q->id == a->queue_id) {
			list_del(&q->link);
			p->nqueues--;
			kfree(q);
			return 0;
		}
	}
	return -EINVAL;
}

static int create_event(struct standin_proc *p, void *data)
{
	struct kfd_ioctl_create_event_args *a = data;
	struct standin_event *e;

	if (p->nevents >= MAX_EVENTS)
		return -ENOMEM;
	e = kzalloc(sizeof(*e), GFP_KERNEL);
	if (!e)
		return -ENOMEM;
	e->id = ++p->next_event;
	e->type = a->event_type;
	e->auto_reset = a->auto_reset;
	list_add_tail(&e->link, &p->events);
	p->nevents++;
	a->event_id = e->id;
	a->event_slot_index = e->id;
	a->event_trigger_data = e->id;
	a->event_page_offset = 0;
	return 0;
}

static int destroy_event(struct standin_proc *p, void *data)
{
	struct kfd_ioctl_destroy_event_args *a = data;
	struct standin_event *e;

	list_for_each_entry(e, &p->events, link) {
		if (e->id == a->event_id) {
			list_del(&e->link);
			p->nevents--;
			kfree(e);
			return 0;
		}
	}
	return -EINVAL;
}

static int export_dmabuf(struct standin_proc *p, void *data)
{
	struct kfd_ioctl_export_dmabuf_args *a = data;
	struct standin_kbo *k = kbo_by_handle(p, a->handle);
	int fd, ret;

	if (!k || !k->bo)
		return -EINVAL;
	ret = drm_gem_prime_handle_to_fd(&k->pdd->gpu->drm, k->pdd->drm_file, k->gem_handle,
					 a->flags & (O_CLOEXEC | O_RDWR), &fd);
	if (ret)
		return ret;
	a->dmabuf_fd = fd;
	return 0;
}

/* The CRIU operations. */
#include "criu.c"

static int map_to_gpu(struct standin_proc *p, void *data)
{
	return map_memory(p, data, true);
}

static int unmap_from_gpu(struct standin_proc *p, void *data)
{
	return map_memory(p, data, false);
}

/* The ioctls, by number: the command (so its argument size) and the handler. */
static const struct {
	unsigned int cmd;
	int (*fn)(struct standin_proc *p, void *data);
} kfd_ioctls[] = {
	{ AMDKFD_IOC_GET_VERSION, get_version },
	{ AMDKFD_IOC_CREATE_QUEUE, create_queue },
	{ AMDKFD_IOC_DESTROY_QUEUE, destroy_queue },
	{ AMDKFD_IOC_CREATE_EVENT, create_event },
	{ AMDKFD_IOC_DESTROY_EVENT, destroy_event },
	{ AMDKFD_IOC_GET_PROCESS_APERTURES_NEW, get_apertures },
	{ AMDKFD_IOC_ACQUIRE_VM, acquire_vm },
	{ AMDKFD_IOC_ALLOC_MEMORY_OF_GPU, alloc_memory },
	{ AMDKFD_IOC_FREE_MEMORY_OF_GPU, free_memory },
	{ AMDKFD_IOC_MAP_MEMORY_TO_GPU, map_to_gpu },
	{ AMDKFD_IOC_UNMAP_MEMORY_FROM_GPU, unmap_from_gpu },
	{ AMDKFD_IOC_CRIU_OP, criu_op },
	{ AMDKFD_IOC_EXPORT_DMABUF, export_dmabuf },
};

/* As amdkfd: a CRIU operation comes from the process itself or from the tracer of its main
 * thread (CRIU during a dump; a guardian that traces the process after CRIU ended). */
static bool caller_may_criu(struct standin_proc *p)
{
	struct task_struct *lead;
	bool ok;

	rcu_read_lock();
	lead = pid_task(p->lead, PIDTYPE_PID);
	ok = lead && (lead == current->group_leader || ptrace_parent(lead) == current);
	rcu_read_unlock();
	return ok;
}

static long kfd_ioctl(struct file *filp, unsigned int cmd, unsigned long arg)
{
	struct standin_proc *p = filp->private_data;
	unsigned int nr = _IOC_NR(cmd), usize = _IOC_SIZE(cmd), ksize, i;
	u64 buf[16] = {};
	int ret;

	if (_IOC_TYPE(cmd) != AMDKFD_IOCTL_BASE)
		return -ENOTTY;
	for (i = 0; i < ARRAY_SIZE(kfd_ioctls) && _IOC_NR(kfd_ioctls[i].cmd) != nr; i++)
		;
	if (i == ARRAY_SIZE(kfd_ioctls))
		return -EINVAL; /* amdkfd answers EINVAL for an ioctl it does not have */
	ksize = _IOC_SIZE(kfd_ioctls[i].cmd);
	BUILD_BUG_ON(sizeof(struct kfd_ioctl_create_queue_args) > sizeof(buf));
	BUILD_BUG_ON(sizeof(struct kfd_ioctl_criu_args) > sizeof(buf));
	if (ksize > sizeof(buf))
		return -EINVAL;
	if (nr == _IOC_NR(AMDKFD_IOC_CRIU_OP)) {
		if (!caller_may_criu(p))
			return -EBADF; /* amdkfd: "Using KFD FD in wrong process" */
		if (!capable(CAP_CHECKPOINT_RESTORE) && !capable(CAP_SYS_ADMIN))
			return -EACCES;
	} else if (p->mm != current->mm) {
		return -EBADF; /* amdkfd: "Using KFD FD in wrong process" */
	}
	/* As amdkfd: what the caller's size lacks is zero, what it has beyond ours is ignored. */
	if ((_IOC_DIR(cmd) & _IOC_WRITE) &&
	    copy_from_user(buf, (void __user *)arg, min(usize, ksize)))
		return -EFAULT;
	mutex_lock(&standin_kfd_lock);
	ret = kfd_ioctls[i].fn(p, buf);
	mutex_unlock(&standin_kfd_lock);
	if (ret == 0 && (_IOC_DIR(cmd) & _IOC_READ) &&
	    copy_to_user((void __user *)arg, buf, min(usize, ksize)))
		return -EFAULT;
	return ret;
}

static const struct file_operations kfd_fops = {
	.owner = THIS_MODULE,
	.open = kfd_open,
	.release = kfd_release,
	.unlocked_ioctl = kfd_ioctl,
	.compat_ioctl = kfd_ioctl,
	.mmap = kfd_mmap,
};

/* As amdkfd: a char major of its own, minor 0, and a "kfd" class so devtmpfs makes /dev/kfd
 * (the plugin recognises the KFD file by that major and minor). */
static int kfd_major = -1;
static struct class *kfd_class;
static struct device *kfd_device;

#if LINUX_VERSION_CODE < KERNEL_VERSION(6, 2, 0)
static char *kfd_devnode(struct device *dev, umode_t *mode)
#else
static char *kfd_devnode(const struct device *dev, umode_t *mode)
#endif
{
	if (mode)
		*mode = 0666;
	return NULL;
}

int standin_kfd_init(void)
{
	int ret;

	tick_wq = alloc_workqueue("kfd_standin_tick", 0, 0);
	if (!tick_wq)
		return -ENOMEM;
	kfd_major = register_chrdev(0, "kfd", &kfd_fops);
	if (kfd_major < 0) {
		destroy_workqueue(tick_wq);
		return kfd_major;
	}
#if LINUX_VERSION_CODE < KERNEL_VERSION(6, 4, 0)
	kfd_class = class_create(THIS_MODULE, "kfd");
#else
	kfd_class = class_create("kfd");
#endif
	ret = PTR_ERR_OR_ZERO(kfd_class);
	if (ret)
		goto unregister;
	kfd_class->devnode = kfd_devnode;
	kfd_device = device_create(kfd_class, NULL, MKDEV(kfd_major, 0), NULL, "kfd");
	ret = PTR_ERR_OR_ZERO(kfd_device);
	if (ret)
		goto destroy_class;
	return 0;
destroy_class:
	class_destroy(kfd_class);
unregister:
	unregister_chrdev(kfd_major, "kfd");
	destroy_workqueue(tick_wq);
	return ret;
}

void standin_kfd_exit(void)
{
	struct standin_proc *p;

	device_destroy(kfd_class, MKDEV(kfd_major, 0));
	class_destroy(kfd_class);
	unregister_chrdev(kfd_major, "kfd");
	/* Every process went with its last file, which pins the module: one left is a bug here. */
	mutex_lock(&standin_kfd_lock);
	list_for_each_entry(p, &procs, link) {
		WARN(1, "kfd_standin: a process is left at unload");
		p->dying = true;
	}
	mutex_unlock(&standin_kfd_lock);
	list_for_each_entry(p, &procs, link)
		cancel_delayed_work_sync(&p->tick);
	destroy_workqueue(tick_wq);
}
