/* router._blockhash: the chained block keys of router/block_keys.py in one C call.
 *
 *   key_0 = xxh3_64(u64le(parent) || block_0),  key_i = xxh3_64(u64le(key_{i-1}) || block_i)
 *
 * where block_i is 4*block_size bytes of the packed (u32le) prompt. xxh3_64 is XXH3_64bits with
 * seed 0 and the default 192-byte secret (xxhash.xxh3_64_intdigest), written here from the
 * published XXH3 algorithm: all length classes (0, 1-3, 4-8, 9-16, 17-128, 129-240 and the
 * striped long path), scalar code, little-endian reads through memcpy.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

typedef uint64_t u64;
typedef uint32_t u32;
typedef uint8_t u8;

/* ---------------------------------------------------------------- constants */

#define P32_1 0x9E3779B1U
#define P32_2 0x85EBCA77U
#define P32_3 0xC2B2AE3DU
#define P64_1 0x9E3779B185EBCA87ULL
#define P64_2 0xC2B2AE3D27D4EB4FULL
#define P64_3 0x165667B19E3779F9ULL
#define P64_4 0x85EBCA77C2B2AE63ULL
#define P64_5 0x27D4EB2F165667C5ULL
#define PMX_1 0x165667919E3779F9ULL
#define PMX_2 0x9FB21C651E98DF25ULL

#define SECRET_LEN 192       /* the default secret */
#define SECRET_LEN_MIN 136   /* the 129-240 path indexes its last read from this, not from 192 */
#define STRIPE 64            /* bytes per stripe of the long path */
#define SECRET_STEP 8        /* secret bytes consumed per stripe */
#define MID_START 3          /* 129-240: secret offset of rounds 8.. */
#define MID_LAST 17          /* 129-240: the last 16 bytes use secret[136 - 17] */
#define LAST_STRIPE_SHIFT 7  /* long: the last stripe uses secret[192 - 64 - 7] */
#define MERGE_START 11       /* long: the final merge uses secret[11..75] */

static const u8 kSecret[SECRET_LEN] = {
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
};

/* ---------------------------------------------------------------- primitives */

static inline u32 rd32(const u8 *p) {
    u32 v;
    memcpy(&v, p, sizeof v);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap32(v);
#endif
    return v;
}

static inline u64 rd64(const u8 *p) {
    u64 v;
    memcpy(&v, p, sizeof v);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap64(v);
#endif
    return v;
}

static inline void wr64(u8 *p, u64 v) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap64(v);
#endif
    memcpy(p, &v, sizeof v);
}

static inline u64 rotl64(u64 x, int r) { return (x << r) | (x >> (64 - r)); }

/* 64x64 -> 128-bit product, folded: low half xor high half */
static inline u64 mulfold(u64 a, u64 b) {
    __uint128_t m = (__uint128_t)a * b;
    return (u64)m ^ (u64)(m >> 64);
}

/* the XXH64 finalizer (lengths 0-3) */
static inline u64 fmix_xxh64(u64 h) {
    h ^= h >> 33;
    h *= P64_2;
    h ^= h >> 29;
    h *= P64_3;
    h ^= h >> 32;
    return h;
}

/* the XXH3 finalizer (lengths 9-240 and the long path) */
static inline u64 fmix_xxh3(u64 h) {
    h ^= h >> 37;
    h *= PMX_1;
    h ^= h >> 32;
    return h;
}

/* the stronger finalizer of lengths 4-8 ("rrmxmx") */
static inline u64 fmix_rrmxmx(u64 h, u64 len) {
    h ^= rotl64(h, 49) ^ rotl64(h, 24);
    h *= PMX_2;
    h ^= (h >> 35) + len;
    h *= PMX_2;
    h ^= h >> 28;
    return h;
}

/* 16 input bytes against 16 secret bytes (seed 0) */
static inline u64 mix16(const u8 *in, const u8 *sec) {
    return mulfold(rd64(in) ^ rd64(sec), rd64(in + 8) ^ rd64(sec + 8));
}

/* ---------------------------------------------------------------- short inputs (0-16) */

