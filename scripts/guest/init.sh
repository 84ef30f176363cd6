#!/bin/bash
# The guest's init (pid 1; scripts/guest/build.sh installs it as /sbin/guest-init): sets up a
# cgroup-v2-only system with what the tests need, runs the one program scripts/guest/run.sh
# asked for, hands back its exit status and powers the guest off.
#
# run.sh talks to it through the 9p share tagged `guest.ctl` (its run directory on the host):
#   argv    the program and its arguments, NUL-separated
#   env     the environment to give it, NUL-separated KEY=VALUE
#   cwd     its working directory
#   shares  "TAG PATH" lines: 9p shares to mount at PATH (the host's paths, so that absolute
#           paths of the checkout, its build outputs and the tools it links to mean the same);
#           those tagged guest.tool* hold built tools and are cached
#   tmpfs   paths to cover with a tmpfs (the tests' scratch directory: overlayfs, which the
#           runtimes stack on it, cannot use 9p as an upper layer)
#   rc      written here: the program's exit status
#   booted  written here once this init runs (run.sh's probe of an accelerator)
#   started written here just before the program runs: after it, run.sh never boots again
# The program's stdout and stderr go to the virtio serial ports named guest.stdout and
# guest.stderr; this init's own messages go to the console (run.sh keeps it in a log).
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
say() { echo "guest-init: $*" >/dev/console; }
halt_guest() {
    sync
    echo o >/proc/sysrq-trigger
    sleep 10
}

mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev 2>/dev/null || true
mkdir -p /dev/pts /dev/shm /dev/mqueue
mount -t devpts devpts /dev/pts -o gid=5,mode=620,ptmxmode=666
mount -t tmpfs shm /dev/shm -o mode=1777
mount -t mqueue mqueue /dev/mqueue
mount -t tmpfs run /run -o mode=0755
mount -t tmpfs tmp /tmp -o mode=1777
# The unified hierarchy alone (the kernel was booted with cgroup_no_v1=all), every controller
# enabled for the cgroups below the root, as systemd would.
mount -t cgroup2 -o nsdelegate cgroup2 /sys/fs/cgroup
controllers=$(sed 's/\([^ ]*\)/+\1/g' /sys/fs/cgroup/cgroup.controllers)
echo "$controllers" >/sys/fs/cgroup/cgroup.subtree_control \
    || say "cannot enable the controllers $controllers"
hostname guest
ip link set lo up
ulimit -n 1048576 2>/dev/null || true

# /dev/net/tun as on a host (CRIU probes it); nothing loads it on demand without udev.
# virtio_console (the program's stdout and stderr) is built into 6.12, a module of 6.1.
modprobe -a virtio_console 9pnet_virtio 9p overlay tun
mkdir -p /run/guest-ctl
if ! mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144 guest.ctl /run/guest-ctl; then
    say "no guest.ctl share: nothing to run"
    halt_guest
fi
ctl=/run/guest-ctl
: >"$ctl/booted"

while read -r tag path; do
    [ -n "$tag" ] || continue
    mkdir -p "$path"
    # guest.tool*: folders nothing changes while the guest runs, cached (run.sh says why).
    cache=mmap
    [[ $tag != guest.tool* ]] || cache=loose
    mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144,cache=$cache "$tag" "$path" \
        || say "cannot mount share $tag at $path"
done <"$ctl/shares"
while read -r path; do
    [ -n "$path" ] || continue
    mkdir -p "$path"
    mount -t tmpfs -o mode=1777 scratch "$path"
done <"$ctl/tmpfs"

port() {
    local p
    for p in /sys/class/virtio-ports/*; do
        [ "$(cat "$p/name" 2>/dev/null)" = "$1" ] && { echo "/dev/${p##*/}"; return; }
    done
    echo /dev/console
}
out=$(port guest.stdout)
err=$(port guest.stderr)

mapfile -d '' -t argv <"$ctl/argv"
while IFS= read -r -d '' kv; do export "${kv?}"; done <"$ctl/env"
cd "$(cat "$ctl/cwd")" || { say "no directory $(cat "$ctl/cwd")"; echo 125 >"$ctl/rc"; halt_guest; }
say "running ${argv[*]} ($(uname -r), cgroup2 controllers: $(cat /sys/fs/cgroup/cgroup.controllers))"
: >"$ctl/started"
"${argv[@]}" </dev/null >"$out" 2>"$err"
rc=$?
echo "$rc" >"$ctl/rc"
say "exit status $rc"
# What the ports still hold reaches the host before the power goes.
sleep 1
halt_guest
