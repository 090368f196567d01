/* worker._paged_attention: paged attention on CPU (worker/executor/cpu_attention.py calls it).
 *
 * Both kernels read each sequence's context through its block table from the paged K/V cache ([cache blocks,
 * block size, kv heads, head dim], fp32): no gathered copy of the batch (prefill repacks one KV head of one
 * sequence at a time into a scratch layout for its micro-kernels). Grouped-query attention: query
 * head i reads KV head i / group. Scores are scaled by `scale`, softmax in fp32. The GIL is released while
 * they run.
 *
 * decode: one query token per sequence attends over its whole context. Each sequence's cache rows are read
 * once per step, in order, for all heads; softmax in two passes (scores, then the weighted sum of V).
 *
 * prefill: a chunk of query tokens per sequence, at the last positions of its context (its cached prefix,
 * then the chunk, whose K/V the caller has written), each attending causally. Flash-style: query tiles
 * against key blocks with an online softmax, through register-blocked micro-kernels (see "prefill" below).
 *
 * The caller passes raw data pointers of contiguous tensors it has checked (dtype, shape, device);
 * this file checks block ids and lengths against the sizes it is given, so a bad table raises
 * instead of reading out of bounds.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "_vec.h"

/* a . b over n floats: vector partial sums, then the 8 lanes added in registers (a plain reduction loop
 * compiled to 16 in-order scalar adds through memory, which dominated the kernel). */
static inline __attribute__((always_inline)) float dot(const float *a, const float *b, int n) {
    f8 acc = {0}, acc2 = {0}; /* two chains: the next multiply-add need not wait for the last */
    int d = 0;
    for (; d + 16 <= n; d += 16) {
        acc += load8(a + d) * load8(b + d);
        acc2 += load8(a + d + 8) * load8(b + d + 8);
    }
    for (; d + 8 <= n; d += 8)
        acc += load8(a + d) * load8(b + d);
    acc += acc2;
    float total = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (; d < n; d++)
        total += a[d] * b[d];
    return total;
}

/* e^x for x <= 0 (scores minus their maximum), 8 at a time (exp_reduced8 in _vec.h); below -87 (e^x under
 * FLT_MIN) gives 0. A libm expf per score was ~7% of a 32-sequence decode step. */
static inline __attribute__((always_inline)) f8 exp8(f8 x) {
    const i8 underflow = x < -87.0f; /* lanes all ones where true */
    x = select8(underflow, x - x - 87.0f, x);
    /* n = round(x / ln2): x <= 0, so truncating x / ln2 - 0.5 toward zero rounds to nearest */
    const f8 e = exp_reduced8(x, __builtin_convertvector(x * 1.44269504088896341f - 0.5f, i8));
    return select8(underflow, x - x, e);
}

/* The lane sums of 8 vectors: lane j of the result is a[j][0] + ... + a[j][7] (a transpose-add in three
 * levels: 7 adds and 14 shuffles for 8 dot products, where reducing each alone took 8 times 3 adds and the
 * lane extracts). */
static inline __attribute__((always_inline)) f8 sum_lanes8(const f8 a[8]) {
    const i8 even = {0, 8, 2, 10, 4, 12, 6, 14}, odd = {1, 9, 3, 11, 5, 13, 7, 15};
    const i8 pairs_lo = {0, 1, 8, 9, 4, 5, 12, 13}, pairs_hi = {2, 3, 10, 11, 6, 7, 14, 15};
    const i8 quads_lo = {0, 1, 2, 3, 8, 9, 10, 11}, quads_hi = {4, 5, 6, 7, 12, 13, 14, 15};
    f8 t[4], u[2];
    for (int i = 0; i < 4; i++)
        t[i] = __builtin_shuffle(a[2 * i], a[2 * i + 1], even) + __builtin_shuffle(a[2 * i], a[2 * i + 1], odd);
    for (int i = 0; i < 2; i++)
        u[i] = __builtin_shuffle(t[2 * i], t[2 * i + 1], pairs_lo) + __builtin_shuffle(t[2 * i], t[2 * i + 1], pairs_hi);
    return __builtin_shuffle(u[0], u[1], quads_lo) + __builtin_shuffle(u[0], u[1], quads_hi);
}

/* dst[j] = q . k_j * scale for the 8 keys k_j = keys + j * stride (head_dim a multiple of 8): 8 accumulators
 * in registers, one vector store. */
static inline __attribute__((always_inline)) void scores8(const float *q, const float *keys, size_t stride,
                                                          int head_dim, float scale, float *dst) {
    f8 acc[8];
    for (int j = 0; j < 8; j++)
        acc[j] = (f8){0};
    for (int d = 0; d < head_dim; d += 8) {
        const f8 qd = load8(q + d);
        for (int j = 0; j < 8; j++)
            acc[j] += qd * load8(keys + (size_t)j * stride + d);
    }
    store8(dst, sum_lanes8(acc) * scale);
}

