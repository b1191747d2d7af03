/* The training thread's hot path in C: Timer.start / Timer.stop and the state they touch.
 *
 * Why: between a step's kernel launches a start+stop of the Python timers finds its bytecode, inline caches and
 * objects evicted, and pays for the cache lines it touches, several times its tight-loop cost
 * (bench/results/cpu-native-floor.md, bench/results/cpu-hot-path-ab.md, bench/results/gpu-h200.md runs 11-13).
 * Here the same logic reads and writes C struct fields.
 *
 * What: five types with the attribute names of their Python counterparts, so every other part of the package
 * (the readout thread, StepContext's sampling logic, Timer's Megatron API, the tests) reads and writes them
 * unchanged:
 *   Slot, Ring          ring.py          (one interval's fields; the single-producer single-consumer ring)
 *   SharedEvent         shared_event.py  (the latest boundary's event, reused by adjacent boundaries)
 *   StepState           step_context.py  (the four fields the hot path reads; StepContext derives from it)
 *   TimerCore           timers.py        (a timer's state and start/stop; Timer derives from it)
 * The logic is the Python path's, line for line (timers.py _PyTimerCore, shared_event.py PySharedEvent); the
 * emitter tests run against both (scripts/test). Pool events stay Python objects (their refs/tag/tainted
 * attributes are touched only on a boundary that records or reuses one). With the driver's record API the
 * record is one cuEventRecord through the function pointer the pool resolved (event_pool.py driver_recorder),
 * not a ctypes call.
 *
 * Rules kept from the Python path: no lock, no I/O, no device call other than the record; every Exception
 * inside start/stop is cleared and counted (faults_training), never raised into training; a KeyboardInterrupt or
 * SystemExit (a signal handler run by Python code this calls) propagates, and the call lets go of the events it
 * held (abandon). An object read across a call into Python is held by a strong reference. Everything runs with
 * the GIL held, which is what orders the producer's slot writes before its head store for the readout thread.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <time.h>

#define NO_REUSE (-(1LL << 62))

static PyTypeObject TimerType; /* defined below */

/* interned attribute and method names */
static PyObject *s_refs, *s_tag, *s_tainted, *s_handle, *s_record, *s_apply, *s_step_timer_started, *s_append,
    *s_popleft, *s_unbalanced, *s_barriers_skipped, *s_faults_training, *s_dropped_ring_full, *s_barrier;
/* degraded reasons (counters.py), set once by set_reasons() */
static PyObject *r_sampled_out, *r_cuda_error, *r_pool_exhausted;

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

/* ---- small helpers on Python objects (cold paths, pool events and counters) ------------------------------ */

/* Where an attribute lives in its object: the offset of a writable __slots__ member (EmitterCounters, the pool's
 * events: event_pool.py), else 0. A generic getattr/setattr looks the descriptor up in the type's MRO every time,
 * and between a step's launches that lookup is cold: it cost a barrier=True start more than the rest of the start,
 * and a device-sampled boundary touches an event's refs, tag or handle several times
 * (bench/results/cpu-cold-calls.md). Only a member of the object's own type or a base (the check the descriptor
 * makes) on a type with the generic getattr and setattr qualifies (no hook is bypassed). A few (type, name) pairs
 * are kept, each with the type's version tag: a change to the type (a new __setattr__, a property over the slot)
 * retires the tag and the entry is looked up again. The types are held, so an address is never another type's. */
#define OFFSETS 16
static struct {
    PyTypeObject *type;
    PyObject *name;
    unsigned int tag;
    Py_ssize_t offset;
} offsets[OFFSETS];

static inline int tag_valid(PyTypeObject *tp, unsigned int tag) {
    return (tp->tp_flags & Py_TPFLAGS_VALID_VERSION_TAG) && tp->tp_version_tag == tag && tag != 0;
}

static Py_ssize_t slot_offset(PyTypeObject *tp, PyObject *name) {
    int i = 0;
    for (; i < OFFSETS && offsets[i].type != NULL; i++) {
        if (offsets[i].type == tp && offsets[i].name == name) {
            if (tag_valid(tp, offsets[i].tag)) return offsets[i].offset;
            break; /* the type changed since: look again, in this entry */
        }
    }
    Py_ssize_t off = 0;
    PyObject *d = _PyType_Lookup(tp, name); /* borrowed; gives the type a version tag */
    if (d != NULL && Py_IS_TYPE(d, &PyMemberDescr_Type) && tp->tp_getattro == PyObject_GenericGetAttr &&
        tp->tp_setattro == PyObject_GenericSetAttr && PyType_IsSubtype(tp, PyDescr_TYPE(d))) {
        PyMemberDef *m = ((PyMemberDescrObject *)d)->d_member;
        if (m->type == T_OBJECT_EX && !(m->flags & READONLY)) off = m->offset;
    }
    unsigned int tag = (tp->tp_flags & Py_TPFLAGS_VALID_VERSION_TAG) ? tp->tp_version_tag : 0;
    if (i < OFFSETS) {
        if (offsets[i].type == NULL) {
            offsets[i].type = (PyTypeObject *)Py_NewRef((PyObject *)tp);
            offsets[i].name = Py_NewRef(name);
        }
        offsets[i].tag = tag;
        offsets[i].offset = off;
    }
    return tag != 0 ? off : 0; /* no tag: nothing tells a later change, so the generic path answers */
}

/* Whether a timer's name, group, level and collective flag are TimerCore's own fields: no class between its type
 * and TimerCore defines one of those names (a property over them, say), so reading the C fields reads what Python
 * would. Kept per type and version tag like the offsets. */
static PyObject *s_label, *s_group_attr, *s_level_attr, *s_collective;
#define PLAIN 8
static struct {
    PyTypeObject *type;
    unsigned int tag;
    int plain;
} plain_types[PLAIN];

static int plain_timer(PyObject *o) {
    PyTypeObject *tp = Py_TYPE(o);
    if (tp == &TimerType) return 1;
    int i = 0;
    for (; i < PLAIN && plain_types[i].type != NULL; i++) {
        if (plain_types[i].type == tp) {
            if (tag_valid(tp, plain_types[i].tag)) return plain_types[i].plain;
            break;
        }
    }
    if (!PyType_IsSubtype(tp, &TimerType)) return 0;
    int plain = 1;
    PyObject *mro = tp->tp_mro;
    PyObject *names[4] = {s_label, s_group_attr, s_level_attr, s_collective};
    for (Py_ssize_t k = 0; plain && mro != NULL && k < PyTuple_GET_SIZE(mro); k++) {
        PyTypeObject *base = (PyTypeObject *)PyTuple_GET_ITEM(mro, k);
        if (base == &TimerType) break;
        PyObject *dict = base->tp_dict;
        for (int n = 0; plain && dict != NULL && n < 4; n++) {
            if (PyDict_GetItemWithError(dict, names[n]) != NULL) plain = 0;
            else if (PyErr_Occurred()) {
                PyErr_Clear();
                plain = 0;
            }
        }
    }
    (void)_PyType_Lookup(tp, s_label); /* gives the type a version tag */
    unsigned int tag = (tp->tp_flags & Py_TPFLAGS_VALID_VERSION_TAG) ? tp->tp_version_tag : 0;
    if (tag == 0) return 0;
    if (i < PLAIN) {
        if (plain_types[i].type == NULL) plain_types[i].type = (PyTypeObject *)Py_NewRef((PyObject *)tp);
        plain_types[i].tag = tag;
        plain_types[i].plain = plain;
    }
    return plain;
}

