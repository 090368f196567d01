/* worker._cpu_ops: the decoder's small elementwise ops on CPU, fp32, one pass each (worker/model/cpu_ops.py
 * calls them).
 *
 * At decode's few rows each torch op costs more in dispatch than in arithmetic: RMSNorm is eight ops, the
 * rotary embedding five per tensor, SiLU(gate) * up three. vLLM's CPU backend fuses them into C++ kernels;
 * these do the same, with torch's formulas in torch's order: every product and sum is rounded on its own as
 * torch's separate ops round them (setup.py builds this file with -ffp-contract=off, so no multiply-add is
 * fused). Only sums over a row (RMSNorm's mean of squares) and exp (SiLU) differ from torch, by ~1e-7
 * relative: the order of a reduction, and a polynomial in place of Sleef's.
 *
 * The caller passes raw data pointers of contiguous fp32 tensors it has checked (dtype, shape, device). The
 * GIL is released while the loops run.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "_vec.h"

/* ---- RMSNorm: out = weight * (x * rsqrt(mean(x^2) + eps)) ---- */

/* sum of x[i]^2: four vector partial sums (independent add chains; torch's reduction also sums in lanes) */
static inline __attribute__((always_inline)) float sum_of_squares(const float *x, int n) {
    f8 acc0 = {0}, acc1 = {0}, acc2 = {0}, acc3 = {0};
    int i = 0;
    for (; i + 32 <= n; i += 32) {
        const f8 a = load8(x + i), b = load8(x + i + 8), c = load8(x + i + 16), d = load8(x + i + 24);
        acc0 += a * a;
        acc1 += b * b;
        acc2 += c * c;
        acc3 += d * d;
    }
    for (; i + 8 <= n; i += 8) {
        const f8 a = load8(x + i);
        acc0 += a * a;
    }
    const f8 acc = (acc0 + acc1) + (acc2 + acc3);
    float total = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (; i < n; i++)
        total += x[i] * x[i];
    return total;
}

/* torch's RMSNorm after the sum: mean = sum / n (torch's CPU mean divides the sum), + eps, rsqrt as 1 / sqrt
 * (torch's rsqrt on CPU), then x * r and weight * that, each rounded. */
static inline __attribute__((always_inline)) void scale_row(const float *x, const float *weight, float *out, int n,
                                                            float sum, float eps) {
    const float r = 1.0f / sqrtf(sum / (float)n + eps);
    int i = 0;
    for (; i + 8 <= n; i += 8)
        store8(out + i, load8(weight + i) * (load8(x + i) * r));
    for (; i < n; i++)
        out[i] = weight[i] * (x[i] * r);
}

CLONES static void rms_norm_rows(const float *x, const float *weight, float *out, Py_ssize_t rows, int size,
                                 float eps) {
    for (Py_ssize_t r = 0; r < rows; r++) {
        const float *row = x + r * size;
        scale_row(row, weight, out + r * size, size, sum_of_squares(row, size), eps);
    }
}

/* residual += x, then x = RMSNorm(residual): the decoder's residual add and the next norm in one pass over
 * the row (vLLM's fused_add_rms_norm). */
CLONES static void add_rms_norm_rows(float *x, float *residual, const float *weight, Py_ssize_t rows, int size,
                                     float eps) {
    for (Py_ssize_t r = 0; r < rows; r++) {
        float *xr = x + r * size, *res = residual + r * size;
        int i = 0;
        for (; i + 8 <= size; i += 8)
            store8(res + i, load8(res + i) + load8(xr + i));
        for (; i < size; i++)
            res[i] += xr[i];
        scale_row(res, weight, xr, size, sum_of_squares(res, size), eps);
    }
}

/* ---- rotary embedding, rotate-half layout: x * cos + cat(-x2, x1) * sin ---- */

