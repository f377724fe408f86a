"""The namespaces driver's seccomp filter: an allowlist modelled on Docker's default profile.

Built with libseccomp (through ``pyseccomp``, a ctypes binding, so it works in any Python) and
exported as the raw ``struct sock_filter[]`` that ``bwrap --seccomp FD`` loads just before it
execs the agent. The guest agent and everything it runs (python3, sh, curl, compilers, test
runners) live under it.

An allowlist, not a denylist: a syscall the kernel gained after this list was written (the
red team's ``open_tree_attr`` beside a blocked ``open_tree``) is refused by default. Decisions:

- Default ``EPERM``, as Docker: what is not listed fails like a missing privilege.
- The list is Docker's default allow list for a container with no capabilities, less what a
  sandboxed tool never needs and that widens the host kernel's surface: ``io_uring_*`` (Docker
  dropped them too), ``memfd_secret``, ``modify_ldt``, ``name_to_handle_at``, ``adjtimex``,
  ``clock_adjtime``, ``fanotify_mark``, ``process_mrelease``; and without ``CAP_SYS_PTRACE``
  none of ``ptrace``, ``process_vm_readv/writev``, ``kcmp``, ``pidfd_getfd`` (Docker grants
  ptrace on kernels >= 4.8; we do not).
- ``socket``: ``AF_UNIX``, ``AF_INET``, ``AF_INET6``, and ``AF_NETLINK`` only with
  ``NETLINK_ROUTE`` (glibc's ``getaddrinfo`` and ``ip`` on ``lo`` read interfaces through it);
  never ``AF_VSOCK``, ``AF_PACKET`` or other netlink families. ``NETLINK_AUDIT`` answers
  ``EPROTONOSUPPORT``, as a kernel without audit would: libaudit's users (shadow's
  ``useradd``/``groupadd``, which ``adduser`` runs as root in the writable root) then carry on,
  where ``EPERM`` makes them abort. ``socketpair``: ``AF_UNIX`` only.
- ``clone`` without any namespace flag; ``clone3`` answers ``ENOSYS`` (its flags live in memory
  a filter cannot read; libc then falls back to ``clone``); ``unshare`` and ``setns`` refused.
- ``personality`` only with Docker's values (query, ``PER_LINUX``, ``PER_LINUX32``,
  ``UNAME26`` and their union).
- Another ABI (i386 ``int 0x80``, x32) kills the process: its numbers would dodge the list.
- ``ioctl(TIOCSTI)`` and ``ioctl(TIOCLINUX)`` (typing into a terminal) refused, compared on the
  low 32 bits the kernel uses, so high garbage bits cannot smuggle them past. libseccomp cannot
  express "allow ioctl unless the low word is X", so that check is a short hand-written prefix
  to libseccomp's program.
"""

from __future__ import annotations

import errno
import functools
import struct
import tempfile

from ephemeral import errors

AUDIT_ARCH_X86_64 = 0xC000003E
X32_SYSCALL_BIT = 0x40000000
SECCOMP_RET_KILL_PROCESS = 0x80000000
SECCOMP_RET_ERRNO = 0x00050000

SYS_IOCTL = 16
TIOCSTI = 0x5412
TIOCLINUX = 0x541C
AF_UNIX, AF_INET, AF_INET6, AF_NETLINK = 1, 2, 10, 16
NETLINK_ROUTE = 0
NETLINK_AUDIT = 9
# CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET (Docker's mask)
CLONE_NS_FLAGS = 0x7E020000
PERSONALITIES = (0x0, 0x8, 0x20000, 0x20008, 0xFFFFFFFF)

