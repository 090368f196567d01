/* router._mask_lookup: MaskTable.prefix_holders (router/mask_table.py) in one C call, and the
 * common cases of MaskTable.add_bits (the KV-event path) on a one-word table.
 *
 * The table is MaskTable's numpy array: a power-of-two number of rows [key, mask word 0 .. W-1]
 * (uint64). A key's candidate rows are its low and its high 32 bits & (rows - 1); the key is in
 * the second if that row's key equals it, else in the first if that one does, else absent (a
 * free row holds a filler key that cannot hash to it, so it never matches). The overflow dict of
 * the Python class is not seen here: MaskTable calls this only while that dict is empty.
 *
 * For the leading keys of a prompt this walks the running AND of their masks and reports every
 * bit set in the first key's mask with the number of leading keys that all have it: the same
 * (bits, lengths) pairs as prefix_holders_of, in increasing bit order per length.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>

typedef uint64_t u64;

#define STACK_WORDS 16 /* masks of up to 1,024 workers need no heap buffer */

/* Append (bit, length) for every bit set in `bits` of word w. */
static int emit(u64 bits, Py_ssize_t w, Py_ssize_t length, PyObject *out_bits, PyObject *out_lengths) {
    while (bits) {
        const int low = __builtin_ctzll(bits);
        bits &= bits - 1;
        PyObject *bit = PyLong_FromSsize_t(w * 64 + low);
        PyObject *len = PyLong_FromSsize_t(length);
        int failed = bit == NULL || len == NULL || PyList_Append(out_bits, bit) < 0 ||
                     PyList_Append(out_lengths, len) < 0;
        Py_XDECREF(bit);
        Py_XDECREF(len);
        if (failed)
            return -1;
    }
    return 0;
}

/* The row holding key, or NULL. */
static inline const u64 *find_row(const u64 *tab, size_t row_len, u64 slot_mask, u64 key) {
    const u64 *second = tab + ((key >> 32) & slot_mask) * row_len;
    if (second[0] == key)
        return second;
    const u64 *first = tab + (key & 0xFFFFFFFFULL & slot_mask) * row_len;
    return first[0] == key ? first : NULL;
}

static int walk(const u64 *tab, size_t row_len, u64 slot_mask, PyObject *keys, u64 *held, PyObject *out_bits,
                PyObject *out_lengths) {
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(keys);
    PyObject **items = PySequence_Fast_ITEMS(keys);
    const size_t words = row_len - 1;
    Py_ssize_t length = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        const unsigned long long key = PyLong_AsUnsignedLongLong(items[i]);
        if (key == (unsigned long long)-1 && PyErr_Occurred())
            return -1;
        const u64 *row = find_row(tab, row_len, slot_mask, (u64)key);
        if (row == NULL)
            break; /* nothing holds this key, so nothing holds a longer prefix */
        u64 any = 0;
        for (size_t w = 0; w < words; w++) {
            const u64 now = i ? held[w] & row[1 + w] : row[1 + w];
            if (i && emit(held[w] & ~now, (Py_ssize_t)w, i, out_bits, out_lengths) < 0)
                return -1;
            held[w] = now;
            any |= now;
        }
        if (!any) /* every bit of the first key was lost by now */
            return 0;
        length = i + 1;
    }
    for (size_t w = 0; w < words && length; w++)
        if (emit(held[w], (Py_ssize_t)w, length, out_bits, out_lengths) < 0)
            return -1;
    return 0;
}

PyDoc_STRVAR(prefix_holders_doc,
"prefix_holders(table, keys, /) -> (list[int], list[int])\n\n"
"table: MaskTable's C-contiguous (2**k, 1 + W) uint64 array; keys: a list or tuple of ints in "
"[0, 2**64). Every bit set in keys[0]'s mask and how many leading keys all have it.");