/* One sequence: out[i] = softmax(q[i] . K_h^T * scale) V_h for every query head i, where h = i / group.
 * scores holds [heads, context_len]. The context is walked block by block, once for the scores and once
 * for the weighted values, and each cache row ([kv heads, head dim], contiguous) is read once per walk for
 * all heads; scores take 8 rows at a time when head_dim is a multiple of 8 (scores8).
 * Each walk prefetches the rows of the next block in its table as it goes (the same row offset, one block
 * ahead): compute on one block overlaps the reads of the next, which the hardware prefetcher does not start
 * across a block boundary. 32 sequences of 290 tokens, 30 layers, cold cache: 63 -> 56 ms with the blocks
 * in table order, 81 -> 65 ms with blocks scattered (one Xeon core). Hint 3 (keep in every level): a
 * non-temporal prefetch made the walk 45% slower. Accumulating values per KV head in registers (the
 * output stored once, not per token) was 1.5x faster in cache but slower cold: its passes over the rows
 * read one cache line of each.
 * Cloned for AVX-512 and plain AVX2, not CLONES' x86-64-v3: with FMA the per-row dot products become
 * chains of 4-cycle multiply-adds instead of independent multiplies into 3-cycle adds. */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
__attribute__((target_clones("avx512f", "avx2", "default")))
#endif
static void attend_sequence(const float *q, float *out, int num_heads, int kv_heads, int head_dim,
                            const float *k_cache, const float *v_cache, const int32_t *table, int context_len,
                            int block_size, float scale, float *scores) {
    const int group = num_heads / kv_heads;
    const size_t row_stride = (size_t)kv_heads * head_dim;
    const int eight_at_a_time = head_dim % 8 == 0;
    for (int start = 0, b = 0; start < context_len; start += block_size, b++) {
        const int in_block = context_len - start < block_size ? context_len - start : block_size;
        const float *rows = k_cache + (size_t)table[b] * block_size * row_stride;
        int off = 0;
        for (; eight_at_a_time && off + 8 <= in_block; off += 8) {
            const float *row = rows + (size_t)off * row_stride;
            const float *ahead = start + block_size < context_len
                                 ? k_cache + ((size_t)table[b + 1] * block_size + off) * row_stride : NULL;
            if (ahead != NULL)
                for (size_t c = 0; c < 8 * row_stride; c += 16)
                    __builtin_prefetch(ahead + c, 0, 3);
            for (int h = 0, i = 0; h < kv_heads; h++)
                for (int g = 0; g < group; g++, i++)
                    scores8(q + (size_t)i * head_dim, row + (size_t)h * head_dim, row_stride, head_dim, scale,
                            scores + (size_t)i * context_len + start + off);
        }
        for (; off < in_block; off++) {
            const float *row = rows + (size_t)off * row_stride;
            for (int h = 0, i = 0; h < kv_heads; h++) {
                const float *k = row + (size_t)h * head_dim;
                for (int g = 0; g < group; g++, i++) {
                    scores[(size_t)i * context_len + start + off] = dot(q + (size_t)i * head_dim, k, head_dim) * scale;
                }
            }
        }
    }
    for (int i = 0; i < num_heads; i++) {
        float *s = scores + (size_t)i * context_len;
        float top = -INFINITY;
        for (int t = 0; t < context_len; t++)
            top = s[t] > top ? s[t] : top;
        f8 sums = {0};
        int t = 0;
        for (; t + 8 <= context_len; t += 8) {
            const f8 e = exp8(load8(s + t) - top);
            memcpy(s + t, &e, sizeof e);
            sums += e;
        }
        float total = ((sums[0] + sums[4]) + (sums[1] + sums[5])) + ((sums[2] + sums[6]) + (sums[3] + sums[7]));
        for (; t < context_len; t++) {
            s[t] = expf(s[t] - top);
            total += s[t];
        }
        const float inv = 1.0f / total;
        for (int t = 0; t < context_len; t++)
            s[t] *= inv;
    }
    memset(out, 0, sizeof(float) * (size_t)num_heads * head_dim);
    for (int start = 0, b = 0; start < context_len; start += block_size, b++) {
        const int in_block = context_len - start < block_size ? context_len - start : block_size;
        const float *rows = v_cache + (size_t)table[b] * block_size * row_stride;
        const float *next = start + block_size < context_len ? v_cache + (size_t)table[b + 1] * block_size * row_stride : NULL;
        for (int off = 0; off < in_block; off++) {
            const float *row = rows + (size_t)off * row_stride;
            const float *ahead = next != NULL ? next + (size_t)off * row_stride : NULL;
            if (ahead != NULL)
                for (size_t c = 0; c < row_stride; c += 16)
                    __builtin_prefetch(ahead + c, 0, 3);
            for (int h = 0, i = 0; h < kv_heads; h++) {
                const float *v = row + (size_t)h * head_dim;
                for (int g = 0; g < group; g++, i++) {
                    const float w = scores[(size_t)i * context_len + start + off];
                    float *oi = out + (size_t)i * head_dim;
#pragma omp simd
                    for (int d = 0; d < head_dim; d++)
                        oi[d] += w * v[d];
                }
            }
        }
    }
}

/* Checks of a call's tables: every context fits its block table, every used block id is in the cache; with
 * query_lens (prefill; decode passes NULL: one query token per sequence), every chunk fits its context and the
 * chunks add up to the num_tokens query rows. Returns the longest context, or -1 with a ValueError set. */
