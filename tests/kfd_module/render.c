// SPDX-License-Identifier: GPL-2.0
/*
 * The stand-in GPUs' render nodes: one DRM device per GPU (DRIVER_GEM | DRIVER_RENDER), so
 * /dev/dri/renderD128 and up, dma-bufs, PRIME and mmap through fake offsets are DRM's own.
 *
 * GEM objects hold kernel memory (vmalloc) or name user memory (GEM_USERPTR). They are mapped
 * as TTM maps amdgpu BOs: a PFN map whose vm_pgoff keeps the fake offset, so /proc/PID/maps,
 * and so CRIU, sees the offset that ALLOC_MEMORY_OF_GPU and RESTORE report. Their dma-bufs
 * are DRM's (drm_gem_dmabuf_export); an import into the device that exported it is the same
 * object, as in amdgpu; other imports are refused.
 *
 * The amdgpu ioctls are those the plugin's copy engine issues: INFO (DEV_INFO, GPUVM_FAULT),
 * GEM_CREATE, GEM_MMAP, GEM_USERPTR, GEM_VA, CTX, CS and WAIT_CS. CS runs the SDMA packets of
 * its IB at once, in the caller (NOP and COPY_LINEAR): an address that no mapping of the
 * submitting file's VM covers, or whose BO is not in the submission's list, is a GPU page
 * fault, as on hardware: that copy is not done, the job completes, and GPUVM_FAULT reports
 * the address.
 */
#include <linux/dma-buf.h>
#include <linux/mm.h>
#include <linux/module.h>
#include <linux/platform_device.h>
#include <linux/sched/mm.h>
#include <linux/slab.h>
#include <linux/uaccess.h>
#include <linux/vmalloc.h>
#include <drm/drm_drv.h>
#include <drm/drm_ioctl.h>
#include <drm/drm_prime.h>
#include "standin.h"

#define IB_MAX_BYTES (256 * 1024)
#define BO_MAX_BYTES (1ULL << 30)
/* SDMA COPY_LINEAR: header, count, parameter, source and destination (low and high). */
#define SDMA_OP_NOP 0
#define SDMA_OP_COPY 1
#define SDMA_COPY_LINEAR_DW 7

static const struct drm_driver standin_driver;
static const struct dma_buf_ops standin_dmabuf_ops;

static struct standin_gpu *to_gpu(struct drm_device *dev)
{
	return container_of(dev, struct standin_gpu, drm);
}

/* ---- GEM objects ---------------------------------------------------------------------- */

static void standin_bo_free(struct drm_gem_object *obj)
{
	struct standin_bo *bo = to_standin_bo(obj);

	if (bo->vram)
		atomic64_sub(obj->size, &bo->gpu->vram_used);
	vfree(bo->vaddr);
	if (bo->mm)
		mmdrop(bo->mm);
	drm_gem_object_release(obj);
	kfree(bo);
}

/* A handle closed in a render file: its mappings in that file's VM go, as amdgpu's do. */
static void standin_bo_close(struct drm_gem_object *obj, struct drm_file *file)
{
	struct standin_file *sf = file->driver_priv;
	struct standin_va *m, *n;

	mutex_lock(&sf->lock);
	list_for_each_entry_safe(m, n, &sf->vas, link) {
		if (&m->bo->base != obj)
			continue;
		list_del(&m->link);
		drm_gem_object_put(obj);
		kfree(m);
	}
	mutex_unlock(&sf->lock);
}

static int standin_bo_mmap(struct drm_gem_object *obj, struct vm_area_struct *vma)
{
	struct standin_bo *bo = to_standin_bo(obj);
	unsigned long start = drm_vma_node_start(&obj->vma_node);
	unsigned long first, addr;
	int ret;

	if (!bo->vaddr)
		return -EPERM; /* user memory is mapped where it is, not through the GPU */
	/* drm_gem_mmap leaves the fake offset (as TTM keeps it); a dma-buf mmap adds it. */
	first = vma->vm_pgoff >= start ? vma->vm_pgoff - start : vma->vm_pgoff;
	if (first + vma_pages(vma) > (obj->size >> PAGE_SHIFT))
		return -EINVAL;
	for (addr = vma->vm_start; addr < vma->vm_end; addr += PAGE_SIZE, first++) {
		ret = remap_pfn_range(vma, addr, vmalloc_to_pfn(bo->vaddr + (first << PAGE_SHIFT)),
				      PAGE_SIZE, vma->vm_page_prot);
		if (ret)
			return ret;
	}
	return 0;
}

