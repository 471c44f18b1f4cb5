/*
 * fi_conf.h - the fabric's configuration files: one `key = value` per
 * line, `#` starts a comment line, blank lines are ignored. Strict: an
 * unknown key, a repeated key, a line without `=`, a number out of range
 * or a missing required key is an error naming the file, the line and the
 * key. Values run to the end of the line (trailing blanks trimmed); there
 * is no quoting.
 */
#ifndef FI_CONF_H
#define FI_CONF_H

#include <stddef.h>

#include "fi_wire.h"

#ifdef __cplusplus
extern "C" {
#endif

#define FI_CONF_STR_MAX 512 /* bytes of a string value, NUL included */

typedef enum fi_conf_type {
    FI_CONF_STR = 0, /* char[FI_CONF_STR_MAX] at offset */
    FI_CONF_INT = 1, /* int at offset, within [min, max] */
} fi_conf_type;

typedef struct fi_conf_key {
    const char *name;   /* key as written in the file; NULL ends the table */
    fi_conf_type type;  /* how the value is parsed */
    size_t offset;      /* where in the target struct */
    int required;       /* 1: the file must set it */
    long min, max;      /* FI_CONF_INT bounds */
    long step;          /* FI_CONF_INT: 0, or the value must be a multiple of it */
} fi_conf_key;

/* The engine's precision keys, alike in every configuration that runs the
 * engine (edge, shard worker, shard-group rank): act_bits 8, 12 or 16
 * (fi_cpu_backend_set_act_bits) and kv_bits 8 or 16
 * (fi_cpu_backend_set_kv_bits), into int fields of those names; OFF(f)
 * is the offset of field f in the target struct. */
#define FI_CONF_PRECISION_KEYS(OFF)                          \
    {"act_bits", FI_CONF_INT, OFF(act_bits), 0, 8, 16, 4}, \
    {"kv_bits", FI_CONF_INT, OFF(kv_bits), 0, 8, 16, 8}

/* Parses path into the struct at dst (which holds defaults on entry)
 * according to keys. Returns 0, or -1 with "FILE:LINE: ..." in err. */
FI_WIRE_MUST_CHECK int fi_conf_load(const char *path, const fi_conf_key *keys, void *dst,
                                    char *err, size_t errlen);

#ifdef __cplusplus
}
#endif
#endif /* FI_CONF_H */