static int check_tables(const int32_t *tables, const int32_t *context_lens, const int32_t *query_lens,
                                int num_seqs, int num_tokens, int block_size, int max_blocks, int cache_blocks) {
    long long total = 0;
    int longest = 0;
    for (int s = 0; s < num_seqs; s++) {
        const int len = context_lens[s], q_len = query_lens != NULL ? query_lens[s] : 0;
        if (len < 0 || len > max_blocks * block_size) {
            PyErr_Format(PyExc_ValueError, "paged attention: context length %d of sequence %d does not fit its "
                         "block table (%d blocks of %d)", len, s, max_blocks, block_size);
            return -1;
        }
        if (q_len < 0 || q_len > len) {
            PyErr_Format(PyExc_ValueError, "paged attention: %d query tokens of sequence %d do not fit its "
                         "context length %d", q_len, s, len);
            return -1;
        }
        const int used = (len + block_size - 1) / block_size;
        for (int b = 0; b < used; b++) {
            const int32_t block = tables[(size_t)s * max_blocks + b];
            if (block < 0 || block >= cache_blocks) {
                PyErr_Format(PyExc_ValueError, "paged attention: block %d of sequence %d is outside the cache "
                             "(%d blocks)", (int)block, s, cache_blocks);
                return -1;
            }
        }
        total += q_len;
        longest = len > longest ? len : longest;
    }
    if (query_lens != NULL && total != num_tokens) {
        PyErr_Format(PyExc_ValueError, "paged attention: query lengths add up to %lld, not the %d query rows",
                     total, num_tokens);
        return -1;
    }
    return longest;
}

/* decode(q, k_cache, v_cache, block_tables, context_lens, out, num_seqs, num_heads, kv_heads, head_dim,
 *        block_size, max_blocks, cache_blocks, scale) -> None; pointers as ints. */
static PyObject *decode(PyObject *self, PyObject *args) {
    unsigned long long q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, out_ptr;
    int num_seqs, num_heads, kv_heads, head_dim, block_size, max_blocks, cache_blocks;
    float scale;
    if (!PyArg_ParseTuple(args, "KKKKKKiiiiiiif", &q_ptr, &k_ptr, &v_ptr, &tables_ptr, &lens_ptr, &out_ptr,
                          &num_seqs, &num_heads, &kv_heads, &head_dim, &block_size, &max_blocks,
                          &cache_blocks, &scale))
        return NULL;
    if (num_seqs < 0 || kv_heads < 1 || head_dim < 1 || block_size < 1 || max_blocks < 0 ||
        num_heads % kv_heads != 0) {
        PyErr_SetString(PyExc_ValueError, "paged attention: bad sizes");
        return NULL;
    }
    const float *q = (const float *)(uintptr_t)q_ptr;
    const float *k_cache = (const float *)(uintptr_t)k_ptr;
    const float *v_cache = (const float *)(uintptr_t)v_ptr;
    const int32_t *tables = (const int32_t *)(uintptr_t)tables_ptr;
    const int32_t *lens = (const int32_t *)(uintptr_t)lens_ptr;
    float *out = (float *)(uintptr_t)out_ptr;
    const int longest = check_tables(tables, lens, NULL, num_seqs, num_seqs, block_size, max_blocks, cache_blocks);
    if (longest < 0)
        return NULL;
    float *scores = PyMem_RawMalloc(sizeof(float) * (size_t)num_heads * (longest > 0 ? longest : 1));
    if (scores == NULL)
        return PyErr_NoMemory();

    Py_BEGIN_ALLOW_THREADS
    for (int s = 0; s < num_seqs; s++) {
        const size_t offset = (size_t)s * num_heads * head_dim;
        if (lens[s] == 0)
            memset(out + offset, 0, sizeof(float) * (size_t)num_heads * head_dim);
        else
            attend_sequence(q + offset, out + offset, num_heads, kv_heads, head_dim, k_cache, v_cache,
                            tables + (size_t)s * max_blocks, lens[s], block_size, scale, scores);
    }
    Py_END_ALLOW_THREADS

    PyMem_RawFree(scores);
    Py_RETURN_NONE;
}

/* 2^x for x <= 0, 8 at a time: x = n + f with |f| <= 1/2, 2^f by the polynomial of Cephes' exp2f (about 1 ulp),
 * times 2^n in the exponent bits. Below -126 it gives 2^-126 (about 1e-38) rather than 0. The prefill works
 * in base 2 (log2(e) folded into the query scale) for this: about half the instructions of exp8. */
static inline __attribute__((always_inline)) f8 exp2_8(f8 x) {
    const i8 low = x < -126.0f;
    const f8 floor = {-126.0f, -126.0f, -126.0f, -126.0f, -126.0f, -126.0f, -126.0f, -126.0f};
    i8 xbits, floor_bits;
    memcpy(&xbits, &x, sizeof xbits);
    memcpy(&floor_bits, &floor, sizeof floor_bits);
    xbits = (xbits & ~low) | (floor_bits & low);
    memcpy(&x, &xbits, sizeof x);
    const i8 n = __builtin_convertvector(x - 0.5f, i8); /* x <= 0: truncating x - 1/2 rounds to nearest */
    const f8 f = x - __builtin_convertvector(n, f8);
    f8 p = 1.535336188319500e-4f * f + 1.339887440266574e-3f;
    p = p * f + 9.618437357674640e-3f;
    p = p * f + 5.550332471162809e-2f;
    p = p * f + 2.402264791363012e-1f;
    p = p * f + 6.931472028550421e-1f;
    p = p * f + 1.0f;
    i8 bits;
    memcpy(&bits, &p, sizeof bits);
    bits += n << 23;
    memcpy(&p, &bits, sizeof p);
    return p;
}

