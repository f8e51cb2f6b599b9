/* kvt_host._fastpath: the host backend's same-host post in C.
 *
 * A small same-host request is one call of kvt's copy engine
 * (kvt._copy.copy_indexed: index checks, copy, epoch and liveness guards),
 * about 0.4 us for one 4 KiB block; the backend's Python around it (handle
 * lookups, the lane claim, the peer's guards) cost three times that
 * (docs/performance.md).  This module holds the fields that path reads as
 * C base types of HostBackend, _Prep and _Lane, and does the common case of
 * transfer():
 *
 *   transfer  READ or WRITE, no notification, int handles of two preps of
 *             host memory (ours first, then ours or a same-host peer's
 *             mapped rows), one block length on both sides, index arrays
 *             (copy_indexed checks them), the lane idle: claimed, guarded,
 *             copied inline and answered SETTLED.  An outcome other than
 *             "copied, the owner alive" goes to HostBackend._after_copy,
 *             still holding the lane.
 *   Lane      enter() and leave(): the caller's claim on an idle lane.
 *
 * Everything else goes to HostBackend._transfer (Python), which is also the
 * pure-Python twin (KVT_NATIVE=0, or no compiler at install) and has the
 * errors' wording.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

static PyObject *op_read, *op_write, *ndarray_type, *copy_indexed, *settled, *threads, *zero, *minus_one;
static PyObject *s_transfer, *s_after_copy, *s_acquire, *s_release, *s_lane, *s_gen, *s_same_host, *s_failed,
    *s_name, *s_epoch, *s_pidfd, *s_address, *s_seen, *s_fd, *s_slot, *s_alive, *s_tid;

#define DEFINE_GC(Type, FIELDS)                                                 \
    static int Type##_traverse(Type *self, visitproc visit, void *arg)          \
    {                                                                           \
        FIELDS(Py_VISIT, self)                                                  \
        return 0;                                                               \
    }                                                                           \
    static int Type##_clear(Type *self)                                         \
    {                                                                           \
        FIELDS(Py_CLEAR, self)                                                  \
        return 0;                                                               \
    }                                                                           \
    static void Type##_dealloc(Type *self)                                      \
    {                                                                           \
        PyObject_GC_UnTrack(self);                                              \
        Type##_clear(self);                                                     \
        Py_TYPE(self)->tp_free((PyObject *)self); /* (a heap subclass's type: subtype_dealloc) */ \
    }

#define MEMBER(name, type, field) {name, type, offsetof(TYPE, field), 0, NULL},

/* ------------------------------------------------------------------ PrepCore */

typedef struct {
    PyObject_HEAD
    PyObject *peer, *descs, *mapped, *addrs, *lengths, *owner, *gen, *inc;
} PrepCore;

#define PREP_FIELDS(X, o) X(o->peer); X(o->descs); X(o->mapped); X(o->addrs); X(o->lengths); X(o->owner); \
    X(o->gen); X(o->inc);
DEFINE_GC(PrepCore, PREP_FIELDS)

#define TYPE PrepCore
static PyMemberDef Prep_members[] = {
    MEMBER("peer", T_OBJECT, peer) MEMBER("descs", T_OBJECT, descs) MEMBER("mapped", T_OBJECT, mapped)
    MEMBER("addrs", T_OBJECT, addrs) MEMBER("lengths", T_OBJECT, lengths) MEMBER("owner", T_OBJECT, owner)
    MEMBER("gen", T_OBJECT, gen) MEMBER("inc", T_OBJECT, inc)
    {NULL}
};
#undef TYPE

static PyTypeObject PrepCoreType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvt_host._fastpath.PrepCore",
    .tp_basicsize = sizeof(PrepCore),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "The fields of kvt_host.backend._Prep.",
    .tp_traverse = (traverseproc)PrepCore_traverse,
    .tp_clear = (inquiry)PrepCore_clear,
    .tp_dealloc = (destructor)PrepCore_dealloc,
    .tp_members = Prep_members,
    .tp_new = PyType_GenericNew,
};

/* ------------------------------------------------------------------ LaneCore */

typedef struct {
    PyObject_HEAD
    PyObject *claim;     /* threading.Lock: held by whoever runs on the lane */
    Py_ssize_t busy;     /* jobs queued or running (counted by _Lane under its own lock) */
    char here;           /* a caller holds claim */
} LaneCore;