static inline PyObject **slot_of(PyObject *o, PyObject *name) {
    Py_ssize_t off = slot_offset(Py_TYPE(o), name);
    return off > 0 ? (PyObject **)((char *)o + off) : NULL;
}

/* o.<name>, a new reference (AttributeError when unset, like getattr) */
static PyObject *get_obj(PyObject *o, PyObject *name) {
    PyObject **s = slot_of(o, name);
    if (s != NULL && *s != NULL) return Py_NewRef(*s);
    return PyObject_GetAttr(o, name);
}

/* o.<name> = v */
static int set_obj(PyObject *o, PyObject *name, PyObject *v) {
    PyObject **s = slot_of(o, name);
    if (s == NULL) return PyObject_SetAttr(o, name, v);
    PyObject *old = *s;
    *s = Py_NewRef(v);
    Py_XDECREF(old);
    return 0;
}

static int get_ll(PyObject *o, PyObject *name, long long *out) {
    PyObject *v = get_obj(o, name);
    if (v == NULL) return -1;
    *out = PyLong_AsLongLong(v);
    Py_DECREF(v);
    return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

static int set_ll(PyObject *o, PyObject *name, long long x) {
    PyObject *v = PyLong_FromLongLong(x);
    if (v == NULL) return -1;
    int rc = set_obj(o, name, v);
    Py_DECREF(v);
    return rc;
}

static int add_ll(PyObject *o, PyObject *name, long long d, long long *after) {
    long long v;
    PyObject **s = slot_of(o, name); /* one lookup for the read and the write */
    if (s == NULL || *s == NULL) {
        if (get_ll(o, name, &v) < 0) return -1;
        v += d;
        if (after != NULL) *after = v;
        return set_ll(o, name, v);
    }
    v = PyLong_AsLongLong(*s);
    if (v == -1 && PyErr_Occurred()) return -1;
    v += d;
    PyObject *nv = PyLong_FromLongLong(v);
    if (nv == NULL) return -1;
    Py_SETREF(*s, nv);
    if (after != NULL) *after = v;
    return 0;
}

/* counters.<name> += 1; an error here is swallowed (the counter is best effort, training goes on) */
static void bump(PyObject *counters, PyObject *name) {
    if (counters == NULL || add_ll(counters, name, 1, NULL) < 0) PyErr_Clear();
}

static int call_append(PyObject *dq, PyObject *item) {
    PyObject *args[3] = {NULL, dq, item}; /* args[0]: the slot PY_VECTORCALL_ARGUMENTS_OFFSET lets the callee use */
    PyObject *r = PyObject_VectorcallMethod(s_append, args + 1, 2 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
    if (r == NULL) return -1;
    Py_DECREF(r);
    return 0;
}

/* free.popleft(): a new reference, or NULL with no exception set when the deque is empty */
static PyObject *pop_free(PyObject *dq) {
    if (PyObject_Length(dq) <= 0) {
        PyErr_Clear();
        return NULL;
    }
    PyObject *args[2] = {NULL, dq};
    PyObject *ev = PyObject_VectorcallMethod(s_popleft, args + 1, 1 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
    if (ev == NULL) PyErr_Clear();
    return ev;
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

/* ---- Slot --------------------------------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    PyObject *timer;
    long long start_ns;
    long long end_ns;
    PyObject *start_ev;
    PyObject *end_ev;
    int own;
    PyObject *binding;
    long long repeat;
    PyObject *reason;
    char injected;
    PyObject *pre; /* the device ms elapsed_batch read for it (readout thread only), else NULL/None */
} SlotObject;

static int Slot_traverse(SlotObject *s, visitproc visit, void *arg) {
    Py_VISIT(s->timer);
    Py_VISIT(s->start_ev);
    Py_VISIT(s->end_ev);
    Py_VISIT(s->binding);
    Py_VISIT(s->reason);
    Py_VISIT(s->pre);
    return 0;
}

static int Slot_clear(SlotObject *s) {
    Py_CLEAR(s->timer);
    Py_CLEAR(s->start_ev);
    Py_CLEAR(s->end_ev);
    Py_CLEAR(s->binding);
    Py_CLEAR(s->reason);
    Py_CLEAR(s->pre);
    return 0;
}

static void Slot_dealloc(SlotObject *s) {
    PyObject_GC_UnTrack(s);
    Slot_clear(s);
    Py_TYPE(s)->tp_free((PyObject *)s);
}

static PyMemberDef Slot_members[] = {
    {"timer", T_OBJECT, offsetof(SlotObject, timer), 0, NULL},
    {"start_ns", T_LONGLONG, offsetof(SlotObject, start_ns), 0, NULL},
    {"end_ns", T_LONGLONG, offsetof(SlotObject, end_ns), 0, NULL},
    {"start_ev", T_OBJECT, offsetof(SlotObject, start_ev), 0, NULL},
    {"end_ev", T_OBJECT, offsetof(SlotObject, end_ev), 0, NULL},
    {"own", T_INT, offsetof(SlotObject, own), 0, NULL},
    {"binding", T_OBJECT, offsetof(SlotObject, binding), 0, NULL},
    {"repeat", T_LONGLONG, offsetof(SlotObject, repeat), 0, NULL},
    {"reason", T_OBJECT, offsetof(SlotObject, reason), 0, NULL},
    {"injected", T_BOOL, offsetof(SlotObject, injected), 0, NULL},
    {"pre", T_OBJECT, offsetof(SlotObject, pre), 0, NULL},
    {NULL},
};

static PyTypeObject SlotType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "otel_straggler._hotpath.Slot",
    .tp_doc = "One interval's fields (ring.py PySlot).",
    .tp_basicsize = sizeof(SlotObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = PyType_GenericNew,
    .tp_dealloc = (destructor)Slot_dealloc,
    .tp_traverse = (traverseproc)Slot_traverse,
    .tp_clear = (inquiry)Slot_clear,
    .tp_members = Slot_members,
};

/* ---- Ring --------------------------------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    long long cap;
    long long mask;
    long long head; /* written by the training thread only */
    long long tail; /* written by the readout thread only */
    PyObject *slots; /* tuple of Slot, max(cap, 1) long; never replaced */
} RingObject;

static int Ring_init(RingObject *r, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"capacity", NULL};
    long long capacity;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "L", kwlist, &capacity)) return -1;
    long long cap = 0;
    if (capacity > 0) {
        if (capacity > (1LL << 40)) {
            PyErr_SetString(PyExc_ValueError, "ring capacity too large");
            return -1;
        }
        cap = 1;
        while (cap < capacity) cap <<= 1;
    }
    long long n = cap > 0 ? cap : 1;
    PyObject *slots = PyTuple_New((Py_ssize_t)n); /* a tuple: nothing can put another object in a slot's place */
    if (slots == NULL) return -1;
    for (long long i = 0; i < n; i++) {
        PyObject *s = PyType_GenericNew(&SlotType, NULL, NULL);
        if (s == NULL) {
            Py_DECREF(slots);
            return -1;
        }
        PyTuple_SET_ITEM(slots, (Py_ssize_t)i, s);
    }
    Py_XSETREF(r->slots, slots);
    r->cap = cap;
    r->mask = cap ? cap - 1 : 0;
    r->head = 0;
    r->tail = 0;
    return 0;
}

static int Ring_traverse(RingObject *r, visitproc visit, void *arg) {
    Py_VISIT(r->slots);
    return 0;
}