static const struct vm_operations_struct standin_vm_ops = {
	.open = drm_gem_vm_open,
	.close = drm_gem_vm_close,
};

static struct dma_buf *standin_bo_export(struct drm_gem_object *obj, int flags)
{
	DEFINE_DMA_BUF_EXPORT_INFO(info);

	if (!to_standin_bo(obj)->vaddr)
		return ERR_PTR(-EPERM); /* amdgpu refuses to export user memory too */
	info.ops = &standin_dmabuf_ops;
	info.size = obj->size;
	info.flags = flags;
	info.priv = obj;
	info.resv = obj->resv;
	return drm_gem_dmabuf_export(obj->dev, &info);
}

static const struct drm_gem_object_funcs standin_bo_funcs = {
	.free = standin_bo_free,
	.close = standin_bo_close,
	.mmap = standin_bo_mmap,
	.export = standin_bo_export,
	.vm_ops = &standin_vm_ops,
};

static struct standin_bo *bo_alloc(struct standin_gpu *gpu, u64 size)
{
	struct standin_bo *bo;

	if (size == 0 || size > BO_MAX_BYTES || !PAGE_ALIGNED(size))
		return ERR_PTR(-EINVAL);
	bo = kzalloc(sizeof(*bo), GFP_KERNEL);
	if (!bo)
		return ERR_PTR(-ENOMEM);
	bo->base.funcs = &standin_bo_funcs;
	bo->gpu = gpu;
	drm_gem_private_object_init(&gpu->drm, &bo->base, size);
	return bo;
}

/* A BO of kernel memory, zeroed, with a fake mmap offset; VRAM is counted against the GPU. */
struct standin_bo *standin_bo_create(struct standin_gpu *gpu, u64 size, bool vram)
{
	struct standin_bo *bo;
	int ret;

	if (vram && atomic64_add_return(size, &gpu->vram_used) > gpu->vram_size) {
		atomic64_sub(size, &gpu->vram_used);
		return ERR_PTR(-ENOMEM);
	}
	bo = bo_alloc(gpu, size);
	if (IS_ERR(bo))
		goto unaccount;
	bo->vram = vram;
	bo->vaddr = vmalloc_user(size);
	ret = bo->vaddr ? drm_gem_create_mmap_offset(&bo->base) : -ENOMEM;
	if (ret) {
		drm_gem_object_put(&bo->base); /* frees and un-counts */
		return ERR_PTR(ret);
	}
	return bo;
unaccount:
	if (vram)
		atomic64_sub(size, &gpu->vram_used);
	return bo;
}

/* ---- dma-bufs -------------------------------------------------------------------------- */

static int standin_attach(struct dma_buf *buf, struct dma_buf_attachment *at)
{
	return -EOPNOTSUPP; /* no device outside this module reaches its memory */
}

static struct sg_table *standin_map(struct dma_buf_attachment *at, enum dma_data_direction dir)
{
	return ERR_PTR(-EOPNOTSUPP);
}

static void standin_unmap(struct dma_buf_attachment *at, struct sg_table *sgt,
			  enum dma_data_direction dir)
{
}

static const struct dma_buf_ops standin_dmabuf_ops = {
	.attach = standin_attach,
	.map_dma_buf = standin_map,
	.unmap_dma_buf = standin_unmap,
	.release = drm_gem_dmabuf_release,
	.mmap = drm_gem_dmabuf_mmap,
};

static struct drm_gem_object *standin_prime_import(struct drm_device *dev, struct dma_buf *buf)
{
	struct drm_gem_object *obj;

	if (buf->ops != &standin_dmabuf_ops)
		return ERR_PTR(-EOPNOTSUPP);
	obj = buf->priv;
	if (obj->dev != dev)
		return ERR_PTR(-EINVAL);
	drm_gem_object_get(obj);
	return obj;
}

/* ---- render files -------------------------------------------------------------------------- */