/* ---- prefill: a chunk of query tokens per sequence, causal over the cached prefix and the chunk ---- */

/* Tile sizes. A query tile is the rows (token, head of the KV group) of TILE_ROWS / group consecutive tokens:
 * every head of a group reads the same K/V, so the tile reuses each K/V block from L1 for all of them. Keys go
 * in blocks of KEY_BLOCK (scores [tile rows, KEY_BLOCK]; the online softmax runs once per block and row), and
 * inside a block in tiles of KEY_TILE transposed keys. Both micro-kernels hold a 6 x 2-vector tile of results
 * in registers (scores of 6 rows x 16 keys; outputs of 6 rows x 16 dims): 12 independent FMA chains cover the
 * FMA latency on two pipes, and with the 2 vectors loaded and 1 broadcast that is 15 of AVX2's 16 registers
 * (a 3 x 4 output tile needs 17: the compiler then reloads V from memory in every FMA, 15 loads per 12 FMAs). */
enum { KEY_TILE = 16, KEY_BLOCK = 64, TILE_ROWS = 24, QK_ROWS = 6, PV_ROWS = 6, PV_VECS = 2 };

struct prefill_shape {
    int num_heads, kv_heads, head_dim, padded_dim, block_size;
    float log2_scale; /* scale * log2(e): scores in base 2, for exp2_8 */
};

/* Scratch for one KV head of one sequence at a time, sized for the longest context of the call. */
struct prefill_scratch {
    float *keys_t;   /* [ceil(context / KEY_TILE)][head_dim][KEY_TILE]: K transposed, a tile of keys per row of dims */
    float *values;   /* [ceil(context / KEY_TILE) * KEY_TILE][padded_dim]: V rows, contiguous */
    float *queries;  /* [tile rows][head_dim]: the tile's queries times log2_scale */
    float *acc;      /* [tile rows][padded_dim]: unnormalized output */
    float *scores;   /* [tile rows][KEY_BLOCK] */
    float *row_max, *row_sum, *rescale; /* [tile rows rounded up to a multiple of 8] each */
};

/* dst[d * KEY_TILE + n] = rows[n][d] for 8 rows of 8 floats: the 8x8 transpose of unpack, shuffle and
 * 128-bit permute (each __builtin_shuffle below is one AVX instruction). */
static inline __attribute__((always_inline)) void transpose8(const float *const rows[8], int d, float *dst) {
    const i8 lo = {0, 8, 1, 9, 4, 12, 5, 13}, hi = {2, 10, 3, 11, 6, 14, 7, 15};
    const i8 pair_lo = {0, 1, 8, 9, 4, 5, 12, 13}, pair_hi = {2, 3, 10, 11, 6, 7, 14, 15};
    const i8 half_lo = {0, 1, 2, 3, 8, 9, 10, 11}, half_hi = {4, 5, 6, 7, 12, 13, 14, 15};
    f8 r[8], t[8], u[8];
    for (int i = 0; i < 8; i++)
        r[i] = load8(rows[i] + d);
    for (int i = 0; i < 8; i += 2) {
        t[i] = __builtin_shuffle(r[i], r[i + 1], lo);
        t[i + 1] = __builtin_shuffle(r[i], r[i + 1], hi);
    }
    for (int i = 0; i < 8; i += 4) {
        u[i] = __builtin_shuffle(t[i], t[i + 2], pair_lo);
        u[i + 1] = __builtin_shuffle(t[i], t[i + 2], pair_hi);
        u[i + 2] = __builtin_shuffle(t[i + 1], t[i + 3], pair_lo);
        u[i + 3] = __builtin_shuffle(t[i + 1], t[i + 3], pair_hi);
    }
    for (int i = 0; i < 4; i++) {
        const f8 first = __builtin_shuffle(u[i], u[i + 4], half_lo);
        const f8 second = __builtin_shuffle(u[i], u[i + 4], half_hi);
        memcpy(dst + (size_t)i * KEY_TILE, &first, sizeof first);
        memcpy(dst + (size_t)(i + 4) * KEY_TILE, &second, sizeof second);
    }
}

/* K and V of one KV head, read once through the block table into the layouts the micro-kernels stream: K
 * transposed in tiles of KEY_TILE keys (so a query value broadcast multiplies KEY_TILE keys with two vector
 * FMAs), V rows back to back. Keys past the context are zero (their scores are masked). */
