/*
 * sampler.c - picks the next token from logits.
 *
 * Order of the steps (as llama.cpp's default chain): repetition penalty,
 * OpenAI's presence and frequency penalties and logit_bias, then greedy if
 * temperature <= 0; otherwise top-k, temperature, softmax,
 * top-p (nucleus), min-p, and a draw from what is left with the sampler's
 * own seeded RNG (xoshiro256**, seeded through splitmix64), so a given seed
 * gives the same tokens on every run.
 */
#include <math.h>
#if defined(__SSE__)
#endif
#include <stdlib.h>
#include <string.h>

#include "fi_model.h"

typedef struct cand {
    int32_t id;  /* token id */
    float v;     /* logit, then probability */
} cand;

struct fi_sampler {
    fi_sampler_params p;
    int n_vocab;
    int n_prompt;     /* history tokens the OpenAI penalties skip */
    cand *c;          /* n_vocab candidates, scratch */
    uint8_t *seen;    /* (n_vocab bits) presence_penalty's marks, cleared after use; or NULL */
    uint64_t rng[4];  /* xoshiro256** state */
};

fi_sampler_params fi_sampler_defaults(void) {
    fi_sampler_params p = {0};
    p.temperature = 0.7f;
    p.top_k = 40;
    p.top_p = 0.95f;
    p.min_p = 0.05f;
    p.repeat_penalty = 1.0f;
    p.repeat_last_n = 64;
    p.seed = 0;
    return p;
}