static int Ring_clear(RingObject *r) {
    Py_CLEAR(r->slots);
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
    {"slots", T_OBJECT, offsetof(RingObject, slots), READONLY, NULL},
    {NULL},
};

static PyTypeObject RingType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "otel_straggler._hotpath.Ring",
    .tp_doc = "Ring(capacity): the fixed single-producer single-consumer ring of intervals (ring.py PyRing).",
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
    PyObject *ev;
    long long gap_ns;
    long long ns;
    PyObject *orphans;
    long long records;
    PyObject *ring; /* a Ring */
    PyObject *stream;
    PyObject *stream_of;
} ShareObject;

static int Share_init(ShareObject *sh, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"gap_us", "stream_of", "orphans", "ring", NULL};
    double gap_us;
    PyObject *stream_of, *orphans, *ring;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "$dOOO", kwlist, &gap_us, &stream_of, &orphans, &ring)) return -1;
    if (!Py_IS_TYPE(ring, &RingType)) {
        PyErr_SetString(PyExc_TypeError, "ring must be an otel_straggler._hotpath.Ring");
        return -1;
    }
    sh->gap_ns = stream_of != Py_None ? (long long)(gap_us * 1000.0) : 0;
    Py_XSETREF(sh->stream_of, Py_NewRef(stream_of));
    Py_XSETREF(sh->orphans, Py_NewRef(orphans));
    Py_XSETREF(sh->ring, Py_NewRef(ring));
    Py_CLEAR(sh->ev);
    Py_CLEAR(sh->stream);
    sh->ns = 0;
    sh->at_stop = 0;
    sh->records = 0;
    return 0;
}

/* an event nothing refers to any more goes back through the readout once every slot before the ring's head was
 * read: tag = head, then onto the orphans */
static int orphan(ShareObject *sh, PyObject *ev) {
    if (sh->ring == NULL || sh->orphans == NULL) {
        PyErr_SetString(PyExc_TypeError, "SharedEvent not initialised");
        return -1;
    }
    if (set_ll(ev, s_tag, ((RingObject *)sh->ring)->head) < 0) return -1;
    return call_append(sh->orphans, ev);
}

/* SharedEvent.recorded(ev, ns, stream, at_stop) */
static int share_recorded(ShareObject *sh, PyObject *ev, long long ns, PyObject *stream, int at_stop) {
    sh->records++;
    if (sh->gap_ns) {
        PyObject *old = sh->ev;
        if (is_set(old)) {
            long long refs;
            if (get_ll(old, s_refs, &refs) < 0) return -1;
            if (refs <= 0 && orphan(sh, old) < 0) return -1;
        }
        Py_XSETREF(sh->ev, Py_NewRef(ev));
        sh->ns = ns;
        Py_XSETREF(sh->stream, Py_NewRef(stream));
        sh->at_stop = (char)at_stop;
    }
    return 0;
}

static PyObject *Share_recorded(ShareObject *sh, PyObject *args) {
    PyObject *ev, *stream;
    long long ns;
    int at_stop;
    if (!PyArg_ParseTuple(args, "OLOp", &ev, &ns, &stream, &at_stop)) return NULL;
    if (share_recorded(sh, ev, ns, stream, at_stop) < 0) return NULL;
    Py_RETURN_NONE;
}

/* SharedEvent.release(ev): 0, or -1 with an exception */
static int release(ShareObject *sh, PyObject *ev) {
    long long refs;
    if (add_ll(ev, s_refs, -1, &refs) < 0) return -1;
    if (set_obj(ev, s_tainted, Py_True) < 0) return -1;
    if (refs <= 0 && ev != sh->ev && orphan(sh, ev) < 0) return -1;
    return 0;
}

static PyObject *Share_release(ShareObject *sh, PyObject *ev) {
    if (release(sh, ev) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *Share_retire(ShareObject *sh, PyObject *Py_UNUSED(ignored)) {
    PyObject *ev = sh->ev;
    sh->ev = NULL;
    if (is_set(ev)) {
        long long refs;
        if (get_ll(ev, s_refs, &refs) < 0 || (refs <= 0 && orphan(sh, ev) < 0)) {
            Py_DECREF(ev);
            return NULL;
        }
    }
    Py_XDECREF(ev);
    Py_RETURN_NONE;
}

static int Share_traverse(ShareObject *sh, visitproc visit, void *arg) {
    Py_VISIT(sh->ev);
    Py_VISIT(sh->orphans);
    Py_VISIT(sh->ring);
    Py_VISIT(sh->stream);
    Py_VISIT(sh->stream_of);
    return 0;
}

static int Share_clear(ShareObject *sh) {
    Py_CLEAR(sh->ev);
    Py_CLEAR(sh->orphans);
    Py_CLEAR(sh->ring);
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
    {"ev", T_OBJECT, offsetof(ShareObject, ev), 0, NULL},
    {"gap_ns", T_LONGLONG, offsetof(ShareObject, gap_ns), 0, NULL},
    {"ns", T_LONGLONG, offsetof(ShareObject, ns), 0, NULL},
    {"orphans", T_OBJECT, offsetof(ShareObject, orphans), READONLY, NULL},
    {"records", T_LONGLONG, offsetof(ShareObject, records), 0, NULL},
    {"ring", T_OBJECT, offsetof(ShareObject, ring), READONLY, NULL},
    {"stream", T_OBJECT, offsetof(ShareObject, stream), 0, NULL},
    {"stream_of", T_OBJECT, offsetof(ShareObject, stream_of), READONLY, NULL},
    {NULL},
};

static PyTypeObject ShareType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "otel_straggler._hotpath.SharedEvent",
    .tp_doc = "SharedEvent(*, gap_us, stream_of, orphans, ring) (shared_event.py PySharedEvent).",
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
    int eq = PyObject_RichCompareBool(cur, sh->stream ? sh->stream : Py_None, Py_EQ);
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
    PyObject *binding; /* (step, tokens, sequences, microbatches) */
    PyObject *device_on;
    PyObject *host_reason;
} StepStateObject;

static int StepState_traverse(StepStateObject *s, visitproc visit, void *arg) {
    Py_VISIT(s->binding);
    Py_VISIT(s->device_on);
    Py_VISIT(s->host_reason);
    return 0;
}

static int StepState_clear(StepStateObject *s) {
    Py_CLEAR(s->binding);
    Py_CLEAR(s->device_on);
    Py_CLEAR(s->host_reason);
    return 0;
}

static void StepState_dealloc(StepStateObject *s) {
    PyObject_GC_UnTrack(s);
    StepState_clear(s);
    Py_TYPE(s)->tp_free((PyObject *)s);
}

static PyMemberDef StepState_members[] = {
    {"step", T_LONGLONG, offsetof(StepStateObject, step), 0, NULL},
    {"binding", T_OBJECT, offsetof(StepStateObject, binding), 0, NULL},
    {"device_on", T_OBJECT, offsetof(StepStateObject, device_on), 0, NULL},
    {"host_reason", T_OBJECT, offsetof(StepStateObject, host_reason), 0, NULL},
    {NULL},
};

static PyTypeObject StepStateType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "otel_straggler._hotpath.StepState",
    .tp_doc = "The step fields the hot path reads (step_context.py PyStepState).",
    .tp_basicsize = sizeof(StepStateObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_BASETYPE,
    .tp_new = PyType_GenericNew,
    .tp_dealloc = (destructor)StepState_dealloc,
    .tp_traverse = (traverseproc)StepState_traverse,
    .tp_clear = (inquiry)StepState_clear,
    .tp_members = StepState_members,
};

/* ---- TimerCore ---------------------------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    char started;
    char is_step;
    char collective;
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
    PyObject *sev;
    PyObject *reason;
    PyObject *name;
    PyObject *label; /* the wire's name: str, bounded (interval.py bound_name) */
    PyObject *level; /* Megatron's log level: any number */
    PyObject *group;
    PyObject *c;       /* EmitterCounters */
    PyObject *ctx;     /* StepState */
    PyObject *share;   /* SharedEvent */
    PyObject *ring;    /* Ring */
    PyObject *free;    /* the pool's free deque */
    PyObject *orphans; /* the pool's orphans deque */
    PyObject *record;  /* the pool's record(ev) -> stream */
    PyObject *inject;
    PyObject *clock; /* None: CLOCK_MONOTONIC; else a callable returning ns (the tests' fake host clock) */
} TimerObject;

