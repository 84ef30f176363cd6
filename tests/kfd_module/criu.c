// SPDX-License-Identifier: GPL-2.0
/*
 * AMDKFD_IOC_CRIU_OP of the stand-in (included by kfd.c, under standin_kfd_lock): the order
 * and size rules and the private data format are described at the top of kfd.c.
 */

struct priv_writer {
	u8 *buf;
	size_t pos, cap;
};

static void put32(struct priv_writer *w, u32 v)
{
	if (w->buf && w->pos + 4 <= w->cap)
		memcpy(w->buf + w->pos, &v, 4);
	w->pos += 4;
}

static void put64(struct priv_writer *w, u64 v)
{
	if (w->buf && w->pos + 8 <= w->cap)
		memcpy(w->buf + w->pos, &v, 8);
	w->pos += 8;
}

/* Writes the private data (or, with no buffer, only counts its size). */
static size_t write_priv(struct standin_proc *p, struct priv_writer *w)
{
	struct standin_kbo *k;
	struct standin_queue *q;
	struct standin_event *e;
	unsigned int i;

	put32(w, PRIV_MAGIC);
	put32(w, PRIV_VERSION);
	put32(w, p->xnack);
	put32(w, p->npdds);
	for (i = 0; i < p->npdds; i++) {
		put32(w, p->pdds[i].user_gpu_id);
		put32(w, 0);
	}
	list_for_each_entry(k, &p->bos, link) {
		put64(w, k->user_addr);
		put32(w, k->idr);
		put32(w, k->n_mapped);
		for (i = 0; i < MAX_MAPPED; i++)
			put32(w, i < k->n_mapped ? k->mapped[i] : 0);
	}
	list_for_each_entry(q, &p->queues, link) {
		put32(w, OBJ_QUEUE);
		put32(w, q->id);
		put32(w, q->gpu_id);
		put32(w, q->type);
		put32(w, q->ring_size);
		put64(w, q->ring_base);
		put64(w, q->wptr);
		put64(w, q->rptr);
		put32(w, MQD_BYTES);
		for (i = 0; i < MQD_BYTES; i += 4)
			put32(w, *(u32 *)&q->mqd[i]);
	}
	list_for_each_entry(e, &p->events, link) {
		put32(w, OBJ_EVENT);
		put32(w, e->id);
		put32(w, e->type);
		put32(w, e->auto_reset);
		put32(w, e->signaled);
	}
	return w->pos;
}

struct priv_reader {
	const u8 *buf;
	size_t pos, len;
	bool bad;
};

static u32 get32(struct priv_reader *r)
{
	u32 v = 0;

	if (r->pos + 4 > r->len)
		r->bad = true;
	else
		memcpy(&v, r->buf + r->pos, 4);
	r->pos += 4;
	return v;
}

static u64 get64(struct priv_reader *r)
{
	u64 v = 0;

	if (r->pos + 8 > r->len)
		r->bad = true;
	else
		memcpy(&v, r->buf + r->pos, 8);
	r->pos += 8;
	return v;
}

/* The dma-buf fds an operation installed in the caller, closed again if it fails. */
struct installed {
	int *fds;
	u32 n;
};

static void close_installed(struct installed *in)
{
	while (in->n > 0)
		close_fd(in->fds[--in->n]);
}

static int export_into_caller(struct standin_kbo *k, struct installed *in, int *fd)
{
	int ret = drm_gem_prime_handle_to_fd(&k->pdd->gpu->drm, k->pdd->drm_file, k->gem_handle,
					     DRM_CLOEXEC | DRM_RDWR, fd);

	if (ret == 0)
		in->fds[in->n++] = *fd;
	return ret;
}

static int criu_process_info(struct standin_proc *p, struct kfd_ioctl_criu_args *a)
{
	struct priv_writer w = {};

	p->evicted++;
	a->num_devices = p->npdds;
	a->num_bos = p->nbos;
	a->num_objects = p->nqueues + p->nevents;
	a->priv_data_size = write_priv(p, &w);
	a->pid = pid_nr_ns(p->lead, ns_of_pid(p->lead));
	return 0;
}