static uint64_t s_splitmix64(uint64_t *x) {
    uint64_t z = (*x += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

static uint64_t s_rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

static uint64_t s_next(uint64_t *s) {
    uint64_t r = s_rotl(s[1] * 5, 7) * 9;
    uint64_t t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = s_rotl(s[3], 45);
    return r;
}

/* Uniform in [0, 1). */
static double s_uniform(uint64_t *s) { return (double)(s_next(s) >> 11) * (1.0 / 9007199254740992.0); }

fi_sampler *fi_sampler_new(const fi_sampler_params *p, int n_vocab) {
    if (n_vocab <= 0) return NULL;
    fi_sampler *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    s->p = p ? *p : fi_sampler_defaults();
    s->n_vocab = n_vocab;
    s->c = malloc((size_t)n_vocab * sizeof *s->c);
    if (s->p.presence_penalty != 0.0f) s->seen = calloc(((size_t)n_vocab + 7) / 8, 1);
    if (!s->c || (s->p.presence_penalty != 0.0f && !s->seen)) {
        free(s->c);
        free(s->seen);
        free(s);
        return NULL;
    }
    if (s->p.n_bias < 0) s->p.n_bias = 0;
    if (s->p.n_bias > FI_SAMPLER_MAX_BIAS) s->p.n_bias = FI_SAMPLER_MAX_BIAS;
    uint64_t x = s->p.seed;
    for (int i = 0; i < 4; i++) s->rng[i] = s_splitmix64(&x);
    return s;
}

void fi_sampler_prompt_len(fi_sampler *s, int n) { s->n_prompt = n > 0 ? n : 0; }

void fi_sampler_destroy(fi_sampler **sp) {
    if (!sp || !*sp) return;
    free((*sp)->seen);
    free((*sp)->c);
    free(*sp);
    *sp = NULL;
}

static int s_cmp_desc(const void *a, const void *b) {
    float x = ((const cand *)a)->v, y = ((const cand *)b)->v;
    if (x > y) return -1;
    if (x < y) return 1;
    /* ties by id, so the order (and a seeded draw) is deterministic */
    return ((const cand *)a)->id - ((const cand *)b)->id;
}

/* Moves the k largest candidates to the front, sorted descending.
 * Quickselect partition, then a sort of the k survivors. */
static void s_top_k(cand *c, int n, int k) {
    if (k >= n) {
        qsort(c, (size_t)n, sizeof *c, s_cmp_desc);
        return;
    }
    int lo = 0, hi = n - 1;
    while (lo < hi) {
        cand pivot = c[(lo + hi) / 2];
        int i = lo, j = hi;
        while (i <= j) {
            while (s_cmp_desc(&c[i], &pivot) < 0) i++;
            while (s_cmp_desc(&c[j], &pivot) > 0) j--;
            if (i <= j) {
                cand t = c[i];
                c[i] = c[j];
                c[j] = t;
                i++;
                j--;
            }
        }
        if (k - 1 <= j) hi = j;
        else if (k - 1 >= i) lo = i;
        else break;
    }
    qsort(c, (size_t)k, sizeof *c, s_cmp_desc);
}

static void s_penalize(const fi_sampler *s, float *logits, const int32_t *hist, int n_hist) {
    float pen = s->p.repeat_penalty;
    if (pen == 1.0f || pen <= 0.0f || !hist || n_hist <= 0) return;
    int from = s->p.repeat_last_n > 0 && n_hist > s->p.repeat_last_n ? n_hist - s->p.repeat_last_n : 0;
    /* A token seen several times is penalised once: mark as we go by
     * remembering which ids were done in the tail itself (quadratic in
     * repeat_last_n, which is small). */
    for (int i = from; i < n_hist; i++) {
        int32_t id = hist[i];
        if (id < 0 || id >= s->n_vocab) continue;
        int seen = 0;
        for (int j = from; j < i; j++)
            if (hist[j] == id) {
                seen = 1;
                break;
            }
        if (seen) continue;
        logits[id] = logits[id] > 0 ? logits[id] / pen : logits[id] * pen;
    }
}

/* OpenAI's penalties over the generated part of the history, then
 * logit_bias: logit[t] -= c[t] * frequency + (c[t] > 0) * presence, where
 * c[t] counts t among the generated tokens; logit[t] += bias[t]. */
static void s_openai(const fi_sampler *s, float *logits, const int32_t *hist, int n_hist) {
    const fi_sampler_params *p = &s->p;
    int n_gen = hist && n_hist > s->n_prompt ? n_hist - s->n_prompt : 0;
    const int32_t *gen = n_gen ? hist + s->n_prompt : NULL;
    if (p->frequency_penalty != 0.0f)
        for (int i = 0; i < n_gen; i++)
            if (gen[i] >= 0 && gen[i] < s->n_vocab) logits[gen[i]] -= p->frequency_penalty;
    if (p->presence_penalty != 0.0f && s->seen) {
        for (int i = 0; i < n_gen; i++) {
            int32_t t = gen[i];
            if (t < 0 || t >= s->n_vocab || (s->seen[t >> 3] & (1u << (t & 7)))) continue;
            s->seen[t >> 3] |= (uint8_t)(1u << (t & 7));
            logits[t] -= p->presence_penalty;
        }
        for (int i = 0; i < n_gen; i++)
            if (gen[i] >= 0 && gen[i] < s->n_vocab) s->seen[gen[i] >> 3] = 0;
    }
    for (int i = 0; i < p->n_bias; i++)
        if (p->bias[i].id >= 0 && p->bias[i].id < s->n_vocab) logits[p->bias[i].id] += p->bias[i].bias;
}

int32_t fi_argmax(const float *x, int n) {
    return fi_argmax_f32(x, n);
}

int32_t fi_sampler_sample(fi_sampler *s, float *logits, const int32_t *hist, int n_hist) {
    const fi_sampler_params *p = &s->p;
    int V = s->n_vocab;
    s_penalize(s, logits, hist, n_hist);
    s_openai(s, logits, hist, n_hist);

    if (!(p->temperature > 0.0f)) return fi_argmax(logits, V);

    cand *c = s->c;
    int n = 0;
    for (int i = 0; i < V; i++)
        if (!isnan(logits[i]) && logits[i] != -INFINITY) c[n++] = (cand){i, logits[i]};
    if (n == 0) return 0;

    int k = p->top_k > 0 && p->top_k < n ? p->top_k : n;
    if (k < n) {
        s_top_k(c, n, k);
        n = k;
    } else {
        /* no top-k: find the maximum; sorting waits until after softmax,
         * where most of the vocabulary can be dropped first */
        int best = 0;
        for (int i = 1; i < n; i++)
            if (c[i].v > c[best].v) best = i;
        cand t = c[0];
        c[0] = c[best];
        c[best] = t;
    }

    /* temperature and softmax (c[0] holds the maximum in both branches) */
    double maxv = c[0].v, sum = 0.0;
    for (int i = 0; i < n; i++) {
        double e = exp(((double)c[i].v - maxv) / p->temperature);
        c[i].v = (float)e;
        sum += e;
    }
    for (int i = 0; i < n; i++) c[i].v = (float)(c[i].v / sum);

    if (p->top_p < 1.0f && p->top_p > 0.0f) {
        if (k == V || k >= n) {
            /* A token with probability below (1-top_p)/n can never be in
             * the nucleus: all such tokens together hold less than 1-top_p,
             * so the tokens above them already reach top_p. Drop them
             * before sorting. */
            float floor_p = (1.0f - p->top_p) / (float)n;
            int m = 0;
            for (int i = 0; i < n; i++)
                if (c[i].v >= floor_p) c[m++] = c[i];
            n = m > 0 ? m : 1;
            qsort(c, (size_t)n, sizeof *c, s_cmp_desc);
        }
        double cum = 0.0;
        int keep = n;
        for (int i = 0; i < n; i++) {
            cum += c[i].v;
            if (cum >= p->top_p) {
                keep = i + 1;
                break;
            }
        }
        n = keep;
    } else if (p->min_p > 0.0f && k >= n) {
        qsort(c, (size_t)n, sizeof *c, s_cmp_desc);
    }

    if (p->min_p > 0.0f) {
        float lim = p->min_p * c[0].v;
        int m = 1;
        while (m < n && c[m].v >= lim) m++;
        n = m;
    }

    double total = 0.0;
    for (int i = 0; i < n; i++) total += c[i].v;
    double r = s_uniform(s->rng) * total, acc = 0.0;
    for (int i = 0; i < n; i++) {
        acc += c[i].v;
        if (r < acc) return c[i].id;
    }
    return c[n - 1].id;
}
