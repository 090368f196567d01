/* worker._paged_attention: paged decode attention on CPU (worker/executor/cpu_attention.py calls it).
 *
 * One query token per sequence attends over its whole context, read in place through its block table
 * from the paged K/V cache ([cache blocks, block size, kv heads, head dim], fp32): no gathered copy.
 * Grouped-query attention: query head i reads KV head i / group. Each sequence's cache rows are
 * read once per step, in order, for all heads. Softmax in fp32 in two
 * passes (scores, then the weighted sum of V), scaled by `scale`. The GIL is released while it runs.
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

/* 8 floats in a vector register (GCC/Clang vector extension: one ymm with AVX2, half a zmm with AVX-512,
 * two xmm otherwise); loads through memcpy, which compiles to unaligned vector loads. */
typedef float f8 __attribute__((vector_size(32)));
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wpsabi" /* f8 values never cross a call: every helper is inlined */
#endif

static inline __attribute__((always_inline)) f8 load8(const float *p) {
    f8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

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

typedef int32_t i8 __attribute__((vector_size(32)));

/* e^x for x <= 0 (scores minus their maximum), 8 at a time: x = n ln2 + r with |r| <= ln2 / 2, e^r by
 * the minimax polynomial of Cephes' expf (about 1 ulp), times 2^n built in the exponent bits; below
 * -87 (e^x under FLT_MIN) gives 0. A libm expf per score was ~7% of a 32-sequence decode step. */
static inline __attribute__((always_inline)) f8 exp8(f8 x) {
    const i8 underflow = x < -87.0f; /* lanes all ones where true */
    i8 xbits, floor_bits;
    const f8 floor = x - x - 87.0f;
    memcpy(&xbits, &x, sizeof xbits);
    memcpy(&floor_bits, &floor, sizeof floor_bits);
    xbits = (xbits & ~underflow) | (floor_bits & underflow);
    memcpy(&x, &xbits, sizeof x);
    /* n = round(x / ln2): x <= 0, so truncating x / ln2 - 0.5 toward zero rounds to nearest */
    const i8 n_int = __builtin_convertvector(x * 1.44269504088896341f - 0.5f, i8);
    const f8 n = __builtin_convertvector(n_int, f8);
    f8 r = x - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    f8 p = 1.9875691500e-4f * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    i8 bits;
    memcpy(&bits, &p, sizeof bits);
    bits = (bits + (n_int << 23)) & ~underflow;
    f8 result;
    memcpy(&result, &bits, sizeof result);
    return result;
}

/* One sequence: out[i] = softmax(q[i] . K_h^T * scale) V_h for every query head i, where h = i / group.
 * The context is walked block by block and each cache row ([kv heads, head dim], contiguous) is read
 * once for all heads: sequential reads the prefetcher follows. scores holds [heads, context_len]. */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
__attribute__((target_clones("avx512f", "avx2", "default")))
#endif
static void attend_sequence(const float *q, float *out, int num_heads, int kv_heads, int head_dim,
                            const float *k_cache, const float *v_cache, const int32_t *table, int context_len,
                            int block_size, float scale, float *scores) {
    const int group = num_heads / kv_heads;
    const size_t row_stride = (size_t)kv_heads * head_dim;
    for (int start = 0, b = 0; start < context_len; start += block_size, b++) {
        const int in_block = context_len - start < block_size ? context_len - start : block_size;
        const float *rows = k_cache + (size_t)table[b] * block_size * row_stride;
        for (int off = 0; off < in_block; off++) {
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
        for (int off = 0; off < in_block; off++) {
            const float *row = rows + (size_t)off * row_stride;
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
    int longest = 0;
    for (int s = 0; s < num_seqs; s++) {
        const int len = lens[s];
        if (len < 0 || len > max_blocks * block_size) {
            PyErr_Format(PyExc_ValueError, "paged attention: context length %d of sequence %d does not fit its "
                         "block table (%d blocks of %d)", len, s, max_blocks, block_size);
            return NULL;
        }
        const int used = (len + block_size - 1) / block_size;
        for (int b = 0; b < used; b++) {
            const int32_t block = tables[(size_t)s * max_blocks + b];
            if (block < 0 || block >= cache_blocks) {
                PyErr_Format(PyExc_ValueError, "paged attention: block %d of sequence %d is outside the cache "
                             "(%d blocks)", (int)block, s, cache_blocks);
                return NULL;
            }
        }
        longest = len > longest ? len : longest;
    }
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

static PyMethodDef methods[] = {
    {"decode", decode, METH_VARARGS, "Paged decode attention over fp32 K/V blocks (see the module comment)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "worker._paged_attention", NULL, -1, methods};

PyMODINIT_FUNC PyInit__paged_attention(void) { return PyModule_Create(&module); }
