/* The training thread's hot path in C: Timer.start / Timer.stop over the ring's byte records, and the readout's
 * drain of those records into the wire's.
 *
 * Why: between a step's kernel launches a start+stop of the Python timers finds its bytecode, inline caches and
 * objects evicted, and pays for the cache lines it touches, several times its tight-loop cost
 * (bench/results/cpu-native-floor.md, bench/results/cpu-hot-path-ab.md, bench/results/gpu-h200.md). Here the same
 * logic reads and writes C fields and one 64-byte record.
 *
 * What: the types of its Python twin, _hotpath_py.py (same names, fields and order; hot_path.py picks one), so
 * every other part of the package (the readout thread, StepContext's sampling logic, Timer's Megatron API, the
 * tests) reads and writes them unchanged:
 *   HotCounters   (the training thread's four counters, C fields; counters.py EmitterCounters derives from it)
 *   EventTable    (the pool's events by id, event_pool.py; refs, tag, tainted, handle: Python arrays read and
 *                  written here through their buffers)
 *   Ring          (the single-producer single-consumer ring of ring.py's records: a bytearray)
 *   SharedEvent   (the latest boundary's event, reused by adjacent boundaries)
 *   StepState     (the fields the hot path reads; step_context.py StepContext derives from it)
 *   TimerCore     (a timer's state and start/stop; timers.py Timer derives from it)
 *   TimersCore    (timers(name, log_level): an existing timer found in C)
 * No Python object lives in a record: the timer, the events and the degraded reason are integer ids into
 * Python-owned tables. The logic is the Python path's, line for line (_hotpath_py.py, readout.py); the emitter
 * tests run against both, and a seeded differential test compares their records and frames byte for byte
 * (tests/emitter/test_hot_path_parity.py). Only CPython's public C API is used.
 *
 * Rules kept from the Python path: no lock, no I/O, no device call other than the record; every Exception
 * inside start/stop is cleared and counted (faults_training), never raised into training; a KeyboardInterrupt or
 * SystemExit (a signal handler run by Python code this calls) propagates, and the call lets go of the events it
 * held (abandon). An object used across a call into Python is held by a strong reference. Everything runs with
 * the GIL held (Py_mod_gil), which is what orders the producer's record writes before its head store for the
 * readout thread.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the ring's and the wire's records are little-endian (ring.py, records.py)"
#endif

#define NO_REUSE (-(1LL << 62))
#define NO_EVENT 0xFFFF

/* interned attribute and method names */
static PyObject *s_apply, *s_step_timer_started, *s_append, *s_popleft, *s_barrier, *s_get, *s_log_level;
/* the degraded reasons' codes and names (counters.REASONS: code -> name), set once by set_reasons() */
static int r_sampled_out = 2, r_cuda_error = 5, r_pool_exhausted = 3;
static PyObject *reason_names;

typedef int (*cu_event_record_fn)(void *event, void *stream);

static inline long long mono_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts); /* time.perf_counter_ns on Linux */
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static inline int is_set(PyObject *o) { return o != NULL && o != Py_None; }

/* an exception that is not an Exception (KeyboardInterrupt, SystemExit: a signal handler raised it in Python code
 * this called) is the program's: it propagates, and the caller lets go of what the call took (abandon) */
static inline int users(void) { return PyErr_Occurred() && !PyErr_ExceptionMatches(PyExc_Exception); }

static int call_append(PyObject *dq, long id) {
    PyObject *item = PyLong_FromLong(id);
    if (item == NULL) return -1;
    PyObject *args[3] = {NULL, dq, item}; /* args[0]: the slot PY_VECTORCALL_ARGUMENTS_OFFSET lets the callee use */
    PyObject *r = PyObject_VectorcallMethod(s_append, args + 1, 2 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
    Py_DECREF(item);
    if (r == NULL) return -1;
    Py_DECREF(r);
    return 0;
}

/* start(barrier=False) / stop(barrier=False): 1 or 0; -1 with TypeError on other arguments (raised to the caller, as
 * Python raises a call-shape error before the method runs); -2 when bool(barrier) raised */
static int parse_barrier(PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    PyObject *b = NULL;
    Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    if (nargs > 1 || nargs + nkw > 1) {
        PyErr_SetString(PyExc_TypeError, "takes at most one argument (barrier)");
        return -1;
    }
    if (nargs == 1) b = args[0];
    else if (nkw == 1) {
        PyObject *k = PyTuple_GET_ITEM(kwnames, 0);
        if (PyUnicode_Compare(k, s_barrier) != 0) {
            PyErr_Format(PyExc_TypeError, "got an unexpected keyword argument '%U'", k);
            return -1;
        }
        b = args[0];
    }
    if (b == NULL || b == Py_False) return 0;
    if (b == Py_True) return 1;
    int v = PyObject_IsTrue(b);
    return v < 0 ? -2 : v; /* -2: its truth value raised (counted as a fault, like any error inside the call) */
}

/* a writable buffer of at least n items of `size` bytes, held until release */
static int take_buffer(PyObject *o, Py_buffer *view, Py_ssize_t n, Py_ssize_t size, const char *what) {
    if (PyObject_GetBuffer(o, view, PyBUF_WRITABLE | PyBUF_ND) < 0) return -1;
    if (view->itemsize != size || view->len < n * size) {
        PyBuffer_Release(view);
        view->obj = NULL;
        PyErr_Format(PyExc_TypeError, "%s: %zd items of %zd bytes expected", what, n, size);
        return -1;
    }
    return 0;
}

static void drop_buffer(Py_buffer *view) {
    if (view->obj != NULL) PyBuffer_Release(view);
    view->obj = NULL;
}

/* ---- HotCounters -------------------------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    long long barriers_skipped;
    long long dropped_ring_full;
    long long faults_training;
    long long unbalanced;
} HotCountersObject;

static PyMemberDef HotCounters_members[] = {
    {"barriers_skipped", T_LONGLONG, offsetof(HotCountersObject, barriers_skipped), 0, NULL},
    {"dropped_ring_full", T_LONGLONG, offsetof(HotCountersObject, dropped_ring_full), 0, NULL},
    {"faults_training", T_LONGLONG, offsetof(HotCountersObject, faults_training), 0, NULL},
    {"unbalanced", T_LONGLONG, offsetof(HotCountersObject, unbalanced), 0, NULL},
    {NULL},
};

static PyTypeObject HotCountersType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "otel_straggler._hotpath.HotCounters",
    .tp_doc = "The training thread's counters (_hotpath_py.py HotCounters).",
    .tp_basicsize = sizeof(HotCountersObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_new = PyType_GenericNew,
    .tp_members = HotCounters_members,
};

/* ---- EventTable --------------------------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    PyObject *events;  /* list: id -> event object */
    PyObject *refs, *tag, *tainted, *handle; /* array('i'), array('q'), bytearray, array('Q') */
    PyObject *free;    /* deque of ids */
    PyObject *orphans; /* deque of ids */
    Py_ssize_t n;
    Py_buffer vrefs, vtag, vtainted, vhandle;
} TableObject;

#define T_REFS(tb) ((int32_t *)(tb)->vrefs.buf)
#define T_TAG(tb) ((int64_t *)(tb)->vtag.buf)
#define T_TAINTED(tb) ((uint8_t *)(tb)->vtainted.buf)
#define T_HANDLE(tb) ((uint64_t *)(tb)->vhandle.buf)

static int Table_clear(TableObject *tb) {
    drop_buffer(&tb->vrefs);
    drop_buffer(&tb->vtag);
    drop_buffer(&tb->vtainted);
    drop_buffer(&tb->vhandle);
    tb->n = 0;
    Py_CLEAR(tb->events);
    Py_CLEAR(tb->refs);
    Py_CLEAR(tb->tag);
    Py_CLEAR(tb->tainted);
    Py_CLEAR(tb->handle);
    Py_CLEAR(tb->free);
    Py_CLEAR(tb->orphans);
    return 0;
}

static int Table_init(TableObject *tb, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"events", "refs", "tag", "tainted", "handle", "free", "orphans", NULL};
    PyObject *events, *refs, *tag, *tainted, *handle, *free_dq, *orphans;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!OOOOOO", kwlist, &PyList_Type, &events, &refs, &tag, &tainted,
                                     &handle, &free_dq, &orphans))
        return -1;
    Table_clear(tb);
    Py_ssize_t n = PyList_GET_SIZE(events);
    if (n > NO_EVENT - 1) {
        PyErr_SetString(PyExc_ValueError, "too many events for the records' 16-bit ids");
        return -1;
    }
    if (take_buffer(refs, &tb->vrefs, n, 4, "refs") < 0 || take_buffer(tag, &tb->vtag, n, 8, "tag") < 0 ||
        take_buffer(tainted, &tb->vtainted, n, 1, "tainted") < 0 || take_buffer(handle, &tb->vhandle, n, 8, "handle") < 0) {
        Table_clear(tb);
        return -1;
    }
    tb->n = n;
    tb->events = Py_NewRef(events);
    tb->refs = Py_NewRef(refs);
    tb->tag = Py_NewRef(tag);
    tb->tainted = Py_NewRef(tainted);
    tb->handle = Py_NewRef(handle);
    tb->free = Py_NewRef(free_dq);
    tb->orphans = Py_NewRef(orphans);
    return 0;
}

