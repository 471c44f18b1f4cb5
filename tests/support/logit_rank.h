/*
 * logit_rank.h - the greedy choice of a row of logits and its margin, for
 * tests that compare two engines token by token (a near tie may flip).
 */
#ifndef LOGIT_RANK_H
#define LOGIT_RANK_H

/* The index of the largest of x[0..n) (n >= 2; the first on ties), and in
 * *gap (unless NULL) its lead over the second largest. */
int logit_argmax_gap(const float *x, int n, float *gap);

#endif /* LOGIT_RANK_H */