#define LANE_FIELDS(X, o) X(o->claim);
DEFINE_GC(LaneCore, LANE_FIELDS)

static PyObject *
call0(PyObject *obj, PyObject *name)
{
    PyObject *args[2] = {NULL, obj};
    return PyObject_VectorcallMethod(name, args + 1, 1 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
}

/* Claim the idle lane: 1 claimed, 0 not (busy, or another caller has it), -1 error. */
static int
lane_enter(LaneCore *self)
{
    /* busy read before and after the try: a job queued after the second read waits for our claim,
       one queued before it makes us back off (a caller never runs ahead of queued work) */
    if (self->busy || self->claim == NULL)
        return 0;
    PyObject *args[3] = {NULL, self->claim, Py_False};
    PyObject *got = PyObject_VectorcallMethod(s_acquire, args + 1, 2 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
    if (got == NULL)
        return -1;
    int taken = got == Py_True;
    Py_DECREF(got);
    if (!taken)
        return 0;
    if (self->busy) {
        PyObject *r = call0(self->claim, s_release);
        if (r == NULL)
            return -1;
        Py_DECREF(r);
        return 0;
    }
    self->here = 1;
    return 1;
}

static int
lane_leave(LaneCore *self)
{
    self->here = 0;
    PyObject *r = call0(self->claim, s_release);
    if (r == NULL)
        return -1;
    Py_DECREF(r);
    return 0;
}

static PyObject *
Lane_enter(LaneCore *self, PyObject *unused)
{
    int got = lane_enter(self);
    return got < 0 ? NULL : PyBool_FromLong(got);
}

static PyObject *
Lane_leave(LaneCore *self, PyObject *unused)
{
    if (self->claim == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "this lane has no claim lock");
        return NULL;
    }
    return lane_leave(self) < 0 ? NULL : Py_NewRef(Py_None);
}

static PyMethodDef Lane_methods[] = {
    {"enter", (PyCFunction)Lane_enter, METH_NOARGS,
     "enter()\n--\n\nClaim the idle lane for work on the caller's thread (then leave); False if it is not idle."},
    {"leave", (PyCFunction)Lane_leave, METH_NOARGS, "leave()\n--\n\nGive up the claim enter() made."},
    {NULL}
};

#define TYPE LaneCore
static PyMemberDef Lane_members[] = {
    MEMBER("_claim", T_OBJECT, claim) MEMBER("_busy", T_PYSSIZET, busy) MEMBER("_here", T_BOOL, here)
    {NULL}
};
#undef TYPE

static PyTypeObject LaneCoreType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvt_host._fastpath.LaneCore",
    .tp_basicsize = sizeof(LaneCore),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "kvt_host.backend._Lane's claim: its fields, enter() and leave().",
    .tp_traverse = (traverseproc)LaneCore_traverse,
    .tp_clear = (inquiry)LaneCore_clear,
    .tp_dealloc = (destructor)LaneCore_dealloc,
    .tp_methods = Lane_methods,
    .tp_members = Lane_members,
    .tp_new = PyType_GenericNew,
};

/* ------------------------------------------------------------------ HostCore */

typedef struct {
    PyObject_HEAD
    PyObject *preps, *peers, *local, *inline_bytes;
    char closed;
} HostCore;

#define CORE_FIELDS(X, o) X(o->preps); X(o->peers); X(o->local); X(o->inline_bytes);
DEFINE_GC(HostCore, CORE_FIELDS)

/* self.<name>(*args): the Python path, or a Python helper */
static PyObject *
call_method(PyObject *self, PyObject *name, PyObject *const *args, Py_ssize_t n, PyObject *kwnames)
{
    PyObject *full[9];  /* full[0]: the slot PY_VECTORCALL_ARGUMENTS_OFFSET lets the callee use */
    Py_ssize_t all = n + (kwnames ? PyTuple_GET_SIZE(kwnames) : 0);
    if (all > 7) {
        PyErr_Format(PyExc_TypeError, "%U() takes at most 7 arguments (%zd given)", name, all);
        return NULL;
    }
    full[1] = self;
    for (Py_ssize_t i = 0; i < all; i++)
        full[i + 2] = args[i];
    return PyObject_VectorcallMethod(name, full + 1, (n + 1) | PY_VECTORCALL_ARGUMENTS_OFFSET, kwnames);
}