static int Table_traverse(TableObject *tb, visitproc visit, void *arg) {
    Py_VISIT(tb->events);
    Py_VISIT(tb->refs);
    Py_VISIT(tb->tag);
    Py_VISIT(tb->tainted);
    Py_VISIT(tb->handle);
    Py_VISIT(tb->free);
    Py_VISIT(tb->orphans);
    return 0;
}

static void Table_dealloc(TableObject *tb) {
    PyObject_GC_UnTrack(tb);
    Table_clear(tb);
    Py_TYPE(tb)->tp_free((PyObject *)tb);
}

static PyMemberDef Table_members[] = {
    {"events", T_OBJECT, offsetof(TableObject, events), READONLY, NULL},
    {"refs", T_OBJECT, offsetof(TableObject, refs), READONLY, NULL},
    {"tag", T_OBJECT, offsetof(TableObject, tag), READONLY, NULL},
    {"tainted", T_OBJECT, offsetof(TableObject, tainted), READONLY, NULL},
    {"handle", T_OBJECT, offsetof(TableObject, handle), READONLY, NULL},
    {"free", T_OBJECT, offsetof(TableObject, free), READONLY, NULL},
    {"orphans", T_OBJECT, offsetof(TableObject, orphans), READONLY, NULL},
    {NULL},
};

static PyTypeObject TableType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "otel_straggler._hotpath.EventTable",
    .tp_doc = "EventTable(events, refs, tag, tainted, handle, free, orphans) (_hotpath_py.py EventTable).",
    .tp_basicsize = sizeof(TableObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Table_init,
    .tp_dealloc = (destructor)Table_dealloc,
    .tp_traverse = (traverseproc)Table_traverse,
    .tp_clear = (inquiry)Table_clear,
    .tp_members = Table_members,
};

/* free.popleft(): the id, or -1 with no exception set when the deque is empty or holds no valid id */
static long pop_free(TableObject *tb) {
    if (PyObject_Length(tb->free) <= 0) {
        PyErr_Clear();
        return -1;
    }
    PyObject *args[2] = {NULL, tb->free};
    PyObject *v = PyObject_VectorcallMethod(s_popleft, args + 1, 1 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
    if (v == NULL) {
        PyErr_Clear();
        return -1;
    }
    long id = PyLong_AsLong(v);
    Py_DECREF(v);
    if (id < 0 || id >= tb->n) {
        PyErr_Clear();
        return -1;
    }
    return id;
}

/* ---- Ring --------------------------------------------------------------------------------------------- */

/* ring.py RECORD, "<qqqqqqiHHHBBB3x": the natural layout of this struct on a little-endian machine */
typedef struct {
    int64_t start_ns, end_ns, step, tokens, sequences, microbatches;
    int32_t repeat;
    uint16_t timer, sev, eev;
    uint8_t flags, own, reason, pad[3];
} Rec;
_Static_assert(sizeof(Rec) == 64, "ring.py RECORD is 64 bytes");

typedef struct {
    PyObject_HEAD
    long long cap;
    long long mask;
    long long head; /* written by the training thread only */
    long long tail; /* written by the readout thread only */
    PyObject *buf;    /* bytearray of max(cap, 1) records; never replaced */
    PyObject *pre;    /* array('d'): device ms read ahead per record, NaN unread (readout thread) */
    PyObject *timers; /* list: timer id -> (name, level, group, collective) */
    Py_buffer vbuf, vpre;
} RingObject;

#define R_REC(r, i) (((Rec *)(r)->vbuf.buf) + ((i) & (r)->mask))
#define R_PRE(r, i) (((double *)(r)->vpre.buf) + ((i) & (r)->mask))

static int Ring_clear(RingObject *r) {
    drop_buffer(&r->vbuf);
    drop_buffer(&r->vpre);
    Py_CLEAR(r->buf);
    Py_CLEAR(r->pre);
    Py_CLEAR(r->timers);
    return 0;
}

static int Ring_init(RingObject *r, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"capacity", NULL};
    long long capacity;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "L", kwlist, &capacity)) return -1;
    long long cap = 0;
    if (capacity > 0) {
        if (capacity > (1LL << 32)) {
            PyErr_SetString(PyExc_ValueError, "ring capacity too large");
            return -1;
        }
        cap = 1;
        while (cap < capacity) cap <<= 1;
    }
    long long n = cap > 0 ? cap : 1;
    Ring_clear(r);
    PyObject *mod = PyImport_ImportModule("otel_straggler.ring");
    if (mod == NULL) return -1;
    PyObject *make = PyObject_GetAttrString(mod, "_storage");
    Py_DECREF(mod);
    if (make == NULL) return -1;
    PyObject *pair = PyObject_CallFunction(make, "L", n);
    Py_DECREF(make);
    if (pair == NULL) return -1;
    if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 3) {
        Py_DECREF(pair);
        PyErr_SetString(PyExc_TypeError, "ring._storage: (buf, pre, timers)");
        return -1;
    }
    r->buf = Py_NewRef(PyTuple_GET_ITEM(pair, 0));
    r->pre = Py_NewRef(PyTuple_GET_ITEM(pair, 1));
    r->timers = Py_NewRef(PyTuple_GET_ITEM(pair, 2));
    Py_DECREF(pair);
    if (take_buffer(r->buf, &r->vbuf, (Py_ssize_t)n * (Py_ssize_t)sizeof(Rec), 1, "buf") < 0 ||
        take_buffer(r->pre, &r->vpre, (Py_ssize_t)n, 8, "pre") < 0) {
        Ring_clear(r);
        return -1;
    }
    r->cap = cap;
    r->mask = cap ? cap - 1 : 0;
    r->head = 0;
    r->tail = 0;
    return 0;
}

static int Ring_traverse(RingObject *r, visitproc visit, void *arg) {
    Py_VISIT(r->buf);
    Py_VISIT(r->pre);
    Py_VISIT(r->timers);
    return 0;
}

static void Ring_dealloc(RingObject *r) {
    PyObject_GC_UnTrack(r);
    Ring_clear(r);
    Py_TYPE(r)->tp_free((PyObject *)r);
}

static Py_ssize_t Ring_len(RingObject *r) { return (Py_ssize_t)(r->head - r->tail); }

static PySequenceMethods Ring_as_sequence = {.sq_length = (lenfunc)Ring_len};

static PyMemberDef Ring_members[] = {
    {"cap", T_LONGLONG, offsetof(RingObject, cap), READONLY, NULL},
    {"mask", T_LONGLONG, offsetof(RingObject, mask), READONLY, NULL},
    {"head", T_LONGLONG, offsetof(RingObject, head), 0, NULL},
    {"tail", T_LONGLONG, offsetof(RingObject, tail), 0, NULL},
    {"buf", T_OBJECT, offsetof(RingObject, buf), READONLY, NULL},
    {"pre", T_OBJECT, offsetof(RingObject, pre), READONLY, NULL},
    {"timers", T_OBJECT, offsetof(RingObject, timers), READONLY, NULL},
    {NULL},
};

static PyTypeObject RingType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "otel_straggler._hotpath.Ring",
    .tp_doc = "Ring(capacity): the fixed single-producer single-consumer ring of records (_hotpath_py.py Ring).",
    .tp_basicsize = sizeof(RingObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Ring_init,
    .tp_dealloc = (destructor)Ring_dealloc,
    .tp_traverse = (traverseproc)Ring_traverse,
    .tp_clear = (inquiry)Ring_clear,
    .tp_members = Ring_members,
    .tp_as_sequence = &Ring_as_sequence,
};

/* ---- SharedEvent -------------------------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    char at_stop;
    int ev; /* an event id, NO_EVENT: none */
    long long gap_ns;
    long long ns;
    long long records;
    PyObject *ring;  /* a Ring */
    PyObject *table; /* an EventTable */
    PyObject *stream;
    PyObject *stream_of;
} ShareObject;

#define SH_TABLE(sh) ((TableObject *)(sh)->table)

static int Share_init(ShareObject *sh, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"gap_us", "stream_of", "table", "ring", NULL};
    double gap_us;
    PyObject *stream_of, *table, *ring;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "$dOO!O!", kwlist, &gap_us, &stream_of, &TableType, &table,
                                     &RingType, &ring))
        return -1;
    sh->gap_ns = stream_of != Py_None ? (long long)(gap_us * 1000.0) : 0;
    Py_XSETREF(sh->stream_of, Py_NewRef(stream_of));
    Py_XSETREF(sh->table, Py_NewRef(table));
    Py_XSETREF(sh->ring, Py_NewRef(ring));
    Py_CLEAR(sh->stream);
    sh->ev = NO_EVENT;
    sh->ns = 0;
    sh->at_stop = 0;
    sh->records = 0;
    return 0;
}

static inline int valid(TableObject *tb, long ev) { return ev >= 0 && ev < tb->n; }

static int bad_id(void) {
    PyErr_SetString(PyExc_ValueError, "event id out of range");
    return -1;
}

/* an event nothing refers to any more goes back through the readout once every record before the ring's head was
 * read: tag = head, then onto the orphans */