static inline long long timer_clock(TimerObject *t) {
    if (!is_set(t->clock)) return mono_ns();
    PyObject *v = PyObject_CallNoArgs(t->clock);
    if (v == NULL) return -1;
    long long ns = PyLong_AsLongLong(v);
    Py_DECREF(v);
    return ns;
}

static inline void set_reason(TimerObject *t, PyObject *reason) { Py_XSETREF(t->reason, Py_XNewRef(reason)); }

/* an event's raw CUevent (its ``handle``) */
static int handle_of(PyObject *ev, void **out) {
    PyObject *h = get_obj(ev, s_handle);
    if (h == NULL) return -1;
    *out = PyLong_AsVoidPtr(h);
    Py_DECREF(h);
    return PyErr_Occurred() ? -1 : 0;
}

/* record ev on the current stream: the stream recorded on (a new reference; None when torch's record made up
 * for a failed driver record), or NULL with an exception */
static PyObject *do_record(TimerObject *t, ShareObject *sh, PyObject *ev) {
    if (t->cu_record && is_set(sh->stream_of)) {
        PyObject *stream = PyObject_CallNoArgs(sh->stream_of);
        if (stream == NULL) return NULL;
        void *handle = NULL, *raw = NULL;
        if (handle_of(ev, &handle) == 0 && stream != Py_None) raw = PyLong_AsVoidPtr(stream);
        if (PyErr_Occurred()) {
            Py_DECREF(stream);
            return NULL;
        }
        if (((cu_event_record_fn)(uintptr_t)t->cu_record)(handle, raw) == 0) return stream;
        Py_DECREF(stream);
        PyObject *args[2] = {NULL, ev};
        PyObject *r = PyObject_VectorcallMethod(s_record, args + 1, 1 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
        if (r == NULL) return NULL;
        Py_DECREF(r);
        Py_RETURN_NONE;
    }
    return PyObject_CallOneArg(t->record, ev);
}

/* _ctx, _share, _ring and _free are checked when set (Timer_set_wire), so the hot path only asks whether they
 * are */
static inline int check_wiring(TimerObject *t) {
    if (t->ctx == NULL || t->share == NULL || t->ring == NULL || t->free == NULL || t->record == NULL ||
        t->orphans == NULL) {
        PyErr_SetString(PyExc_TypeError, "timer not wired to the native ring, shared event and step state");
        return -1;
    }
    return 0;
}

static PyObject *fault(TimerObject *t) {
    if (users()) return NULL;
    PyErr_Clear();
    bump(t->c, s_faults_training);
    Py_RETURN_NONE;
}

/* start's work once the call shape and balance are checked; ctx and sh are strong references the caller holds
 * (a call into Python below, the stream lookup or a record, could replace the timer's own) */
static PyObject *start_impl(TimerObject *t, StepStateObject *ctx, ShareObject *sh) {
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
                set_reason(t, r_sampled_out); /* another repeat of this step has its device time */
                sh->ns = NO_REUSE;            /* its GPU work is in no later boundary's reused event */
                t->started = 1;
                long long now = timer_clock(t);
                if (now == -1 && PyErr_Occurred()) return fault(t);
                t->t0 = now;
                Py_RETURN_NONE;
            }
        }
        long long now = timer_clock(t);
        if (now == -1 && PyErr_Occurred()) return fault(t);
        PyObject *ev = Py_XNewRef(sh->ev);
        int same = is_set(ev) && now - sh->ns < sh->gap_ns ? same_stream(sh) : 0;
        if (same < 0) {
            Py_DECREF(ev);
            return NULL;
        }
        if (same) {
            if (add_ll(ev, s_refs, 1, NULL) < 0) { /* the previous boundary's event, reused */
                Py_DECREF(ev);
                return fault(t);
            }
            Py_XSETREF(t->sev, ev);
            set_reason(t, NULL);
            t->started = 1;
            t->t0 = now;
            Py_RETURN_NONE;
        }
        Py_XDECREF(ev);
        ev = pop_free(t->free);
        if (ev != NULL) {
            if (set_ll(ev, s_refs, 1) < 0) {
                Py_DECREF(ev);
                return fault(t);
            }
            Py_XSETREF(t->sev, Py_NewRef(ev)); /* and this call keeps its own until the record is done */
            set_reason(t, NULL);
            PyObject *stream = do_record(t, sh, ev);
            if (stream == NULL) {
                if (users()) {
                    Py_DECREF(ev);
                    return NULL;
                }
                PyErr_Clear();
                set_reason(t, r_cuda_error);
                sh->ns = NO_REUSE;
            } else {
                int rc = share_recorded(sh, ev, now, stream, 0);
                Py_DECREF(stream);
                if (rc < 0) {
                    Py_DECREF(ev);
                    return fault(t);
                }
            }
            Py_DECREF(ev);
        } else {
            set_reason(t, r_pool_exhausted);
            sh->ns = NO_REUSE;
        }
    } else {
        set_reason(t, is_set(ctx->host_reason) ? ctx->host_reason : NULL);
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
    PyObject *sev = t->sev;
    t->sev = NULL;
    if (sev == NULL) return;
    PyObject *et, *ev, *tb;
    PyErr_Fetch(&et, &ev, &tb);
    if (sev != Py_None && release(sh, sev) < 0) PyErr_Clear();
    Py_DECREF(sev);
    PyErr_Restore(et, ev, tb);
}

/* a start of a started timer or a stop of a stopped one: counted, then raised as Megatron's assert raises it */
static PyObject *misuse(TimerObject *t, const char *msg) {
    bump(t->c, s_unbalanced);
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
    if (barrier) bump(t->c, s_barriers_skipped);
    if (check_wiring(t) < 0) return fault(t);
    PyObject *ctx = Py_NewRef(t->ctx), *sh = Py_NewRef(t->share);
    PyObject *r = start_impl(t, (StepStateObject *)ctx, (ShareObject *)sh);
    if (r == NULL) abandon(t, (ShareObject *)sh);
    Py_DECREF(ctx);
    Py_DECREF(sh);
    return r;
}

/* the dropped interval's events: no slot reads them, so whoever returns them waits for them to complete */
static int drop_events(TimerObject *t, PyObject *sev, PyObject *eev, int own, long long h) {
    if (sev == NULL) return 0;
    if (set_obj(sev, s_tainted, Py_True) < 0) return -1;
    if (own & 1) {
        if (set_ll(sev, s_tag, h) < 0 || call_append(t->orphans, sev) < 0) return -1;
    }
    if (eev != NULL) {
        if (set_obj(eev, s_tainted, Py_True) < 0) return -1;
        if (own & 2) {
            if (set_ll(eev, s_tag, h) < 0 || call_append(t->orphans, eev) < 0) return -1;
        }
    }
    return 0;
}