/* copy_indexed's guards for a copy to same-host peer `owner` (HostBackend._guards):
 * g[0..6] = epoch address, seen, pidfd, lock fd, slot, alive, tid (new references).
 * 1 filled, 0 its prepped addresses no longer hold (the Python path), -1 error. */
enum { G_EPOCH, G_SEEN, G_PIDFD, G_LOCK, G_SLOT, G_ALIVE, G_TID, NGUARDS };

static int
peer_guards(HostCore *self, PyObject *owner, PrepCore *rp, PyObject **g)
{
    PyObject *v = PyObject_GetAttr(owner, s_gen);
    if (v == NULL)
        return -1;
    int ok = rp->gen != NULL && PyObject_RichCompareBool(v, rp->gen, Py_EQ);
    Py_DECREF(v);
    if (ok <= 0)
        return ok;
    if ((v = PyObject_GetAttr(owner, s_same_host)) == NULL)
        return -1;
    ok = PyObject_IsTrue(v);
    Py_DECREF(v);
    if (ok <= 0)
        return ok;
    if ((v = PyObject_GetAttr(owner, s_failed)) == NULL)
        return -1;
    ok = v == Py_None;
    Py_DECREF(v);
    if (!ok)
        return 0;
    /* still the peer loaded under its name (not one removed, maybe added again) */
    if ((v = PyObject_GetAttr(owner, s_name)) == NULL)
        return -1;
    PyObject *now = PyDict_GetItemWithError(self->peers, v);  /* (no __missing__: a plain lookup) */
    Py_DECREF(v);
    if (now != owner)
        return PyErr_Occurred() ? -1 : 0;
    PyObject *w = PyObject_GetAttr(owner, s_epoch);
    if (w == NULL)
        return -1;
    if (w == Py_None) {
        Py_DECREF(w);
        return 0;
    }
    PyObject *pidfd = PyObject_GetAttr(owner, s_pidfd);
    if (pidfd == NULL) {
        Py_DECREF(w);
        return -1;
    }
    g[G_PIDFD] = pidfd == Py_None ? Py_NewRef(minus_one) : Py_NewRef(pidfd);
    Py_DECREF(pidfd);
    PyObject *names[NGUARDS] = {s_address, s_seen, NULL, s_fd, s_slot, s_alive, s_tid};
    for (int i = 0; i < NGUARDS; i++) {
        if (names[i] != NULL && (g[i] = PyObject_GetAttr(w, names[i])) == NULL) {
            Py_DECREF(w);
            return -1;
        }
    }
    Py_DECREF(w);
    return 1;
}

static int
is_argument_error(void)
{
    return PyErr_ExceptionMatches(PyExc_IndexError) || PyErr_ExceptionMatches(PyExc_ValueError)
        || PyErr_ExceptionMatches(PyExc_TypeError) || PyErr_ExceptionMatches(PyExc_OverflowError);
}

