/* A host-only timers object in C, for bench/native_floor.py only: what Megatron's call shape
 * ``timers(name, log_level).start()`` / ``.stop()`` costs when the hot path's state is C memory instead of
 * Python objects. Host clock, one ring slot of plain integers per interval; no device events, no readout, no
 * log-level check. Not part of otel_straggler. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>

#define CAP 8192
static int64_t ring_start[CAP], ring_end[CAP];
static int32_t ring_timer[CAP];
static uint64_t ring_head = 0;

static inline int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

typedef struct {
    PyObject_HEAD
    int started;
    int clock; /* 0: a counter instead of the clock (what the clock read costs in situ) */
    int32_t id;
    int64_t t0;
    int64_t elapsed;
    uint64_t unbalanced;
} TimerObject;

static PyObject *Timer_start(PyObject *op, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    TimerObject *self = (TimerObject *)op;
    if (self->started) {
        self->unbalanced++;
        Py_RETURN_NONE;
    }
    self->started = 1;
    self->t0 = self->clock ? now_ns() : (int64_t)ring_head;
    Py_RETURN_NONE;
}

static PyObject *Timer_stop(PyObject *op, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    TimerObject *self = (TimerObject *)op;
    if (!self->started) {
        self->unbalanced++;
        Py_RETURN_NONE;
    }
    int64_t t = self->clock ? now_ns() : (int64_t)ring_head + 1;
    self->started = 0;
    self->elapsed += t - self->t0;
    uint64_t i = ring_head & (CAP - 1);
    ring_start[i] = self->t0;
    ring_end[i] = t;
    ring_timer[i] = self->id;
    ring_head++;
    Py_RETURN_NONE;
}

static PyMethodDef Timer_methods[] = {
    {"start", (PyCFunction)(void (*)(void))Timer_start, METH_FASTCALL | METH_KEYWORDS, NULL},
    {"stop", (PyCFunction)(void (*)(void))Timer_stop, METH_FASTCALL | METH_KEYWORDS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject TimerType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "floor.Timer",
    .tp_basicsize = sizeof(TimerObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_methods = Timer_methods,
};

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *timers;
    int32_t next_id;
    int clock;
} TimersObject;

static PyObject *Timers_vcall(PyObject *callable, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    TimersObject *self = (TimersObject *)callable;
    if (PyVectorcall_NARGS(nargsf) < 1) {
        PyErr_SetString(PyExc_TypeError, "timers(name, log_level=None)");
        return NULL;
    }
    PyObject *t = PyDict_GetItemWithError(self->timers, args[0]);
    if (t != NULL) {
        Py_INCREF(t);
        return t;
    }
    if (PyErr_Occurred())
        return NULL;
    TimerObject *nt = PyObject_New(TimerObject, &TimerType);
    if (nt == NULL)
        return NULL;
    nt->started = 0;
    nt->clock = self->clock;
    nt->id = self->next_id++;
    nt->t0 = 0;
    nt->elapsed = 0;
    nt->unbalanced = 0;
    if (PyDict_SetItem(self->timers, args[0], (PyObject *)nt) < 0) {
        Py_DECREF(nt);
        return NULL;
    }
    return (PyObject *)nt;
}

static PyObject *Timers_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"clock", NULL};
    int clock = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|p", kwlist, &clock))
        return NULL;
    TimersObject *self = (TimersObject *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->clock = clock;
    self->vectorcall = Timers_vcall;
    self->timers = PyDict_New();
    self->next_id = 0;
    if (self->timers == NULL) {
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

static PyObject *Timers_intervals(PyObject *op, PyObject *unused) {
    return PyLong_FromUnsignedLongLong(ring_head);
}

static PyMethodDef Timers_methods[] = {
    {"intervals", Timers_intervals, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject TimersType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "floor.Timers",
    .tp_basicsize = sizeof(TimersObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_vectorcall_offset = offsetof(TimersObject, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_new = Timers_new,
    .tp_methods = Timers_methods,
};

static struct PyModuleDef floor_module = {PyModuleDef_HEAD_INIT, "floor", NULL, -1, NULL};

PyMODINIT_FUNC PyInit_floor(void) {
    if (PyType_Ready(&TimerType) < 0 || PyType_Ready(&TimersType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&floor_module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&TimersType);
    if (PyModule_AddObject(m, "Timers", (PyObject *)&TimersType) < 0) {
        Py_DECREF(&TimersType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