static int orphan(ShareObject *sh, long ev) {
    T_TAG(SH_TABLE(sh))[ev] = ((RingObject *)sh->ring)->head;
    return call_append(SH_TABLE(sh)->orphans, ev);
}

/* SharedEvent.recorded(ev, ns, stream, at_stop) */
static int share_recorded(ShareObject *sh, long ev, long long ns, PyObject *stream, int at_stop) {
    sh->records++;
    if (sh->gap_ns) {
        int old = sh->ev;
        sh->ev = (int)ev;
        sh->ns = ns;
        Py_XSETREF(sh->stream, Py_NewRef(stream));
        sh->at_stop = (char)at_stop;
        if (old != NO_EVENT && T_REFS(SH_TABLE(sh))[old] <= 0 && orphan(sh, old) < 0) return -1;
    }
    return 0;
}

static int check_share(ShareObject *sh) {
    if (sh->table == NULL || sh->ring == NULL) {
        PyErr_SetString(PyExc_TypeError, "SharedEvent not initialised");
        return -1;
    }
    return 0;
}

static PyObject *Share_recorded(ShareObject *sh, PyObject *args) {
    PyObject *stream;
    long ev;
    long long ns;
    int at_stop;
    if (!PyArg_ParseTuple(args, "lLOp", &ev, &ns, &stream, &at_stop)) return NULL;
    if (check_share(sh) < 0) return NULL;
    if (!valid(SH_TABLE(sh), ev)) return bad_id(), NULL;
    if (share_recorded(sh, ev, ns, stream, at_stop) < 0) return NULL;
    Py_RETURN_NONE;
}

/* SharedEvent.release(ev): 0, or -1 with an exception */
static int release(ShareObject *sh, long ev) {
    TableObject *tb = SH_TABLE(sh);
    int32_t refs = --T_REFS(tb)[ev];
    T_TAINTED(tb)[ev] = 1;
    if (refs <= 0 && ev != sh->ev && orphan(sh, ev) < 0) return -1;
    return 0;
}

static PyObject *Share_release(ShareObject *sh, PyObject *arg) {
    long ev = PyLong_AsLong(arg);
    if (ev == -1 && PyErr_Occurred()) return NULL;
    if (check_share(sh) < 0) return NULL;
    if (!valid(SH_TABLE(sh), ev)) return bad_id(), NULL;
    if (release(sh, ev) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *Share_retire(ShareObject *sh, PyObject *Py_UNUSED(ignored)) {
    if (check_share(sh) < 0) return NULL;
    int ev = sh->ev;
    sh->ev = NO_EVENT;
    if (ev != NO_EVENT && T_REFS(SH_TABLE(sh))[ev] <= 0 && orphan(sh, ev) < 0) return NULL;
    Py_RETURN_NONE;
}

static int Share_traverse(ShareObject *sh, visitproc visit, void *arg) {
    Py_VISIT(sh->ring);
    Py_VISIT(sh->table);
    Py_VISIT(sh->stream);
    Py_VISIT(sh->stream_of);
    return 0;
}

static int Share_clear(ShareObject *sh) {
    Py_CLEAR(sh->ring);
    Py_CLEAR(sh->table);
    Py_CLEAR(sh->stream);
    Py_CLEAR(sh->stream_of);
    return 0;
}

static void Share_dealloc(ShareObject *sh) {
    PyObject_GC_UnTrack(sh);
    Share_clear(sh);
    Py_TYPE(sh)->tp_free((PyObject *)sh);
}

static PyMethodDef Share_methods[] = {
    {"recorded", (PyCFunction)Share_recorded, METH_VARARGS,
     "recorded(ev, ns, stream, at_stop): a boundary recorded ev; later boundaries may reuse it."},
    {"release", (PyCFunction)Share_release, METH_O, "release(ev): a reference that will not be published."},
    {"retire", (PyCFunction)Share_retire, METH_NOARGS, "retire(): stop reusing the latest event."},
    {NULL},
};

static PyMemberDef Share_members[] = {
    {"at_stop", T_BOOL, offsetof(ShareObject, at_stop), 0, NULL},
    {"ev", T_INT, offsetof(ShareObject, ev), READONLY, NULL},
    {"gap_ns", T_LONGLONG, offsetof(ShareObject, gap_ns), 0, NULL},
    {"ns", T_LONGLONG, offsetof(ShareObject, ns), 0, NULL},
    {"records", T_LONGLONG, offsetof(ShareObject, records), 0, NULL},
    {"ring", T_OBJECT, offsetof(ShareObject, ring), READONLY, NULL},
    {"table", T_OBJECT, offsetof(ShareObject, table), READONLY, NULL},
    {"stream", T_OBJECT, offsetof(ShareObject, stream), 0, NULL},
    {"stream_of", T_OBJECT, offsetof(ShareObject, stream_of), READONLY, NULL},
    {NULL},
};

static PyTypeObject ShareType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "otel_straggler._hotpath.SharedEvent",
    .tp_doc = "SharedEvent(*, gap_us, stream_of, table, ring) (_hotpath_py.py SharedEvent).",
    .tp_basicsize = sizeof(ShareObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Share_init,
    .tp_dealloc = (destructor)Share_dealloc,
    .tp_traverse = (traverseproc)Share_traverse,
    .tp_clear = (inquiry)Share_clear,
    .tp_members = Share_members,
    .tp_methods = Share_methods,
};

/* whether the current stream is the one sh->ev was recorded on; 0 when that cannot be told; -1 with the program's
 * exception (users) */
static int same_stream(ShareObject *sh) {
    if (sh->stream_of == NULL) return 0;
    PyObject *cur = PyObject_CallNoArgs(sh->stream_of);
    if (cur == NULL) {
        if (users()) return -1;
        PyErr_Clear();
        return 0;
    }
    PyObject *was = Py_NewRef(sh->stream ? sh->stream : Py_None);
    int eq = PyObject_RichCompareBool(cur, was, Py_EQ);
    Py_DECREF(was);
    Py_DECREF(cur);
    if (eq < 0) {
        if (users()) return -1;
        PyErr_Clear();
        return 0;
    }
    return eq;
}

/* ---- StepState ---------------------------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    long long step;
    int host_code;
    PyObject *binding; /* (step, tokens, sequences, microbatches): for Python readers */
    PyObject *device_on;
    /* ``wire``: (step, tokens, sequences, microbatches, flags) as the record carries them */
    int64_t w_step, w_tokens, w_sequences, w_microbatches;
    uint8_t w_flags;
} StepStateObject;

static int StepState_traverse(StepStateObject *s, visitproc visit, void *arg) {
    Py_VISIT(s->binding);
    Py_VISIT(s->device_on);
    return 0;
}

static int StepState_clear(StepStateObject *s) {
    Py_CLEAR(s->binding);
    Py_CLEAR(s->device_on);
    return 0;
}

static void StepState_dealloc(StepStateObject *s) {
    PyObject_GC_UnTrack(s);
    StepState_clear(s);
    Py_TYPE(s)->tp_free((PyObject *)s);
}

static PyObject *StepState_get_wire(StepStateObject *s, void *closure) {
    return Py_BuildValue("(LLLLi)", (long long)s->w_step, (long long)s->w_tokens, (long long)s->w_sequences,
                         (long long)s->w_microbatches, (int)s->w_flags);
}

/* set at a step change (cold): five exact ints, converted here once, so a stop copies C integers */
static int StepState_set_wire(StepStateObject *s, PyObject *v, void *closure) {
    if (v == NULL || !PyTuple_CheckExact(v) || PyTuple_GET_SIZE(v) != 5) {
        PyErr_SetString(PyExc_TypeError, "wire: (step, tokens, sequences, microbatches, flags)");
        return -1;
    }
    long long x[5];
    for (int i = 0; i < 5; i++) {
        PyObject *o = PyTuple_GET_ITEM(v, i);
        if (!PyLong_CheckExact(o)) {
            PyErr_SetString(PyExc_TypeError, "wire: ints");
            return -1;
        }
        x[i] = PyLong_AsLongLong(o);
        if (x[i] == -1 && PyErr_Occurred()) return -1;
    }
    if (x[4] < 0 || x[4] > 0xFF) {
        PyErr_SetString(PyExc_ValueError, "wire: flags are a byte");
        return -1;
    }
    s->w_step = x[0];
    s->w_tokens = x[1];
    s->w_sequences = x[2];
    s->w_microbatches = x[3];
    s->w_flags = (uint8_t)x[4];
    return 0;
}

static PyMemberDef StepState_members[] = {
    {"step", T_LONGLONG, offsetof(StepStateObject, step), 0, NULL},
    {"host_code", T_INT, offsetof(StepStateObject, host_code), 0, NULL},
    {"binding", T_OBJECT, offsetof(StepStateObject, binding), 0, NULL},
    {"device_on", T_OBJECT, offsetof(StepStateObject, device_on), 0, NULL},
    {NULL},
};

static PyGetSetDef StepState_getset[] = {
    {"wire", (getter)StepState_get_wire, (setter)StepState_set_wire, NULL, NULL},
    {NULL},
};

static PyTypeObject StepStateType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "otel_straggler._hotpath.StepState",
    .tp_doc = "The step fields the hot path reads (_hotpath_py.py StepState).",
    .tp_basicsize = sizeof(StepStateObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_BASETYPE,
    .tp_new = PyType_GenericNew,
    .tp_dealloc = (destructor)StepState_dealloc,
    .tp_traverse = (traverseproc)StepState_traverse,
    .tp_clear = (inquiry)StepState_clear,
    .tp_members = StepState_members,
    .tp_getset = StepState_getset,
};

/* ---- TimerCore ---------------------------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    char started;
    char is_step;
    int sev;    /* the running start's event id, NO_EVENT: none */
    int reason; /* its degraded reason code, 0: none */
    int id;     /* the timer's id in its ring's table */
    long long t0;
    long long elapsed_ns;
    long long active_ns;
    double elapsed_base;
    long long rep_step;
    long long rep;
    long long pick;
    long long sstep;
    long long starts;
    unsigned long long cu_record; /* address of cuEventRecord (driver record API), 0: call record */
    PyObject *name;
    PyObject *label; /* the wire's name: str, bounded (records.py bound_name) */
    PyObject *level; /* Megatron's log level: any number */
    PyObject *group;
    PyObject *c;       /* HotCounters */
    PyObject *ctx;     /* StepState */
    PyObject *share;   /* SharedEvent */
    PyObject *ring;    /* Ring */
    PyObject *tab;     /* EventTable */
    PyObject *free;    /* the table's free deque */
    PyObject *orphans; /* the table's orphans deque */
    PyObject *record;  /* the pool's record(id) -> stream */
    PyObject *inject;
    PyObject *clock; /* None: CLOCK_MONOTONIC; else a callable returning ns (the tests' fake host clock) */
} TimerObject;

