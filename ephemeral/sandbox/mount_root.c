/* The writable root's mounts (writable_root.py), run by host root in a sandbox launcher's
 * private mount namespace: one exec instead of a shell's six, and the idmapped mount this
 * host's util-linux cannot make.
 *
 *   mount-root ROOTFS LOWER UPPER TARGET SIZE_BYTES TAG DISK OWNER RUNTIME RUNTIME_AT EMPTY
 *              [USERNS]
 *
 * ROOTFS is bound read-only at LOWER (idmapped into the user namespace file USERNS when given),
 * a tmpfs of SIZE_BYTES named TAG at UPPER holds the overlay's upper and work directories (the
 * upper one owned by OWNER, who is root inside), and the overlay is mounted at TARGET.
 *
 * With a DISK other than "-" (an ext4 file the host made, writable_root.make_disk), UPPER is
 * that file on a loop device instead of the tmpfs: attached with autoclear, so the device is
 * freed when its last mount goes with this mount namespace, and the file's name is unlinked
 * at once (its blocks live as long as the device). The upper directory then also holds /tmp
 * (mode 1777): the sandbox's /tmp is on the disk, not a tmpfs.
 *
 * A ROOTFS of several directories joined by ':' (a pulled image's layers, topmost first) gets a
 * small tmpfs at LOWER and each layer bound (idmapped) read-only at LOWER/<i>: the overlay's
 * lower layers are then LOWER/0:LOWER/1:..., so the mount options name no host path.
 *
 * The agent runtime (agent_runtime.py) RUNTIME is mounted at RUNTIME_AT as a read-only overlay
 * of it and the empty directory EMPTY (an overlay needs two layers to have no upper one): its
 * own filesystem, so the sandbox's mountinfo names /proc/self/fd/N instead of a host path. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/loop.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#ifndef SYS_open_tree
#define SYS_open_tree 428
#endif
#ifndef SYS_move_mount
#define SYS_move_mount 429
#endif
#ifndef SYS_mount_setattr
#define SYS_mount_setattr 442
#endif
#define OPEN_TREE_CLONE_ 1
#define MOVE_MOUNT_F_EMPTY_PATH_ 0x4
#define MOUNT_ATTR_RDONLY_ 0x1
#define MOUNT_ATTR_IDMAP_ 0x00100000

struct attr {
    uint64_t attr_set, attr_clr, propagation, userns_fd;
};

static void fail(const char *what) {
    fprintf(stderr, "writable root: %s: %s\n", what, strerror(errno));
    exit(1);
}

/* Bind SOURCE read-only at DEST, idmapped into the user namespace NS when NS >= 0. */
static void bind_ro(const char *source, const char *dest, int ns) {
    if (ns >= 0) {
        int tree = (int)syscall(SYS_open_tree, AT_FDCWD, source, OPEN_TREE_CLONE_ | O_CLOEXEC);
        if (tree < 0) fail("open_tree of the image");
        struct attr a = {MOUNT_ATTR_IDMAP_ | MOUNT_ATTR_RDONLY_, 0, 0, (uint64_t)ns};
        if (syscall(SYS_mount_setattr, tree, "", AT_EMPTY_PATH, &a, sizeof a) < 0)
            fail("idmapped mount of the image");
        if (syscall(SYS_move_mount, tree, "", AT_FDCWD, dest, MOVE_MOUNT_F_EMPTY_PATH_) < 0)
            fail("move the image's mount");
        close(tree);
    } else {
        if (mount(source, dest, NULL, MS_BIND, NULL) < 0) fail("bind the image");
        if (mount(NULL, dest, NULL, MS_REMOUNT | MS_BIND | MS_RDONLY, NULL) < 0)
            fail("make the image's bind read-only");
    }
}

/* Mount the ext4 file DISK at UPPER through a free loop device that autoclears, then unlink
 * DISK: nothing but the mount holds its blocks. Another launcher may take the same free device
 * between GET_FREE and CONFIGURE (EBUSY): ask again. */