static int standin_open(struct drm_device *dev, struct drm_file *file)
{
	struct standin_file *sf = kzalloc(sizeof(*sf), GFP_KERNEL);

	if (!sf)
		return -ENOMEM;
	sf->gpu = to_gpu(dev);
	mutex_init(&sf->lock);
	INIT_LIST_HEAD(&sf->vas);
	idr_init_base(&sf->ctxs, 1);
	file->driver_priv = sf;
	return 0;
}

static void standin_postclose(struct drm_device *dev, struct drm_file *file)
{
	struct standin_file *sf = file->driver_priv;
	struct standin_va *m, *n;

	/* DRM closed every handle first (standin_bo_close); what is left had none. */
	list_for_each_entry_safe(m, n, &sf->vas, link) {
		drm_gem_object_put(&m->bo->base);
		kfree(m);
	}
	idr_destroy(&sf->ctxs);
	mutex_destroy(&sf->lock);
	kfree(sf);
}

DEFINE_DRM_GEM_FOPS(standin_fops);

struct drm_file *standin_render_file(struct file *filp)
{
	struct drm_file *file;

	if (!filp || filp->f_op != &standin_fops)
		return NULL;
	file = filp->private_data;
	/* Only render nodes: a primary node (card*) is not what amdkfd binds a VM to. */
	if (!file || !file->minor || file->minor->type != DRM_MINOR_RENDER)
		return NULL;
	if (file->minor->dev->driver != &standin_driver)
		return NULL;
	return file;
}

/* ---- amdgpu ioctls ----------------------------------------------------------------------- */

static int ioctl_info(struct drm_device *dev, void *data, struct drm_file *file)
{
	struct drm_amdgpu_info *info = data;
	struct standin_file *sf = file->driver_priv;
	void __user *out = u64_to_user_ptr(info->return_pointer);
	size_t len;

	switch (info->query) {
	case AMDGPU_INFO_DEV_INFO: {
		struct drm_amdgpu_info_device d = {};

		d.device_id = 0x7380 + sf->gpu->index;
		d.family = STANDIN_FAMILY;
		d.num_shader_engines = 1;
		d.virtual_address_offset = STANDIN_VA_START;
		d.virtual_address_max = STANDIN_VA_END;
		d.virtual_address_alignment = PAGE_SIZE;
		len = min_t(size_t, info->return_size, sizeof(d));
		return copy_to_user(out, &d, len) ? -EFAULT : 0;
	}
	case 0x23: { /* AMDGPU_INFO_GPUVM_FAULT (Linux 6.10) */
		struct { u64 addr; u32 status; u32 vmhub; } f = {};

		mutex_lock(&sf->lock);
		f.addr = sf->fault_addr;
		f.status = sf->fault_status;
		mutex_unlock(&sf->lock);
		len = min_t(size_t, info->return_size, sizeof(f));
		return copy_to_user(out, &f, len) ? -EFAULT : 0;
	}
	default:
		return -EINVAL;
	}
}

/* The handle of a new object in `file`; the file's handle holds the only reference after. */
static int new_handle(struct drm_file *file, struct standin_bo *bo, u32 *handle)
{
	int ret = drm_gem_handle_create(file, &bo->base, handle);

	drm_gem_object_put(&bo->base);
	return ret;
}

static int ioctl_gem_create(struct drm_device *dev, void *data, struct drm_file *file)
{
	union drm_amdgpu_gem_create *args = data;
	u64 size = PAGE_ALIGN(args->in.bo_size);
	struct standin_bo *bo;
	u32 handle;
	int ret;

	if (!(args->in.domains & (AMDGPU_GEM_DOMAIN_GTT | AMDGPU_GEM_DOMAIN_VRAM)))
		return -EINVAL;
	bo = standin_bo_create(to_gpu(dev), size, !(args->in.domains & AMDGPU_GEM_DOMAIN_GTT));
	if (IS_ERR(bo))
		return PTR_ERR(bo);
	ret = new_handle(file, bo, &handle);
	if (ret)
		return ret;
	memset(args, 0, sizeof(*args));
	args->out.handle = handle;
	return 0;
}

static int ioctl_gem_mmap(struct drm_device *dev, void *data, struct drm_file *file)
{
	union drm_amdgpu_gem_mmap *args = data;
	struct drm_gem_object *obj = drm_gem_object_lookup(file, args->in.handle);
	int ret = 0;

	if (!obj)
		return -ENOENT;
	if (!to_standin_bo(obj)->vaddr)
		ret = -EPERM;
	else
		args->out.addr_ptr = drm_vma_node_offset_addr(&obj->vma_node);
	drm_gem_object_put(obj);
	return ret;
}

