/*
 * net_ports.c - free TCP ports for tests. See net_ports.h.
 */
#include "net_ports.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define S_LO 20000 /* below net.ipv4.ip_local_port_range's default 32768 */
#define S_HI 32000

int fi_test_free_ports(int n) {
    unsigned seed = (unsigned)getpid() ^ (unsigned)time(NULL) ^ (unsigned)clock();
    for (int attempt = 0; attempt < 200; attempt++) {
        int base = S_LO + (int)(rand_r(&seed) % (unsigned)(S_HI - S_LO - n));
        int fds[64], k = 0, ok = n <= 64;
        for (; ok && k < n; k++) {
            struct sockaddr_in a;
            memset(&a, 0, sizeof a);
            a.sin_family = AF_INET;
            a.sin_port = htons((uint16_t)(base + k));
            a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
            fds[k] = socket(AF_INET, SOCK_STREAM, 0);
            if (fds[k] < 0 || bind(fds[k], (struct sockaddr *)&a, sizeof a) != 0) ok = 0;
        }
        for (int i = 0; i < k; i++)
            if (fds[i] >= 0) close(fds[i]);
        if (ok) return base;
    }
    return -1;
}