/* stop's work once the call shape and balance are checked; ctx, sh and ring are strong references the caller
 * holds. Every object this keeps across a call into Python (the binding, the events) is a strong reference too. */
static PyObject *stop_impl(TimerObject *t, StepStateObject *ctx, ShareObject *sh, RingObject *r) {
    int injected = 0;
    if (is_set(t->inject)) {
        PyObject *step = PyLong_FromLongLong(ctx->step);
        if (step == NULL) return fault(t);
        PyObject *a[3] = {NULL, t->inject, step};
        PyObject *res = PyObject_VectorcallMethod(s_apply, a + 1, 2 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
        Py_DECREF(step);
        if (res == NULL) return fault(t);
        injected = PyObject_IsTrue(res);
        Py_DECREF(res);
        if (injected < 0) return fault(t);
    }
    long long now = timer_clock(t);
    if (now == -1 && PyErr_Occurred()) return fault(t);
    t->started = 0;
    t->elapsed_ns += now - t->t0;
    PyObject *b = ctx->binding;
    if (b == NULL || !PyTuple_Check(b) || PyTuple_GET_SIZE(b) < 1) {
        PyErr_SetString(PyExc_TypeError, "binding");
        return fault(t);
    }
    Py_INCREF(b); /* before reading its step, which may run Python code (__index__) that replaces ctx.binding */
    long long bstep = PyLong_AsLongLong(PyTuple_GET_ITEM(b, 0));
    if (bstep == -1 && PyErr_Occurred()) {
        Py_DECREF(b);
        return fault(t);
    }
    long long rep;
    if (bstep == t->rep_step) {
        rep = t->rep + 1;
    } else {
        rep = 0;
        t->rep_step = bstep;
    }
    t->rep = rep;
    PyObject *sev = t->sev; /* the reference moves to this call */
    t->sev = NULL;
    PyObject *reason = is_set(t->reason) ? t->reason : NULL;
    Py_XINCREF(reason);
    PyObject *eev = NULL, *last = NULL;
    int own = 0, published = 0;
    if (sev != NULL && sev == Py_None) Py_CLEAR(sev);
    if (sev != NULL) {
        if (reason == NULL) {
            PyObject *ev = Py_XNewRef(sh->ev);
            int same = is_set(ev) && sh->at_stop && ev != sev && now - sh->ns < sh->gap_ns ? same_stream(sh) : 0;
            if (same < 0) {
                Py_DECREF(ev);
                goto fail;
            }
            if (same) {
                if (add_ll(ev, s_refs, 1, NULL) < 0) {
                    Py_DECREF(ev);
                    goto fail;
                }
                eev = ev; /* an inner timer's stop just before this one's */
            } else {
                Py_XDECREF(ev);
                eev = pop_free(t->free);
                if (eev != NULL) {
                    if (set_ll(eev, s_refs, 1) < 0) goto fail;
                    PyObject *stream = do_record(t, sh, eev);
                    if (stream == NULL) {
                        if (users()) goto fail;
                        PyErr_Clear();
                        Py_XSETREF(reason, Py_NewRef(r_cuda_error));
                        sh->ns = NO_REUSE;
                    } else {
                        int rc = share_recorded(sh, eev, now, stream, 1);
                        Py_DECREF(stream);
                        if (rc < 0) goto fail;
                    }
                } else {
                    Py_XSETREF(reason, Py_NewRef(r_pool_exhausted));
                    sh->ns = NO_REUSE;
                }
            }
        }
        /* publish the references: the slot owns (returns to the pool) what nothing else refers to any more */
        long long srefs, erefs;
        if (add_ll(sev, s_refs, -1, &srefs) < 0) goto fail;
        if (eev != NULL && add_ll(eev, s_refs, -1, &erefs) < 0) goto fail;
        published = 1;
        last = Py_XNewRef(sh->ev);
        if (eev != NULL && erefs <= 0 && eev != last) own = 2;
        if (sev != eev && srefs <= 0 && sev != last) own |= 1;
        Py_XDECREF(last);
    }
    long long h = r->head;
    if (h - r->tail >= r->cap) {
        bump(t->c, s_dropped_ring_full);
        if (drop_events(t, sev, eev, own, h) < 0) goto fail;
        Py_XDECREF(sev);
        Py_XDECREF(eev);
        Py_XDECREF(reason);
        Py_DECREF(b);
        Py_RETURN_NONE;
    }
    SlotObject *sl = (SlotObject *)PyTuple_GET_ITEM(r->slots, (Py_ssize_t)(h & r->mask));
    /* start_ev/end_ev/injected are reset by the readout thread before it frees a slot, so only non-default values
     * are written here; the slot takes this call's references */
    Py_XSETREF(sl->timer, Py_NewRef((PyObject *)t));
    sl->start_ns = t->t0;
    sl->end_ns = now;
    if (sev != NULL) {
        Py_XSETREF(sl->start_ev, sev);
        sl->own = own;
        if (eev != NULL) Py_XSETREF(sl->end_ev, eev);
    }
    Py_XSETREF(sl->binding, b);
    sl->repeat = rep;
    Py_XSETREF(sl->reason, reason != NULL ? reason : Py_NewRef(Py_None));
    if (injected) sl->injected = 1;
    r->head = h + 1;
    Py_RETURN_NONE;
fail:
    if (users() && !published) { /* the program's exception: this call's references are let go, as a reset does */
        PyObject *et, *ev, *tb;
        PyErr_Fetch(&et, &ev, &tb);
        if (sev != NULL && release(sh, sev) < 0) PyErr_Clear();
        if (eev != NULL && eev != sev && release(sh, eev) < 0) PyErr_Clear();
        PyErr_Restore(et, ev, tb);
    }
    Py_XDECREF(sev);
    Py_XDECREF(eev);
    Py_XDECREF(reason);
    Py_DECREF(b);
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
    if (barrier) bump(t->c, s_barriers_skipped);
    if (check_wiring(t) < 0) return fault(t);
    PyObject *ctx = Py_NewRef(t->ctx), *sh = Py_NewRef(t->share), *ring = Py_NewRef(t->ring);
    PyObject *res = stop_impl(t, (StepStateObject *)ctx, (ShareObject *)sh, (RingObject *)ring);
    if (res == NULL) abandon(t, (ShareObject *)sh);
    Py_DECREF(ctx);
    Py_DECREF(sh);
    Py_DECREF(ring);
    return res;
}

static int Timer_traverse(TimerObject *t, visitproc visit, void *arg) {
    Py_VISIT(t->sev);
    Py_VISIT(t->reason);
    Py_VISIT(t->name);
    Py_VISIT(t->label);
    Py_VISIT(t->level);
    Py_VISIT(t->group);
    Py_VISIT(t->c);
    Py_VISIT(t->ctx);
    Py_VISIT(t->share);
    Py_VISIT(t->ring);
    Py_VISIT(t->free);
    Py_VISIT(t->orphans);
    Py_VISIT(t->record);
    Py_VISIT(t->inject);
    Py_VISIT(t->clock);
    return 0;
}

static int Timer_clear(TimerObject *t) {
    Py_CLEAR(t->sev);
    Py_CLEAR(t->reason);
    Py_CLEAR(t->name);
    Py_CLEAR(t->label);
    Py_CLEAR(t->level);
    Py_CLEAR(t->group);
    Py_CLEAR(t->c);
    Py_CLEAR(t->ctx);
    Py_CLEAR(t->share);
    Py_CLEAR(t->ring);
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
    return (PyObject *)t;
}

static PyMethodDef Timer_methods[] = {
    {"start", (PyCFunction)(void (*)(void))Timer_start, METH_FASTCALL | METH_KEYWORDS,
     "start($self, /, barrier=False)\n--\n\nA host timestamp, and on a device-sampled step an event record."},
    {"stop", (PyCFunction)(void (*)(void))Timer_stop, METH_FASTCALL | METH_KEYWORDS,
     "stop($self, /, barrier=False)\n--\n\nEnds the interval and publishes it in the ring."},
    {NULL},
};

#define TM(name, type, field) {name, type, offsetof(TimerObject, field), 0, NULL}
static PyMemberDef Timer_members[] = {
    TM("_started", T_BOOL, started),
    TM("_is_step", T_BOOL, is_step),
    TM("collective", T_BOOL, collective),
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
    TM("_sev", T_OBJECT, sev),
    TM("_reason", T_OBJECT, reason),
    TM("name", T_OBJECT, name),
    TM("label", T_OBJECT, label),
    TM("_level", T_OBJECT, level),
    TM("_group", T_OBJECT, group),
    TM("_c", T_OBJECT, c),
    TM("_orphans", T_OBJECT, orphans),
    TM("_record", T_OBJECT, record),
    TM("_inject", T_OBJECT, inject),
    TM("_clock", T_OBJECT, clock),
    {NULL},
};

/* the wiring attributes: the type each must have is checked here, once, instead of on every start/stop */
enum { WIRE_CTX, WIRE_SHARE, WIRE_RING, WIRE_FREE };

static PyObject **wire_field(TimerObject *t, void *which) {
    switch ((int)(intptr_t)which) {
    case WIRE_CTX: return &t->ctx;
    case WIRE_SHARE: return &t->share;
    case WIRE_RING: return &t->ring;
    default: return &t->free;
    }
}

static PyObject *Timer_get_wire(TimerObject *t, void *which) {
    PyObject *v = *wire_field(t, which);
    return Py_NewRef(v != NULL ? v : Py_None);
}

static int Timer_set_wire(TimerObject *t, PyObject *v, void *which) {
    int w = (int)(intptr_t)which;
    if (v == NULL || v == Py_None) {
        Py_CLEAR(*wire_field(t, which));
        return 0;
    }
    int ok = w == WIRE_CTX ? PyObject_TypeCheck(v, &StepStateType)
             : w == WIRE_SHARE ? Py_IS_TYPE(v, &ShareType)
             : w == WIRE_RING ? Py_IS_TYPE(v, &RingType)
             : 1;
    if (!ok) {
        PyErr_Format(PyExc_TypeError, "%s must be the C hot path's %s, not %s",
                     w == WIRE_CTX ? "_ctx" : w == WIRE_SHARE ? "_share" : "_ring",
                     w == WIRE_CTX ? "StepState" : w == WIRE_SHARE ? "SharedEvent" : "Ring", Py_TYPE(v)->tp_name);
        return -1;
    }
    Py_XSETREF(*wire_field(t, which), Py_NewRef(v));
    return 0;
}

static PyGetSetDef Timer_getset[] = {
    {"_ctx", (getter)Timer_get_wire, (setter)Timer_set_wire, NULL, (void *)(intptr_t)WIRE_CTX},
    {"_share", (getter)Timer_get_wire, (setter)Timer_set_wire, NULL, (void *)(intptr_t)WIRE_SHARE},
    {"_ring", (getter)Timer_get_wire, (setter)Timer_set_wire, NULL, (void *)(intptr_t)WIRE_RING},
    {"_free", (getter)Timer_get_wire, (setter)Timer_set_wire, NULL, (void *)(intptr_t)WIRE_FREE},
    {NULL},
};

static PyTypeObject TimerType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "otel_straggler._hotpath.TimerCore",
    .tp_doc = "A timer's state and its start/stop in C (timers.py _PyTimerCore).",
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
static PyObject *s_get, *s_log_level;

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
    if (PyLong_CheckExact(level) && own != NULL && PyLong_CheckExact(own) && plain_timer(t)) {
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

static int fn_of(PyObject *addr, void **out) {
    *out = PyLong_AsVoidPtr(addr);
    if (*out == NULL && !PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "null function address");
    return *out == NULL ? -1 : 0;
}

/* event_elapsed(fn_address, start_ev, end_ev): cuEventElapsedTime on the events' handles; ms, None while either is
 * unfinished, RuntimeError on any other result (event_pool.py driver_elapsed) */
static PyObject *event_elapsed(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    void *fn, *a, *b;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "event_elapsed(fn_address, start_ev, end_ev)");
        return NULL;
    }
    if (fn_of(args[0], &fn) < 0 || handle_of(args[1], &a) < 0 || handle_of(args[2], &b) < 0) return NULL;
    float ms = 0.0f;
    int rc = ((cu_event_elapsed_fn)fn)(&ms, a, b);
    if (rc == 0) return PyFloat_FromDouble((double)ms);
    if (rc == CUDA_ERROR_NOT_READY) Py_RETURN_NONE;
    return PyErr_Format(PyExc_RuntimeError, "cuEventElapsedTime failed (%d)", rc);
}