static int ioctl_gem_userptr(struct drm_device *dev, void *data, struct drm_file *file)
{
	struct drm_amdgpu_gem_userptr *args = data;
	struct vm_area_struct *vma;
	struct standin_bo *bo;
	int ret = 0;

	if (!PAGE_ALIGNED(args->addr) || !PAGE_ALIGNED(args->size) || args->size == 0 ||
	    args->size > BO_MAX_BYTES || args->addr + args->size < args->addr)
		return -EINVAL;
	if (!(args->flags & AMDGPU_GEM_USERPTR_REGISTER))
		return -EACCES; /* amdgpu: without an MMU notifier the BO must be read-only */
	if (args->flags & (AMDGPU_GEM_USERPTR_VALIDATE | AMDGPU_GEM_USERPTR_ANONONLY)) {
		/* The pages must be anonymous memory of the caller, all of them mapped. */
		u64 addr = args->addr, end = args->addr + args->size;

		mmap_read_lock(current->mm);
		while (addr < end) {
			vma = find_vma(current->mm, addr);
			if (!vma || vma->vm_start > addr || vma->vm_file) {
				ret = -EFAULT;
				break;
			}
			addr = vma->vm_end;
		}
		mmap_read_unlock(current->mm);
		if (ret)
			return ret;
	}
	bo = bo_alloc(to_gpu(dev), args->size);
	if (IS_ERR(bo))
		return PTR_ERR(bo);
	bo->userptr = args->addr;
	bo->mm = current->mm;
	mmgrab(bo->mm);
	return new_handle(file, bo, &args->handle);
}

static int ioctl_gem_va(struct drm_device *dev, void *data, struct drm_file *file)
{
	struct drm_amdgpu_gem_va *args = data;
	struct standin_file *sf = file->driver_priv;
	struct drm_gem_object *obj;
	struct standin_va *m, *n;
	int ret = 0;

	if (args->operation != AMDGPU_VA_OP_MAP && args->operation != AMDGPU_VA_OP_UNMAP)
		return -EINVAL;
	if (!PAGE_ALIGNED(args->va_address) || !PAGE_ALIGNED(args->map_size) ||
	    !PAGE_ALIGNED(args->offset_in_bo) || args->map_size == 0 ||
	    args->va_address < STANDIN_VA_START ||
	    args->va_address + args->map_size > STANDIN_VA_END ||
	    args->va_address + args->map_size < args->va_address)
		return -EINVAL;
	obj = drm_gem_object_lookup(file, args->handle);
	if (!obj)
		return -ENOENT;
	mutex_lock(&sf->lock);
	if (args->operation == AMDGPU_VA_OP_UNMAP) {
		ret = -ENOENT;
		list_for_each_entry_safe(m, n, &sf->vas, link) {
			if (&m->bo->base == obj && m->va == args->va_address) {
				list_del(&m->link);
				drm_gem_object_put(obj);
				kfree(m);
				ret = 0;
				break;
			}
		}
		goto out;
	}
	if (args->offset_in_bo + args->map_size > obj->size) {
		ret = -EINVAL;
		goto out;
	}
	list_for_each_entry(m, &sf->vas, link) {
		if (args->va_address < m->va + m->size && m->va < args->va_address + args->map_size) {
			ret = -EINVAL; /* amdgpu: the range conflicts with a mapping */
			goto out;
		}
	}
	m = kzalloc(sizeof(*m), GFP_KERNEL);
	if (!m) {
		ret = -ENOMEM;
		goto out;
	}
	drm_gem_object_get(obj);
	m->bo = to_standin_bo(obj);
	m->va = args->va_address;
	m->size = args->map_size;
	m->offset = args->offset_in_bo;
	list_add_tail(&m->link, &sf->vas);
out:
	mutex_unlock(&sf->lock);
	drm_gem_object_put(obj);
	return ret;
}