static int criu_checkpoint(struct standin_proc *p, struct kfd_ioctl_criu_args *a)
{
	struct kfd_criu_device_bucket *devs = NULL;
	struct kfd_criu_bo_bucket *bos = NULL;
	struct installed in = {};
	struct priv_writer w = {};
	struct standin_kbo *k;
	unsigned int i = 0;
	int ret = -EINVAL;

	if (!a->devices || !a->bos || !a->priv_data || p->evicted == 0)
		return -EINVAL;
	if (a->num_devices != p->npdds || a->num_bos != p->nbos ||
	    a->num_objects != p->nqueues + p->nevents || a->priv_data_size != write_priv(p, &w))
		return -EINVAL;
	devs = kvcalloc(p->npdds, sizeof(*devs), GFP_KERNEL);
	bos = kvcalloc(p->nbos + 1, sizeof(*bos), GFP_KERNEL);
	in.fds = kvcalloc(p->nbos + 1, sizeof(int), GFP_KERNEL);
	w.buf = kvmalloc(a->priv_data_size, GFP_KERNEL);
	w.cap = a->priv_data_size;
	w.pos = 0;
	ret = -ENOMEM;
	if (!devs || !bos || !in.fds || !w.buf)
		goto out;
	list_for_each_entry(k, &p->bos, link) {
		struct kfd_criu_bo_bucket *b = &bos[i++];
		int fd;

		b->addr = k->va;
		b->size = k->size;
		b->offset = k->offset;
		b->gpu_id = k->pdd->user_gpu_id;
		b->alloc_flags = k->flags;
		b->dmabuf_fd = KFD_INVALID_FD;
		if (k->bo) {
			ret = export_into_caller(k, &in, &fd);
			if (ret)
				goto out;
			b->dmabuf_fd = fd;
		}
	}
	for (i = 0; i < p->npdds; i++) {
		devs[i].user_gpu_id = p->pdds[i].user_gpu_id;
		devs[i].actual_gpu_id = p->pdds[i].gpu->gpu_id;
	}
	write_priv(p, &w);
	ret = -EFAULT;
	if (copy_to_user(u64_to_user_ptr(a->devices), devs, p->npdds * sizeof(*devs)) ||
	    copy_to_user(u64_to_user_ptr(a->bos), bos, p->nbos * sizeof(*bos)) ||
	    copy_to_user(u64_to_user_ptr(a->priv_data), w.buf, a->priv_data_size))
		goto out;
	ret = 0;
out:
	if (ret)
		close_installed(&in);
	kvfree(devs);
	kvfree(bos);
	kvfree(in.fds);
	kvfree(w.buf);
	return ret;
}

struct restore_bo {
	u64 user_addr;
	u32 idr, n_mapped, mapped[MAX_MAPPED];
};

