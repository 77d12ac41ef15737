/*
 * lmcache_core._speedups: optional compiled helpers of the pure-Python core.
 *
 * Built by `pip install` when a C compiler is present (setup.py marks the extension
 * optional: a failed build leaves the pure-Python path, which gives identical results).
 * Every function here answers only the common case and returns None for anything else,
 * so the Python caller keeps one place for input rules and error messages.
 *
 * int32_le(tokens) -> bytes | None
 *     The int32 little-endian bytes of a list or tuple of token ids, when every element
 *     is an exact Python int in [-2**31, 2**31); None otherwise (another sequence type,
 *     a bool, a numpy integer scalar, an id out of range, anything else). No Python code
 *     runs while it reads the sequence (exact ints only), so the list cannot change
 *     under it.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

static PyObject *
int32_le(PyObject *module, PyObject *tokens)
{
    (void)module;
    Py_ssize_t n;
    PyObject **items;
    if (PyList_CheckExact(tokens)) {
        n = PyList_GET_SIZE(tokens);
        items = ((PyListObject *)tokens)->ob_item;
    } else if (PyTuple_CheckExact(tokens)) {
        n = PyTuple_GET_SIZE(tokens);
        items = ((PyTupleObject *)tokens)->ob_item;
    } else {
        Py_RETURN_NONE;
    }
    if (n > PY_SSIZE_T_MAX / 4) {
        Py_RETURN_NONE;
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, n * 4);
    if (out == NULL) {
        return NULL;
    }
    unsigned char *p = (unsigned char *)PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = items[i];
        if (!PyLong_CheckExact(item)) {
            goto decline;
        }
        int overflow = 0;
        long v = PyLong_AsLongAndOverflow(item, &overflow);
        if (overflow != 0 || v < INT32_MIN || v > INT32_MAX) {
            goto decline;
        }
        uint32_t u = (uint32_t)(int32_t)v;
        p[0] = (unsigned char)u;
        p[1] = (unsigned char)(u >> 8);
        p[2] = (unsigned char)(u >> 16);
        p[3] = (unsigned char)(u >> 24);
        p += 4;
    }
    return out;

decline:
    Py_DECREF(out);
    Py_RETURN_NONE;
}

static PyMethodDef speedups_methods[] = {
    {"int32_le", int32_le, METH_O,
     "int32_le(tokens) -> bytes | None: int32 little-endian bytes of a list or tuple of "
     "exact ints in the int32 range; None for any other input."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef speedups_module = {
    PyModuleDef_HEAD_INIT,
    "lmcache_core._speedups",
    "Optional compiled helpers of lmcache_core (pure-Python fallbacks give identical results).",
    0,
    speedups_methods,
    NULL,
    NULL,
    NULL,
    NULL,
};

PyMODINIT_FUNC
PyInit__speedups(void)
{
    return PyModuleDef_Init(&speedups_module);
}