static PyObject *prefix_holders(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "prefix_holders() takes exactly 2 arguments (%zd given)", nargs);
        return NULL;
    }
    PyObject *keys = args[1];
    if (!PyList_Check(keys) && !PyTuple_Check(keys)) {
        PyErr_SetString(PyExc_TypeError, "prefix_holders() takes the keys as a list or a tuple");
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return NULL;
    PyObject *out_bits = NULL, *out_lengths = NULL, *result = NULL;
    u64 stack_held[STACK_WORDS];
    u64 *held = stack_held;
    if (view.ndim != 2 || view.itemsize != 8 || view.shape[1] < 2 || view.shape[0] < 1 ||
        (view.shape[0] & (view.shape[0] - 1)) != 0) {
        PyErr_SetString(PyExc_ValueError, "table must be a C-contiguous (2**k, 1 + words) uint64 array");
        goto done;
    }
    const size_t row_len = (size_t)view.shape[1];
    if (row_len - 1 > STACK_WORDS && (held = PyMem_Malloc((row_len - 1) * sizeof(u64))) == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    out_bits = PyList_New(0);
    out_lengths = PyList_New(0);
    if (out_bits == NULL || out_lengths == NULL)
        goto done;
    if (walk((const u64 *)view.buf, row_len, (u64)view.shape[0] - 1, keys, held, out_bits, out_lengths) < 0)
        goto done;
    result = PyTuple_Pack(2, out_bits, out_lengths);

done:
    if (held != stack_held)
        PyMem_Free(held);
    Py_XDECREF(out_bits);
    Py_XDECREF(out_lengths);
    PyBuffer_Release(&view);
    return result;
}

#define FILL 0x100000001ULL /* a free row s holds the filler (s ^ 1) * FILL, which cannot hash to s */

PyDoc_STRVAR(add_bits_doc,
"add_bits(table, key, bits, may_insert, /) -> int\n\n"
"MaskTable.add_bits on a one-word table (rows [key, mask]): OR bits into key's mask. Returns the "
"previous mask if the key was there; -2 if it was absent and went into a free candidate row "
"(only with may_insert and bits != 0); -1 if the Python path must do it (absent without a free "
"candidate row or without may_insert, or a key that is not a u64).");

static PyObject *add_bits(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 4) {
        PyErr_Format(PyExc_TypeError, "add_bits() takes exactly 4 arguments (%zd given)", nargs);
        return NULL;
    }
    const unsigned long long key = PyLong_AsUnsignedLongLong(args[1]);
    if (key == (unsigned long long)-1 && PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_OverflowError) && !PyErr_ExceptionMatches(PyExc_TypeError))
            return NULL;
        PyErr_Clear(); /* not a u64: the Python path raises the error it documents */
        return PyLong_FromLong(-1);
    }
    const unsigned long long bits = PyLong_AsUnsignedLongLong(args[2]);
    if (bits == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    const int may_insert = PyObject_IsTrue(args[3]);
    if (may_insert < 0)
        return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_WRITABLE) < 0)
        return NULL;
    PyObject *result = NULL;
    if (view.ndim != 2 || view.itemsize != 8 || view.shape[1] != 2 || view.shape[0] < 1 ||
        (view.shape[0] & (view.shape[0] - 1)) != 0) {
        PyErr_SetString(PyExc_ValueError, "table must be a C-contiguous (2**k, 2) uint64 array");
        goto done;
    }
    u64 *tab = (u64 *)view.buf;
    const u64 slot_mask = (u64)view.shape[0] - 1;
    const u64 s1 = key & 0xFFFFFFFFULL & slot_mask, s2 = (key >> 32) & slot_mask;
    u64 *row = tab[2 * s1] == key ? tab + 2 * s1 : tab[2 * s2] == key ? tab + 2 * s2 : NULL;
    if (row != NULL) {
        const u64 prev = row[1];
        row[1] = prev | bits;
        result = PyLong_FromUnsignedLongLong(prev);
    } else if (may_insert && bits) {
        row = tab[2 * s1] == (s1 ^ 1) * FILL ? tab + 2 * s1 : tab[2 * s2] == (s2 ^ 1) * FILL ? tab + 2 * s2 : NULL;
        if (row != NULL) {
            row[0] = key;
            row[1] = bits;
        }
        result = PyLong_FromLong(row != NULL ? -2 : -1);
    } else {
        result = PyLong_FromLong(-1);
    }
done:
    PyBuffer_Release(&view);
    return result;
}

static PyMethodDef methods[] = {
    {"prefix_holders", (PyCFunction)(void (*)(void))prefix_holders, METH_FASTCALL, prefix_holders_doc},
    {"add_bits", (PyCFunction)(void (*)(void))add_bits, METH_FASTCALL, add_bits_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "router._mask_lookup",
    .m_doc = "MaskTable.prefix_holders and add_bits (see router/mask_table.py), computed in C.",
    .m_size = 0,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__mask_lookup(void) { return PyModuleDef_Init(&module_def); }