/* event_query(fn_address, ev): cuEventQuery on the event's handle; True once complete, False while not,
 * RuntimeError on any other result (event_pool.py driver_query) */
static PyObject *event_query(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    void *fn, *a;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "event_query(fn_address, ev)");
        return NULL;
    }
    if (fn_of(args[0], &fn) < 0 || handle_of(args[1], &a) < 0) return NULL;
    int rc = ((cu_event_query_fn)fn)(a);
    if (rc == 0) Py_RETURN_TRUE;
    if (rc == CUDA_ERROR_NOT_READY) Py_RETURN_FALSE;
    return PyErr_Format(PyExc_RuntimeError, "cuEventQuery failed (%d)", rc);
}

/* elapsed_batch(fn_address, ring, tail, head): the device times of the ring's slots tail..head-1 that have two
 * events and no degraded reason, read in order with cuEventElapsedTime, each left in the slot's ``pre`` (a float;
 * readout.py uses it instead of its own call); stops at the first pair that is unfinished or fails (that slot and
 * the later ones keep pre None and the readout's own call answers for them). The GIL is released once around the
 * driver calls of up to BATCH slots (the handles are read before, the results stored after, with it held): a
 * call into the driver between launches costs microseconds (bench/results/gpu-h200/driver_calls-9.log), and with
 * the GIL released the training thread runs meanwhile. The slots are not reused while the readout has not moved the
 * ring's tail past them, and the events they hold are not returned to the pool before that. Returns the number
 * of slots given a time. */
