#!/bin/sh
# Minimal reproducer of docs/crun-restore-kills.md: crun 1.28's restore, on cgroup v1/hybrid,
# with a v1 hierarchy listed first in /proc/self/cgroup that crun does not join (here: the
# name=systemd hierarchy left unmounted), SIGKILLs every process in every cgroup it can see.
#
# It is made harmless: it runs only as pid 1 of a new pid namespace (so a kill reaches only
# processes of that namespace), in a cgroup namespace rooted at a fresh cgroup "box" under this
# process's own cgroups (so the cgroups crun walks, kills in and removes are the box's), with
# /sys/fs/cgroup remounted in a private mount namespace. Run as root:
#
#   unshare --fork --pid --mount-proc --kill-child sh docs/crun-restore-kills-repro.sh
#
# Environment: CRUN (default .runtimes-2026/bin/crun), CRIU_DIR (a directory with `criu`,
# default .criu-4.3/bin), BUSYBOX (a static busybox, default .runtimes/bin/busybox), WORK
# (default /tmp/crun-restore-kills), JOIN_ALL=1 mounts every hierarchy (the restore is clean).
set -u
# Stage 1 is pid 1 of the namespace, stage 2 its child.
[ "$$" = 1 ] || { [ "${STAGE:-1}" = 2 ] && [ "$PPID" = 1 ]; } \
    || { echo "refusing: run me as pid 1 of a new pid namespace (see the top)" >&2; exit 99; }
here=$(cd "$(dirname "$0")/.." && pwd)
CRUN=${CRUN:-$here/.runtimes-2026/bin/crun}
CRIU_DIR=${CRIU_DIR:-$here/.criu-4.3/bin}
BUSYBOX=${BUSYBOX:-$here/.runtimes/bin/busybox}
W=${WORK:-/tmp/crun-restore-kills}

if [ "${STAGE:-1}" = 1 ]; then
    # The box, under this process's own cgroup of every hierarchy.
    rm -f "$W.boxes"
    while IFS=: read -r _ ctl path; do
        case $ctl in "") d=unified ;; name=*) d=${ctl#name=} ;; *) d=$ctl ;; esac
        box=/sys/fs/cgroup/$d${path%/}/crun-restore-kills-box
        mkdir -p "$box"
        if [ "$d" = cpuset ]; then
            cat "${box%/*}/cpuset.cpus" >"$box/cpuset.cpus"
            cat "${box%/*}/cpuset.mems" >"$box/cpuset.mems"
        fi
        echo $$ >"$box/cgroup.procs" || { echo "cannot enter $box" >&2; exit 98; }
        echo "$box" >>"$W.boxes"
    done </proc/self/cgroup
    # Two bystanders: one in a child cgroup of the box, one in the box's root.
    mem=$(grep memory "$W.boxes")
    mkdir -p "$mem/bystander"
    sh -c "echo \$\$ >$mem/bystander/cgroup.procs; exec sleep 600" &
    b1=$!
    sleep 600 &
    b2=$!
    STAGE=2 unshare -C -m --propagation private sh "$0"
    rc=$?
    alive() { if kill -0 "$1" 2>/dev/null; then echo alive; else echo KILLED; fi; }
    echo "stage 2 ended with status $rc"
    echo "bystander in a child cgroup: $(alive $b1); bystander in the box's root: $(alive $b2)"
    # This is pid 1 of the namespace: kill(-1) ends everything else there, then the box goes,
    # deepest first.
    kill -KILL -1 2>/dev/null
    sleep 1
    while read -r box; do
        echo $$ >"${box%/*}/cgroup.procs"
        find "$box" -depth -type d -exec rmdir {} \; 2>/dev/null
    done <"$W.boxes"
    rm -rf "$W" "$W.boxes" "$W.empty"
    exit $rc
fi

# Stage 2: /sys/fs/cgroup shows the box as the root of every hierarchy; name=systemd is left
# unmounted, as a machine may leave a v1 hierarchy unmounted (crun then skips it).
umount -l /sys/fs/cgroup
mount -t tmpfs tmpfs /sys/fs/cgroup
for c in $(awk '$2 != 0 && $4 == 1 { print $1 }' /proc/cgroups); do
    grep -q ":$c:" /proc/self/cgroup || continue
    mkdir /sys/fs/cgroup/$c && mount -t cgroup -o $c cgroup /sys/fs/cgroup/$c
done
mkdir /sys/fs/cgroup/unified && mount -t cgroup2 cgroup2 /sys/fs/cgroup/unified
if [ -n "${JOIN_ALL:-}" ]; then
    mkdir /sys/fs/cgroup/systemd && mount -t cgroup -o none,name=systemd cgroup /sys/fs/cgroup/systemd
fi
# crun refuses hybrid mode while cgroup v2 offers controllers.
: >"$W.empty"
mount --bind "$W.empty" /sys/fs/cgroup/unified/cgroup.controllers
echo "first line of /proc/self/cgroup: $(head -n1 /proc/self/cgroup)"

rm -rf "$W"
mkdir -p "$W/rootfs/bin" "$W/rootfs/proc" "$W/rootfs/dev" "$W/state" "$W/img" "$W/work"
cp "$BUSYBOX" "$W/rootfs/bin/busybox"
for a in sh usleep; do ln -s busybox "$W/rootfs/bin/$a"; done
cat >"$W/config.json" <<EOF
{"ociVersion": "1.0.2",
 "process": {"terminal": false, "user": {"uid": 0, "gid": 0}, "cwd": "/", "env": ["PATH=/bin"],
             "args": ["/bin/sh", "-c", "while :; do usleep 100000; done"]},
 "root": {"path": "$W/rootfs"},
 "mounts": [{"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs"}],
 "linux": {"cgroupsPath": "/ct", "namespaces": [{"type": "pid"}, {"type": "mount"}]}}
EOF
export PATH="$CRIU_DIR:$PATH"
crun() { "$CRUN" --root "$W/state" --log "$W/crun.log" "$@" </dev/null >/dev/null 2>&1; }

crun run -d --bundle "$W" ct; echo "crun run: $?"
crun checkpoint --image-path "$W/img" --work-path "$W/work" ct; echo "crun checkpoint: $?"
# The box's root can be frozen, the machine's cannot: crun's kill loop would freeze crun itself
# here, so the restore runs without the freezer, as the loop runs on a machine.
umount /sys/fs/cgroup/freezer
crun restore -d --image-path "$W/img" --work-path "$W/work" --bundle "$W" ct; echo "crun restore: $?"
sleep 2
tail -n1 "$W/work/restore.log"
crun delete -f ct