static inline __attribute__((always_inline)) void pack_kv(const struct prefill_shape *sh, const float *k_cache,
                                                          const float *v_cache, const int32_t *table,
                                                          int context_len, int kv_head, struct prefill_scratch *w) {
    const int dim = sh->head_dim, padded_dim = sh->padded_dim;
    const size_t row_stride = (size_t)sh->kv_heads * dim;
    for (int j0 = 0; j0 < context_len; j0 += 8) {
        const float *k_rows[8], *v_rows[8];
        for (int n = 0; n < 8; n++) {
            const int j = j0 + n;
            if (j >= context_len) {
                k_rows[n] = v_rows[n] = NULL;
                continue;
            }
            const size_t slot = (size_t)table[j / sh->block_size] * sh->block_size + j % sh->block_size;
            k_rows[n] = k_cache + slot * row_stride + (size_t)kv_head * dim;
            v_rows[n] = v_cache + slot * row_stride + (size_t)kv_head * dim;
        }
        float *kt = w->keys_t + (size_t)(j0 / KEY_TILE) * dim * KEY_TILE + j0 % KEY_TILE;
        const int full = context_len - j0 >= 8;
        int d = 0;
        for (; full && d + 8 <= dim; d += 8)
            transpose8(k_rows, d, kt + (size_t)d * KEY_TILE);
        for (; d < dim; d++)
            for (int n = 0; n < 8; n++)
                kt[(size_t)d * KEY_TILE + n] = k_rows[n] ? k_rows[n][d] : 0.0f;
        for (int n = 0; n < 8; n++) {
            float *v = w->values + (size_t)(j0 + n) * padded_dim;
            const int copied = v_rows[n] != NULL ? dim : 0;
            if (copied > 0)
                memcpy(v, v_rows[n], sizeof(float) * dim);
            memset(v + copied, 0, sizeof(float) * (padded_dim - copied));
        }
    }
    if (context_len % KEY_TILE > 0 && context_len % KEY_TILE <= 8) { /* the last tile's upper 8 keys */
        float *kt = w->keys_t + (size_t)(context_len / KEY_TILE) * dim * KEY_TILE + 8;
        for (int d = 0; d < dim; d++)
            memset(kt + (size_t)d * KEY_TILE, 0, sizeof(float) * 8);
        memset(w->values + (size_t)(context_len / KEY_TILE * KEY_TILE + 8) * padded_dim, 0,
               sizeof(float) * 8 * padded_dim);
    }
}

/* scores[r][0, KEY_TILE) = queries[r] . keys for `rows` query rows and one transposed key tile: per dim, two
 * vector loads of keys and one broadcast per row feed 2 * rows independent FMAs. `rows` is a constant at each
 * call site, so the accumulators unroll into registers. */
static inline __attribute__((always_inline)) void qk_tile(const float *queries, const float *keys_t, int dim,
                                                          float *scores, const int rows) {
    f8 lo[QK_ROWS], hi[QK_ROWS];
    for (int r = 0; r < rows; r++)
        lo[r] = hi[r] = (f8){0};
    for (int d = 0; d < dim; d++) {
        const f8 k0 = load8(keys_t + (size_t)d * KEY_TILE), k1 = load8(keys_t + (size_t)d * KEY_TILE + 8);
        for (int r = 0; r < rows; r++) {
            const float x = queries[(size_t)r * dim + d];
            lo[r] += x * k0;
            hi[r] += x * k1;
        }
    }
    for (int r = 0; r < rows; r++) {
        memcpy(scores + (size_t)r * KEY_BLOCK, &lo[r], sizeof(f8));
        memcpy(scores + (size_t)r * KEY_BLOCK + 8, &hi[r], sizeof(f8));
    }
}

/* acc[r][0, 8 * vecs) = acc[r] * rescale[r] + sum over n keys of p[r][j] * values[j]: per key, `vecs` vector
 * loads of V and one broadcast per row feed rows * vecs FMAs. */
static inline __attribute__((always_inline)) void pv_tile(float *acc, int padded_dim, const float *rescale,
                                                          const float *p, const float *values, int n,
                                                          const int rows, const int vecs) {
    f8 o[PV_ROWS][PV_VECS];
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < vecs; c++)
            o[r][c] = load8(acc + (size_t)r * padded_dim + 8 * c) * rescale[r];
    for (int j = 0; j < n; j++) {
        f8 v[PV_VECS];
        for (int c = 0; c < vecs; c++)
            v[c] = load8(values + (size_t)j * padded_dim + 8 * c);
        for (int r = 0; r < rows; r++) {
            const float x = p[(size_t)r * KEY_BLOCK + j];
            for (int c = 0; c < vecs; c++)
                o[r][c] += x * v[c];
        }
    }
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < vecs; c++)
            memcpy(acc + (size_t)r * padded_dim + 8 * c, &o[r][c], sizeof(f8));
}

/* Lane-wise max (C has no ?: on vectors): a comparison gives all-ones lanes, which select by bit masks. */
static inline __attribute__((always_inline)) f8 max8(f8 a, f8 b) {
    const i8 a_wins = a > b;
    i8 a_bits, b_bits;
    memcpy(&a_bits, &a, sizeof a_bits);
    memcpy(&b_bits, &b, sizeof b_bits);
    a_bits = (a_bits & a_wins) | (b_bits & ~a_wins);
    memcpy(&a, &a_bits, sizeof a);
    return a;
}

/* Keys [0, n) of a block that tile rows [r0, r0 + count) see between them: the last row's token sees the most.
 * `visible` is the keys of the block the tile's first token sees. */
static inline __attribute__((always_inline)) int keys_seen(int visible, int group, int r0, int count, int n) {
    const int seen = visible + (r0 + count - 1) / group;
    return seen < n ? (seen > 0 ? seen : 0) : n;
}

/* Scores of `rows` tile rows against the keys of the block (n of them) each group of QK_ROWS rows sees, in
 * whole key tiles; the rest of a row's scores are left for softmax_block to mask. */
