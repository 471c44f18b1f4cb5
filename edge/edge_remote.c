/* edge_remote.c - the routed executor (placeholder until routing lands). */
#include <stdio.h>

#include "edge_impl.h"

int edge_remote_new(fi_edge *e, edge_exec *out, char *err, size_t errlen) {
    (void)e, (void)out;
    snprintf(err, errlen, "coordinator: routing over the fabric is not built yet");
    return -1;
}