static void mount_disk(const char *disk, const char *upper) {
    int file = open(disk, O_RDWR | O_NOFOLLOW | O_CLOEXEC);
    if (file < 0) fail("open the disk file");
    int ctl = open("/dev/loop-control", O_RDWR | O_CLOEXEC);
    if (ctl < 0) fail("open /dev/loop-control");
    char dev[64];
    int loop = -1;
    for (int tries = 0; loop < 0; tries++) {
        int n = ioctl(ctl, LOOP_CTL_GET_FREE);
        if (n < 0) fail("a free loop device");
        snprintf(dev, sizeof dev, "/dev/loop%d", n);
        loop = open(dev, O_RDWR | O_CLOEXEC);
        if (loop < 0) fail("open the loop device");
        struct loop_config cfg;
        memset(&cfg, 0, sizeof cfg);
        cfg.fd = (unsigned)file;
        cfg.info.lo_flags = LO_FLAGS_AUTOCLEAR;
        if (ioctl(loop, LOOP_CONFIGURE, &cfg) < 0) {
            if (errno != EBUSY || tries >= 64) fail("attach the disk file");
            close(loop);
            loop = -1;
        }
    }
    close(ctl);
    close(file);
    if (mount(dev, upper, "ext4", MS_NOSUID | MS_NODEV | MS_NOATIME, "noinit_itable") < 0)
        fail("mount the disk");
    close(loop); /* the mount holds the device now: autoclear frees it with the mount */
    if (unlink(disk) < 0) fail("unlink the disk file");
}

int main(int argc, char **argv) {
    if (argc != 12 && argc != 13) {
        fprintf(stderr, "usage: mount-root ROOTFS LOWER UPPER TARGET SIZE TAG DISK OWNER "
                        "RUNTIME RUNTIME_AT EMPTY [USERNS]\n");
        return 2;
    }
    const char *rootfs = argv[1], *lower = argv[2], *upper = argv[3], *target = argv[4];
    const char *size = argv[5], *tag = argv[6], *disk = argv[7];
    unsigned owner = (unsigned)strtoul(argv[8], NULL, 10);
    const char *runtime = argv[9], *runtime_at = argv[10], *empty = argv[11];
    char buf[4096];

    int rt = open(runtime, O_PATH | O_DIRECTORY | O_CLOEXEC);
    if (rt < 0) fail("open the agent runtime");
    snprintf(buf, sizeof buf, "lowerdir=/proc/self/fd/%d:%s", rt, empty);
    if (mount("ephemeral-agent", runtime_at, "overlay", MS_RDONLY | MS_NOSUID | MS_NODEV, buf) < 0)
        fail("the agent runtime's mount");
    close(rt);

    int ns = -1;
    if (argc == 13) {
        ns = open(argv[12], O_RDONLY | O_CLOEXEC);
        if (ns < 0) fail("open the user namespace");
    }
    char lowers[4096] = "";
    if (strchr(rootfs, ':') == NULL) {
        bind_ro(rootfs, lower, ns);
        snprintf(lowers, sizeof lowers, "%s", lower);
    } else {
        if (mount("layers", lower, "tmpfs", MS_NOSUID | MS_NODEV, "size=64k,mode=0755") < 0)
            fail("tmpfs for the layers");
        char *list = strdup(rootfs), *save = NULL;
        if (list == NULL) fail("strdup");
        int i = 0;
        for (char *layer = strtok_r(list, ":", &save); layer; layer = strtok_r(NULL, ":", &save)) {
            char point[512];
            snprintf(point, sizeof point, "%s/%d", lower, i);
            if (mkdir(point, 0755) < 0) fail("a layer's mount point");
            bind_ro(layer, point, ns);
            size_t used = strlen(lowers);
            if (used + strlen(point) + 2 >= sizeof lowers) {
                errno = E2BIG;
                fail("too many layers");
            }
            snprintf(lowers + used, sizeof lowers - used, "%s%s", i ? ":" : "", point);
            i++;
        }
        free(list);
    }
    int on_disk = strcmp(disk, "-") != 0;
    if (on_disk) {
        mount_disk(disk, upper);
        if (chmod(upper, 0700) < 0) fail("the disk's mode");
    } else {
        snprintf(buf, sizeof buf, "size=%s,mode=0700", size);
        if (mount(tag, upper, "tmpfs", MS_NOSUID | MS_NODEV, buf) < 0)
            fail("tmpfs for the upper layer");
    }
    snprintf(buf, sizeof buf, "%s/root", upper);
    if (mkdir(buf, 0755) < 0 || chown(buf, owner, owner) < 0 || chmod(buf, 0755) < 0)
        fail("the upper directory");
    if (on_disk) {
        snprintf(buf, sizeof buf, "%s/root/tmp", upper);
        if (mkdir(buf, 01777) < 0 || chown(buf, owner, owner) < 0 || chmod(buf, 01777) < 0)
            fail("the disk's /tmp");
    }
    snprintf(buf, sizeof buf, "%s/work", upper);
    if (mkdir(buf, 0700) < 0) fail("the work directory");
    snprintf(buf, sizeof buf, "lowerdir=%s,upperdir=%s/root,workdir=%s/work", lowers, upper, upper);
    if (mount("sandbox", target, "overlay", 0, buf) < 0) fail("the overlay");
    return 0;
}