static PyObject *
Core_transfer(HostCore *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    if (kwnames != NULL || nargs < 5 || nargs > 6 || (nargs == 6 && args[5] != Py_None) || self->closed
        || (args[0] != op_read && args[0] != op_write) || self->preps == NULL || !PyDict_Check(self->preps)
        || self->peers == NULL || !PyDict_Check(self->peers) || self->local == NULL || self->inline_bytes == NULL
        || (PyObject *)Py_TYPE(args[2]) != ndarray_type || (PyObject *)Py_TYPE(args[4]) != ndarray_type
        || !PyLong_CheckExact(args[1]) || !PyLong_CheckExact(args[3]))
        goto slow;
    /* int handles: their lookups run no Python code */
    PyObject *lpo = PyDict_GetItemWithError(self->preps, args[1]);
    PyObject *rpo = lpo ? PyDict_GetItemWithError(self->preps, args[3]) : NULL;
    if (rpo == NULL) {
        PyErr_Clear();
        goto slow;  /* (not a handle of ours: the Python path says so) */
    }
    if (!PyObject_TypeCheck(lpo, &PrepCoreType) || !PyObject_TypeCheck(rpo, &PrepCoreType))
        goto slow;
    PrepCore *lp = (PrepCore *)lpo, *rp = (PrepCore *)rpo;
    if (lp->addrs == NULL || lp->addrs == Py_None || rp->addrs == NULL || rp->addrs == Py_None
        || lp->peer != Py_None || lp->lengths == NULL || rp->lengths == NULL
        || !PyLong_CheckExact(lp->lengths) || !PyLong_CheckExact(rp->lengths) || rp->owner == NULL)
        goto slow;
    int same = PyObject_RichCompareBool(lp->lengths, rp->lengths, Py_EQ);  /* uniform rows, one length */
    if (same <= 0) {
        PyErr_Clear();
        goto slow;
    }
    /* more than inline_bytes goes to the lane's worker: straight to the Python path, which queues it,
       rather than through copy_indexed's index checks first (it would answer TOO_BIG) */
    unsigned long long block = PyLong_AsUnsignedLongLong(lp->lengths);
    unsigned long long most = PyLong_AsUnsignedLongLong(self->inline_bytes);
    Py_ssize_t rows = PyObject_Length(args[2]);
    if (PyErr_Occurred()) {
        PyErr_Clear();
        goto slow;
    }
    if (block && (unsigned long long)rows > most / block)
        goto slow;
    /* our references: another thread may release the preps (or the peer) while the copy runs */
    Py_INCREF(lp);
    Py_INCREF(rp);
    PyObject *owner = Py_NewRef(rp->owner), *lane = NULL, *got = NULL, *result = NULL;
    PyObject *g[NGUARDS] = {NULL};
    int entered = 0, is_slow = 1;
    if (owner == Py_None) {
        lane = Py_NewRef(self->local);
    } else if ((lane = PyObject_GetAttr(owner, s_lane)) == NULL) {
        is_slow = 0;
        goto out;
    }
    if (!PyObject_TypeCheck(lane, &LaneCoreType))
        goto out;
    entered = lane_enter((LaneCore *)lane);
    if (entered <= 0) {  /* busy: queued work first, on the Python path */
        is_slow = entered == 0;
        entered = 0;
        goto out;
    }
    /* holding the lane: the peer's mappings, epoch page and pidfd stay as they are */
    if (owner == Py_None) {
        PyObject *none[NGUARDS] = {zero, zero, minus_one, minus_one, zero, zero, zero};
        for (int i = 0; i < NGUARDS; i++)
            g[i] = Py_NewRef(none[i]);
    } else {
        int ok = peer_guards(self, owner, rp, g);
        if (ok <= 0) {
            is_slow = ok == 0;
            goto out;
        }
    }
    {
        int read = args[0] == op_read;
        PyObject *cargs[15] = {read ? lp->addrs : rp->addrs, read ? args[2] : args[4],
                               read ? rp->addrs : lp->addrs, read ? args[4] : args[2], lp->lengths, Py_None,
                               self->inline_bytes, g[G_EPOCH], g[G_SEEN], g[G_PIDFD], threads, g[G_LOCK],
                               g[G_SLOT], g[G_ALIVE], g[G_TID]};
        got = PyObject_Vectorcall(copy_indexed, cargs, 15, NULL);
    }
    if (got == NULL) {
        if (is_argument_error())
            PyErr_Clear();  /* nothing copied: the Python path checks again and names the problem */
        else
            is_slow = 0;
        goto out;
    }
    int negative = PyObject_RichCompareBool(got, zero, Py_LT);
    if (negative < 0) {
        is_slow = 0;
        goto out;
    }
    is_slow = 0;
    if (!negative) {  /* copied: it counts if no owner, or the copy engine checked the owner lives */
        int alive = owner == Py_None || PyObject_RichCompareBool(g[G_PIDFD], zero, Py_GE) == 1
            || PyObject_IsTrue(g[G_ALIVE]) == 1;
        PyErr_Clear();
        if (alive) {
            result = Py_NewRef(settled);
            goto out;
        }
    }
    PyObject *aargs[4] = {got, args[0], owner, g[G_PIDFD]};
    result = call_method((PyObject *)self, s_after_copy, aargs, 4, NULL);
    if (result == Py_None) {  /* nothing copied: the Python path takes the request */
        Py_CLEAR(result);
        is_slow = 1;
    }
out:
    if (entered) {
        PyObject *et, *ev, *tb;
        PyErr_Fetch(&et, &ev, &tb);
        if (lane_leave((LaneCore *)lane) < 0) {
            Py_XDECREF(et);
            Py_XDECREF(ev);
            Py_XDECREF(tb);
            Py_CLEAR(result);
            is_slow = 0;
        } else {
            PyErr_Restore(et, ev, tb);
        }
    }
    for (int i = 0; i < NGUARDS; i++)
        Py_XDECREF(g[i]);
    Py_XDECREF(got);
    Py_XDECREF(lane);
    Py_DECREF(owner);
    Py_DECREF(lp);
    Py_DECREF(rp);
    if (!is_slow)
        return result;
slow:
    return call_method((PyObject *)self, s_transfer, args, nargs, kwnames);
}