static inline __attribute__((always_inline)) void qk_block(const float *queries, int rows, int group, int visible,
                                                           const float *keys_t, int dim, int n, float *scores) {
    for (int r0 = 0; r0 < rows; r0 += QK_ROWS) {
        const int count = rows - r0 < QK_ROWS ? rows - r0 : QK_ROWS;
        const int keys = keys_seen(visible, group, r0, count, n);
        const float *q = queries + (size_t)r0 * dim;
        float *s = scores + (size_t)r0 * KEY_BLOCK;
        for (int t = 0; t < keys; t += KEY_TILE) {
            const float *kt = keys_t + (size_t)t * dim;
            switch (count) {
            case 6: qk_tile(q, kt, dim, s + t, 6); break;
            case 5: qk_tile(q, kt, dim, s + t, 5); break;
            case 4: qk_tile(q, kt, dim, s + t, 4); break;
            case 3: qk_tile(q, kt, dim, s + t, 3); break;
            case 2: qk_tile(q, kt, dim, s + t, 2); break;
            default: qk_tile(q, kt, dim, s + t, 1); break;
            }
        }
    }
}

static inline __attribute__((always_inline)) void pv_rows(float *acc, int padded_dim, const float *rescale,
                                                          const float *p, const float *values, int n, const int rows) {
    int d = 0;
    for (; d + 8 * PV_VECS <= padded_dim; d += 8 * PV_VECS)
        pv_tile(acc + d, padded_dim, rescale, p, values + d, n, rows, PV_VECS);
    for (; d < padded_dim; d += 8)
        pv_tile(acc + d, padded_dim, rescale, p, values + d, n, rows, 1);
}

/* acc += P V for the tile rows, each group of PV_ROWS rows over the keys of the block it sees. */
static inline __attribute__((always_inline)) void pv_block(float *acc, int rows, int group, int visible, int padded_dim,
                                                           const float *rescale, const float *p, const float *values,
                                                           int n) {
    for (int r0 = 0; r0 < rows; r0 += PV_ROWS) {
        const int count = rows - r0 < PV_ROWS ? rows - r0 : PV_ROWS;
        const int keys = keys_seen(visible, group, r0, count, n);
        float *a = acc + (size_t)r0 * padded_dim;
        const float *pr = p + (size_t)r0 * KEY_BLOCK;
        switch (count) {
        case 6: pv_rows(a, padded_dim, rescale + r0, pr, values, keys, 6); break;
        case 5: pv_rows(a, padded_dim, rescale + r0, pr, values, keys, 5); break;
        case 4: pv_rows(a, padded_dim, rescale + r0, pr, values, keys, 4); break;
        case 3: pv_rows(a, padded_dim, rescale + r0, pr, values, keys, 3); break;
        case 2: pv_rows(a, padded_dim, rescale + r0, pr, values, keys, 2); break;
        default: pv_rows(a, padded_dim, rescale + r0, pr, values, keys, 1); break;
        }
    }
}

/* The largest lane and the sum of lanes, by halving (3 dependent steps instead of 7). */
static inline __attribute__((always_inline)) float hmax8(f8 x) {
    x = max8(x, __builtin_shuffle(x, (i8){4, 5, 6, 7, 0, 1, 2, 3}));
    x = max8(x, __builtin_shuffle(x, (i8){2, 3, 0, 1, 6, 7, 4, 5}));
    return max8(x, __builtin_shuffle(x, (i8){1, 0, 3, 2, 5, 4, 7, 6}))[0];
}

static inline __attribute__((always_inline)) float hsum8(f8 x) {
    x += __builtin_shuffle(x, (i8){4, 5, 6, 7, 0, 1, 2, 3});
    x += __builtin_shuffle(x, (i8){2, 3, 0, 1, 6, 7, 4, 5});
    return x[0] + x[1];
}

/* s[j] = -inf for j in [visible, end), 8 at a time from the vector holding `visible`. */
static inline __attribute__((always_inline)) void mask_from(float *s, int visible, int end) {
    const i8 lanes = {0, 1, 2, 3, 4, 5, 6, 7};
    const f8 hidden = {-INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY};
    i8 hidden_bits;
    memcpy(&hidden_bits, &hidden, sizeof hidden_bits);
    for (int j = visible / 8 * 8; j < end; j += 8) {
        const i8 keep = lanes + j < visible;
        const f8 x = load8(s + j);
        i8 bits;
        memcpy(&bits, &x, sizeof bits);
        bits = (bits & keep) | (hidden_bits & ~keep);
        memcpy(s + j, &bits, sizeof bits);
    }
}

/* Online softmax over one key block of n keys for every tile row (Milakov & Gimelshein,
 * "Online normalizer calculation for softmax"; the FlashAttention update), in base 2: scores past the row's
 * last visible key become -inf, the running max moves to the block's, the row's sum and accumulator are
 * rescaled by 2^(old max - new max) (pv_tile applies `rescale`), and the scores become 2^(score - max). Block 0
 * holds key 0, which every row sees, so the max is finite from the first block on (the empty start's -inf max
 * gives a factor of 2^-126 on zeros). In passes over all rows rather than row by row: one row's chain of max,
 * exp and sum is ~200 cycles of latency, and rows side by side overlap it (a third less time in a
 * micro-benchmark); the rescale factors take one exp2_8 per 8 rows. */
