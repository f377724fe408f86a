"""A seccomp-BPF deny-list for the namespaces driver, assembled here (no libseccomp needed).

bwrap ``--seccomp FD`` loads a raw ``struct sock_filter[]`` program. The filter:
- kills any process that makes a syscall through another ABI (i386 ``int 0x80``, x32), which
  would otherwise bypass a number-based list;
- answers EPERM to the syscalls a sandboxed tool never needs and that widen the host kernel's
  attack surface (ptrace, keyrings, mounts, namespaces, bpf, perf, modules, io_uring, ...);
- refuses ``clone`` with any namespace flag and ``clone3`` outright (ENOSYS makes libc fall
  back to ``clone``, whose flags we can inspect), and ``ioctl(TIOCSTI)``.
"""

from __future__ import annotations

import errno
import struct

AUDIT_ARCH_X86_64 = 0xC000003E
X32_SYSCALL_BIT = 0x40000000

SECCOMP_RET_KILL_PROCESS = 0x80000000
SECCOMP_RET_ERRNO = 0x00050000
SECCOMP_RET_ALLOW = 0x7FFF0000

# classic BPF opcodes
_LD_W_ABS = 0x20
_JEQ_K = 0x15
_JGE_K = 0x35
_JSET_K = 0x45
_RET_K = 0x06

# seccomp_data offsets
_NR = 0
_ARCH = 4
_ARG0_LO = 16
_ARG1_LO = 24

SYS_IOCTL = 16
SYS_CLONE = 56
SYS_CLONE3 = 435
TIOCSTI = 0x5412
CLONE_NS_FLAGS = (
    0x00020000  # NEWNS
    | 0x02000000  # NEWCGROUP
    | 0x04000000  # NEWUTS
    | 0x08000000  # NEWIPC
    | 0x10000000  # NEWUSER
    | 0x20000000  # NEWPID
    | 0x40000000  # NEWNET
)

# x86_64 numbers
DENIED: dict[str, int] = {
    "acct": 163,
    "add_key": 248,
    "adjtimex": 159,
    "bpf": 321,
    "clock_adjtime": 305,
    "clock_settime": 227,
    "delete_module": 176,
    "finit_module": 313,
    "fsconfig": 431,
    "fsmount": 432,
    "fsopen": 430,
    "fspick": 433,
    "init_module": 175,
    "io_uring_enter": 426,
    "io_uring_register": 427,
    "io_uring_setup": 425,
    "ioperm": 173,
    "iopl": 172,
    "kexec_file_load": 320,
    "kexec_load": 246,
    "keyctl": 250,
    "lookup_dcookie": 212,
    "mount": 165,
    "mount_setattr": 442,
    "move_mount": 429,
    "name_to_handle_at": 303,
    "open_by_handle_at": 304,
    "open_tree": 428,
    "perf_event_open": 298,
    "pivot_root": 155,
    "process_vm_readv": 310,
    "process_vm_writev": 311,
    "ptrace": 101,
    "quotactl": 179,
    "reboot": 169,
    "request_key": 249,
    "setns": 308,
    "settimeofday": 164,
    "swapoff": 168,
    "swapon": 167,
    "umount2": 166,
    "unshare": 272,
    "userfaultfd": 323,
    "vhangup": 153,
}


def _ins(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("<HBBI", code, jt, jf, k)


def program() -> bytes:
    """The compiled filter, ready to hand to ``bwrap --seccomp``."""
    eperm = SECCOMP_RET_ERRNO | errno.EPERM
    enosys = SECCOMP_RET_ERRNO | errno.ENOSYS
    out = [
        _ins(_LD_W_ABS, _ARCH),
        _ins(_JEQ_K, AUDIT_ARCH_X86_64, jt=1, jf=0),
        _ins(_RET_K, SECCOMP_RET_KILL_PROCESS),
        _ins(_LD_W_ABS, _NR),
        _ins(_JGE_K, X32_SYSCALL_BIT, jt=0, jf=1),
        _ins(_RET_K, SECCOMP_RET_KILL_PROCESS),
    ]
    for nr in sorted(DENIED.values()):
        out += [_ins(_JEQ_K, nr, jt=0, jf=1), _ins(_RET_K, eperm)]
    out += [_ins(_JEQ_K, SYS_CLONE3, jt=0, jf=1), _ins(_RET_K, enosys)]
    # clone(flags, ...): namespace flags refused; the accumulator is reloaded, so check last
    out += [
        _ins(_JEQ_K, SYS_CLONE, jt=0, jf=3),
        _ins(_LD_W_ABS, _ARG0_LO),
        _ins(_JSET_K, CLONE_NS_FLAGS, jt=0, jf=1),
        _ins(_RET_K, eperm),
        _ins(_LD_W_ABS, _NR),
        _ins(_JEQ_K, SYS_IOCTL, jt=0, jf=3),
        _ins(_LD_W_ABS, _ARG1_LO),
        _ins(_JEQ_K, TIOCSTI, jt=0, jf=1),
        _ins(_RET_K, eperm),
        _ins(_RET_K, SECCOMP_RET_ALLOW),
    ]
    return b"".join(out)