static int ioctl_ctx(struct drm_device *dev, void *data, struct drm_file *file)
{
	union drm_amdgpu_ctx *args = data;
	struct standin_file *sf = file->driver_priv;
	int id, ret = 0;

	mutex_lock(&sf->lock);
	switch (args->in.op) {
	case AMDGPU_CTX_OP_ALLOC_CTX:
		id = idr_alloc(&sf->ctxs, sf, 1, 1024, GFP_KERNEL);
		if (id < 0) {
			ret = id;
			break;
		}
		memset(args, 0, sizeof(*args));
		args->out.alloc.ctx_id = id;
		break;
	case AMDGPU_CTX_OP_FREE_CTX:
		ret = idr_remove(&sf->ctxs, args->in.ctx_id) ? 0 : -EINVAL;
		break;
	default:
		ret = -EINVAL;
	}
	mutex_unlock(&sf->lock);
	return ret;
}

/* Where `va`..`va + len` lies: a mapping of the VM whose BO is in the submission's list. */
static struct standin_va *resolve(struct standin_file *sf, u64 va, u64 len,
				  struct drm_gem_object **list, u32 n)
{
	struct standin_va *m;
	u32 i;

	list_for_each_entry(m, &sf->vas, link) {
		if (va < m->va || va + len > m->va + m->size || va + len < va)
			continue;
		for (i = 0; i < n; i++)
			if (list[i] == &m->bo->base)
				return m;
		return NULL;
	}
	return NULL;
}

/* Copies `len` bytes between two resolved places; user memory only of the caller's own mm. */
static int copy_bytes(struct standin_va *dm, u64 dva, struct standin_va *sm, u64 sva, u64 len)
{
	struct standin_bo *d = dm->bo, *s = sm->bo;
	u64 doff = dm->offset + (dva - dm->va), soff = sm->offset + (sva - sm->va);
	void *bounce;
	int ret = 0;

	if ((d->mm && d->mm != current->mm) || (s->mm && s->mm != current->mm))
		return -EFAULT;
	if (d->vaddr && s->vaddr) {
		memmove(d->vaddr + doff, s->vaddr + soff, len);
		return 0;
	}
	if (d->vaddr)
		return copy_from_user(d->vaddr + doff, u64_to_user_ptr(s->userptr + soff), len) ?
			       -EFAULT : 0;
	if (s->vaddr)
		return copy_to_user(u64_to_user_ptr(d->userptr + doff), s->vaddr + soff, len) ?
			       -EFAULT : 0;
	bounce = kvmalloc(len, GFP_KERNEL);
	if (!bounce)
		return -ENOMEM;
	if (copy_from_user(bounce, u64_to_user_ptr(s->userptr + soff), len) ||
	    copy_to_user(u64_to_user_ptr(d->userptr + doff), bounce, len))
		ret = -EFAULT;
	kvfree(bounce);
	return ret;
}

/* Runs the IB's packets. A packet the engine does not know fails the submission. */
static int run_ib(struct standin_file *sf, const u32 *ib, u32 ndw, struct drm_gem_object **list,
		  u32 n)
{
	u32 i = 0;

	while (i < ndw) {
		u32 h = ib[i], op = h & 0xff, sub = (h >> 8) & 0xff;

		if (op == SDMA_OP_NOP) {
			i += 1 + ((h >> 16) & 0x3fff);
			continue;
		}
		if (op == SDMA_OP_COPY && sub == 0 && i + SDMA_COPY_LINEAR_DW <= ndw) {
			const u32 *p = &ib[i];
			u64 len = (u64)(p[1] & 0x3fffff) + 1;
			u64 src = p[3] | ((u64)p[4] << 32), dst = p[5] | ((u64)p[6] << 32);
			struct standin_va *sm = resolve(sf, src, len, list, n);
			struct standin_va *dm = resolve(sf, dst, len, list, n);
			int ret;

			i += SDMA_COPY_LINEAR_DW;
			if (!sm || !dm) {
				/* A GPU page fault: the copy is lost, the job goes on. */
				if (!sf->fault_status) {
					sf->fault_addr = !sm ? src : dst;
					sf->fault_status = 1;
				}
				continue;
			}
			ret = copy_bytes(dm, dst, sm, src, len);
			if (ret)
				return ret;
			continue;
		}
		return -EINVAL;
	}
	return 0;
}

