#!/bin/busybox sh
# Stage 0 (initramfs, static busybox): load the virtio modules, mount the read-only image disk
# under a tmpfs overlay and the agent runtime's disk at /.ephemeral, prepare the mounts the agent
# needs, then hand PID 1 to stage 2, run by this busybox: nothing of the image runs our side.
# Every write in the guest lands in RAM; both disks are attached readonly=on by the host.
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

# the agent's command line and environment, comma-separated (microvm.py checks they hold no
# comma or blank): the runtime's loader and python, the agent's script
python=
agent=
agent_env=
layers=0
overlay_size=50%
pids=
probe=
for arg in $(cat /proc/cmdline); do
    case "$arg" in
        ephemeral.python=*) python="${arg#ephemeral.python=}" ;;
        ephemeral.agent=*) agent="${arg#ephemeral.agent=}" ;;
        ephemeral.env=*) agent_env="${arg#ephemeral.env=}" ;;
        ephemeral.layers=*) layers="${arg#ephemeral.layers=}" ;;
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

# virtio-mmio devices come from ACPI and probe asynchronously, in no fixed order: each disk is
# known by the serial the host gave it.
root=
runtime=
i=0
while [ -z "$root" ] || [ -z "$runtime" ]; do
    for f in /sys/block/vd*/serial; do
        serial=
        read -r serial <"$f" 2>/dev/null
        d="${f%/serial}"
        case "$serial" in
            ephemeral-root) [ -b "/dev/${d##*/}" ] && root="/dev/${d##*/}" ;;
            ephemeral-agent) [ -b "/dev/${d##*/}" ] && runtime="/dev/${d##*/}" ;;
        esac
    done
    i=$((i + 1)); [ "$i" -gt 2000 ] && fail "no disks (root '$root', agent '$runtime')"
    [ -z "$root" ] || [ -z "$runtime" ] && usleep 5000
done

mkdir -p /lower /upper /newroot
mount -t ext4 -o ro,noload "$root" /lower || fail "mount $root"
# A pulled image's disk holds its layers as directories 0..N-1, lowest first: the overlay
# stacks them (their whiteouts and opaque directories are overlayfs's own, as on the host).
lowerdir=/lower
if [ "$layers" -gt 0 ]; then
    lowerdir=
    n=0
    while [ "$n" -lt "$layers" ]; do
        lowerdir="/lower/$n${lowerdir:+:}$lowerdir"
        n=$((n + 1))
    done
fi
mount -t tmpfs -o "size=$overlay_size,mode=0755" overlay-upper /upper || fail "tmpfs upper"
mkdir -p /upper/data /upper/work
mount -t overlay overlay -o "lowerdir=$lowerdir,upperdir=/upper/data,workdir=/upper/work" \
    /newroot || fail "mount overlay"

# An image need not have these (a lone busybox has no /proc), and may hold anything in their
# place: what is not a directory is replaced in the sandbox's own layer.
for d in proc sys dev run tmp .ephemeral; do
    if [ -L "/newroot/$d" ] || { [ -e "/newroot/$d" ] && [ ! -d "/newroot/$d" ]; }; then
        rm -rf "/newroot/$d"
    fi
    mkdir -p "/newroot/$d"
done
mount -t ext4 -o ro,noload,nodev,nosuid "$runtime" /newroot/.ephemeral || fail "mount $runtime"
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
# snapshot restore; stage 2 runs from there on this busybox, whatever the image holds.
mkdir -p /newroot/run/ephemeral/upper
chmod 0700 /newroot/run/ephemeral
mount --move /upper /newroot/run/ephemeral/upper || fail "move upper"
cp /stage2-init.sh /bin/busybox /newroot/run/ephemeral/

# The default limits, so a restore that asks for them changes nothing (exec is slow under TCG).
# RLIMIT_NPROC is per uid and root is exempt: it binds the worker's commands, not the agent.
[ -n "$pids" ] && ulimit -u "$pids"

[ -n "$python" ] && [ -n "$agent" ] || fail "no agent on the kernel command line"
[ -f "/newroot$agent" ] || fail "agent $agent missing in the agent runtime"
exec switch_root /newroot /run/ephemeral/busybox env -i PATH=/usr/bin:/bin \
    /run/ephemeral/busybox sh /run/ephemeral/stage2-init.sh "$python" "$agent" "$agent_env"
