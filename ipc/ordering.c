/* ipc._ordering: the CPU's memory barriers for the shared-memory rings (see ipc/ordering.py).
 *
 * CPython has no acquire load, release store or fence; these are the compiler's __atomic
 * builtins, so each CPU gets its own instructions: on x86-64 plain moves and a locked
 * no-op, on aarch64 ldar, stlr and dmb ish.  Every call is also a compiler barrier.
 *
 * Words(buffer) wraps an 8-byte-aligned buffer of u64 words (a ring's header lines) and
 * holds it until release(), as a memoryview would; a released Words refuses every access
 * instead of touching unmapped memory, and one over a read-only buffer (a status reader's
 * mapping) refuses stores.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

typedef struct {
    PyObject_HEAD
    Py_buffer view;
    uint64_t *words; /* NULL once released */
    Py_ssize_t count;
} WordsObject;

static void words_drop(WordsObject *self)
{
    if (self->words != NULL) {
        self->words = NULL;
        self->count = 0;
        PyBuffer_Release(&self->view);
    }
}

static int words_init(WordsObject *self, PyObject *args, PyObject *kwds)
{
    PyObject *obj;
    if (kwds != NULL && PyDict_GET_SIZE(kwds) != 0) {
        PyErr_SetString(PyExc_TypeError, "Words() takes no keyword arguments");
        return -1;
    }
    if (!PyArg_ParseTuple(args, "O:Words", &obj))
        return -1;
    words_drop(self);
    if (PyObject_GetBuffer(obj, &self->view, PyBUF_SIMPLE) < 0)
        return -1;
    if ((uintptr_t)self->view.buf % sizeof(uint64_t) != 0 || self->view.len % sizeof(uint64_t) != 0) {
        PyBuffer_Release(&self->view);
        PyErr_SetString(PyExc_ValueError,
                        "Words needs a buffer that starts on an 8-byte boundary and holds whole u64 words");
        return -1;
    }
    self->words = (uint64_t *)self->view.buf;
    self->count = self->view.len / (Py_ssize_t)sizeof(uint64_t);
    return 0;
}

static void words_dealloc(WordsObject *self)
{
    words_drop(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* The word at index `arg`, or NULL with an exception set. */
static uint64_t *words_at(WordsObject *self, PyObject *arg)
{
    Py_ssize_t i = PyLong_AsSsize_t(arg);
    if (i == -1 && PyErr_Occurred())
        return NULL;
    if (self->words == NULL) {
        PyErr_SetString(PyExc_ValueError, "Words: released");
        return NULL;
    }
    if (i < 0 || i >= self->count) {
        PyErr_Format(PyExc_IndexError, "Words: index %zd out of range (%zd words)", i, self->count);
        return NULL;
    }
    return &self->words[i];
}

static PyObject *words_load_acquire(WordsObject *self, PyObject *arg)
{
    uint64_t *w = words_at(self, arg);
    if (w == NULL)
        return NULL;
    return PyLong_FromUnsignedLongLong(__atomic_load_n(w, __ATOMIC_ACQUIRE));
}

static PyObject *words_store_release(WordsObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "store_release(index, value) takes 2 arguments (%zd given)", nargs);
        return NULL;
    }
    uint64_t *w = words_at(self, args[0]);
    if (w == NULL)
        return NULL;
    if (self->view.readonly) {
        PyErr_SetString(PyExc_TypeError, "Words: the buffer is read-only");
        return NULL;
    }
    unsigned long long value = PyLong_AsUnsignedLongLong(args[1]);
    if (value == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    __atomic_store_n(w, (uint64_t)value, __ATOMIC_RELEASE);
    Py_RETURN_NONE;
}

static PyObject *words_release(WordsObject *self, PyObject *unused)
{
    words_drop(self);
    Py_RETURN_NONE;
}

static PyMethodDef words_methods[] = {
    {"load_acquire", (PyCFunction)words_load_acquire, METH_O,
     "load_acquire(i): word i; no later load or store of this thread is done before it."},
    {"store_release", (PyCFunction)(void (*)(void))words_store_release, METH_FASTCALL,
     "store_release(i, value): store word i after every earlier load and store of this thread."},
    {"release", (PyCFunction)words_release, METH_NOARGS,
     "release(): let go of the buffer (idempotent); later accesses raise ValueError."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject WordsType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "ipc._ordering.Words",
    .tp_basicsize = sizeof(WordsObject),
    .tp_dealloc = (destructor)words_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Words(buffer): acquire loads and release stores of the u64 words of a writable buffer.",
    .tp_methods = words_methods,
    .tp_init = (initproc)words_init,
    .tp_new = PyType_GenericNew,
};

static PyObject *ordering_fence(PyObject *module, PyObject *unused)
{
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    Py_RETURN_NONE;
}

static PyMethodDef ordering_methods[] = {
    {"fence", ordering_fence, METH_NOARGS,
     "fence(): full barrier; no store before it is ordered after a load behind it."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef ordering_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "ipc._ordering",
    .m_doc = "Acquire loads, release stores and a full fence.",
    .m_size = -1,
    .m_methods = ordering_methods,
};

PyMODINIT_FUNC PyInit__ordering(void)
{
    if (PyType_Ready(&WordsType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&ordering_module);
    if (m == NULL)
        return NULL;
    /* Lock-free 8-byte atomics are plain instructions on shared memory; otherwise the
     * builtins would take a lock private to this process, which orders nothing between
     * processes. */
    if (PyModule_AddObjectRef(m, "LOCK_FREE_U64",
                              __atomic_always_lock_free(sizeof(uint64_t), 0) ? Py_True : Py_False) < 0
        || PyModule_AddObjectRef(m, "Words", (PyObject *)&WordsType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