static int ioctl_cs(struct drm_device *dev, void *data, struct drm_file *file)
{
	union drm_amdgpu_cs *args = data;
	struct standin_file *sf = file->driver_priv;
	struct drm_amdgpu_cs_chunk_ib ib = {};
	struct drm_amdgpu_bo_list_in bl = {};
	struct drm_gem_object **list = NULL;
	struct drm_amdgpu_bo_list_entry e;
	struct standin_va *ibm;
	bool have_ib = false;
	u32 *words = NULL;
	u32 i, n = 0;
	int ret = 0;

	if (args->in.num_chunks == 0 || args->in.num_chunks > 16 || args->in.bo_list_handle)
		return -EINVAL;
	for (i = 0; i < args->in.num_chunks; i++) {
		struct drm_amdgpu_cs_chunk c;
		u64 ptr;

		if (copy_from_user(&ptr, u64_to_user_ptr(args->in.chunks + 8 * i), 8) ||
		    copy_from_user(&c, u64_to_user_ptr(ptr), sizeof(c)))
			return -EFAULT;
		if (c.chunk_id == AMDGPU_CHUNK_ID_IB) {
			if (have_ib || c.length_dw * 4 < sizeof(ib) ||
			    copy_from_user(&ib, u64_to_user_ptr(c.chunk_data), sizeof(ib)))
				return -EINVAL;
			have_ib = true;
		} else if (c.chunk_id == AMDGPU_CHUNK_ID_BO_HANDLES) {
			if (c.length_dw * 4 < sizeof(bl) ||
			    copy_from_user(&bl, u64_to_user_ptr(c.chunk_data), sizeof(bl)))
				return -EINVAL;
		} else {
			return -EINVAL;
		}
	}
	if (!have_ib || ib.ip_type != AMDGPU_HW_IP_DMA || ib.ring != 0 || ib.ip_instance != 0 ||
	    ib.ib_bytes == 0 || ib.ib_bytes > IB_MAX_BYTES || ib.ib_bytes % 4 ||
	    bl.bo_number > 4096 || (bl.bo_number && bl.bo_info_size < sizeof(e)))
		return -EINVAL;
	mutex_lock(&sf->lock);
	if (!idr_find(&sf->ctxs, args->in.ctx_id)) {
		ret = -EINVAL;
		goto out;
	}
	list = kvcalloc(bl.bo_number + 1, sizeof(*list), GFP_KERNEL);
	words = kvmalloc(ib.ib_bytes, GFP_KERNEL);
	if (!list || !words) {
		ret = -ENOMEM;
		goto out;
	}
	for (n = 0; n < bl.bo_number; n++) {
		if (copy_from_user(&e, u64_to_user_ptr(bl.bo_info_ptr + (u64)n * bl.bo_info_size),
				   sizeof(e))) {
			ret = -EFAULT;
			goto out;
		}
		list[n] = drm_gem_object_lookup(file, e.bo_handle);
		if (!list[n]) {
			ret = -ENOENT;
			goto out;
		}
	}
	ibm = resolve(sf, ib.va_start, ib.ib_bytes, list, n);
	if (!ibm) {
		ret = -EINVAL; /* amdgpu: the IB must lie in a mapped BO of the job */
		goto out;
	}
	{
		/* The IB is read as the engine would, through a bounce copy of it. */
		struct standin_va tmp = { .bo = NULL };
		struct standin_bo kbuf = { .vaddr = words };

		tmp.bo = &kbuf;
		tmp.va = 0;
		tmp.size = ib.ib_bytes;
		ret = copy_bytes(&tmp, 0, ibm, ib.va_start, ib.ib_bytes);
		if (ret)
			goto out;
	}
	ret = run_ib(sf, words, ib.ib_bytes / 4, list, n);
	if (ret)
		goto out;
	memset(args, 0, sizeof(*args));
	args->out.handle = ++sf->seq;
out:
	mutex_unlock(&sf->lock);
	while (list && n > 0)
		drm_gem_object_put(list[--n]);
	kvfree(list);
	kvfree(words);
	return ret;
}

static int ioctl_wait_cs(struct drm_device *dev, void *data, struct drm_file *file)
{
	union drm_amdgpu_wait_cs *args = data;
	struct standin_file *sf = file->driver_priv;
	int ret = 0;

	mutex_lock(&sf->lock);
	if (!idr_find(&sf->ctxs, args->in.ctx_id) || args->in.handle > sf->seq)
		ret = -EINVAL;
	mutex_unlock(&sf->lock);
	if (ret)
		return ret;
	memset(args, 0, sizeof(*args));
	args->out.status = 0; /* every job is done when CS returns */
	return 0;
}