/* In place on every head of every token: x [tokens] rows of `heads` heads of head_dim floats, rows
 * row_stride floats apart (q and k may be views into the fused qkv projection); cos and sin [tokens,
 * head_dim]. For i < half: x1 * cos + (-x2) * sin, for the second half: x2 * cos + x1 * sin, as torch
 * computes them (two products, then their sum). */
CLONES static void rotate_heads(float *x, Py_ssize_t tokens, int heads, int head_dim, Py_ssize_t row_stride,
                                const float *cos, const float *sin) {
    const int half = head_dim / 2;
    for (Py_ssize_t t = 0; t < tokens; t++) {
        const float *c = cos + t * head_dim, *s = sin + t * head_dim;
        for (int h = 0; h < heads; h++) {
            float *lo = x + t * row_stride + (Py_ssize_t)h * head_dim, *hi = lo + half;
            int i = 0;
            for (; i + 8 <= half; i += 8) {
                const f8 a = load8(lo + i), b = load8(hi + i);
                store8(lo + i, a * load8(c + i) + (-b) * load8(s + i));
                store8(hi + i, b * load8(c + half + i) + a * load8(s + half + i));
            }
            for (; i < half; i++) {
                const float a = lo[i], b = hi[i];
                lo[i] = a * c[i] + (-b) * s[i];
                hi[i] = b * c[half + i] + a * s[half + i];
            }
        }
    }
}

/* ---- SiLU(gate) * up ---- */

/* e^x, 8 at a time, x clamped to [-87, 88] (e^x stays a normal float; SiLU below needs no more), by Cephes'
 * expf polynomial (exp_reduced8 in _vec.h, about 1 ulp). torch uses Sleef's expf (also about 1 ulp); libm's
 * scalar expf would be most of the op. */
static inline __attribute__((always_inline)) f8 exp8(f8 x) {
    const f8 zero = {0}, lowest = zero - 87.0f, highest = zero + 88.0f;
    x = select8(x < lowest, lowest, x);
    x = select8(x > highest, highest, x);
    const f8 t = x * 1.44269504088896341f;
    /* round to nearest: truncate t + 1/2 toward zero, then step down where that rounded a negative up */
    i8 n_int = __builtin_convertvector(t + 0.5f, i8);
    n_int -= (i8)(__builtin_convertvector(n_int, f8) > t + 0.5f) & 1;
    return exp_reduced8(x, n_int);
}

/* out[t] = silu(gate_up[t, :I]) * gate_up[t, I:], silu(g) = g / (1 + e^-g) as torch's CPU kernel writes it.
 * Where e^-g would overflow (g < -88) the clamp gives g / (1 + e^88), ~1e-36, for torch's -0. */
CLONES static void silu_mul_rows(const float *gate_up, float *out, Py_ssize_t rows, int inter) {
    for (Py_ssize_t r = 0; r < rows; r++) {
        const float *g = gate_up + r * 2 * inter, *u = g + inter;
        float *o = out + r * inter;
        int i = 0;
        for (; i + 8 <= inter; i += 8) {
            const f8 gv = load8(g + i);
            store8(o + i, gv / (1.0f + exp8(-gv)) * load8(u + i));
        }
        for (; i < inter; i++) {
            const float gi = g[i] < -88.0f ? -88.0f : g[i];
            o[i] = g[i] / (1.0f + expf(-gi)) * u[i];
        }
    }
}

/* ---- the Python functions: pointers as ints, sizes checked here (the caller checked dtypes and layouts) ---- */