static inline u64 h_0to16(const u8 *in, size_t len) {
    if (len > 8) {
        u64 lo = rd64(in) ^ (rd64(kSecret + 24) ^ rd64(kSecret + 32));
        u64 hi = rd64(in + len - 8) ^ (rd64(kSecret + 40) ^ rd64(kSecret + 48));
        u64 acc = (u64)len + __builtin_bswap64(lo) + hi + mulfold(lo, hi);
        return fmix_xxh3(acc);
    }
    if (len >= 4) {
        u64 first = rd32(in), last = rd32(in + len - 4);
        u64 keyed = (last + (first << 32)) ^ (rd64(kSecret + 8) ^ rd64(kSecret + 16));
        return fmix_rrmxmx(keyed, (u64)len);
    }
    if (len > 0) {
        u32 packed = ((u32)in[0] << 16) | ((u32)in[len >> 1] << 24) | (u32)in[len - 1] | ((u32)len << 8);
        u64 flip = (u64)(rd32(kSecret) ^ rd32(kSecret + 4));
        return fmix_xxh64((u64)packed ^ flip);
    }
    return fmix_xxh64(rd64(kSecret + 56) ^ rd64(kSecret + 64));
}

/* ---------------------------------------------------------------- 17-128 */

static inline u64 h_17to128(const u8 *in, size_t len) {
    u64 acc = (u64)len * P64_1;
    if (len > 32) {
        if (len > 64) {
            if (len > 96) {
                acc += mix16(in + 48, kSecret + 96);
                acc += mix16(in + len - 64, kSecret + 112);
            }
            acc += mix16(in + 32, kSecret + 64);
            acc += mix16(in + len - 48, kSecret + 80);
        }
        acc += mix16(in + 16, kSecret + 32);
        acc += mix16(in + len - 32, kSecret + 48);
    }
    acc += mix16(in, kSecret);
    acc += mix16(in + len - 16, kSecret + 16);
    return fmix_xxh3(acc);
}

/* ---------------------------------------------------------------- 129-240 */

static u64 h_129to240(const u8 *in, size_t len) {
    size_t rounds = len / 16, i;
    u64 acc = (u64)len * P64_1;
    for (i = 0; i < 8; i++)
        acc += mix16(in + 16 * i, kSecret + 16 * i);
    acc = fmix_xxh3(acc);
    for (i = 8; i < rounds; i++)
        acc += mix16(in + 16 * i, kSecret + 16 * (i - 8) + MID_START);
    acc += mix16(in + len - 16, kSecret + SECRET_LEN_MIN - MID_LAST);
    return fmix_xxh3(acc);
}

/* ---------------------------------------------------------------- long inputs (> 240) */

/* one 64-byte stripe into the 8 accumulators */
static inline void stripe(u64 acc[8], const u8 *in, const u8 *sec) {
    for (int i = 0; i < 8; i++) {
        u64 v = rd64(in + 8 * i);
        u64 k = v ^ rd64(sec + 8 * i);
        acc[i ^ 1] += v;
        acc[i] += (u64)(u32)k * (k >> 32);
    }
}

static inline void scramble(u64 acc[8], const u8 *sec) {
    for (int i = 0; i < 8; i++) {
        u64 a = acc[i];
        a ^= a >> 47;
        a ^= rd64(sec + 8 * i);
        a *= P32_1;
        acc[i] = a;
    }
}

static u64 h_long(const u8 *in, size_t len) {
    u64 acc[8] = {P32_3, P64_1, P64_2, P64_3, P64_4, P32_2, P64_5, P32_1};
    const size_t per_block = (SECRET_LEN - STRIPE) / SECRET_STEP; /* 16 stripes */
    const size_t block_len = STRIPE * per_block;                  /* 1024 bytes */
    const size_t blocks = (len - 1) / block_len;
    size_t b, s, tail_stripes;

    for (b = 0; b < blocks; b++) {
        const u8 *blk = in + b * block_len;
        for (s = 0; s < per_block; s++)
            stripe(acc, blk + s * STRIPE, kSecret + s * SECRET_STEP);
        scramble(acc, kSecret + SECRET_LEN - STRIPE);
    }
    /* the last, partial block (its final stripe is always handled below) */
    tail_stripes = ((len - 1) - block_len * blocks) / STRIPE;
    for (s = 0; s < tail_stripes; s++)
        stripe(acc, in + blocks * block_len + s * STRIPE, kSecret + s * SECRET_STEP);
    /* the last 64 bytes of input (overlapping what came before) */
    stripe(acc, in + len - STRIPE, kSecret + SECRET_LEN - STRIPE - LAST_STRIPE_SHIFT);

    /* merge the accumulators */
    u64 h = (u64)len * P64_1;
    for (int i = 0; i < 4; i++) {
        const u8 *sec = kSecret + MERGE_START + 16 * i;
        h += mulfold(acc[2 * i] ^ rd64(sec), acc[2 * i + 1] ^ rd64(sec + 8));
    }
    return fmix_xxh3(h);
}