static const struct drm_ioctl_desc standin_ioctls[] = {
	DRM_IOCTL_DEF_DRV(AMDGPU_GEM_CREATE, ioctl_gem_create, DRM_AUTH | DRM_RENDER_ALLOW),
	DRM_IOCTL_DEF_DRV(AMDGPU_GEM_MMAP, ioctl_gem_mmap, DRM_AUTH | DRM_RENDER_ALLOW),
	DRM_IOCTL_DEF_DRV(AMDGPU_CTX, ioctl_ctx, DRM_AUTH | DRM_RENDER_ALLOW),
	DRM_IOCTL_DEF_DRV(AMDGPU_CS, ioctl_cs, DRM_AUTH | DRM_RENDER_ALLOW),
	DRM_IOCTL_DEF_DRV(AMDGPU_INFO, ioctl_info, DRM_AUTH | DRM_RENDER_ALLOW),
	DRM_IOCTL_DEF_DRV(AMDGPU_GEM_VA, ioctl_gem_va, DRM_AUTH | DRM_RENDER_ALLOW),
	DRM_IOCTL_DEF_DRV(AMDGPU_WAIT_CS, ioctl_wait_cs, DRM_AUTH | DRM_RENDER_ALLOW),
	DRM_IOCTL_DEF_DRV(AMDGPU_GEM_USERPTR, ioctl_gem_userptr, DRM_AUTH | DRM_RENDER_ALLOW),
};

static const struct drm_driver standin_driver = {
	.driver_features = DRIVER_GEM | DRIVER_RENDER,
	.open = standin_open,
	.postclose = standin_postclose,
	.gem_prime_import = standin_prime_import,
#if LINUX_VERSION_CODE < KERNEL_VERSION(6, 6, 0)
	.prime_handle_to_fd = drm_gem_prime_handle_to_fd,
	.prime_fd_to_handle = drm_gem_prime_fd_to_handle,
	/* Before 6.6 a dma-buf mmap asks the driver for this hook (else ENOSYS). */
	.gem_prime_mmap = drm_gem_prime_mmap,
#endif
	.ioctls = standin_ioctls,
	.num_ioctls = ARRAY_SIZE(standin_ioctls),
	.fops = &standin_fops,
	.name = "kfd_standin",
	.desc = "stand-in amdgpu render node (test fixture)",
#if LINUX_VERSION_CODE < KERNEL_VERSION(6, 14, 0)
	.date = "20261202",
#endif
	.major = 3,
	.minor = 57,
};

/* ---- devices ----------------------------------------------------------------------------- */

int standin_render_init(void)
{
	return 0;
}

void standin_render_exit(void)
{
}

int standin_gpu_register(struct standin_gpu **out, unsigned int index, u32 gpu_id, u64 vram)
{
	struct platform_device *pdev;
	struct standin_gpu *gpu;
	int ret;

	pdev = platform_device_register_simple("kfd_standin", index, NULL, 0);
	if (IS_ERR(pdev))
		return PTR_ERR(pdev);
	/* The platform device has no driver: its devres group is released by hand. */
	if (!devres_open_group(&pdev->dev, NULL, GFP_KERNEL)) {
		ret = -ENOMEM;
		goto unregister;
	}
	gpu = devm_drm_dev_alloc(&pdev->dev, &standin_driver, struct standin_gpu, drm);
	if (IS_ERR(gpu)) {
		ret = PTR_ERR(gpu);
		goto release;
	}
	gpu->pdev = pdev;
	gpu->index = index;
	gpu->gpu_id = gpu_id;
	gpu->vram_size = vram;
	ret = drm_dev_register(&gpu->drm, 0);
	if (ret)
		goto release;
	*out = gpu;
	return 0;
release:
	devres_release_group(&pdev->dev, NULL);
unregister:
	platform_device_unregister(pdev);
	return ret;
}

void standin_gpu_unregister(struct standin_gpu *gpu)
{
	struct platform_device *pdev = gpu->pdev;

	drm_dev_unregister(&gpu->drm);
	devres_release_group(&pdev->dev, NULL);
	platform_device_unregister(pdev);
}