_ALLOWED_NAMES = """
accept accept4 access alarm arch_prctl bind brk capget capset chdir chmod chown
clock_getres clock_gettime clock_nanosleep close close_range connect copy_file_range creat
dup dup2 dup3 epoll_create epoll_create1 epoll_ctl epoll_ctl_old epoll_pwait epoll_pwait2
epoll_wait epoll_wait_old eventfd eventfd2 execve execveat exit exit_group faccessat
faccessat2 fadvise64 fallocate fchdir fchmod fchmodat fchown fchownat fcntl fdatasync
fgetxattr flistxattr flock fork fremovexattr fsetxattr fstat fstatfs fsync ftruncate futex
futex_waitv futimesat getcpu getcwd getdents getdents64 getegid geteuid getgid getgroups
getitimer getpeername getpgid getpgrp getpid getppid getpriority getrandom getresgid
getresuid getrlimit get_robust_list getrusage getsid getsockname getsockopt get_thread_area
gettid gettimeofday getuid getxattr inotify_add_watch inotify_init inotify_init1
inotify_rm_watch io_cancel ioctl io_destroy io_getevents io_pgetevents ioprio_get ioprio_set
io_setup io_submit kill landlock_add_rule landlock_create_ruleset landlock_restrict_self
lchown lgetxattr link linkat listen listxattr llistxattr lremovexattr lseek lsetxattr lstat
madvise membarrier memfd_create mincore mkdir mkdirat mknod mknodat mlock mlock2 mlockall
mmap mprotect mq_getsetattr mq_notify mq_open mq_timedreceive mq_timedsend mq_unlink mremap
msgctl msgget msgrcv msgsnd msync munlock munlockall munmap nanosleep newfstatat open openat
openat2 pause pidfd_open pidfd_send_signal pipe pipe2 pkey_alloc pkey_free pkey_mprotect poll
ppoll prctl pread64 preadv preadv2 prlimit64 pselect6 pwrite64 pwritev pwritev2 read
readahead readlink readlinkat readv recvfrom recvmmsg recvmsg remap_file_pages removexattr
rename renameat renameat2 restart_syscall rmdir rseq rt_sigaction rt_sigpending
rt_sigprocmask rt_sigqueueinfo rt_sigreturn rt_sigsuspend rt_sigtimedwait rt_tgsigqueueinfo
sched_getaffinity sched_getattr sched_getparam sched_get_priority_max sched_get_priority_min
sched_getscheduler sched_rr_get_interval sched_setaffinity sched_setattr sched_setparam
sched_setscheduler sched_yield seccomp select semctl semget semop semtimedop sendfile
sendmmsg sendmsg sendto setfsgid setfsuid setgid setgroups setitimer setpgid setpriority
setregid setresgid setresuid setreuid setrlimit set_robust_list setsid setsockopt
set_thread_area set_tid_address setuid setxattr shmat shmctl shmdt shmget shutdown
sigaltstack signalfd signalfd4 splice stat statfs statx symlink symlinkat sync
sync_file_range syncfs sysinfo tee tgkill time timer_create timer_delete timer_getoverrun
timer_gettime timer_settime timerfd_create timerfd_gettime timerfd_settime times tkill
truncate umask uname unlink unlinkat utime utimensat utimes vfork vmsplice wait4 waitid
write writev
"""
ALLOWED = tuple(_ALLOWED_NAMES.split())

# classic BPF
_LD_W_ABS, _JEQ_K, _JGE_K, _RET_K = 0x20, 0x15, 0x35, 0x06
_ARCH, _NR, _ARG1_LO = 4, 0, 24


def _ins(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("<HBBI", code, jt, jf, k)


def _prefix() -> bytes:
    """x32 numbers killed; ioctl(TIOCSTI/TIOCLINUX) refused on the low word. Every other path
    falls through to libseccomp's program (which checks the arch again)."""
    eperm = SECCOMP_RET_ERRNO | errno.EPERM
    out = [
        _ins(_LD_W_ABS, _ARCH),
        _ins(_JEQ_K, AUDIT_ARCH_X86_64, jt=0, jf=8),  # -> end
        _ins(_LD_W_ABS, _NR),
        _ins(_JGE_K, X32_SYSCALL_BIT, jt=0, jf=1),
        _ins(_RET_K, SECCOMP_RET_KILL_PROCESS),
        _ins(_JEQ_K, SYS_IOCTL, jt=0, jf=4),  # -> end
        _ins(_LD_W_ABS, _ARG1_LO),
        _ins(_JEQ_K, TIOCSTI, jt=1, jf=0),
        _ins(_JEQ_K, TIOCLINUX, jt=0, jf=1),  # -> end
        _ins(_RET_K, eperm),
    ]
    return b"".join(out)


@functools.cache
def program() -> bytes:
    """The compiled filter, ready to hand to ``bwrap --seccomp`` (built once per process)."""
    try:
        import pyseccomp as sc
    except (ImportError, OSError) as exc:  # OSError: the binding found no libseccomp.so.2
        raise errors.SandboxError(
            f"cannot build the seccomp filter: {exc} (apt-get install libseccomp2; "
            "pip install pyseccomp)"
        ) from exc

    arch = sc.system_arch()
    f = sc.SyscallFilter(sc.ERRNO(errno.EPERM))
    f.set_attr(sc.Attr.ACT_BADARCH, sc.KILL_PROCESS)
    # a binary tree of syscall numbers: ~9 comparisons per syscall instead of ~300
    f.set_attr(sc.Attr.CTL_OPTIMIZE, 2)
    for name in ALLOWED:
        if sc.resolve_syscall(arch, name) >= 0:  # skip what this arch does not have
            f.add_rule(sc.ALLOW, name)
    for family in (AF_UNIX, AF_INET, AF_INET6):
        f.add_rule(sc.ALLOW, "socket", sc.Arg(0, sc.EQ, family))
    f.add_rule(sc.ALLOW, "socket", sc.Arg(0, sc.EQ, AF_NETLINK), sc.Arg(2, sc.EQ, NETLINK_ROUTE))
    f.add_rule(
        sc.ERRNO(errno.EPROTONOSUPPORT),
        "socket",
        sc.Arg(0, sc.EQ, AF_NETLINK),
        sc.Arg(2, sc.EQ, NETLINK_AUDIT),
    )
    f.add_rule(sc.ALLOW, "socketpair", sc.Arg(0, sc.EQ, AF_UNIX))
    f.add_rule(sc.ALLOW, "clone", sc.Arg(0, sc.MASKED_EQ, CLONE_NS_FLAGS, 0))
    f.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    for persona in PERSONALITIES:
        f.add_rule(sc.ALLOW, "personality", sc.Arg(0, sc.EQ, persona))
    with tempfile.TemporaryFile() as out:
        f.export_bpf(out)
        out.seek(0)
        compiled = out.read()
    return _prefix() + compiled
