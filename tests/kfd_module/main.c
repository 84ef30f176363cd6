// SPDX-License-Identifier: GPL-2.0
/*
 * The stand-in KFD module: GPUs as DRM devices with render nodes (render.c) and /dev/kfd
 * (kfd.c), for running real CRIU and the checkpoint plugin against a real kernel in a test
 * guest. Parameters:
 *
 *   gpu_ids=ID,ID,...   the KFD gpu ids of the GPUs, in render-node order (default one GPU,
 *                       0xcf75); a test restores onto "other" GPUs by loading the module
 *                       again with other ids
 *   vram_mb=N           VRAM of each GPU in MiB (default 256); VRAM BOs beyond it fail with
 *                       ENOMEM, as on a full GPU
 */
#include <linux/module.h>
#include <linux/moduleparam.h>
#include "standin.h"

static uint gpu_ids[STANDIN_MAX_GPUS] = { 0xcf75 };
static int n_gpu_ids = 1;
module_param_array(gpu_ids, uint, &n_gpu_ids, 0444);
MODULE_PARM_DESC(gpu_ids, "KFD gpu ids of the stand-in GPUs, in render-node order");
static uint vram_mb = 256;
module_param(vram_mb, uint, 0444);
MODULE_PARM_DESC(vram_mb, "VRAM per GPU, MiB");

struct standin_gpu *standin_gpus[STANDIN_MAX_GPUS];
unsigned int standin_ngpus;
DEFINE_MUTEX(standin_kfd_lock);

struct standin_gpu *standin_gpu_by_id(u32 gpu_id)
{
	unsigned int i;

	for (i = 0; i < standin_ngpus; i++)
		if (standin_gpus[i]->gpu_id == gpu_id)
			return standin_gpus[i];
	return NULL;
}

static void unregister_all(void)
{
	while (standin_ngpus > 0) {
		standin_ngpus--;
		standin_gpu_unregister(standin_gpus[standin_ngpus]);
		standin_gpus[standin_ngpus] = NULL;
	}
}

static int __init standin_init(void)
{
	int i, j, ret;

	if (n_gpu_ids < 1 || n_gpu_ids > STANDIN_MAX_GPUS || vram_mb == 0)
		return -EINVAL;
	for (i = 0; i < n_gpu_ids; i++) {
		/* amdkfd's gpu ids are 16-bit hashes, never 0: the mmap offset holds 16 bits. */
		if (gpu_ids[i] == 0 || gpu_ids[i] > 0xffff)
			return -EINVAL;
		for (j = 0; j < i; j++)
			if (gpu_ids[j] == gpu_ids[i])
				return -EINVAL;
	}
	ret = standin_render_init();
	if (ret)
		return ret;
	for (i = 0; i < n_gpu_ids; i++) {
		ret = standin_gpu_register(&standin_gpus[i], i, gpu_ids[i],
					   (u64)vram_mb << 20);
		if (ret)
			goto fail;
		standin_ngpus++;
	}
	ret = standin_kfd_init();
	if (ret)
		goto fail;
	pr_info("kfd_standin: %u GPU(s), /dev/kfd ready\n", standin_ngpus);
	return 0;
fail:
	unregister_all();
	standin_render_exit();
	return ret;
}

static void __exit standin_exit(void)
{
	standin_kfd_exit();
	unregister_all();
	standin_render_exit();
}

module_init(standin_init);
module_exit(standin_exit);
MODULE_LICENSE("GPL");
MODULE_DESCRIPTION("Stand-in KFD and amdgpu render nodes for checkpoint/restore tests (no hardware)");
