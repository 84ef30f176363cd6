#!/bin/busybox sh
# The guest's initramfs (scripts/guest/build.sh): Debian's kernel has virtio_blk and ext4 as
# modules, so this loads them, mounts the root file system (/dev/vda, ext4) and hands over to
# the guest's init there (/sbin/guest-init, scripts/guest/init.sh).
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc
mount -t devtmpfs dev /dev
for m in $(cat /lib/modules/order); do
    insmod "/lib/modules/$m" || echo "initramfs: insmod $m failed" >/dev/console
done
i=0
while [ ! -b /dev/vda ] && [ $i -lt 200 ]; do usleep 50000; i=$((i + 1)); done
if ! mount -t ext4 -o rw /dev/vda /newroot; then
    echo "initramfs: cannot mount /dev/vda" >/dev/console
    echo o >/proc/sysrq-trigger
fi
umount /dev /proc
exec switch_root /newroot /sbin/guest-init