#define BATCH 256
static PyObject *elapsed_batch(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    void *fn;
    long long tail, head;
    if (nargs != 4 || !Py_IS_TYPE(args[1], &RingType)) {
        PyErr_SetString(PyExc_TypeError, "elapsed_batch(fn_address, ring, tail, head)");
        return NULL;
    }
    if (fn_of(args[0], &fn) < 0) return NULL;
    tail = PyLong_AsLongLong(args[2]);
    if (tail == -1 && PyErr_Occurred()) return NULL;
    head = PyLong_AsLongLong(args[3]);
    if (head == -1 && PyErr_Occurred()) return NULL;
    RingObject *r = (RingObject *)args[1];
    if (r->cap == 0) return PyLong_FromLong(0);
    if (tail < r->tail) tail = r->tail; /* only published, unread slots: the readout's own */
    if (head > r->head) head = r->head;
    if (head > tail + r->cap) head = tail + r->cap;
    SlotObject *slot[BATCH];
    void *h[2 * BATCH];
    float ms[BATCH];
    long long given = 0;
    long long i = tail;
    while (i < head) {
        int m = 0;
        for (; i < head && m < BATCH; i++) {
            SlotObject *sl = (SlotObject *)PyTuple_GET_ITEM(r->slots, (Py_ssize_t)(i & r->mask));
            if (!is_set(sl->start_ev) || !is_set(sl->end_ev) || is_set(sl->reason) || is_set(sl->pre)) continue;
            if (handle_of(sl->start_ev, &h[2 * m]) < 0 || handle_of(sl->end_ev, &h[2 * m + 1]) < 0) {
                PyErr_Clear();
                i = head; /* the readout's own call meets that error */
                break;
            }
            slot[m++] = sl;
        }
        int done = 0;
        if (m > 0) {
            Py_BEGIN_ALLOW_THREADS
            for (; done < m; done++)
                if (((cu_event_elapsed_fn)fn)(&ms[done], h[2 * done], h[2 * done + 1]) != 0) break;
            Py_END_ALLOW_THREADS
        }
        for (int k = 0; k < done; k++) {
            PyObject *v = PyFloat_FromDouble((double)ms[k]);
            if (v == NULL) return NULL;
            Py_XSETREF(slot[k]->pre, v);
        }
        given += done;
        if (done < m) break;
    }
    return PyLong_FromLongLong(given);
}

/* ---- the readout's drain, packed (readout.py, export/wire.py) ------------------------------------------ */

/* The wire's interval record (export/wire.py RECORD, "<HHHbBqiqqdqqq"): packed, little-endian. */
#define REC_SIZE 68
#define REC_HEADER 7 /* wire.HEADER: an INTERVALS frame's type, length and count before its first record */
#define F_DEVICE 1
#define F_TOKENS 2
#define F_SEQUENCES 4
#define F_MICROBATCHES 8
#define F_INJECTED 16
#define F_COLLECTIVE 32