/* rms_norm(x, weight, out, rows, size, eps) -> None */
static PyObject *rms_norm(PyObject *self, PyObject *args) {
    unsigned long long x_ptr, weight_ptr, out_ptr;
    Py_ssize_t rows;
    int size;
    float eps;
    if (!PyArg_ParseTuple(args, "KKKnif", &x_ptr, &weight_ptr, &out_ptr, &rows, &size, &eps))
        return NULL;
    if (rows < 0 || size < 1) {
        PyErr_SetString(PyExc_ValueError, "rms_norm: bad sizes");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    rms_norm_rows((const float *)(uintptr_t)x_ptr, (const float *)(uintptr_t)weight_ptr,
                  (float *)(uintptr_t)out_ptr, rows, size, eps);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* add_rms_norm(x, residual, weight, rows, size, eps) -> None; updates residual and x in place */
static PyObject *add_rms_norm(PyObject *self, PyObject *args) {
    unsigned long long x_ptr, residual_ptr, weight_ptr;
    Py_ssize_t rows;
    int size;
    float eps;
    if (!PyArg_ParseTuple(args, "KKKnif", &x_ptr, &residual_ptr, &weight_ptr, &rows, &size, &eps))
        return NULL;
    if (rows < 0 || size < 1) {
        PyErr_SetString(PyExc_ValueError, "add_rms_norm: bad sizes");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    add_rms_norm_rows((float *)(uintptr_t)x_ptr, (float *)(uintptr_t)residual_ptr,
                      (const float *)(uintptr_t)weight_ptr, rows, size, eps);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* rotary(q, k, cos, sin, tokens, heads, kv_heads, head_dim, q_row_stride, k_row_stride) -> None; q and k in place */
static PyObject *rotary(PyObject *self, PyObject *args) {
    unsigned long long q_ptr, k_ptr, cos_ptr, sin_ptr;
    Py_ssize_t tokens, q_row_stride, k_row_stride;
    int heads, kv_heads, head_dim;
    if (!PyArg_ParseTuple(args, "KKKKniiinn", &q_ptr, &k_ptr, &cos_ptr, &sin_ptr, &tokens, &heads, &kv_heads,
                          &head_dim, &q_row_stride, &k_row_stride))
        return NULL;
    if (tokens < 0 || heads < 0 || kv_heads < 0 || head_dim < 2 || head_dim % 2 != 0 ||
        q_row_stride < (Py_ssize_t)heads * head_dim || k_row_stride < (Py_ssize_t)kv_heads * head_dim) {
        PyErr_SetString(PyExc_ValueError, "rotary: bad sizes");
        return NULL;
    }
    const float *cos = (const float *)(uintptr_t)cos_ptr, *sin = (const float *)(uintptr_t)sin_ptr;
    Py_BEGIN_ALLOW_THREADS
    rotate_heads((float *)(uintptr_t)q_ptr, tokens, heads, head_dim, q_row_stride, cos, sin);
    rotate_heads((float *)(uintptr_t)k_ptr, tokens, kv_heads, head_dim, k_row_stride, cos, sin);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* silu_mul(gate_up, out, rows, intermediate) -> None */
static PyObject *silu_mul(PyObject *self, PyObject *args) {
    unsigned long long gate_up_ptr, out_ptr;
    Py_ssize_t rows;
    int inter;
    if (!PyArg_ParseTuple(args, "KKni", &gate_up_ptr, &out_ptr, &rows, &inter))
        return NULL;
    if (rows < 0 || inter < 1) {
        PyErr_SetString(PyExc_ValueError, "silu_mul: bad sizes");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    silu_mul_rows((const float *)(uintptr_t)gate_up_ptr, (float *)(uintptr_t)out_ptr, rows, inter);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"rms_norm", rms_norm, METH_VARARGS, "out = weight * x / sqrt(mean(x^2) + eps) per row, fp32."},
    {"add_rms_norm", add_rms_norm, METH_VARARGS, "residual += x; x = RMSNorm(residual), in place, fp32."},
    {"rotary", rotary, METH_VARARGS, "Rotate-half rotary embedding of q and k in place, fp32."},
    {"silu_mul", silu_mul, METH_VARARGS, "out = silu(gate) * up for gate_up = [gate | up] per row, fp32."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "worker._cpu_ops", NULL, -1, methods};

PyMODINIT_FUNC PyInit__cpu_ops(void) { return PyModule_Create(&module); }