static PyMethodDef Core_methods[] = {
    {"transfer", (PyCFunction)(void (*)(void))Core_transfer, METH_FASTCALL | METH_KEYWORDS,
     "transfer(op, local_prep, local_idx, remote_prep, remote_idx, notif=None)\n--\n\n"
     "Post a transfer (kvt.backend.Backend.transfer)."},
    {NULL}
};

#define TYPE HostCore
static PyMemberDef Core_members[] = {
    MEMBER("_preps", T_OBJECT, preps) MEMBER("_peers", T_OBJECT, peers) MEMBER("_local", T_OBJECT, local)
    MEMBER("inline_bytes", T_OBJECT, inline_bytes) MEMBER("_closed", T_BOOL, closed)
    {NULL}
};
#undef TYPE

static PyTypeObject HostCoreType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvt_host._fastpath.HostCore",
    .tp_basicsize = sizeof(HostCore),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "HostBackend's hot fields and the common case of transfer().",
    .tp_traverse = (traverseproc)HostCore_traverse,
    .tp_clear = (inquiry)HostCore_clear,
    .tp_dealloc = (destructor)HostCore_dealloc,
    .tp_methods = Core_methods,
    .tp_members = Core_members,
    .tp_new = PyType_GenericNew,
};

/* ------------------------------------------------------------------ module */

static PyObject *
setup(PyObject *module, PyObject *args)
{
    PyObject *r, *w, *nd, *ci, *st, *th;
    if (!PyArg_ParseTuple(args, "OOOOOO:setup", &r, &w, &nd, &ci, &st, &th))
        return NULL;
    Py_XSETREF(op_read, Py_NewRef(r));
    Py_XSETREF(op_write, Py_NewRef(w));
    Py_XSETREF(ndarray_type, Py_NewRef(nd));
    Py_XSETREF(copy_indexed, Py_NewRef(ci));
    Py_XSETREF(settled, Py_NewRef(st));
    Py_XSETREF(threads, Py_NewRef(th));
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"setup", setup, METH_VARARGS,
     "setup(Op.READ, Op.WRITE, numpy.ndarray, kvt.memcopy.copy_indexed, kvt.types.SETTLED, kvt.memcopy.THREADS)"},
    {NULL}
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvt_host._fastpath", "The host backend's same-host post in C (kvt_host/_fastpath.c).",
    -1, module_methods,
};

PyMODINIT_FUNC
PyInit__fastpath(void)
{
    if (PyType_Ready(&PrepCoreType) < 0 || PyType_Ready(&LaneCoreType) < 0 || PyType_Ready(&HostCoreType) < 0)
        return NULL;
    struct { PyObject **s; const char *text; } names[] = {
        {&s_transfer, "_transfer"}, {&s_after_copy, "_after_copy"}, {&s_acquire, "acquire"},
        {&s_release, "release"}, {&s_lane, "lane"}, {&s_gen, "gen"}, {&s_same_host, "same_host"},
        {&s_failed, "failed"}, {&s_name, "name"}, {&s_epoch, "epoch"}, {&s_pidfd, "_pidfd"},
        {&s_address, "address"}, {&s_seen, "seen"}, {&s_fd, "fd"}, {&s_slot, "slot"}, {&s_alive, "alive"},
        {&s_tid, "tid"},
    };
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if ((*names[i].s = PyUnicode_InternFromString(names[i].text)) == NULL)
            return NULL;
    if ((zero = PyLong_FromLong(0)) == NULL || (minus_one = PyLong_FromLong(-1)) == NULL)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, "PrepCore", (PyObject *)&PrepCoreType) < 0
        || PyModule_AddObjectRef(m, "LaneCore", (PyObject *)&LaneCoreType) < 0
        || PyModule_AddObjectRef(m, "HostCore", (PyObject *)&HostCoreType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