static inline u64 xxh3_64(const u8 *in, size_t len) {
    if (len <= 16)
        return h_0to16(in, len);
    if (len <= 128)
        return h_17to128(in, len);
    if (len <= 240)
        return h_129to240(in, len);
    return h_long(in, len);
}

/* ---------------------------------------------------------------- Python bindings */

/* obj (anything with __index__) as a u64; OverflowError outside 0..2**64-1 */
static int as_u64(PyObject *obj, u64 *out) {
    PyObject *idx = PyNumber_Index(obj);
    if (idx == NULL)
        return -1;
    unsigned long long v = PyLong_AsUnsignedLongLong(idx); /* OverflowError if < 0 or >= 2**64 */
    Py_DECREF(idx);
    if (v == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    *out = (u64)v;
    return 0;
}

/* The key list of blocks of `stride` bytes; buf has room for 8 + stride bytes. */
static PyObject *chain_into_list(const u8 *data, Py_ssize_t nblocks, size_t stride, u64 key, u8 *buf) {
    PyObject *list = PyList_New(nblocks);
    if (list == NULL)
        return NULL;
    const size_t len = 8 + stride;
    for (Py_ssize_t i = 0; i < nblocks; i++) {
        wr64(buf, key);
        memcpy(buf + 8, data + (size_t)i * stride, stride);
        key = xxh3_64(buf, len);
        PyObject *item = PyLong_FromUnsignedLongLong(key);
        if (item == NULL) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, i, item);
    }
    return list;
}

#define STACK_BUF 1032 /* 8 + 4*256: block sizes up to 256 tokens hash from the stack */

PyDoc_STRVAR(chain_keys_doc,
"chain_keys(packed, block_size, parent_key, /) -> list[int]\n\n"
"Keys of the full blocks of packed (u32le tokens, 4*block_size bytes a block): "
"key_i = xxh3_64(u64le(key_{i-1}) || block_i), key_{-1} = parent_key. "
"A trailing partial block has no key.");

static PyObject *chain_keys(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 3) {
        PyErr_Format(PyExc_TypeError, "chain_keys() takes exactly 3 arguments (%zd given)", nargs);
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0)
        return NULL;

    PyObject *result = NULL;
    u8 stack_buf[STACK_BUF];
    u8 *heap_buf = NULL;
    u64 parent;
    int overflow = 0;

    PyObject *bs_obj = PyNumber_Index(args[1]);
    if (bs_obj == NULL)
        goto done;
    long long block_size = PyLong_AsLongLongAndOverflow(bs_obj, &overflow);
    Py_DECREF(bs_obj);
    if (block_size == -1 && PyErr_Occurred())
        goto done;
    if (overflow < 0 || (!overflow && block_size < 1)) {
        PyErr_SetString(PyExc_ValueError, "block_size must be >= 1");
        goto done;
    }
    if (as_u64(args[2], &parent) < 0)
        goto done;

    /* a block longer than the input (or than any input could be) leaves no full block */
    const Py_ssize_t len = view.len;
    if (overflow > 0 || block_size > (long long)(len / 4)) {
        result = PyList_New(0);
        goto done;
    }
    const size_t stride = 4 * (size_t)block_size;
    const Py_ssize_t nblocks = (Py_ssize_t)((size_t)len / stride);
    u8 *buf = stack_buf;
    if (8 + stride > sizeof stack_buf) {
        buf = heap_buf = PyMem_Malloc(8 + stride);
        if (buf == NULL) {
            PyErr_NoMemory();
            goto done;
        }
    }
    result = chain_into_list((const u8 *)view.buf, nblocks, stride, parent, buf);

done:
    PyMem_Free(heap_buf);
    PyBuffer_Release(&view);
    return result;
}

PyDoc_STRVAR(xxh3_64_doc,
"xxh3_64(data, /) -> int\n\n"
"XXH3_64bits of a bytes-like object (seed 0, default secret): xxhash.xxh3_64_intdigest(data).");

