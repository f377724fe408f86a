#!/bin/busybox sh
# Stage 0 (initramfs, static busybox): load the virtio modules, mount the read-only root disk
# under a tmpfs overlay, prepare the mounts the agent needs, then hand PID 1 to the root's /bin/sh.
# Every write in the guest lands in RAM; the disk itself is attached readonly=on by the host.
/bin/busybox --install -s /bin
export PATH=/bin

fail() {
    echo "ephemeral-stage0: $*" >/dev/console
    echo b >/proc/sysrq-trigger  # with -no-reboot QEMU exits instead of hanging
    exit 1
}

mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev

agent=/opt/ephemeral/agent.py
overlay_size=50%
pids=
probe=
for arg in $(cat /proc/cmdline); do
    case "$arg" in
        ephemeral.agent=*) agent="${arg#ephemeral.agent=}" ;;
        ephemeral.overlay=*) overlay_size="${arg#ephemeral.overlay=}" ;;
        ephemeral.pids=*) pids="${arg#ephemeral.pids=}" ;;
        ephemeral.probe=1) probe=1 ;;
    esac
done

while read -r mod; do
    case "$mod" in ''|'#'*) continue ;; esac
    insmod "/lib/modules/$mod.ko" || fail "insmod $mod"
done </lib/modules/order

if [ -n "$probe" ]; then
    # The host only asks whether this kernel boots under this accelerator.
    echo "EPHEMERAL-PROBE-OK" >/dev/console
    echo b >/proc/sysrq-trigger
fi

# virtio-mmio devices come from ACPI and probe asynchronously.
i=0
while [ ! -b /dev/vda ]; do
    i=$((i + 1)); [ "$i" -gt 2000 ] && fail "no /dev/vda"
    usleep 5000
done

mkdir -p /lower /upper /newroot
mount -t ext4 -o ro,noload /dev/vda /lower || fail "mount /dev/vda"
mount -t tmpfs -o "size=$overlay_size,mode=0755" overlay-upper /upper || fail "tmpfs upper"
mkdir -p /upper/data /upper/work
mount -t overlay overlay -o lowerdir=/lower,upperdir=/upper/data,workdir=/upper/work /newroot \
    || fail "mount overlay"

mount -t proc proc /newroot/proc
mount -t sysfs sysfs /newroot/sys
mount -t devtmpfs devtmpfs /newroot/dev
mkdir -p /newroot/dev/pts /newroot/dev/shm
mount -t devpts -o newinstance,ptmxmode=0666 devpts /newroot/dev/pts
mount -t tmpfs -o size=64m,mode=1777 shm /newroot/dev/shm
mount -t tmpfs -o size=16m,mode=0755 run /newroot/run
chmod 1777 /newroot/tmp
echo sandbox >/proc/sys/kernel/hostname
ip link set lo up
# Kernel chatter from the guest must not flood the host's console pipe.
echo 1 >/proc/sys/kernel/printk

# The overlay's upper tmpfs stays reachable (root only) so stage 2 can resize it after a
# snapshot restore; stage 2 itself runs from there, the root image is not ours to change.
mkdir -p /newroot/run/ephemeral/upper
chmod 0700 /newroot/run/ephemeral
mount --move /upper /newroot/run/ephemeral/upper || fail "move upper"
cp /stage2-init.sh /newroot/run/ephemeral/stage2-init.sh

# The default limits, so a restore that asks for them changes nothing (exec is slow under TCG).
# RLIMIT_NPROC is per uid and root is exempt: it binds the worker's commands, not the agent.
[ -n "$pids" ] && ulimit -u "$pids"

[ -f "/newroot$agent" ] || fail "agent $agent missing in the root image"
exec switch_root /newroot /usr/bin/env -i PATH=/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin \
    LANG=C.UTF-8 /bin/sh /run/ephemeral/stage2-init.sh "$agent"
