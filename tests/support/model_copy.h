/*
 * model_copy.h - a private copy of a model file, for tests that change the
 * file in place (a deployment's pinned model_sha256 no longer matching).
 */
#ifndef MODEL_COPY_H
#define MODEL_COPY_H

#include <stddef.h>

/* Copies src to dst; 0, or -1. With sha (65 bytes) not NULL, the copy's
 * SHA-256 in hex. */
int model_copy(const char *src, const char *dst, char *sha);
/* Flips the lowest bit of the file's last byte, in place (same inode, so
 * a process that mapped the file sees the change); again to undo. 0 or -1. */
int model_flip_last_byte(const char *path);

#endif /* MODEL_COPY_H */