#define COUNTERS(t) ((HotCountersObject *)(t)->c)

static inline long long timer_clock(TimerObject *t) {
    if (!is_set(t->clock)) return mono_ns();
    PyObject *v = PyObject_CallNoArgs(t->clock);
    if (v == NULL) return -1;
    long long ns = PyLong_AsLongLong(v);
    Py_DECREF(v);
    return ns;
}

/* record event ev on the current stream: the stream recorded on (a new reference; what the pool's record returned
 * when the driver's record failed or is not used), or NULL with an exception */
static PyObject *do_record(TimerObject *t, ShareObject *sh, TableObject *tb, long ev) {
    if (t->cu_record && is_set(sh->stream_of)) {
        PyObject *stream = PyObject_CallNoArgs(sh->stream_of);
        if (stream == NULL) return NULL;
        void *raw = stream != Py_None ? PyLong_AsVoidPtr(stream) : NULL;
        if (PyErr_Occurred()) {
            Py_DECREF(stream);
            return NULL;
        }
        void *handle = (void *)(uintptr_t)T_HANDLE(tb)[ev];
        if (((cu_event_record_fn)(uintptr_t)t->cu_record)(handle, raw) == 0) return stream;
        Py_DECREF(stream); /* the pool's record tries again and falls back to torch's */
    }
    PyObject *id = PyLong_FromLong(ev);
    if (id == NULL) return NULL;
    PyObject *r = PyObject_CallOneArg(t->record, id);
    Py_DECREF(id);
    return r;
}

/* the wiring is checked when set (Timer_set_wire), so the hot path only asks whether it is there; and the running
 * start's event id, which Python code may have set (``_sev``), is one of the table's before anything indexes with it */
static inline int check_wiring(TimerObject *t) {
    if (t->ctx == NULL || t->share == NULL || t->ring == NULL || t->tab == NULL || t->free == NULL ||
        t->record == NULL || t->orphans == NULL || t->c == NULL ||
        ((ShareObject *)t->share)->table != t->tab || SH_TABLE((ShareObject *)t->share) == NULL) {
        PyErr_SetString(PyExc_TypeError, "timer not wired to the native ring, event table, shared event and step");
        return -1;
    }
    if (t->sev != NO_EVENT && t->sev >= ((TableObject *)t->tab)->n) return bad_id();
    return 0;
}

static PyObject *fault(TimerObject *t) {
    if (users()) return NULL;
    PyErr_Clear();
    if (t->c != NULL) COUNTERS(t)->faults_training++;
    Py_RETURN_NONE;
}

/* start's work once the call shape and balance are checked; ctx, sh and tb are strong references the caller holds
 * (a call into Python below, the stream lookup or a record, could replace the timer's own) */
static PyObject *start_impl(TimerObject *t, StepStateObject *ctx, ShareObject *sh, TableObject *tb) {
    if (t->is_step) {
        PyObject *args1[2] = {NULL, (PyObject *)ctx};
        PyObject *r = PyObject_VectorcallMethod(s_step_timer_started, args1 + 1, 1 | PY_VECTORCALL_ARGUMENTS_OFFSET,
                                                NULL);
        if (r == NULL) return fault(t);
        Py_DECREF(r);
    }
    PyObject *on = ctx->device_on;
    int device = on == Py_True ? 1 : (is_set(on) ? PyObject_IsTrue(on) : 0);
    if (device < 0) return fault(t);
    if (device) {
        long long pick = t->pick;
        if (pick >= 0) {
            long long nxt = t->starts;
            if (t->sstep != ctx->step) { /* its first start in this step: the middle of its previous count */
                t->pick = pick = nxt >> 1;
                t->sstep = ctx->step;
                nxt = 0;
            }
            t->starts = nxt + 1;
            if (nxt != pick) {
                t->reason = r_sampled_out; /* another repeat of this step has its device time */
                sh->ns = NO_REUSE;         /* its GPU work is in no later boundary's reused event */
                t->started = 1;
                long long now = timer_clock(t);
                if (now == -1 && PyErr_Occurred()) return fault(t);
                t->t0 = now;
                Py_RETURN_NONE;
            }
        }
        long long now = timer_clock(t);
        if (now == -1 && PyErr_Occurred()) return fault(t);
        int ev = sh->ev;
        int same = ev != NO_EVENT && now - sh->ns < sh->gap_ns ? same_stream(sh) : 0;
        if (same < 0) return NULL;
        if (same) {
            T_REFS(tb)[ev] += 1; /* the previous boundary's event, reused */
            t->sev = ev;
            t->reason = 0;
            t->started = 1;
            t->t0 = now;
            Py_RETURN_NONE;
        }
        long id = pop_free(tb);
        if (id >= 0) {
            T_REFS(tb)[id] = 1;
            t->sev = (int)id;
            t->reason = 0;
            PyObject *stream = do_record(t, sh, tb, id);
            if (stream == NULL) {
                if (users()) return NULL;
                PyErr_Clear();
                t->reason = r_cuda_error;
                sh->ns = NO_REUSE;
            } else {
                int rc = share_recorded(sh, id, now, stream, 0);
                Py_DECREF(stream);
                if (rc < 0) return fault(t);
            }
        } else {
            t->reason = r_pool_exhausted;
            sh->ns = NO_REUSE;
        }
    } else {
        t->reason = ctx->host_code;
    }
    t->started = 1;
    long long now = timer_clock(t);
    if (now == -1 && PyErr_Occurred()) return fault(t);
    t->t0 = now;
    Py_RETURN_NONE;
}

/* a start or stop that raised the program's exception (users): the timer is not running, and the event its start
 * held is let go as a reset lets go of it; the exception stays set */
static void abandon(TimerObject *t, ShareObject *sh) {
    t->started = 0;
    int sev = t->sev;
    t->sev = NO_EVENT;
    if (sev == NO_EVENT) return;
    PyObject *et, *ev, *tb;
    PyErr_Fetch(&et, &ev, &tb);
    if (release(sh, sev) < 0) PyErr_Clear();
    PyErr_Restore(et, ev, tb);
}

/* a start of a started timer or a stop of a stopped one: counted, then raised as Megatron's assert raises it */
static PyObject *misuse(TimerObject *t, const char *msg) {
    if (t->c != NULL) COUNTERS(t)->unbalanced++;
    PyErr_SetString(PyExc_AssertionError, msg);
    return NULL;
}

static PyObject *Timer_start(TimerObject *t, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    int barrier = 0;
    if (nargs || kwnames) {
        barrier = parse_barrier(args, nargs, kwnames);
        if (barrier == -1) return NULL; /* a call-shape error, raised as the Python method raises it */
        if (barrier < 0) return fault(t);
    }
    if (t->started) return misuse(t, "timer has already been started"); /* Megatron's assert, before anything */
    if (barrier && t->c != NULL) COUNTERS(t)->barriers_skipped++;
    if (check_wiring(t) < 0) return fault(t);
    PyObject *ctx = Py_NewRef(t->ctx), *sh = Py_NewRef(t->share), *tb = Py_NewRef(t->tab);
    PyObject *r = start_impl(t, (StepStateObject *)ctx, (ShareObject *)sh, (TableObject *)tb);
    if (r == NULL) abandon(t, (ShareObject *)sh);
    Py_DECREF(ctx);
    Py_DECREF(sh);
    Py_DECREF(tb);
    return r;
}

/* stop's work once the call shape and balance are checked; ctx, sh, tb and ring are strong references the caller
 * holds. */
