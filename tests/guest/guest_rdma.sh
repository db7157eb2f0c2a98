# Sourced by the run script inside the guest (after switch_root): the kernel's soft-RoCE device
# rxe0 on a dummy netdev with a TEST-NET address, no route out. Sets nothing up on the host.
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev 2>/dev/null
mkdir -p /dev/pts /dev/shm /run
mount -t devpts devpts /dev/pts
mount -t tmpfs tmpfs /dev/shm
mount -t tmpfs tmpfs /run
guest_say() { echo "kvtier-guest: $*"; }
guest_end() {  # the status line the host reads, then power off (PID 1 must never exit)
    echo "KVTIER-GUEST-RC=$1"
    sync
    echo o > /proc/sysrq-trigger
    # Wait for the power-off; `sleep` itself may fail with EIO as the disks go away, and PID 1
    # returning would panic the kernel: loop until the machine is off.
    while :; do sleep 30 2>/dev/null || :; done
}
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root
hostname kvtier-guest
ip link set lo up
modprobe dummy && modprobe rdma_rxe && modprobe ib_uverbs && modprobe rdma_ucm \
    || { guest_say "modprobe of dummy/rdma_rxe/ib_uverbs failed"; guest_end 125; }
ip link add kvt0 type dummy && ip addr add 192.0.2.1/24 dev kvt0 && ip link set kvt0 up \
    || { guest_say "cannot set up the dummy netdev"; guest_end 125; }
rdma link add rxe0 type rxe netdev kvt0 || { guest_say "rdma link add rxe0 failed"; guest_end 125; }
i=0
until [ "$(cat /sys/class/infiniband/rxe0/ports/1/state 2>/dev/null)" = "4: ACTIVE" ]; do
    i=$((i + 1))
    [ $i -gt 300 ] && { guest_say "rxe0 port 1 never became ACTIVE"; guest_end 125; }
    sleep 0.1
done
guest_say "rxe0 port 1 ACTIVE after $(cut -d' ' -f1 /proc/uptime) s of guest uptime; GIDs:"
for g in /sys/class/infiniband/rxe0/ports/1/gids/[0-3]; do
    t=$(cat "/sys/class/infiniband/rxe0/ports/1/gid_attrs/types/${g##*/}" 2>/dev/null)
    echo "  ${g##*/}: $(cat "$g") ${t}"
done
ulimit -l unlimited