static PyObject *py_xxh3_64(PyObject *module, PyObject *arg) {
    (void)module;
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    u64 h = xxh3_64((const u8 *)view.buf, (size_t)view.len);
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLongLong(h);
}

/* An exact int small enough to be stored in one digit: its value, without PyLong_AsUnsignedLong's
 * checks (about a third of pack_u32's time for 8,192 tokens). */
static inline int small_int(PyObject *obj, long *value) {
    if (!PyLong_CheckExact(obj))
        return 0;
#if PY_VERSION_HEX >= 0x030C0000
    if (!PyUnstable_Long_IsCompact((PyLongObject *)obj))
        return 0;
    *value = (long)PyUnstable_Long_CompactValue((PyLongObject *)obj);
    return 1;
#else
    const Py_ssize_t size = Py_SIZE(obj);
    if (size < -1 || size > 1)
        return 0;
    *value = size * (long)((PyLongObject *)obj)->ob_digit[0];
    return 1;
#endif
}

PyDoc_STRVAR(pack_u32_doc,
"pack_u32(token_ids, /) -> bytes\n\n"
"A list or tuple of ints as consecutive u32 little-endian values: array('I', token_ids).tobytes() "
"on a little-endian host, without the intermediate array. OverflowError for a value outside "
"[0, 2**32), TypeError for something that is not an int (or int-like, with __index__).");

static PyObject *pack_u32(PyObject *module, PyObject *seq) {
    (void)module;
    if (!PyList_Check(seq) && !PyTuple_Check(seq)) {
        PyErr_SetString(PyExc_TypeError, "pack_u32() takes a list or a tuple of ints");
        return NULL;
    }
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject *out = PyBytes_FromStringAndSize(NULL, 4 * n);
    if (out == NULL)
        return NULL;
    u8 *dst = (u8 *)PyBytes_AS_STRING(out);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = items[i];
        unsigned long v;
        long small;
        if (small_int(item, &small)) { /* the usual token id: one digit, read in place */
            if (small < 0) {
                PyErr_SetString(PyExc_OverflowError, "can't convert negative value to unsigned int");
                Py_DECREF(out);
                return NULL;
            }
            v = (unsigned long)small;
        } else if (PyLong_Check(item)) {
            v = PyLong_AsUnsignedLong(item); /* OverflowError if negative */
        } else { /* an int-like object (numpy integer): its __index__, as array('I') takes it */
            Py_INCREF(item);
            PyObject *index = PyNumber_Index(item);
            Py_DECREF(item);
            if (index == NULL) {
                Py_DECREF(out);
                return NULL;
            }
            v = PyLong_AsUnsignedLong(index);
            Py_DECREF(index);
            /* __index__ ran Python code, which may have resized the list under us */
            if (PySequence_Fast_GET_SIZE(seq) != n) {
                PyErr_SetString(PyExc_RuntimeError, "the token list changed while it was being packed");
                Py_DECREF(out);
                return NULL;
            }
            items = PySequence_Fast_ITEMS(seq);
        }
        if (v == (unsigned long)-1 && PyErr_Occurred()) {
            Py_DECREF(out);
            return NULL;
        }
        if (v > 0xFFFFFFFFUL) {
            PyErr_SetString(PyExc_OverflowError, "token id does not fit in an unsigned 32-bit int");
            Py_DECREF(out);
            return NULL;
        }
        const u32 v32 = (u32)v;
        dst[4 * i] = (u8)v32;
        dst[4 * i + 1] = (u8)(v32 >> 8);
        dst[4 * i + 2] = (u8)(v32 >> 16);
        dst[4 * i + 3] = (u8)(v32 >> 24);
    }
    return out;
}

static PyMethodDef methods[] = {
    {"chain_keys", (PyCFunction)(void (*)(void))chain_keys, METH_FASTCALL, chain_keys_doc},
    {"xxh3_64", (PyCFunction)py_xxh3_64, METH_O, xxh3_64_doc},
    {"pack_u32", (PyCFunction)pack_u32, METH_O, pack_u32_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "router._blockhash",
    .m_doc = "Chained xxh3_64 block keys (see router/block_keys.py), computed in C.",
    .m_size = 0,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__blockhash(void) { return PyModuleDef_Init(&module_def); }