/* ids[key] for a non-empty str key the child has (wire.WireEncoder.ids), else -1 (no exception set) */
static long str_id(PyObject *ids, PyObject *key) {
    if (key == NULL || !PyUnicode_CheckExact(key) || PyUnicode_GET_LENGTH(key) == 0) return -1;
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

/* an int binding field: 1 and *out for an int, 0 for None, -1 for anything else (no exception set) */
static int opt_ll(PyObject *o, long long *out) {
    if (o == Py_None) return 0;
    if (!PyLong_Check(o)) return -1;
    int overflow = 0;
    *out = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (overflow || (*out == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        return -1;
    }
    return 1;
}

static inline void put(char **p, const void *v, size_t n) {
    memcpy(*p, v, n);
    *p += n;
}

/* Let go of everything a read slot holds, as readout.py does after reading one (the producer's stores then free
 * nothing), and move the ring's tail past it. */
static void consume_slot(RingObject *r, SlotObject *sl) {
    Py_XSETREF(sl->start_ev, Py_NewRef(Py_None));
    Py_XSETREF(sl->end_ev, Py_NewRef(Py_None));
    sl->injected = 0;
    Py_XSETREF(sl->timer, Py_NewRef(Py_None));
    Py_XSETREF(sl->binding, Py_NewRef(Py_None));
    Py_XSETREF(sl->reason, Py_NewRef(Py_None));
    Py_XSETREF(sl->pre, Py_NewRef(Py_None));
    r->tail += 1;
}

/* pack_slots(ring, head, ids, degraded, free, wall_offset, frame, count): the readout's drain of the common slots in
 * C, packed straight into an INTERVALS frame (wire.RecordBatch) instead of an Interval object each that the sink
 * then packs. From the ring's tail up to ``head`` it reads each slot that is
 *   * device-timed and read: two events, no degraded reason, its device ms in ``pre`` (elapsed_batch); its own
 *     events go back to ``free`` (``tainted`` cleared), as readout.py returns them; or
 *   * host-only without events: no event, a degraded reason (counted in ``degraded``, readout.py's dict);
 * whose timer is a TimerCore whose name and group (and reason) have an id in ``ids`` (wire.WireEncoder.ids)
 * and whose fields fit the record; it writes the record the wire encoder would (RecordBatch.add) at
 * ``frame[REC_HEADER + count * REC_SIZE]``, releases the slot and moves the tail on. It stops at the first other
 * slot (readout.py reads that one: an unfinished or failed event, a timeout, a string without an id yet, a
 * test's fake) and when the frame is full. Returns (count, faults): the frame's records now, and the slots lost
 * to an error returning their events (consumed without a record, as readout.py counts them in faults_readout).
 * The GIL is held throughout: the slots' objects are Python objects. */
static PyObject *pack_slots(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 8 || !Py_IS_TYPE(args[0], &RingType) || !PyDict_CheckExact(args[2]) ||
        !PyDict_CheckExact(args[3]) || !PyByteArray_Check(args[6])) {
        PyErr_SetString(PyExc_TypeError,
                        "pack_slots(ring, head, ids: dict, degraded: dict, free, wall_offset, frame: bytearray, count)");
        return NULL;
    }
    RingObject *r = (RingObject *)args[0];
    PyObject *ids = args[2], *degraded = args[3], *free_dq = args[4], *frame = args[6];
    long long head = PyLong_AsLongLong(args[1]);
    if (head == -1 && PyErr_Occurred()) return NULL;
    long long off = PyLong_AsLongLong(args[5]);
    if (off == -1 && PyErr_Occurred()) return NULL;
    long long count = PyLong_AsLongLong(args[7]);
    if (count == -1 && PyErr_Occurred()) return NULL;
    Py_ssize_t size = PyByteArray_GET_SIZE(frame);
    long long cap = size >= REC_HEADER ? (size - REC_HEADER) / REC_SIZE : 0;
    long long faults = 0;
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    if (r->cap == 0 || count < 0) head = r->tail;
    if (head > r->head) head = r->head;
    char *base = PyByteArray_AS_STRING(frame);
    while (r->tail < head && count < cap) {
        SlotObject *sl = (SlotObject *)PyTuple_GET_ITEM(r->slots, (Py_ssize_t)(r->tail & r->mask));
        if (sl->timer == NULL || !plain_timer(sl->timer)) break;
        TimerObject *t = (TimerObject *)sl->timer;
        PyObject *b = sl->binding;
        if (b == NULL || !PyTuple_CheckExact(b) || PyTuple_GET_SIZE(b) != 4) break;
        int device = is_set(sl->start_ev);
        PyObject *reason = NULL;
        double dev = 0.0;
        if (device) {
            if (!is_set(sl->end_ev) || is_set(sl->reason) || sl->pre == NULL || !PyFloat_CheckExact(sl->pre)) break;
            dev = PyFloat_AS_DOUBLE(sl->pre);
        } else {
            if (is_set(sl->end_ev) || !is_set(sl->reason)) break;
            reason = sl->reason;
        }
        long name_id = str_id(ids, t->label), group_id = str_id(ids, t->group);
        long reason_id = reason != NULL ? str_id(ids, reason) : 0xFFFF;
        if (name_id < 0 || group_id < 0 || reason_id < 0) break;
        long long step = 0, tokens = 0, seqs = 0, mbs = 0;
        int has_tok, has_seq, has_mbs;
        if (opt_ll(PyTuple_GET_ITEM(b, 0), &step) != 1) break;
        if ((has_tok = opt_ll(PyTuple_GET_ITEM(b, 1), &tokens)) < 0) break;
        if ((has_seq = opt_ll(PyTuple_GET_ITEM(b, 2), &seqs)) < 0) break;
        if ((has_mbs = opt_ll(PyTuple_GET_ITEM(b, 3), &mbs)) < 0) break;
        if (t->level == NULL || !PyLong_CheckExact(t->level) || sl->repeat < INT32_MIN || sl->repeat > INT32_MAX) break;
        int loverflow = 0;
        long lv = PyLong_AsLongAndOverflow(t->level, &loverflow); /* the record's byte: clamped (wire_level) */
        if (lv == -1 && PyErr_Occurred()) {
            PyErr_Clear();
            break;
        }
        if (loverflow) lv = loverflow > 0 ? 127 : -128;
        long long start, end;
        if (__builtin_add_overflow(sl->start_ns, off, &start) || __builtin_add_overflow(sl->end_ns, off, &end)) break;
        /* everything the record needs is read before the calls below, which may run Python code */
        signed char level = (signed char)(lv < -128 ? -128 : lv > 127 ? 127 : lv);
        unsigned char flags = (unsigned char)((device ? F_DEVICE : 0) | (has_tok ? F_TOKENS : 0) |
                                              (has_seq ? F_SEQUENCES : 0) | (has_mbs ? F_MICROBATCHES : 0) |
                                              (sl->injected ? F_INJECTED : 0) | (t->collective ? F_COLLECTIVE : 0));
        int32_t repeat = (int32_t)sl->repeat;
        /* the slot is this function's: from here on it is read and released, with or without a record */
        int failed = 0;
        if (device) {
            PyObject *evs[2] = {sl->start_ev, sl->end_ev};
            for (int k = 0; k < 2 && !failed; k++) {
                if (!(sl->own & (1 << k))) continue;
                if (set_obj(evs[k], s_tainted, Py_False) < 0 || call_append(free_dq, evs[k]) < 0) failed = 1;
            }
        } else {
            PyObject *n = PyDict_GetItemWithError(degraded, reason);
            long long was = 0;
            if (n != NULL) was = PyLong_AsLongLong(n);
            PyObject *v = (PyErr_Occurred() || was < 0) ? NULL : PyLong_FromLongLong(was + 1);
            if (v == NULL || PyDict_SetItem(degraded, reason, v) < 0) failed = 1;
            Py_XDECREF(v);
        }
        if (failed) {
            PyErr_Clear();
            faults += 1;
            consume_slot(r, sl);
            continue;
        }
        unsigned short u16[3] = {(unsigned short)name_id, (unsigned short)group_id, (unsigned short)reason_id};
        char *p = base + REC_HEADER + count * REC_SIZE;
        put(&p, u16, sizeof u16);
        put(&p, &level, 1);
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
        consume_slot(r, sl);
    }
#endif
    return Py_BuildValue("(LL)", count, faults);
}

/* ---- module ------------------------------------------------------------------------------------------- */

static PyObject *set_reasons(PyObject *mod, PyObject *args) {
    PyObject *b, *c, *d;
    if (!PyArg_ParseTuple(args, "UUU", &b, &c, &d)) return NULL;
    Py_XSETREF(r_sampled_out, Py_NewRef(b));
    Py_XSETREF(r_cuda_error, Py_NewRef(c));
    Py_XSETREF(r_pool_exhausted, Py_NewRef(d));
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"event_elapsed", (PyCFunction)(void (*)(void))event_elapsed, METH_FASTCALL,
     "event_elapsed(fn_address, start_ev, end_ev): cuEventElapsedTime; ms, or None while unfinished."},
    {"event_query", (PyCFunction)(void (*)(void))event_query, METH_FASTCALL,
     "event_query(fn_address, ev): cuEventQuery; True once the event completed."},
    {"elapsed_batch", (PyCFunction)(void (*)(void))elapsed_batch, METH_FASTCALL,
     "elapsed_batch(fn_address, ring, tail, head): pending slots' device ms into slot.pre, the GIL released."},
    {"pack_slots", (PyCFunction)(void (*)(void))pack_slots, METH_FASTCALL,
     "pack_slots(ring, head, ids, degraded, free, wall_offset, frame, count): read slots straight into wire records."},
    {"set_reasons", set_reasons, METH_VARARGS,
     "set_reasons(sampled_out, cuda_error, pool_exhausted): the degraded reasons (counters.py)."},
    {NULL},
};

/* multi-phase initialisation: the types are static (one interpreter), the GIL is held throughout (every field is
 * guarded by it: the readout and the training thread share the ring without a lock) */
static int module_exec(PyObject *m) {
    PyTypeObject *types[] = {&SlotType, &RingType, &ShareType, &StepStateType, &TimerType, &TimersType};
    const char *names[] = {"Slot", "Ring", "SharedEvent", "StepState", "TimerCore", "TimersCore"};
    for (int i = 0; i < 6; i++)
        if (PyModule_AddObjectRef(m, names[i], (PyObject *)types[i]) < 0) return -1;
    PyObject *no_reuse = PyLong_FromLongLong(NO_REUSE);
    if (no_reuse == NULL) return -1;
    int rc = PyModule_AddObjectRef(m, "NO_REUSE", no_reuse);
    Py_DECREF(no_reuse);
    if (rc < 0) return -1;
    if (PyModule_AddIntConstant(m, "RECORD_SIZE", REC_SIZE) < 0 || PyModule_AddIntConstant(m, "RECORD_HEADER", REC_HEADER) < 0)
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
    INTERN(s_refs, "refs");
    INTERN(s_tag, "tag");
    INTERN(s_tainted, "tainted");
    INTERN(s_handle, "handle");
    INTERN(s_record, "record");
    INTERN(s_apply, "apply");
    INTERN(s_step_timer_started, "step_timer_started");
    INTERN(s_append, "append");
    INTERN(s_popleft, "popleft");
    INTERN(s_unbalanced, "unbalanced");
    INTERN(s_barriers_skipped, "barriers_skipped");
    INTERN(s_faults_training, "faults_training");
    INTERN(s_dropped_ring_full, "dropped_ring_full");
    INTERN(s_barrier, "barrier");
    INTERN(s_get, "_get");
    INTERN(s_label, "label");
    INTERN(s_group_attr, "_group");
    INTERN(s_level_attr, "_level");
    INTERN(s_collective, "collective");
    INTERN(s_log_level, "log_level");
    INTERN(r_sampled_out, "sampled_out");
    INTERN(r_cuda_error, "cuda_error");
    INTERN(r_pool_exhausted, "pool_exhausted");
    PyTypeObject *types[] = {&SlotType, &RingType, &ShareType, &StepStateType, &TimerType, &TimersType};
    for (int i = 0; i < 6; i++)
        if (PyType_Ready(types[i]) < 0) return NULL;
    return PyModuleDef_Init(&module_def);
}