static inline __attribute__((always_inline)) void softmax_block(struct prefill_scratch *w, int rows, int group,
                                                                int visible, int n) {
    const int padded_n = (n + KEY_TILE - 1) / KEY_TILE * KEY_TILE;
    for (int r = 0; r < rows; r++) {
        float *s = w->scores + (size_t)r * KEY_BLOCK;
        const int seen = keys_seen(visible, group, r, 1, n);
        if (seen < padded_n)
            mask_from(s, seen, padded_n);
        f8 top0 = load8(s), top1 = load8(s + 8);
        for (int j = KEY_TILE; j < padded_n; j += KEY_TILE) {
            top0 = max8(top0, load8(s + j));
            top1 = max8(top1, load8(s + j + 8));
        }
        const float top = hmax8(max8(top0, top1));
        w->rescale[r] = top > w->row_max[r] ? top : w->row_max[r]; /* the new max, until the next pass */
    }
    for (int r = 0; r < rows; r += 8) { /* the arrays have room for whole vectors */
        const f8 old = load8(w->row_max + r), top = load8(w->rescale + r), factor = exp2_8(old - top);
        memcpy(w->row_max + r, &top, sizeof top);
        memcpy(w->rescale + r, &factor, sizeof factor);
    }
    for (int r = 0; r < rows; r++) {
        float *s = w->scores + (size_t)r * KEY_BLOCK;
        const float top = w->row_max[r];
        f8 sum0 = {0}, sum1 = {0};
        for (int j = 0; j < padded_n; j += KEY_TILE) {
            const f8 e0 = exp2_8(load8(s + j) - top), e1 = exp2_8(load8(s + j + 8) - top);
            memcpy(s + j, &e0, sizeof e0);
            memcpy(s + j + 8, &e1, sizeof e1);
            sum0 += e0;
            sum1 += e1;
        }
        w->row_sum[r] = w->row_sum[r] * w->rescale[r] + hsum8(sum0 + sum1);
    }
}

/* The tile's queries (tokens [t0, t0 + tokens) of the chunk, heads of KV head kv_head) times log2_scale, row r =
 * token * group + head in group; the running max, sum and accumulator reset. */
static inline __attribute__((always_inline)) void start_tile(const struct prefill_shape *sh, const float *q, int t0,
                                                             int tokens, int kv_head, struct prefill_scratch *w) {
    const int group = sh->num_heads / sh->kv_heads, dim = sh->head_dim;
    for (int t = 0, r = 0; t < tokens; t++) {
        for (int g = 0; g < group; g++, r++) {
            const float *src = q + ((size_t)(t0 + t) * sh->num_heads + (size_t)kv_head * group + g) * dim;
            for (int d = 0; d < dim; d++)
                w->queries[(size_t)r * dim + d] = src[d] * sh->log2_scale;
            w->row_max[r] = -INFINITY;
            w->row_sum[r] = 0.0f;
        }
    }
    for (int r = tokens * group; r % 8 != 0; r++) /* lanes past the last row: finite, their results unused */
        w->row_max[r] = w->rescale[r] = w->row_sum[r] = 0.0f;
    memset(w->acc, 0, sizeof(float) * (size_t)tokens * group * sh->padded_dim);
}

/* out rows of the tile = accumulator / sum. */
static inline __attribute__((always_inline)) void finish_tile(const struct prefill_shape *sh, float *out, int t0,
                                                              int tokens, int kv_head,
                                                              const struct prefill_scratch *w) {
    const int group = sh->num_heads / sh->kv_heads, dim = sh->head_dim;
    for (int t = 0, r = 0; t < tokens; t++) {
        for (int g = 0; g < group; g++, r++) {
            float *dst = out + ((size_t)(t0 + t) * sh->num_heads + (size_t)kv_head * group + g) * dim;
            const float inv = 1.0f / w->row_sum[r];
            for (int d = 0; d < dim; d++)
                dst[d] = w->acc[(size_t)r * sh->padded_dim + d] * inv;
        }
    }
}

/* One sequence: query token t of the chunk (position context_len - q_len + t) attends to keys [0, its position].
 * Per KV head: pack its K/V, then per query tile walk the key blocks up to the tile's last position (blocks
 * past every row's causal limit are never touched), scores -> online softmax -> P V.
 * "arch=x86-64-v3" is AVX2 with FMA: a plain "avx2" clone has no FMA and would split every multiply-add. */
CLONES
static void prefill_sequence(const struct prefill_shape *sh, const float *q, float *out, int q_len, int context_len,
                             const float *k_cache, const float *v_cache, const int32_t *table,
                             struct prefill_scratch *w) {
    const int group = sh->num_heads / sh->kv_heads;
    const int tile_tokens = TILE_ROWS / group > 0 ? TILE_ROWS / group : 1;
    const int first_position = context_len - q_len;
    for (int h = 0; h < sh->kv_heads; h++) {
        pack_kv(sh, k_cache, v_cache, table, context_len, h, w);
        for (int t0 = 0; t0 < q_len; t0 += tile_tokens) {
            const int tokens = q_len - t0 < tile_tokens ? q_len - t0 : tile_tokens;
            const int rows = tokens * group;
            const int first_visible = first_position + t0; /* last key of the tile's first row */
            const int keys = first_visible + tokens;        /* keys any row of the tile sees */
            start_tile(sh, q, t0, tokens, h, w);
            for (int j0 = 0; j0 < keys; j0 += KEY_BLOCK) {
                const int n = keys - j0 < KEY_BLOCK ? keys - j0 : KEY_BLOCK;
                const int visible = first_visible - j0 + 1; /* keys of the block the tile's first row sees */
                qk_block(w->queries, rows, group, visible, w->keys_t + (size_t)j0 * sh->head_dim, sh->head_dim, n,
                         w->scores);
                softmax_block(w, rows, group, visible, n);
                pv_block(w->acc, rows, group, visible, sh->padded_dim, w->rescale, w->scores,
                         w->values + (size_t)j0 * sh->padded_dim, n);
            }
            finish_tile(sh, out, t0, tokens, h, w);
        }
    }
}

