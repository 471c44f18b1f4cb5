/*
 * net_ports.h - free TCP ports on 127.0.0.1 for tests that must write
 * endpoints into configuration files before anything binds them (shard
 * groups: every rank's endpoint is in the group file).
 */
#ifndef FI_TEST_NET_PORTS_H
#define FI_TEST_NET_PORTS_H

/* The first of n consecutive ports that are free now, below Linux's
 * ephemeral range (so that outgoing connections do not take them
 * meanwhile); -1 when none were found in 200 tries. Another process may
 * still take one before the caller binds it: rare, not impossible. */
int fi_test_free_ports(int n);

#endif