static PyObject *stop_impl(TimerObject *t, StepStateObject *ctx, ShareObject *sh, TableObject *tb, RingObject *r) {
    uint8_t injected = 0;
    if (is_set(t->inject)) {
        PyObject *step = PyLong_FromLongLong(ctx->step);
        if (step == NULL) return fault(t);
        PyObject *a[3] = {NULL, t->inject, step};
        PyObject *res = PyObject_VectorcallMethod(s_apply, a + 1, 2 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
        Py_DECREF(step);
        if (res == NULL) return fault(t);
        int inj = PyObject_IsTrue(res);
        Py_DECREF(res);
        if (inj < 0) return fault(t);
        injected = inj ? 16 /* F_INJECTED */ : 0;
    }
    long long now = timer_clock(t);
    if (now == -1 && PyErr_Occurred()) return fault(t);
    t->started = 0;
    t->elapsed_ns += now - t->t0;
    int64_t bstep = ctx->w_step; /* C integers: reading them runs no Python code */
    long long rep;
    if (bstep == t->rep_step) {
        rep = t->rep + 1;
    } else {
        rep = 0;
        t->rep_step = bstep;
    }
    t->rep = rep;
    int sev = t->sev, eev = NO_EVENT;
    int reason = t->reason;
    int own = 0;
    int32_t srefs = 0, erefs = 0;
    if (sev != NO_EVENT) {
        t->sev = NO_EVENT; /* the reference moves to this call */
        if (reason == 0) {
            int ev = sh->ev;
            int same = ev != NO_EVENT && sh->at_stop && ev != sev && now - sh->ns < sh->gap_ns ? same_stream(sh) : 0;
            if (same < 0) goto fail;
            if (same) {
                T_REFS(tb)[ev] += 1; /* an inner timer's stop just before this one's */
                eev = ev;
            } else {
                long id = pop_free(tb);
                if (id >= 0) {
                    eev = (int)id;
                    T_REFS(tb)[eev] = 1;
                    PyObject *stream = do_record(t, sh, tb, eev);
                    if (stream == NULL) {
                        if (users()) goto fail;
                        PyErr_Clear();
                        reason = r_cuda_error;
                        sh->ns = NO_REUSE;
                    } else {
                        int rc = share_recorded(sh, eev, now, stream, 1);
                        Py_DECREF(stream);
                        if (rc < 0) goto fail;
                    }
                } else {
                    reason = r_pool_exhausted;
                    sh->ns = NO_REUSE;
                }
            }
        }
        /* the references once published: the record owns (returns to the pool) what nothing else refers to */
        int last = sh->ev;
        srefs = T_REFS(tb)[sev] - 1;
        if (eev != NO_EVENT) {
            erefs = T_REFS(tb)[eev] - 1;
            if (erefs <= 0 && eev != last) own = 2;
        }
        if (sev != eev && srefs <= 0 && sev != last) own |= 1;
    }
    long long h = r->head;
    if (h - r->tail >= r->cap) {
        COUNTERS(t)->dropped_ring_full++;
        if (sev != NO_EVENT) { /* no record reads them: whoever returns them waits for them to complete */
            T_REFS(tb)[sev] = srefs;
            T_TAINTED(tb)[sev] = 1;
            if (own & 1) T_TAG(tb)[sev] = h;
            if (eev != NO_EVENT) {
                T_REFS(tb)[eev] = erefs;
                T_TAINTED(tb)[eev] = 1;
                if (own & 2) T_TAG(tb)[eev] = h;
            }
            if (((own & 1) && call_append(t->orphans, sev) < 0) || ((own & 2) && call_append(t->orphans, eev) < 0))
                return fault(t);
        }
        Py_RETURN_NONE;
    }
    Rec *rec = R_REC(r, h);
    rec->start_ns = t->t0;
    rec->end_ns = now;
    rec->step = bstep;
    rec->tokens = ctx->w_tokens;
    rec->sequences = ctx->w_sequences;
    rec->microbatches = ctx->w_microbatches;
    rec->repeat = (int32_t)rep;
    rec->timer = (uint16_t)t->id;
    rec->sev = (uint16_t)sev;
    rec->eev = (uint16_t)eev;
    rec->flags = (uint8_t)(ctx->w_flags | injected);
    rec->own = (uint8_t)own;
    rec->reason = (uint8_t)reason;
    memset(rec->pad, 0, sizeof rec->pad);
    if (sev != NO_EVENT) {
        T_REFS(tb)[sev] = srefs;
        if (eev != NO_EVENT) T_REFS(tb)[eev] = erefs;
    }
    r->head = h + 1;
    Py_RETURN_NONE;
fail:
    if (users()) { /* the program's exception: this call's references are let go, as a reset does */
        PyObject *et, *ev, *tbk;
        PyErr_Fetch(&et, &ev, &tbk);
        if (release(sh, sev) < 0) PyErr_Clear();
        if (eev != NO_EVENT && eev != sev && release(sh, eev) < 0) PyErr_Clear();
        PyErr_Restore(et, ev, tbk);
    }
    return fault(t);
}

static PyObject *Timer_stop(TimerObject *t, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    int barrier = 0;
    if (nargs || kwnames) {
        barrier = parse_barrier(args, nargs, kwnames);
        if (barrier == -1) return NULL;
        if (barrier < 0) return fault(t);
    }
    if (!t->started) return misuse(t, "timer is not started");
    if (barrier && t->c != NULL) COUNTERS(t)->barriers_skipped++;
    if (check_wiring(t) < 0) return fault(t);
    PyObject *ctx = Py_NewRef(t->ctx), *sh = Py_NewRef(t->share), *tb = Py_NewRef(t->tab), *ring = Py_NewRef(t->ring);
    PyObject *res = stop_impl(t, (StepStateObject *)ctx, (ShareObject *)sh, (TableObject *)tb, (RingObject *)ring);
    if (res == NULL) abandon(t, (ShareObject *)sh);
    Py_DECREF(ctx);
    Py_DECREF(sh);
    Py_DECREF(tb);
    Py_DECREF(ring);
    return res;
}

static int Timer_traverse(TimerObject *t, visitproc visit, void *arg) {
    Py_VISIT(t->name);
    Py_VISIT(t->label);
    Py_VISIT(t->level);
    Py_VISIT(t->group);
    Py_VISIT(t->c);
    Py_VISIT(t->ctx);
    Py_VISIT(t->share);
    Py_VISIT(t->ring);
    Py_VISIT(t->tab);
    Py_VISIT(t->free);
    Py_VISIT(t->orphans);
    Py_VISIT(t->record);
    Py_VISIT(t->inject);
    Py_VISIT(t->clock);
    return 0;
}

static int Timer_clear(TimerObject *t) {
    Py_CLEAR(t->name);
    Py_CLEAR(t->label);
    Py_CLEAR(t->level);
    Py_CLEAR(t->group);
    Py_CLEAR(t->c);
    Py_CLEAR(t->ctx);
    Py_CLEAR(t->share);
    Py_CLEAR(t->ring);
    Py_CLEAR(t->tab);
    Py_CLEAR(t->free);
    Py_CLEAR(t->orphans);
    Py_CLEAR(t->record);
    Py_CLEAR(t->inject);
    Py_CLEAR(t->clock);
    return 0;
}

static void Timer_dealloc(TimerObject *t) {
    PyObject_GC_UnTrack(t);
    Timer_clear(t);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

static PyObject *Timer_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    TimerObject *t = (TimerObject *)type->tp_alloc(type, 0);
    if (t == NULL) return NULL;
    t->rep_step = -1;
    t->rep = -1;
    t->pick = -1;
    t->sstep = -1;
    t->sev = NO_EVENT;
    t->id = 0xFFFF;
    return (PyObject *)t;
}

static PyMethodDef Timer_methods[] = {
    {"start", (PyCFunction)(void (*)(void))Timer_start, METH_FASTCALL | METH_KEYWORDS,
     "start($self, /, barrier=False)\n--\n\nA host timestamp, and on a device-sampled step an event record."},
    {"stop", (PyCFunction)(void (*)(void))Timer_stop, METH_FASTCALL | METH_KEYWORDS,
     "stop($self, /, barrier=False)\n--\n\nEnds the interval and publishes its record in the ring."},
    {NULL},
};

#define TM(name, type, field) {name, type, offsetof(TimerObject, field), 0, NULL}
static PyMemberDef Timer_members[] = {
    TM("_started", T_BOOL, started),
    TM("_is_step", T_BOOL, is_step),
    TM("_t0", T_LONGLONG, t0),
    TM("_elapsed_ns", T_LONGLONG, elapsed_ns),
    TM("_active_ns", T_LONGLONG, active_ns),
    TM("_elapsed_base", T_DOUBLE, elapsed_base),
    TM("_rep_step", T_LONGLONG, rep_step),
    TM("_rep", T_LONGLONG, rep),
    TM("_pick", T_LONGLONG, pick),
    TM("_sstep", T_LONGLONG, sstep),
    TM("_starts", T_LONGLONG, starts),
    TM("_cu_record", T_ULONGLONG, cu_record),
    TM("_reason", T_INT, reason),
    TM("name", T_OBJECT, name),
    TM("label", T_OBJECT, label),
    TM("_level", T_OBJECT, level),
    TM("_group", T_OBJECT, group),
    TM("_orphans", T_OBJECT, orphans),
    TM("_free", T_OBJECT, free),
    TM("_record", T_OBJECT, record),
    TM("_inject", T_OBJECT, inject),
    TM("_clock", T_OBJECT, clock),
    {NULL},
};

/* the wiring attributes: the type each must have is checked here, once, instead of on every start/stop */
enum { WIRE_CTX, WIRE_SHARE, WIRE_RING, WIRE_TAB, WIRE_C };

static PyObject **wire_field(TimerObject *t, void *which) {
    switch ((int)(intptr_t)which) {
    case WIRE_CTX: return &t->ctx;
    case WIRE_SHARE: return &t->share;
    case WIRE_RING: return &t->ring;
    case WIRE_TAB: return &t->tab;
    default: return &t->c;
    }
}

static PyObject *Timer_get_wire(TimerObject *t, void *which) {
    PyObject *v = *wire_field(t, which);
    return Py_NewRef(v != NULL ? v : Py_None);
}

static int Timer_set_wire(TimerObject *t, PyObject *v, void *which) {
    static const char *names[] = {"_ctx", "_share", "_ring", "_tab", "_c"};
    static const char *types[] = {"StepState", "SharedEvent", "Ring", "EventTable", "HotCounters"};
    int w = (int)(intptr_t)which;
    if (v == NULL || v == Py_None) {
        Py_CLEAR(*wire_field(t, which));
        return 0;
    }
    int ok = w == WIRE_CTX ? PyObject_TypeCheck(v, &StepStateType)
             : w == WIRE_SHARE ? Py_IS_TYPE(v, &ShareType)
             : w == WIRE_RING ? Py_IS_TYPE(v, &RingType)
             : w == WIRE_TAB ? Py_IS_TYPE(v, &TableType)
             : PyObject_TypeCheck(v, &HotCountersType);
    if (!ok) {
        PyErr_Format(PyExc_TypeError, "%s must be the C hot path's %s, not %s", names[w], types[w],
                     Py_TYPE(v)->tp_name);
        return -1;
    }
    Py_XSETREF(*wire_field(t, which), Py_NewRef(v));
    return 0;
}

static PyObject *Timer_get_int(TimerObject *t, void *which) {
    int v = which == NULL ? t->sev : t->id;
    return PyLong_FromLong(v);
}

/* ``_sev`` and ``_id``: an event id (NO_EVENT: none) and a timer id, both 16 bits in the record */
static int Timer_set_int(TimerObject *t, PyObject *v, void *which) {
    long x = v != NULL ? PyLong_AsLong(v) : -1;
    if (x == -1 && PyErr_Occurred()) return -1;
    if (x < 0 || x > 0xFFFF) {
        PyErr_SetString(PyExc_ValueError, "an id is 16 bits");
        return -1;
    }
    if (which == NULL) t->sev = (int)x;
    else t->id = (int)x;
    return 0;
}

static PyGetSetDef Timer_getset[] = {
    {"_ctx", (getter)Timer_get_wire, (setter)Timer_set_wire, NULL, (void *)(intptr_t)WIRE_CTX},
    {"_share", (getter)Timer_get_wire, (setter)Timer_set_wire, NULL, (void *)(intptr_t)WIRE_SHARE},
    {"_ring", (getter)Timer_get_wire, (setter)Timer_set_wire, NULL, (void *)(intptr_t)WIRE_RING},
    {"_tab", (getter)Timer_get_wire, (setter)Timer_set_wire, NULL, (void *)(intptr_t)WIRE_TAB},
    {"_c", (getter)Timer_get_wire, (setter)Timer_set_wire, NULL, (void *)(intptr_t)WIRE_C},
    {"_sev", (getter)Timer_get_int, (setter)Timer_set_int, NULL, NULL},
    {"_id", (getter)Timer_get_int, (setter)Timer_set_int, NULL, (void *)1},
    {NULL},
};

static PyTypeObject TimerType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "otel_straggler._hotpath.TimerCore",
    .tp_doc = "A timer's state and its start/stop in C (_hotpath_py.py TimerCore).",
    .tp_basicsize = sizeof(TimerObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_BASETYPE,
    .tp_new = Timer_new,
    .tp_dealloc = (destructor)Timer_dealloc,
    .tp_traverse = (traverseproc)Timer_traverse,
    .tp_clear = (inquiry)Timer_clear,
    .tp_members = Timer_members,
    .tp_getset = Timer_getset,
    .tp_methods = Timer_methods,
};

/* ---- TimersCore --------------------------------------------------------------------------------------- */

/* Megatron calls ``timers(name, log_level=...)`` twice per interval, once for the start and once for the stop: the
 * lookup of an existing timer is the hot path's other half. Between a step's launches a Python ``__call__`` finds
 * its frame, code and dicts cold and costs about three times a C start (bench/results/cpu-cold-calls.md). Here the
 * lookup is one dict read and a level compare; everything else (a new name, a level that does not match, a
 * call shape other than (name) / (name, level)) goes to ``self._get``, the Python code of timers.py. */

typedef struct {
    PyObject_HEAD
    PyObject *timers; /* ``_timers``: name -> Timer */
    vectorcallfunc vectorcall;
} TimersObject;

/* the existing timer ``name`` when its level matches ``level`` (NULL or None: any), a new reference; else NULL, no
 * exception set: ``_get`` answers */
static PyObject *timers_fast(TimersObject *ts, PyObject *name, PyObject *level) {
    if (ts->timers == NULL || !PyDict_CheckExact(ts->timers) || !PyUnicode_CheckExact(name)) return NULL;
    PyObject *t = PyDict_GetItemWithError(ts->timers, name); /* borrowed; a str key runs no Python code */
    if (t == NULL) {
        PyErr_Clear(); /* _get meets it again and says what it is */
        return NULL;
    }
    if (level == NULL || level == Py_None) return Py_NewRef(t);
    PyObject *own = PyObject_TypeCheck(t, &TimerType) ? ((TimerObject *)t)->level : NULL;
    if (PyLong_CheckExact(level) && own != NULL && PyLong_CheckExact(own)) {
        /* two ints: the comparison runs no Python code */
        if (PyObject_RichCompareBool(level, own, Py_EQ) == 1) return Py_NewRef(t);
        PyErr_Clear();
    }
    return NULL;
}

static PyObject *timers_vectorcall(PyObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    PyObject *r = NULL;
    if (nargs == 1 && nkw == 0) r = timers_fast((TimersObject *)self, args[0], NULL);
    else if (nargs == 2 && nkw == 0) r = timers_fast((TimersObject *)self, args[0], args[1]);
    else if (nargs == 1 && nkw == 1 && PyUnicode_Compare(PyTuple_GET_ITEM(kwnames, 0), s_log_level) == 0)
        r = timers_fast((TimersObject *)self, args[0], args[1]);
    if (r != NULL) return r;
    PyErr_Clear();
    PyObject *get = PyObject_GetAttr(self, s_get);
    if (get == NULL) return NULL;
    r = PyObject_Vectorcall(get, args, nargs, kwnames);
    Py_DECREF(get);
    return r;
}

/* the call through tp_call (a subclass that does not inherit the vectorcall flag: Python 3.11). Not
 * PyVectorcall_Call: that unpacks the keyword dict into a new array and tuple first, ~0.3 us more per cold lookup
 * (bench/cold_calls.py, the two side by side). */
static PyObject *Timers_call(PyObject *self, PyObject *args, PyObject *kwargs) {
    Py_ssize_t nargs = PyTuple_GET_SIZE(args);
    Py_ssize_t nkw = kwargs ? PyDict_GET_SIZE(kwargs) : 0;
    PyObject *r = NULL;
    if (nargs >= 1 && nargs + nkw <= 2) {
        PyObject *level = nargs == 2 ? PyTuple_GET_ITEM(args, 1) : NULL;
        if (nkw == 1) level = PyDict_GetItemWithError(kwargs, s_log_level); /* borrowed; NULL: another keyword */
        if (nkw == 0 || level != NULL) r = timers_fast((TimersObject *)self, PyTuple_GET_ITEM(args, 0), level);
    }
    if (r != NULL) return r;
    PyErr_Clear();
    PyObject *get = PyObject_GetAttr(self, s_get);
    if (get == NULL) return NULL;
    r = PyObject_Call(get, args, kwargs);
    Py_DECREF(get);
    return r;
}

static PyObject *Timers_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    TimersObject *ts = (TimersObject *)type->tp_alloc(type, 0);
    if (ts == NULL) return NULL;
    ts->vectorcall = timers_vectorcall;
    return (PyObject *)ts;
}

