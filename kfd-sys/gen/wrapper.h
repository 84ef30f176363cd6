/* Input for gen/regen.sh: the uAPI headers kfd-sys binds.
 *
 * `drm/...` resolves through a temporary include directory whose `drm`
 * entry points at libdrm-dev's /usr/include/libdrm (Debian ships the DRM
 * uAPI headers there, not in linux-libc-dev). */
#include <linux/kfd_ioctl.h>
#include <drm/drm.h>
#include <drm/amdgpu_drm.h>
