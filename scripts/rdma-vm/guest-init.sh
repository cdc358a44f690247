#!/bin/sh
# PID 1 of the dxnet RDMA test VM (installed as /init in its initramfs by
# scripts/rdma-vm/vm.sh). Brings up a Soft-RoCE device rxe0, mounts the host
# directory and the per-run control directory (both 9p), runs the command and
# reports its exit status on a serial line, then powers the VM off.
#
# Serial lines: ttyS0 kernel console + this script's log (a file on the host)
#               ttyS1 the command's stdout+stderr (the host's stdout)
#               ttyS2 status lines for the host: VM_BOOTED, VM_READY, VM_EXIT=<n>
export PATH=/usr/sbin:/usr/bin:/sbin:/bin
export HOME=/root TMPDIR=/tmp LANG=C.UTF-8
umask 022

mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
mkdir -p /dev/pts /dev/shm /tmp /run /root
mount -t devpts devpts /dev/pts
mount -t tmpfs tmpfs /dev/shm
mount -t tmpfs tmpfs /tmp
mount -t tmpfs tmpfs /run
exec </dev/null >/dev/ttyS0 2>&1

say()    { echo "dxnet-vm: $*"; }
report() { echo "$*" >/dev/ttyS2; }
uptime_s() { cut -d' ' -f1 /proc/uptime; }
shutdown_vm() {
    report "VM_EXIT=$1"
    sync
    poweroff -f
    sleep 30
}

report "VM_BOOTED uptime=$(uptime_s)"

# Kernel modules, dependencies first (order computed when the image was built).
while read -r mod; do
    [ -n "$mod" ] || continue
    insmod "/lib/modules/$mod.ko" || say "insmod $mod failed"
done </etc/dxnet-vm/modules

# Control share: the command to run and its environment.
CTL=/run/ctl
mkdir -p "$CTL"
mount -t 9p -o trans=virtio,version=9p2000.L ctl "$CTL" || { say "cannot mount the control share"; shutdown_vm 125; }
. "$CTL/vm.conf"      # sets VM_HOSTDIR, VM_IP

# Soft-RoCE on a dummy Ethernet device (always has carrier; nothing leaves the
# VM, it has no NIC). MTU 4200 leaves room for the 4096-byte RoCE MTU.
ip link set lo up
ip link add rxenet0 type dummy
ip link set rxenet0 mtu 4200
ip addr add "$VM_IP/24" dev rxenet0
ip link set rxenet0 up
rdma link add rxe0 type rxe netdev rxenet0 || { say "rdma link add failed"; shutdown_vm 125; }

# Index of the RoCE v2 GID that carries the IPv4 address (the GID table is
# filled asynchronously after the link is added).
want=$(echo "$VM_IP" | awk -F. '{ printf "0000:0000:0000:0000:0000:ffff:%02x%02x:%02x%02x", $1, $2, $3, $4 }')
port=/sys/class/infiniband/rxe0/ports/1
gid_index=
tries=0
while [ -z "$gid_index" ] && [ $tries -lt 200 ]; do
    for f in "$port"/gids/*; do
        n=${f##*/}
        [ "$(cat "$f" 2>/dev/null)" = "$want" ] || continue
        [ "$(cat "$port/gid_attrs/types/$n" 2>/dev/null)" = "RoCE v2" ] || continue
        gid_index=$n
        break
    done
    [ -n "$gid_index" ] || { tries=$((tries + 1)); sleep 0.05; }
done
[ -n "$gid_index" ] || { say "no RoCE v2 GID for $VM_IP"; shutdown_vm 125; }

export RDMA_VM=1 RDMA_DEV=rxe0 RDMA_PORT=1 RDMA_GID_INDEX="$gid_index" \
       RDMA_IP="$VM_IP" RDMA_NETDEV=rxenet0
ulimit -l unlimited

if [ -n "$VM_HOSTDIR" ]; then
    mkdir -p "$VM_HOSTDIR"
    mount -t 9p -o trans=virtio,version=9p2000.L,msize=512000,cache=mmap host "$VM_HOSTDIR" ||
        { say "cannot mount the host directory"; shutdown_vm 125; }
    cd "$VM_HOSTDIR" || shutdown_vm 125
fi

say "ready at ${VM_IP}, rxe0 gid index $gid_index, uptime $(uptime_s)s"
report "VM_READY uptime=$(uptime_s) gid_index=$gid_index"

stty -F /dev/ttyS1 raw -echo 2>/dev/null
# Only this subshell has ttyS1 open: its final close drains the UART.
( . "$CTL/env.sh"; exec sh "$CTL/cmd.sh" ) </dev/null >/dev/ttyS1 2>&1
rc=$?
say "command finished with status $rc at uptime $(uptime_s)s"
[ -n "$VM_HOSTDIR" ] && umount "$VM_HOSTDIR"
shutdown_vm $rc