static int Timers_traverse(TimersObject *ts, visitproc visit, void *arg) {
    Py_VISIT(ts->timers);
    return 0;
}

static int Timers_clear(TimersObject *ts) {
    Py_CLEAR(ts->timers);
    return 0;
}

static void Timers_dealloc(TimersObject *ts) {
    PyObject_GC_UnTrack(ts);
    Timers_clear(ts);
    Py_TYPE(ts)->tp_free((PyObject *)ts);
}

static PyMemberDef Timers_members[] = {
    {"_timers", T_OBJECT, offsetof(TimersObject, timers), 0, NULL},
    {NULL},
};

static PyTypeObject TimersType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "otel_straggler._hotpath.TimersCore",
    .tp_doc = "Timers(name, log_level=None): an existing timer in C, anything else through self._get (timers.py).",
    .tp_basicsize = sizeof(TimersObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_vectorcall_offset = offsetof(TimersObject, vectorcall),
    .tp_call = Timers_call,
    .tp_new = Timers_new,
    .tp_dealloc = (destructor)Timers_dealloc,
    .tp_traverse = (traverseproc)Timers_traverse,
    .tp_clear = (inquiry)Timers_clear,
    .tp_members = Timers_members,
};

/* ---- the readout's driver calls ------------------------------------------------------------------------ */

