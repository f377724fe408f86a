/* Preloaded in the guest (/etc/ld.so.preload). gVisor's 2022 runsc answers EINVAL to statx()
 * with AT_NO_AUTOMOUNT or a sync-type flag, which coreutils always passes, so `ls -l` and
 * `stat` fail there. Both flags are meaningless in the sandbox (no automounts, no network
 * filesystems): strip them and make the real syscall. Harmless under every other driver. */
#define _GNU_SOURCE
#include <sys/syscall.h>
#include <unistd.h>

struct statx;

int statx(int dirfd, const char *path, int flags, unsigned int mask, struct statx *buf) {
    return (int)syscall(SYS_statx, dirfd, path, flags & ~(0x800 | 0x6000), mask, buf);
}
