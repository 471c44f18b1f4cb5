/*
 * fedinfer.c - main of the `fedinfer` binary: dispatches to the command
 * named by the first argument. Each command lives with the folder that owns
 * it (core: run, bench, inspect; fabric: keygen, coordinator, shard; edge:
 * edge) and answers --help itself.
 */
#include <stdio.h>
#include <string.h>

#include "fi_cmd.h"
#include "fi_coord_route.h"
#include "fi_edge.h"
#include "fi_fabric_cmd.h"

/* bench --serve measures the coordinator's router itself. */
static int s_bench_route(const fi_bench_replica *r, int n, const uint64_t *h, int nh) {
    fi_route_cand c[8];
    if (n > 8) n = 8;
    for (int i = 0; i < n; i++)
        c[i] = (fi_route_cand){.capacity = r[i].capacity, .running = r[i].running, .queued = r[i].queued,
                               .filter = r[i].filter, .filter_len = r[i].filter_len, .id = r[i].id};
    static uint64_t turn; /* as the coordinator's count of choices */
    return fi_route_pick(c, n, h, nh, fi_route_key(h, nh, turn++), NULL);
}

typedef struct command {
    const char *name;                 /* first argument */
    int (*fn)(int argc, char **argv); /* runs it; returns the exit status */
    const char *summary;              /* one line for --help */
} command;

static const command s_commands[] = {
    {"run", fi_cmd_run, "generate text with a model (chat by default)"},
    {"bench", fi_cmd_bench, "measure prefill, decode, memory and the bandwidth floor"},
    {"inspect", fi_cmd_inspect, "print a GGUF file's metadata and tensor table"},
    {"keygen", fi_cmd_keygen, "write a CURVE key pair (NAME.key mode 0600, NAME.pub)"},
    {"coordinator", fi_cmd_coordinator, "run the coordinator that brokers the fabric"},
    {"shard", fi_cmd_shard, "serve a model to the coordinator as a cluster worker"},
    {"edge", fi_cmd_edge, "serve the OpenAI-compatible API of a site (policy, local, routed)"},
};

static void s_usage(FILE *f) {
    fprintf(f, "usage: fedinfer COMMAND [options]\n\ncommands:\n");
    for (size_t i = 0; i < sizeof s_commands / sizeof s_commands[0]; i++)
        fprintf(f, "  %-12s %s\n", s_commands[i].name, s_commands[i].summary);
    fprintf(f, "\n`fedinfer COMMAND --help` describes a command's options.\n");
}

int main(int argc, char **argv) {
    fi_bench_serve_set_router(s_bench_route);
    if (argc < 2) {
        s_usage(stderr);
        return 2;
    }
    if (!strcmp(argv[1], "--help") || !strcmp(argv[1], "-h") || !strcmp(argv[1], "help")) {
        s_usage(stdout);
        return 0;
    }
    if (!strcmp(argv[1], "--version")) {
        printf("fedinfer 0.1.0\n");
        return 0;
    }
    for (size_t i = 0; i < sizeof s_commands / sizeof s_commands[0]; i++)
        if (!strcmp(argv[1], s_commands[i].name)) return s_commands[i].fn(argc - 1, argv + 1);
    fprintf(stderr, "fedinfer: unknown command '%s'\n", argv[1]);
    s_usage(stderr);
    return 2;
}
