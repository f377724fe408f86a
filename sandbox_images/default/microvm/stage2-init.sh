#!/run/ephemeral/busybox sh
# Stage 2: PID 1 in the sandbox's root, run by stage 0's static busybox (copied to
# /run/ephemeral: the image may have no shell at all). Starts the agent on the agent runtime
# (/.ephemeral: our loader, python and libraries, never the image's), then waits on the
# virtio-serial port "ctl" for the host's per-sandbox limits. A memory snapshot is taken while
# it waits there, so every restore applies its own limits to the same saved VM:
#   host -> "<overlay-size> <max-user-processes>\n"   e.g. "32m 64"; "-" keeps the value the
#           VM booted with (stage 0 set the defaults), which costs no exec: slow under TCG
#   guest -> "ok\n" (or "error ...\n")
# When the agent exits (or the host goes away), the VM reboots, which -no-reboot turns into
# QEMU exiting. Orphans of commands go to the agent (a subreaper), not here.
bb=/run/ephemeral/busybox
python="$1"  # the runtime's loader and python with their options, comma-separated
agent="$2"
agent_env="$3"  # K=V,K=V

set -f
IFS=,
# shellcheck disable=SC2086  # split on commas on purpose
$bb env -i $agent_env $python "$agent" --channel virtio:sbx &
agent_pid=$!
unset IFS
set +f

ctl=
i=0
while [ -z "$ctl" ] && [ "$i" -lt 5000 ]; do
    for f in /sys/class/virtio-ports/*/name; do
        name=
        read -r name <"$f" 2>/dev/null
        if [ "$name" = ctl ]; then d="${f%/name}"; ctl="/dev/${d##*/}"; fi
    done
    i=$((i + 1))
    [ -z "$ctl" ] && $bb usleep 2000
done

set_nproc() {
    # busybox has no prlimit: the runtime's python sets the agent's RLIMIT_NPROC
    IFS=,
    # shellcheck disable=SC2086
    $python -c 'import resource, sys
n = int(sys.argv[2])
resource.prlimit(int(sys.argv[1]), resource.RLIMIT_NPROC, (n, n))' "$agent_pid" "$1"
    rc=$?
    unset IFS
    return $rc
}

if [ -n "$ctl" ] && exec 3<>"$ctl"; then
    # EOF (the host closed the channel) skips straight to waiting for the agent.
    if read -r size nproc <&3; then
        err=
        case "$size" in
            -) ;;
            ''|*[!0-9mk]*) err="bad size" ;;
            *) $bb mount -o "remount,size=$size" /run/ephemeral/upper || err="remount failed" ;;
        esac
        case "$nproc" in
            -) ;;
            ''|*[!0-9]*) err="bad nproc" ;;
            *) set_nproc "$nproc" || err="prlimit failed" ;;
        esac
        if [ -z "$err" ]; then echo ok >&3; else echo "error $err" >&3; fi
    fi
    exec 3>&-
fi

wait "$agent_pid"
echo b >/proc/sysrq-trigger
