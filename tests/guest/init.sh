#!/bin/busybox sh
# The guest's first process, from the initramfs `rdma_guest.py` builds: loads the modules a 9p
# root needs, mounts the host's root read-only under a tmpfs overlay, and hands over to the run
# script the host named on the kernel command line (kvtier_run=PATH, a path on the host).
/bin/busybox --install -s /bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
say() { echo "kvtier-guest: $*"; }
fail() { say "$*"; echo "KVTIER-GUEST-RC=125"; echo o > /proc/sysrq-trigger; while :; do sleep 5 2>/dev/null || :; done; }
for m in $(cat /modules.list); do
    insmod "/modules/$m" 2>/dev/null || say "insmod $m failed (built in, or already loaded)"
done
mkdir -p /lower /upper /newroot
mount -t 9p -o trans=virtio,version=9p2000.L,ro,msize=524288,cache=loose hostroot /lower \
    || fail "cannot mount the host root over 9p"
mount -t tmpfs -o size=1280m tmpfs /upper
mkdir -p /upper/rw /upper/work
mount -t overlay overlay -o lowerdir=/lower,upperdir=/upper/rw,workdir=/upper/work /newroot \
    || fail "cannot mount the overlay"
run=$(sed -n 's/.*kvtier_run=\([^ ]*\).*/\1/p' /proc/cmdline)
[ -n "$run" ] && [ -f "/newroot$run" ] || fail "no run script (kvtier_run=$run)"
umount /proc /sys
umount /dev 2>/dev/null
exec switch_root /newroot /bin/sh "$run"