static int criu_restore(struct standin_proc *p, struct kfd_ioctl_criu_args *a)
{
	struct kfd_criu_device_bucket *devs = NULL;
	struct kfd_criu_bo_bucket *bos = NULL;
	struct restore_bo *rb = NULL;
	struct standin_queue *q, *qn;
	struct standin_event *e, *en;
	struct standin_kbo *k, *kn;
	struct installed in = {};
	struct priv_reader r = {};
	struct file *filps[STANDIN_MAX_GPUS] = {};
	u32 user_ids[STANDIN_MAX_GPUS] = {};
	LIST_HEAD(new_queues);
	LIST_HEAD(new_events);
	u32 i, j, nq = 0, ne = 0;
	u8 *priv = NULL;
	int ret = -EINVAL;

	if (p->mm != current->mm)
		return -EBADF; /* RESTORE runs in the restored process */
	if (!a->devices || !a->bos || !a->priv_data || !a->priv_data_size || !a->num_devices ||
	    !a->num_bos || a->num_bos > MAX_BOS || a->priv_data_size > MAX_PRIV ||
	    a->num_objects > MAX_QUEUES + MAX_EVENTS)
		return -EINVAL;
	if (p->restored || p->nbos || p->nqueues || p->nevents)
		return -EINVAL;
	/* A fresh KFD process has one device per GPU of this machine. */
	if (a->num_devices != p->npdds)
		return -EINVAL;
	ret = -ENOMEM;
	devs = kvcalloc(a->num_devices, sizeof(*devs), GFP_KERNEL);
	bos = kvcalloc(a->num_bos, sizeof(*bos), GFP_KERNEL);
	rb = kvcalloc(a->num_bos, sizeof(*rb), GFP_KERNEL);
	in.fds = kvcalloc(a->num_bos, sizeof(int), GFP_KERNEL);
	priv = kvmalloc(a->priv_data_size, GFP_KERNEL);
	if (!devs || !bos || !rb || !in.fds || !priv)
		goto out;
	ret = -EFAULT;
	if (copy_from_user(devs, u64_to_user_ptr(a->devices), a->num_devices * sizeof(*devs)) ||
	    copy_from_user(bos, u64_to_user_ptr(a->bos), a->num_bos * sizeof(*bos)) ||
	    copy_from_user(priv, u64_to_user_ptr(a->priv_data), a->priv_data_size))
		goto out;
	r.buf = priv;
	r.len = a->priv_data_size;
	ret = -EINVAL;
	if (get32(&r) != PRIV_MAGIC || get32(&r) != PRIV_VERSION)
		goto out;
	p->xnack = get32(&r) != 0;
	if (get32(&r) != a->num_devices)
		goto out;
	/* Devices: each bucket a GPU of this machine, once, with an unbound render file of it. */
	for (i = 0; i < a->num_devices; i++) {
		struct drm_file *file;
		struct standin_file *sf;
		struct standin_pdd *d = pdd_by_gpu(p, devs[i].actual_gpu_id);

		get32(&r);
		get32(&r);
		if (!d || filps[d - p->pdds])
			goto out;
		for (j = 0; j < i; j++)
			if (devs[j].user_gpu_id == devs[i].user_gpu_id)
				goto out;
		filps[d - p->pdds] = fget(devs[i].drm_fd);
		file = standin_render_file(filps[d - p->pdds]);
		sf = file ? file->driver_priv : NULL;
		if (!sf || sf->gpu != d->gpu || sf->bound) {
			ret = filps[d - p->pdds] ? -EINVAL : -EBADF;
			goto out;
		}
		user_ids[d - p->pdds] = devs[i].user_gpu_id;
	}
	/* BOs: on a device of a bucket, sized in pages, not overlapping. */
	for (i = 0; i < a->num_bos; i++) {
		struct kfd_criu_bo_bucket *b = &bos[i];
		bool found = false;

		rb[i].user_addr = get64(&r);
		rb[i].idr = get32(&r);
		rb[i].n_mapped = get32(&r);
		for (j = 0; j < MAX_MAPPED; j++)
			rb[i].mapped[j] = get32(&r);
		if (r.bad || rb[i].n_mapped > MAX_MAPPED || rb[i].idr == 0 || b->size == 0 ||
		    !PAGE_ALIGNED(b->size) || b->addr + b->size < b->addr)
			goto out;
		for (j = 0; j < a->num_devices; j++)
			found |= devs[j].user_gpu_id == b->gpu_id;
		for (j = 0; j < rb[i].n_mapped; j++) {
			u32 g;
			bool ok = false;

			for (g = 0; g < a->num_devices; g++)
				ok |= devs[g].user_gpu_id == rb[i].mapped[j];
			if (!ok)
				goto out;
		}
		if (!found)
			goto out;
	}
	/* Objects. */
	for (i = 0; i < a->num_objects; i++) {
		u32 kind = get32(&r);

		if (kind == OBJ_QUEUE) {
			bool ok = false;

			q = kzalloc(sizeof(*q), GFP_KERNEL);
			if (!q) {
				ret = -ENOMEM;
				goto out;
			}
			list_add_tail(&q->link, &new_queues);
			nq++;
			q->id = get32(&r);
			q->gpu_id = get32(&r);
			q->type = get32(&r);
			q->ring_size = get32(&r);
			q->ring_base = get64(&r);
			q->wptr = get64(&r);
			q->rptr = get64(&r);
			if (get32(&r) != MQD_BYTES || r.pos + MQD_BYTES > r.len)
				goto out;
			memcpy(q->mqd, priv + r.pos, MQD_BYTES);
			r.pos += MQD_BYTES;
			for (j = 0; j < a->num_devices; j++)
				ok |= devs[j].user_gpu_id == q->gpu_id;
			if (!ok || q->id >= 1024)
				goto out;
		} else if (kind == OBJ_EVENT) {
			e = kzalloc(sizeof(*e), GFP_KERNEL);
			if (!e) {
				ret = -ENOMEM;
				goto out;
			}
			list_add_tail(&e->link, &new_events);
			ne++;
			e->id = get32(&r);
			e->type = get32(&r);
			e->auto_reset = get32(&r);
			e->signaled = get32(&r);
		} else {
			goto out;
		}
		if (r.bad)
			goto out;
	}
	if (r.bad || r.pos != r.len || nq > MAX_QUEUES || ne > MAX_EVENTS)
		goto out;
	/* Everything checked: bind the files, make the BOs and export their dma-bufs. */
	for (i = 0; i < p->npdds; i++) {
		struct standin_pdd *d = &p->pdds[i];

		if (!filps[i])
			continue;
		d->drm_filp = filps[i];
		d->drm_file = filps[i]->private_data;
		((struct standin_file *)d->drm_file->driver_priv)->bound = true;
		d->user_gpu_id = user_ids[i];
		filps[i] = NULL;
	}
	for (i = 0; i < a->num_bos; i++) {
		struct kfd_criu_bo_bucket *b = &bos[i];
		struct standin_pdd *d = pdd_by_user_id(p, b->gpu_id);
		int fd;

		k = kbo_make(p, d, b->addr, b->size, b->alloc_flags, rb[i].user_addr, rb[i].idr,
			     &ret);
		if (!k)
			goto undo;
		k->n_mapped = rb[i].n_mapped;
		memcpy(k->mapped, rb[i].mapped, sizeof(k->mapped));
		b->restored_offset = k->offset;
		b->dmabuf_fd = KFD_INVALID_FD;
		if (k->bo) {
			ret = export_into_caller(k, &in, &fd);
			if (ret)
				goto undo;
			b->dmabuf_fd = fd;
		}
	}
	ret = -EFAULT;
	if (copy_to_user(u64_to_user_ptr(a->bos), bos, a->num_bos * sizeof(*bos)))
		goto undo;
	list_splice_tail_init(&new_queues, &p->queues);
	list_splice_tail_init(&new_events, &p->events);
	p->nqueues = nq;
	p->nevents = ne;
	list_for_each_entry(q, &p->queues, link)
		p->next_queue = max(p->next_queue, q->id + 1);
	list_for_each_entry(e, &p->events, link)
		p->next_event = max(p->next_event, e->id);
	p->restored = true;
	p->awaiting_resume = true;
	p->evicted = 1;
	ret = 0;
	goto out;
undo:
	close_installed(&in);
	list_for_each_entry_safe(k, kn, &p->bos, link)
		kbo_remove(p, k);
	for (i = 0; i < p->npdds; i++) {
		pdd_unbind(&p->pdds[i]);
		p->pdds[i].user_gpu_id = p->pdds[i].gpu->gpu_id;
	}
out:
	for (i = 0; i < STANDIN_MAX_GPUS; i++)
		if (filps[i])
			fput(filps[i]);
	list_for_each_entry_safe(q, qn, &new_queues, link)
		kfree(q);
	list_for_each_entry_safe(e, en, &new_events, link)
		kfree(e);
	kvfree(devs);
	kvfree(bos);
	kvfree(rb);
	kvfree(in.fds);
	kvfree(priv);
	return ret;
}

static int criu_resume(struct kfd_ioctl_criu_args *a)
{
	struct pid *pid = find_get_pid(a->pid);
	struct standin_proc *t;
	int ret = -ESRCH;

	if (!pid)
		return -ESRCH;
	list_for_each_entry(t, &procs, link) {
		if (t->lead != pid)
			continue;
		if (!t->awaiting_resume) {
			ret = -EINVAL;
			break;
		}
		t->awaiting_resume = false;
		t->evicted = 0;
		ret = 0;
		break;
	}
	put_pid(pid);
	return ret;
}

static int criu_op(struct standin_proc *p, void *data)
{
	struct kfd_ioctl_criu_args *a = data;

	switch (a->op) {
	case KFD_CRIU_OP_PROCESS_INFO:
		return criu_process_info(p, a);
	case KFD_CRIU_OP_CHECKPOINT:
		return criu_checkpoint(p, a);
	case KFD_CRIU_OP_UNPAUSE:
		if (p->evicted == 0)
			return -EINVAL;
		p->evicted--;
		return 0;
	case KFD_CRIU_OP_RESTORE:
		return criu_restore(p, a);
	case KFD_CRIU_OP_RESUME:
		return criu_resume(a);
	default:
		return -EINVAL;
	}
}