/* prefill(q, k_cache, v_cache, block_tables, context_lens, query_lens, out, num_seqs, num_tokens, num_heads,
 *         kv_heads, head_dim, block_size, max_blocks, cache_blocks, scale) -> None; pointers as ints.
 * q and out are [num_tokens, num_heads, head_dim], each sequence's query_lens[s] rows after the last's. */
static PyObject *prefill(PyObject *self, PyObject *args) {
    unsigned long long q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, qlens_ptr, out_ptr;
    int num_seqs, num_tokens, num_heads, kv_heads, head_dim, block_size, max_blocks, cache_blocks;
    float scale;
    if (!PyArg_ParseTuple(args, "KKKKKKKiiiiiiiif", &q_ptr, &k_ptr, &v_ptr, &tables_ptr, &lens_ptr, &qlens_ptr,
                          &out_ptr, &num_seqs, &num_tokens, &num_heads, &kv_heads, &head_dim, &block_size,
                          &max_blocks, &cache_blocks, &scale))
        return NULL;
    if (num_seqs < 0 || num_tokens < 0 || kv_heads < 1 || head_dim < 1 || block_size < 1 || max_blocks < 0 ||
        num_heads % kv_heads != 0) {
        PyErr_SetString(PyExc_ValueError, "paged attention: bad sizes");
        return NULL;
    }
    const int32_t *tables = (const int32_t *)(uintptr_t)tables_ptr;
    const int32_t *context_lens = (const int32_t *)(uintptr_t)lens_ptr;
    const int32_t *query_lens = (const int32_t *)(uintptr_t)qlens_ptr;
    const int longest = check_tables(tables, context_lens, query_lens, num_seqs, num_tokens, block_size,
                                             max_blocks, cache_blocks);
    if (longest < 0)
        return NULL;
    const struct prefill_shape shape = {num_heads, kv_heads, head_dim, (head_dim + 7) / 8 * 8, block_size,
                                        scale * 1.44269504088896341f};
    const int group = num_heads / kv_heads;
    const size_t tile_rows = (size_t)(TILE_ROWS / group > 0 ? TILE_ROWS / group : 1) * group;
    const size_t vector_rows = (tile_rows + 7) / 8 * 8;
    const size_t padded_len = (size_t)(longest + KEY_TILE - 1) / KEY_TILE * KEY_TILE;
    const size_t sizes[] = {padded_len * head_dim, padded_len * shape.padded_dim, tile_rows * head_dim,
                            tile_rows * shape.padded_dim, tile_rows * KEY_BLOCK, vector_rows, vector_rows, vector_rows};
    size_t total = 0;
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++)
        total += (sizes[i] + 15) / 16 * 16; /* each array on its own 64-byte line */
    float *memory = PyMem_RawMalloc(sizeof(float) * total + 64);
    if (memory == NULL)
        return PyErr_NoMemory();
    float *arrays[sizeof sizes / sizeof sizes[0]];
    float *next = (float *)(((uintptr_t)memory + 63) & ~(uintptr_t)63);
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
        arrays[i] = next;
        next += (sizes[i] + 15) / 16 * 16;
    }
    struct prefill_scratch scratch = {arrays[0], arrays[1], arrays[2], arrays[3], arrays[4],
                                      arrays[5], arrays[6], arrays[7]};
    const float *q = (const float *)(uintptr_t)q_ptr;
    const float *k_cache = (const float *)(uintptr_t)k_ptr;
    const float *v_cache = (const float *)(uintptr_t)v_ptr;
    float *out = (float *)(uintptr_t)out_ptr;

    Py_BEGIN_ALLOW_THREADS
    size_t row = 0;
    for (int s = 0; s < num_seqs; s++) {
        const size_t offset = row * num_heads * head_dim;
        if (query_lens[s] > 0)
            prefill_sequence(&shape, q + offset, out + offset, query_lens[s], context_lens[s], k_cache, v_cache,
                             tables + (size_t)s * max_blocks, &scratch);
        row += query_lens[s];
    }
    Py_END_ALLOW_THREADS

    PyMem_RawFree(memory);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"decode", decode, METH_VARARGS, "Paged decode attention over fp32 K/V blocks (see the module comment)."},
    {"prefill", prefill, METH_VARARGS, "Causal paged prefill attention over fp32 K/V blocks (see the module comment)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "worker._paged_attention", NULL, -1, methods};

PyMODINIT_FUNC PyInit__paged_attention(void) { return PyModule_Create(&module); }