typedef int (*cu_event_elapsed_fn)(float *ms, void *start, void *end);
typedef int (*cu_event_query_fn)(void *event);
#define CUDA_ERROR_NOT_READY 600

static int ptr_of(PyObject *addr, void **out) {
    *out = PyLong_AsVoidPtr(addr);
    return PyErr_Occurred() ? -1 : 0;
}

static int fn_of(PyObject *addr, void **out) {
    if (ptr_of(addr, out) < 0) return -1;
    if (*out == NULL) PyErr_SetString(PyExc_ValueError, "null function address");
    return *out == NULL ? -1 : 0;
}

/* event_elapsed(fn_address, start_handle, end_handle): cuEventElapsedTime on two raw events; ms, None while either
 * is unfinished, RuntimeError on any other result (event_pool.py driver_elapsed) */
static PyObject *event_elapsed(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    void *fn, *a, *b;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "event_elapsed(fn_address, start_handle, end_handle)");
        return NULL;
    }
    if (fn_of(args[0], &fn) < 0 || ptr_of(args[1], &a) < 0 || ptr_of(args[2], &b) < 0) return NULL;
    float ms = 0.0f;
    int rc = ((cu_event_elapsed_fn)fn)(&ms, a, b);
    if (rc == 0) return PyFloat_FromDouble((double)ms);
    if (rc == CUDA_ERROR_NOT_READY) Py_RETURN_NONE;
    return PyErr_Format(PyExc_RuntimeError, "cuEventElapsedTime failed (%d)", rc);
}

/* event_query(fn_address, handle): cuEventQuery on a raw event; True once complete, False while not, RuntimeError
 * on any other result (event_pool.py driver_query) */
static PyObject *event_query(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    void *fn, *a;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "event_query(fn_address, handle)");
        return NULL;
    }
    if (fn_of(args[0], &fn) < 0 || ptr_of(args[1], &a) < 0) return NULL;
    int rc = ((cu_event_query_fn)fn)(a);
    if (rc == 0) Py_RETURN_TRUE;
    if (rc == CUDA_ERROR_NOT_READY) Py_RETURN_FALSE;
    return PyErr_Format(PyExc_RuntimeError, "cuEventQuery failed (%d)", rc);
}

/* elapsed_batch(fn_address, ring, table, tail, head): the device times of the ring's records tail..head-1 that have
 * two events and no degraded reason, read in order with cuEventElapsedTime, each left in the ring's ``pre`` (readout.py
 * uses it instead of its own call); stops at the first pair that is unfinished or fails (that record and the later
 * ones keep NaN and the readout's own call answers for them). The GIL is released once around the driver calls of
 * up to BATCH records (the handles are read before, the results stored after, with it held): a call into the driver
 * between launches costs microseconds (bench/results/gpu-h200/driver_calls-9.log), and with the GIL released the
 * training thread runs meanwhile. The records are not reused while the readout has not moved the ring's tail past
 * them, and the events they hold are not returned to the pool before that. Returns the number of records given a
 * time. */
#define BATCH 256
static PyObject *elapsed_batch(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    void *fn;
    long long tail, head;
    if (nargs != 5 || !Py_IS_TYPE(args[1], &RingType) || !Py_IS_TYPE(args[2], &TableType)) {
        PyErr_SetString(PyExc_TypeError, "elapsed_batch(fn_address, ring, table, tail, head)");
        return NULL;
    }
    if (fn_of(args[0], &fn) < 0) return NULL;
    tail = PyLong_AsLongLong(args[3]);
    if (tail == -1 && PyErr_Occurred()) return NULL;
    head = PyLong_AsLongLong(args[4]);
    if (head == -1 && PyErr_Occurred()) return NULL;
    RingObject *r = (RingObject *)args[1];
    TableObject *tb = (TableObject *)args[2];
    if (r->cap == 0 || r->vbuf.obj == NULL) return PyLong_FromLong(0);
    if (tail < r->tail) tail = r->tail; /* only published, unread records: the readout's own */
    if (head > r->head) head = r->head;
    if (head > tail + r->cap) head = tail + r->cap;
    double *slot[BATCH];
    void *h[2 * BATCH];
    float ms[BATCH];
    long long given = 0;
    long long i = tail;
    while (i < head) {
        int m = 0;
        for (; i < head && m < BATCH; i++) {
            Rec *rec = R_REC(r, i);
            double *pre = R_PRE(r, i);
            if (rec->sev == NO_EVENT || rec->eev == NO_EVENT || rec->reason != 0 || *pre == *pre) continue;
            if (rec->sev >= tb->n || rec->eev >= tb->n) {
                i = head; /* the readout's own call meets that error */
                break;
            }
            h[2 * m] = (void *)(uintptr_t)T_HANDLE(tb)[rec->sev];
            h[2 * m + 1] = (void *)(uintptr_t)T_HANDLE(tb)[rec->eev];
            slot[m++] = pre;
        }
        int done = 0;
        if (m > 0) {
            Py_BEGIN_ALLOW_THREADS
            for (; done < m; done++)
                if (((cu_event_elapsed_fn)fn)(&ms[done], h[2 * done], h[2 * done + 1]) != 0) break;
            Py_END_ALLOW_THREADS
        }
        for (int k = 0; k < done; k++) *slot[k] = (double)ms[k];
        given += done;
        if (done < m) break;
    }
    return PyLong_FromLongLong(given);
}

/* ---- the readout's drain, packed (readout.py, records.py) ---------------------------------------------- */

/* The wire's interval record (records.py RECORD, "<HHHbBqiqqdqqq"): packed, little-endian. */
#define REC_SIZE 68
#define REC_HEADER 7 /* records.HEADER: an INTERVALS frame's type, length and count before its first record */
#define F_DEVICE 1
#define F_COLLECTIVE 32

/* ids[key] for a non-empty str key the child has (records.WireEncoder.ids), else -1 (no exception set) */
static long str_id(PyObject *ids, PyObject *key) {
    if (key == NULL || !PyUnicode_CheckExact(key) || PyUnicode_GetLength(key) == 0) return -1;
    PyObject *v = PyDict_GetItemWithError(ids, key); /* borrowed; a str key runs no Python code */
    if (v == NULL || !PyLong_CheckExact(v)) {
        PyErr_Clear();
        return -1;
    }
    long id = PyLong_AsLong(v);
    if (id < 0 || id >= 0xFFFF) {
        PyErr_Clear();
        return -1;
    }
    return id;
}

static inline void put(char **p, const void *v, size_t n) {
    memcpy(*p, v, n);
    *p += n;
}

/* pack_records(ring, table, head, ids, degraded, wall_offset, frame, count): the readout's drain of the common
 * records in C, packed straight into an INTERVALS frame (records.RecordBatch). From the ring's tail up to ``head``
 * it reads each record that is
 *   * device-timed and read: two events, no degraded reason, its device ms in the ring's ``pre`` (elapsed_batch);
 *     the events it owns go back to the table's free list (``tainted`` cleared), as readout.py returns them; or
 *   * host-only without events: no event, a degraded reason (counted in ``degraded``, the counters' array by code);
 * whose timer's name and group (and reason) have an id in ``ids`` (records.WireEncoder.ids); it writes the record
 * the wire encoder would (RecordBatch.put) at ``frame[REC_HEADER + count * REC_SIZE]``, and moves the tail on. It
 * stops at the first other record (readout.py reads that one: an unfinished or failed event, a timeout, a string
 * without an id yet) and when the frame is full. Returns (count, faults): the frame's records now, and the records
 * lost to an error returning their events (consumed without a record, as readout.py counts them in
 * faults_readout). */
