/*
 * model_copy.c - see model_copy.h.
 */
#include "model_copy.h"

#include <fcntl.h>
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>

#include "fi_gguf.h"

int model_copy(const char *src, const char *dst, char *sha) {
    int in = open(src, O_RDONLY), out = open(dst, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    int rc = in < 0 || out < 0 ? -1 : 0;
    char buf[1 << 16];
    ssize_t n;
    while (!rc && (n = read(in, buf, sizeof buf)) > 0)
        if (write(out, buf, (size_t)n) != n) rc = -1;
    if (in >= 0) close(in);
    if (out >= 0 && close(out) != 0) rc = -1;
    if (rc || !sha) return rc;
    char err[256];
    fi_gguf *g = fi_gguf_open(dst, err, sizeof err);
    if (!g) return -1;
    fi_gguf_sha256(g, sha);
    fi_gguf_close(&g);
    return 0;
}

int model_flip_last_byte(const char *path) {
    int fd = open(path, O_RDWR);
    if (fd < 0) return -1;
    struct stat st;
    unsigned char b;
    int rc = -1;
    if (fstat(fd, &st) == 0 && st.st_size > 0 && pread(fd, &b, 1, st.st_size - 1) == 1) {
        b ^= 1;
        rc = pwrite(fd, &b, 1, st.st_size - 1) == 1 ? 0 : -1;
    }
    close(fd);
    return rc;
}
