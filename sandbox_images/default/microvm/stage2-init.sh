#!/bin/sh
# Stage 2: PID 1 in the root image (Debian's dash). Starts the agent, then waits on the
# virtio-serial port "ctl" for the host's per-sandbox limits. A memory snapshot is taken while
# it waits there, so every restore applies its own limits to the same saved VM:
#   host -> "<overlay-size> <max-user-processes>\n"   e.g. "32m 64"; "-" keeps the value the
#           VM booted with (stage 0 set the defaults), which costs no exec: slow under TCG
#   guest -> "ok\n" (or "error ...\n")
# When the agent exits (or the host goes away), the VM reboots, which -no-reboot turns into
# QEMU exiting. Orphans of commands go to the agent (a subreaper), not here.
agent="$1"

/usr/bin/python3 -I -S "$agent" --channel virtio:sbx &
agent_pid=$!

ctl=
i=0
while [ -z "$ctl" ] && [ "$i" -lt 5000 ]; do
    for f in /sys/class/virtio-ports/*/name; do
        name=
        read -r name <"$f" 2>/dev/null
        if [ "$name" = ctl ]; then d="${f%/name}"; ctl="/dev/${d##*/}"; fi
    done
    i=$((i + 1))
    [ -z "$ctl" ] && sleep 0.002
done

if [ -n "$ctl" ] && exec 3<>"$ctl"; then
    # EOF (the host closed the channel) skips straight to waiting for the agent.
    if read -r size nproc <&3; then
        err=
        case "$size" in
            -) ;;
            ''|*[!0-9mk]*) err="bad size" ;;
            *) mount -o "remount,size=$size" /run/ephemeral/upper || err="remount failed" ;;
        esac
        case "$nproc" in
            -) ;;
            ''|*[!0-9]*) err="bad nproc" ;;
            *) prlimit --pid "$agent_pid" --nproc="$nproc:$nproc" || err="prlimit failed" ;;
        esac
        if [ -z "$err" ]; then echo ok >&3; else echo "error $err" >&3; fi
    fi
    exec 3>&-
fi

wait "$agent_pid"
echo b >/proc/sysrq-trigger