static PyObject *pack_records(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 8 || !Py_IS_TYPE(args[0], &RingType) || !Py_IS_TYPE(args[1], &TableType) ||
        !PyDict_CheckExact(args[3]) || !PyByteArray_Check(args[6])) {
        PyErr_SetString(PyExc_TypeError,
                        "pack_records(ring, table, head, ids: dict, degraded, wall_offset, frame: bytearray, count)");
        return NULL;
    }
    RingObject *r = (RingObject *)args[0];
    TableObject *tb = (TableObject *)args[1];
    PyObject *ids = args[3], *frame = args[6];
    long long head = PyLong_AsLongLong(args[2]);
    if (head == -1 && PyErr_Occurred()) return NULL;
    long long off = PyLong_AsLongLong(args[5]);
    if (off == -1 && PyErr_Occurred()) return NULL;
    long long count = PyLong_AsLongLong(args[7]);
    if (count == -1 && PyErr_Occurred()) return NULL;
    Py_buffer vdeg;
    if (take_buffer(args[4], &vdeg, 1, 8, "degraded") < 0) return NULL;
    int64_t *degraded = (int64_t *)vdeg.buf;
    PyObject *names = reason_names;
    if (names == NULL || PyTuple_GET_SIZE(names) * 8 > vdeg.len) {
        PyBuffer_Release(&vdeg);
        PyErr_SetString(PyExc_TypeError, "set_reasons() first, with one name per counter of degraded");
        return NULL;
    }
    Py_INCREF(names);
    Py_ssize_t size = PyByteArray_Size(frame);
    long long cap = size >= REC_HEADER ? (size - REC_HEADER) / REC_SIZE : 0;
    long long faults = 0;
    if (r->cap == 0 || count < 0 || r->vbuf.obj == NULL) head = r->tail;
    if (head > r->head) head = r->head;
    char *base = PyByteArray_AsString(frame);
    PyObject *timers = r->timers;
    Py_ssize_t ntimers = timers != NULL && PyList_Check(timers) ? PyList_GET_SIZE(timers) : 0;
    while (r->tail < head && count < cap) {
        Rec *rec = R_REC(r, r->tail);
        double *pre = R_PRE(r, r->tail);
        if (rec->timer >= ntimers) break;
        PyObject *entry = PyList_GET_ITEM(timers, rec->timer); /* (name, level, group, collective) */
        if (!PyTuple_CheckExact(entry) || PyTuple_GET_SIZE(entry) != 4) break;
        int device = rec->sev != NO_EVENT;
        double dev = 0.0;
        if (device) {
            if (rec->eev == NO_EVENT || rec->reason != 0 || *pre != *pre || rec->sev >= tb->n || rec->eev >= tb->n)
                break;
            dev = *pre;
        } else {
            if (rec->eev != NO_EVENT || rec->reason == 0 || rec->reason >= PyTuple_GET_SIZE(names)) break;
        }
        long name_id = str_id(ids, PyTuple_GET_ITEM(entry, 0)), group_id = str_id(ids, PyTuple_GET_ITEM(entry, 2));
        long reason_id = device ? 0xFFFF : str_id(ids, PyTuple_GET_ITEM(names, rec->reason));
        if (name_id < 0 || group_id < 0 || reason_id < 0) break;
        PyObject *lv = PyTuple_GET_ITEM(entry, 1);
        if (!PyLong_CheckExact(lv)) break;
        long level = PyLong_AsLong(lv);
        if (level < -128 || level > 127) {
            PyErr_Clear();
            break;
        }
        int collective = PyObject_IsTrue(PyTuple_GET_ITEM(entry, 3));
        if (collective < 0) {
            PyErr_Clear();
            break;
        }
        long long start, end;
        if (__builtin_add_overflow(rec->start_ns, off, &start) || __builtin_add_overflow(rec->end_ns, off, &end)) break;
        /* the record is this function's: from here on it is read and consumed, with or without a wire record */
        int failed = 0;
        if (device) {
            int evs[2] = {rec->sev, rec->eev};
            for (int k = 0; k < 2 && !failed; k++) {
                if (!(rec->own & (1 << k))) continue;
                T_TAINTED(tb)[evs[k]] = 0;
                if (call_append(tb->free, evs[k]) < 0) failed = 1;
            }
        } else {
            degraded[rec->reason] += 1;
        }
        *pre = NAN;
        r->tail += 1;
        if (failed) {
            PyErr_Clear();
            faults += 1;
            continue;
        }
        unsigned short u16[3] = {(unsigned short)name_id, (unsigned short)group_id, (unsigned short)reason_id};
        signed char lvl = (signed char)level;
        unsigned char flags = (unsigned char)((device ? F_DEVICE : 0) | rec->flags | (collective ? F_COLLECTIVE : 0));
        int64_t step = rec->step, tokens = rec->tokens, seqs = rec->sequences, mbs = rec->microbatches;
        int32_t repeat = rec->repeat;
        char *p = base + REC_HEADER + count * REC_SIZE;
        put(&p, u16, sizeof u16);
        put(&p, &lvl, 1);
        put(&p, &flags, 1);
        put(&p, &step, 8);
        put(&p, &repeat, 4);
        put(&p, &start, 8);
        put(&p, &end, 8);
        put(&p, &dev, 8);
        put(&p, &tokens, 8);
        put(&p, &seqs, 8);
        put(&p, &mbs, 8);
        count += 1;
    }
    Py_DECREF(names);
    PyBuffer_Release(&vdeg);
    return Py_BuildValue("(LL)", count, faults);
}

/* ---- module ------------------------------------------------------------------------------------------- */

static PyObject *set_reasons(PyObject *mod, PyObject *args) {
    int b, c, d;
    PyObject *names;
    if (!PyArg_ParseTuple(args, "O!iii", &PyTuple_Type, &names, &b, &c, &d)) return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(names);
    if (n > 256 || b <= 0 || c <= 0 || d <= 0 || b >= n || c >= n || d >= n) {
        PyErr_SetString(PyExc_ValueError, "set_reasons(names, sampled_out, cuda_error, pool_exhausted): codes index names");
        return NULL;
    }
    Py_XSETREF(reason_names, Py_NewRef(names));
    r_sampled_out = b;
    r_cuda_error = c;
    r_pool_exhausted = d;
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"event_elapsed", (PyCFunction)(void (*)(void))event_elapsed, METH_FASTCALL,
     "event_elapsed(fn_address, start_handle, end_handle): cuEventElapsedTime; ms, or None while unfinished."},
    {"event_query", (PyCFunction)(void (*)(void))event_query, METH_FASTCALL,
     "event_query(fn_address, handle): cuEventQuery; True once the event completed."},
    {"elapsed_batch", (PyCFunction)(void (*)(void))elapsed_batch, METH_FASTCALL,
     "elapsed_batch(fn_address, ring, table, tail, head): pending records' device ms into ring.pre, GIL released."},
    {"pack_records", (PyCFunction)(void (*)(void))pack_records, METH_FASTCALL,
     "pack_records(ring, table, head, ids, degraded, wall_offset, frame, count): ring records into wire records."},
    {"set_reasons", set_reasons, METH_VARARGS,
     "set_reasons(names, sampled_out, cuda_error, pool_exhausted): the degraded reasons by code (counters.py)."},
    {NULL},
};

#define NTYPES 7
static PyTypeObject *types[NTYPES] = {&HotCountersType, &TableType, &RingType, &ShareType,
                                      &StepStateType, &TimerType, &TimersType};
static const char *type_names[NTYPES] = {"HotCounters", "EventTable", "Ring", "SharedEvent",
                                         "StepState", "TimerCore", "TimersCore"};

/* multi-phase initialisation: the types are static (one interpreter), the GIL is held throughout (every field is
 * guarded by it: the readout and the training thread share the ring without a lock) */
static int module_exec(PyObject *m) {
    for (int i = 0; i < NTYPES; i++)
        if (PyModule_AddObjectRef(m, type_names[i], (PyObject *)types[i]) < 0) return -1;
    PyObject *no_reuse = PyLong_FromLongLong(NO_REUSE);
    if (no_reuse == NULL) return -1;
    int rc = PyModule_AddObjectRef(m, "NO_REUSE", no_reuse);
    Py_DECREF(no_reuse);
    if (rc < 0) return -1;
    if (PyModule_AddIntConstant(m, "RECORD_SIZE", REC_SIZE) < 0 ||
        PyModule_AddIntConstant(m, "RECORD_HEADER", REC_HEADER) < 0 ||
        PyModule_AddIntConstant(m, "RING_RECORD_SIZE", (long)sizeof(Rec)) < 0)
        return -1;
    return 0;
}

static PyModuleDef_Slot module_slots[] = {
    {Py_mod_exec, (void *)module_exec},
#if PY_VERSION_HEX >= 0x030C0000
    {Py_mod_multiple_interpreters, Py_MOD_MULTIPLE_INTERPRETERS_NOT_SUPPORTED},
#endif
#if PY_VERSION_HEX >= 0x030D0000
    {Py_mod_gil, Py_MOD_GIL_USED},
#endif
    {0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "otel_straggler._hotpath",
    .m_doc = "The training thread's hot path in C (see the source's header; hot_path.py chooses it).",
    .m_size = 0,
    .m_methods = module_methods,
    .m_slots = module_slots,
};

#define INTERN(var, text)                                                                                         \
    if ((var = PyUnicode_InternFromString(text)) == NULL) return NULL

PyMODINIT_FUNC PyInit__hotpath(void) {
    INTERN(s_apply, "apply");
    INTERN(s_step_timer_started, "step_timer_started");
    INTERN(s_append, "append");
    INTERN(s_popleft, "popleft");
    INTERN(s_barrier, "barrier");
    INTERN(s_get, "_get");
    INTERN(s_log_level, "log_level");
    for (int i = 0; i < NTYPES; i++)
        if (PyType_Ready(types[i]) < 0) return NULL;
    return PyModuleDef_Init(&module_def);
}
