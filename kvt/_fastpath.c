/* kvt._fastpath: the post path of kvt.Agent in C.
 *
 * A one-block round trip through Agent (transfer_blocks, Transfer.state,
 * release) is a few Python frames around the backend's calls; on a slow
 * CPU those frames cost as much as NIXL's own post (docs/performance.md).
 * This module holds the three objects of that path as C base types whose
 * fields Python reads and writes as attributes:
 *
 *   AgentCore     Agent's hot fields and transfer_blocks' common case: a
 *                 route prepped already, one region, no flag up (closed,
 *                 transfers to reap, peers lost, integrity, sealed
 *                 notifications).  Anything else, and keyword arguments,
 *                 go to Agent._transfer_blocks (Python), which also has the
 *                 errors' wording.
 *   RouteCore     a checked, prepped layout pairing (Agent._Route's fields).
 *   TransferCore  Transfer's fields, state(), release() and the finalizer
 *                 that hands a transfer dropped unreleased to its agent;
 *                 one the backend returned SETTLED for is DONE without
 *                 asking it, and has nothing to release.
 *   block_index   Agent.block_index's common case (a list or tuple of ints,
 *                 all in range): one call instead of a few numpy calls,
 *                 which cost ~0.1 ms on caches an engine's step has just
 *                 flushed.  Anything else returns None: the Python path then
 *                 converts, or raises with the errors' wording.
 *
 * kvt/agent.py keeps a pure-Python twin of each (KVT_NATIVE=0, or no
 * compiler at install); both run the whole test suite.  The clock is
 * CLOCK_MONOTONIC, the one time.perf_counter_ns reads on Linux.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <time.h>

static PyTypeObject *transfer_type;             /* kvt.agent.Transfer (a subclass of TransferCore) */
static PyObject *closed_error, *invalid_handle;  /* kvt.errors */
static PyObject *proc_status, *done_state;      /* Status.PROC, XferState.DONE */
static PyObject *np_empty, *np_int64;            /* numpy.empty, numpy.dtype(int64): block_index's result */
static PyObject *s_transfer, *s_check_state, *s_release, *s_status, *s_slow, *s_kv;

static long long
now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* ---------------------------------------------------------------- RouteCore */

typedef struct {
    PyObject_HEAD
    PyObject *lprep, *rprep, *lregions, *rregions;
    long long block_len, nblocks, rnblocks;
} RouteCore;

static int
Route_traverse(RouteCore *self, visitproc visit, void *arg)
{
    Py_VISIT(self->lprep);
    Py_VISIT(self->rprep);
    Py_VISIT(self->lregions);
    Py_VISIT(self->rregions);
    return 0;
}

static int
Route_clear(RouteCore *self)
{
    Py_CLEAR(self->lprep);
    Py_CLEAR(self->rprep);
    Py_CLEAR(self->lregions);
    Py_CLEAR(self->rregions);
    return 0;
}

static void
Route_dealloc(RouteCore *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    Route_clear(self);
    tp->tp_free((PyObject *)self);  /* (subtype_dealloc drops a heap subclass's reference to its type) */
}

static PyMemberDef Route_members[] = {
    {"lprep", T_OBJECT_EX, offsetof(RouteCore, lprep), 0, NULL},
    {"rprep", T_OBJECT_EX, offsetof(RouteCore, rprep), 0, NULL},
    {"lregions", T_OBJECT, offsetof(RouteCore, lregions), 0, NULL},
    {"rregions", T_OBJECT, offsetof(RouteCore, rregions), 0, NULL},
    {"block_len", T_LONGLONG, offsetof(RouteCore, block_len), 0, NULL},
    {"nblocks", T_LONGLONG, offsetof(RouteCore, nblocks), 0, NULL},
    {"rnblocks", T_LONGLONG, offsetof(RouteCore, rnblocks), 0, NULL},
    {NULL}
};

static PyTypeObject RouteCoreType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvt._fastpath.RouteCore",
    .tp_basicsize = sizeof(RouteCore),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "A checked, prepped layout pairing: the fields kvt.agent._Route sets.",
    .tp_traverse = (traverseproc)Route_traverse,
    .tp_clear = (inquiry)Route_clear,
    .tp_dealloc = (destructor)Route_dealloc,
    .tp_members = Route_members,
    .tp_new = PyType_GenericNew,
};

/* ---------------------------------------------------------------- AgentCore */

typedef struct {
    PyObject_HEAD
    PyObject *backend, *routes, *lost, *orphans, *notif_seal;
    char closed, integrity;
} AgentCore;

static int
Agent_traverse(AgentCore *self, visitproc visit, void *arg)
{
    Py_VISIT(self->backend);
    Py_VISIT(self->routes);
    Py_VISIT(self->lost);
    Py_VISIT(self->orphans);
    Py_VISIT(self->notif_seal);
    return 0;
}

static int
Agent_clear(AgentCore *self)
{
    Py_CLEAR(self->backend);
    Py_CLEAR(self->routes);
    Py_CLEAR(self->lost);
    Py_CLEAR(self->orphans);
    Py_CLEAR(self->notif_seal);
    return 0;
}

static void
Agent_dealloc(AgentCore *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    Agent_clear(self);
    tp->tp_free((PyObject *)self);  /* (subtype_dealloc drops a heap subclass's reference to its type) */
}

static PyObject *
slow(PyObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    PyObject *full[9];  /* full[0]: the slot PY_VECTORCALL_ARGUMENTS_OFFSET lets the callee use */
    Py_ssize_t n = PyVectorcall_NARGS(nargsf), nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    if (n + nkw > 7) {
        PyErr_Format(PyExc_TypeError, "transfer_blocks() takes at most 7 arguments (%zd given)", n + nkw);
        return NULL;
    }
    full[1] = self;
    for (Py_ssize_t i = 0; i < n + nkw; i++)
        full[i + 2] = args[i];
    return PyObject_VectorcallMethod(s_slow, full + 1, (n + 1) | PY_VECTORCALL_ARGUMENTS_OFFSET, kwnames);
}

static PyObject *new_transfer(PyObject *agent, PyObject *backend, PyObject *handle, long long nbytes,
                              long long descs, long long t0, PyObject *peer);

/* transfer_blocks(op, peer, local_ids, remote_ids, layout="kv", notif=None, remote_layout=None) */
static PyObject *
Agent_transfer_blocks(AgentCore *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    long long t0 = now_ns();
    if (kwnames != NULL || nargs < 4 || nargs > 7 || self->closed || self->integrity || self->routes == NULL
        || self->backend == NULL || self->orphans == NULL || !PyList_CheckExact(self->orphans)
        || PyList_GET_SIZE(self->orphans) || self->lost == NULL || !PyDict_CheckExact(self->lost)
        || PyDict_GET_SIZE(self->lost) || !PyDict_CheckExact(self->routes))
        return slow((PyObject *)self, args, nargs, kwnames);
    PyObject *op = args[0], *peer = args[1], *lids = args[2], *rids = args[3];
    PyObject *layout = nargs > 4 ? args[4] : s_kv, *notif = nargs > 5 ? args[5] : Py_None;
    PyObject *rname = nargs > 6 ? args[6] : Py_None;
    if (notif != Py_None && self->notif_seal != NULL && self->notif_seal != Py_None)
        return slow((PyObject *)self, args, nargs, kwnames);
    if (rname == Py_None || (PyUnicode_CheckExact(rname) && PyUnicode_GET_LENGTH(rname) == 0))
        rname = layout;
    if (!PyUnicode_CheckExact(peer) || !PyUnicode_CheckExact(layout) || !PyUnicode_CheckExact(rname))
        return slow((PyObject *)self, args, nargs, kwnames);
    PyObject *key = PyTuple_Pack(3, peer, layout, rname);
    if (key == NULL)
        return NULL;
    PyObject *found = PyDict_GetItemWithError(self->routes, key);
    Py_DECREF(key);
    if (found == NULL) {
        if (PyErr_Occurred())
            return NULL;
        return slow((PyObject *)self, args, nargs, kwnames);  /* checks and preps the route */
    }
    if (!PyObject_TypeCheck(found, &RouteCoreType))
        return slow((PyObject *)self, args, nargs, kwnames);
    RouteCore *route = (RouteCore *)found;
    if (route->lregions != NULL && route->lregions != Py_None)  /* several regions: ids become indices */
        return slow((PyObject *)self, args, nargs, kwnames);
    if (route->lprep == NULL || route->rprep == NULL)
        return slow((PyObject *)self, args, nargs, kwnames);
    long long n;
    if (lids == Py_None) {
        n = route->nblocks;
    } else {
        Py_ssize_t len = PyObject_Size(lids);
        if (len < 0) {  /* a scalar or a generator: the slow path names the error */
            PyErr_Clear();
            return slow((PyObject *)self, args, nargs, kwnames);
        }
        n = len;
    }
    /* the route may be replaced (and freed) by another thread while the backend runs */
    long long block_len = route->block_len;
    PyObject *backend = Py_NewRef(self->backend), *lprep = Py_NewRef(route->lprep);
    PyObject *rprep = Py_NewRef(route->rprep);
    PyObject *call[8] = {NULL, backend, op, lprep, lids, rprep, rids, notif};
    PyObject *h = PyObject_VectorcallMethod(s_transfer, call + 1, 7 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
    Py_DECREF(lprep);
    Py_DECREF(rprep);
    if (h == NULL) {
        Py_DECREF(backend);
        if (PyErr_ExceptionMatches(invalid_handle)) {  /* a prep released under the post: nothing was posted */
            PyErr_Clear();
            return slow((PyObject *)self, args, nargs, kwnames);
        }
        return NULL;
    }
    PyObject *t = new_transfer((PyObject *)self, backend, h, n * block_len, n, t0, peer);
    Py_DECREF(backend);
    Py_DECREF(h);
    return t;
}

static PyMethodDef Agent_methods[] = {
    {"transfer_blocks", (PyCFunction)(void (*)(void))Agent_transfer_blocks, METH_FASTCALL | METH_KEYWORDS,
     "transfer_blocks(op, peer, local_ids, remote_ids, layout='kv', notif=None, remote_layout=None)\n--\n\n"
     "``op`` (READ pulls, WRITE pushes) between our ``local_ids`` blocks of\n"
     "``layout`` and the peer's ``remote_ids`` blocks of ``remote_layout``\n"
     "(default: the same name); ``notif`` reaches the peer after the bytes."},
    {NULL}
};

static PyMemberDef Agent_members[] = {
    {"backend", T_OBJECT_EX, offsetof(AgentCore, backend), 0, NULL},
    {"_routes", T_OBJECT_EX, offsetof(AgentCore, routes), 0, NULL},
    {"_lost", T_OBJECT_EX, offsetof(AgentCore, lost), 0, NULL},
    {"_orphans", T_OBJECT_EX, offsetof(AgentCore, orphans), 0, NULL},
    {"_notif_seal", T_OBJECT, offsetof(AgentCore, notif_seal), 0, NULL},
    {"_closed", T_BOOL, offsetof(AgentCore, closed), 0, NULL},
    {"_integrity", T_BOOL, offsetof(AgentCore, integrity), 0, NULL},
    {NULL}
};

static PyTypeObject AgentCoreType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvt._fastpath.AgentCore",
    .tp_basicsize = sizeof(AgentCore),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "kvt.Agent's hot fields and the common case of transfer_blocks.",
    .tp_traverse = (traverseproc)Agent_traverse,
    .tp_clear = (inquiry)Agent_clear,
    .tp_dealloc = (destructor)Agent_dealloc,
    .tp_methods = Agent_methods,
    .tp_members = Agent_members,
    .tp_new = PyType_GenericNew,
};

/* ------------------------------------------------------------- TransferCore */

typedef struct {
    PyObject_HEAD
    PyObject *agent, *backend, *handle, *peer, *verify;
    long long nbytes, descs, t0, t1, t2;  /* t2 < 0: not settled yet (None) */
    char live;                            /* cleared by the one release that frees the handle */
    char settled;                         /* the backend returned SETTLED: no call about it is due */
} TransferCore;

static int
Transfer_traverse(TransferCore *self, visitproc visit, void *arg)
{
    Py_VISIT(self->agent);
    Py_VISIT(self->backend);
    Py_VISIT(self->handle);
    Py_VISIT(self->peer);
    Py_VISIT(self->verify);
    return 0;
}

static int
Transfer_clear(TransferCore *self)
{
    Py_CLEAR(self->agent);
    Py_CLEAR(self->backend);
    Py_CLEAR(self->handle);
    Py_CLEAR(self->peer);
    Py_CLEAR(self->verify);
    return 0;
}

static int
agent_closed(PyObject *agent)
{
    if (PyObject_TypeCheck(agent, &AgentCoreType))
        return ((AgentCore *)agent)->closed;
    PyObject *v = PyObject_GetAttrString(agent, "_closed");
    int closed = v == NULL ? -1 : PyObject_IsTrue(v);
    Py_XDECREF(v);
    return closed;
}

/* A transfer dropped unreleased: its agent releases the handle on its next
 * post; never from here, since a finalizer may run inside a backend call that
 * holds the backend's lock. */
static void
Transfer_finalize(TransferCore *self)
{
    if (!self->live || self->settled || self->agent == NULL || self->handle == NULL)
        return;
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    int closed = agent_closed(self->agent);
    if (closed == 0) {
        PyObject *orphans = PyObject_TypeCheck(self->agent, &AgentCoreType)
            ? (Py_XNewRef(((AgentCore *)self->agent)->orphans))
            : PyObject_GetAttrString(self->agent, "_orphans");
        if (orphans != NULL && PyList_Check(orphans))
            PyList_Append(orphans, self->handle);
        Py_XDECREF(orphans);
    }
    PyErr_Clear();  /* half-built, or torn down at interpreter exit: nothing to hand over */
    PyErr_Restore(type, value, tb);
}

static void
Transfer_dealloc(TransferCore *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    if (PyObject_CallFinalizerFromDealloc((PyObject *)self) < 0)
        return;  /* resurrected */
    PyObject_GC_UnTrack(self);
    Transfer_clear(self);
    tp->tp_free((PyObject *)self);  /* (subtype_dealloc drops a heap subclass's reference to its type) */
}

/* The backend returned SETTLED (the int 0): done at post, so completion was
 * first seen when the post returned. */
static void
mark_settled(TransferCore *t)
{
    int overflow;
    t->settled = PyLong_CheckExact(t->handle) && PyLong_AsLongLongAndOverflow(t->handle, &overflow) == 0;
    t->t2 = t->settled ? t->t1 : -1;
}

static PyObject *
new_transfer(PyObject *agent, PyObject *backend, PyObject *handle, long long nbytes, long long descs, long long t0,
             PyObject *peer)
{
    TransferCore *t = (TransferCore *)transfer_type->tp_alloc(transfer_type, 0);
    if (t == NULL)
        return NULL;
    t->t1 = now_ns();
    t->t0 = t0 < 0 ? t->t1 : t0;
    t->agent = Py_NewRef(agent);
    t->backend = Py_NewRef(backend);
    t->handle = Py_NewRef(handle);
    t->peer = Py_NewRef(peer);
    t->verify = Py_NewRef(Py_None);
    t->nbytes = nbytes;
    t->descs = descs;
    t->live = 1;
    mark_settled(t);
    return (PyObject *)t;
}

/* Transfer(agent, handle, nbytes, descs=0, t0=None, peer=None) */
static int
Transfer_init(TransferCore *self, PyObject *args, PyObject *kwds)
{
    static char *kw[] = {"agent", "handle", "nbytes", "descs", "t0", "peer", NULL};
    PyObject *agent, *handle, *t0 = Py_None, *peer = Py_None;
    long long nbytes, descs = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOL|LOO:Transfer", kw, &agent, &handle, &nbytes, &descs, &t0,
                                     &peer))
        return -1;
    PyObject *backend = PyObject_GetAttrString(agent, "backend");
    if (backend == NULL)
        return -1;
    long long t1 = now_ns(), start = t1;
    if (t0 != Py_None) {
        start = PyLong_AsLongLong(t0);
        if (start == -1 && PyErr_Occurred()) {
            Py_DECREF(backend);
            return -1;
        }
    }
    Py_XSETREF(self->agent, Py_NewRef(agent));
    Py_XSETREF(self->backend, backend);
    Py_XSETREF(self->handle, Py_NewRef(handle));
    Py_XSETREF(self->peer, Py_NewRef(peer));
    Py_XSETREF(self->verify, Py_NewRef(Py_None));
    self->nbytes = nbytes;
    self->descs = descs;
    self->t0 = start;
    self->t1 = t1;
    self->live = 1;
    mark_settled(self);
    return 0;
}

static int
half_built(TransferCore *self)
{
    if (self->agent != NULL && self->backend != NULL && self->handle != NULL)
        return 0;
    PyErr_SetString(PyExc_AttributeError, "this Transfer has no agent, backend or handle (deleted)");
    return 1;
}

static PyObject *
Transfer_state(TransferCore *self, PyObject *unused)
{
    if (half_built(self))
        return NULL;
    if (!self->live) {
        PyErr_Format(invalid_handle, "transfer %R was released; its state is gone (telemetry stays)", self->handle);
        return NULL;
    }
    if (self->settled)
        return Py_NewRef(done_state);
    PyObject *call[3] = {NULL, self->backend, self->handle};
    PyObject *s = PyObject_VectorcallMethod(s_check_state, call + 1, 2 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
    if (s == NULL || self->t2 >= 0)
        return s;
    PyObject *status = PyObject_GetAttr(s, s_status);
    if (status == NULL) {
        Py_DECREF(s);
        return NULL;
    }
    if (status != proc_status)
        self->t2 = now_ns();
    Py_DECREF(status);
    return s;
}

static PyObject *
Transfer_release(TransferCore *self, PyObject *unused)
{
    if (!self->live)  /* released already (by this or a concurrent call): idempotent */
        Py_RETURN_NONE;
    if (half_built(self))
        return NULL;
    self->live = 0;
    if (self->settled)
        Py_RETURN_NONE;
    int closed = agent_closed(self->agent);
    if (closed < 0)
        return NULL;
    if (closed)  /* close() released every handle */
        Py_RETURN_NONE;
    PyObject *call[3] = {NULL, self->backend, self->handle};
    PyObject *r = PyObject_VectorcallMethod(s_release, call + 1, 2 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
    if (r == NULL) {
        if (!PyErr_ExceptionMatches(closed_error))  /* closed meanwhile: close released it */
            return NULL;
        PyErr_Clear();
    }
    Py_XDECREF(r);
    Py_RETURN_NONE;
}

static PyObject *
Transfer_get_t2(TransferCore *self, void *closure)
{
    if (self->t2 < 0)
        Py_RETURN_NONE;
    return PyLong_FromLongLong(self->t2);
}

static int
Transfer_set_t2(TransferCore *self, PyObject *value, void *closure)
{
    if (value == NULL || value == Py_None) {
        self->t2 = -1;
        return 0;
    }
    long long v = PyLong_AsLongLong(value);
    if (v == -1 && PyErr_Occurred())
        return -1;
    self->t2 = v;
    return 0;
}

static PyObject *
Transfer_get_live(TransferCore *self, void *closure)
{
    return PyBool_FromLong(self->live);
}

static PyObject *
Transfer_get_settled(TransferCore *self, void *closure)
{
    return PyBool_FromLong(self->settled);
}

static PyMethodDef Transfer_methods[] = {
    {"state", (PyCFunction)Transfer_state, METH_NOARGS,
     "state()\n--\n\nThe backend's XferState of this transfer (InvalidHandle once released)."},
    {"release", (PyCFunction)Transfer_release, METH_NOARGS,
     "release()\n--\n\nFree the handle.  Releasing a transfer in flight stops it where the\n"
     "backend can, else waits for its posted bytes (bounded by the backend's\n"
     "timeout).  Idempotent for this object, and nothing to do once the\n"
     "agent is closed (``close`` released every handle)."},
    {NULL}
};

static PyMemberDef Transfer_members[] = {
    {"_agent", T_OBJECT_EX, offsetof(TransferCore, agent), 0, NULL},
    {"_backend", T_OBJECT_EX, offsetof(TransferCore, backend), 0, NULL},
    {"handle", T_OBJECT_EX, offsetof(TransferCore, handle), 0, NULL},
    {"peer", T_OBJECT, offsetof(TransferCore, peer), 0, NULL},
    {"verify", T_OBJECT, offsetof(TransferCore, verify), 0, NULL},
    {"nbytes", T_LONGLONG, offsetof(TransferCore, nbytes), 0, NULL},
    {"descs", T_LONGLONG, offsetof(TransferCore, descs), 0, NULL},
    {"_t0", T_LONGLONG, offsetof(TransferCore, t0), 0, NULL},
    {"_t1", T_LONGLONG, offsetof(TransferCore, t1), 0, NULL},
    {NULL}
};

static PyGetSetDef Transfer_getset[] = {
    {"_t2", (getter)Transfer_get_t2, (setter)Transfer_set_t2, NULL, NULL},
    {"_live", (getter)Transfer_get_live, NULL, NULL, NULL},
    {"_settled", (getter)Transfer_get_settled, NULL, NULL, NULL},
    {NULL}
};

static PyTypeObject TransferCoreType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvt._fastpath.TransferCore",
    .tp_basicsize = sizeof(TransferCore),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "kvt.Transfer's fields, state() and release().",
    .tp_traverse = (traverseproc)Transfer_traverse,
    .tp_clear = (inquiry)Transfer_clear,
    .tp_dealloc = (destructor)Transfer_dealloc,
    .tp_finalize = (destructor)Transfer_finalize,
    .tp_methods = Transfer_methods,
    .tp_members = Transfer_members,
    .tp_getset = Transfer_getset,
    .tp_init = (initproc)Transfer_init,
    .tp_new = PyType_GenericNew,
};

/* ------------------------------------------------------------ block_index */

static PyObject *
block_index(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "block_index(block_ids, num_blocks, regions)");
        return NULL;
    }
    PyObject *ids = args[0];
    long long nb = PyLong_AsLongLong(args[1]), nr = PyLong_AsLongLong(args[2]), span;
    if ((nb == -1 || nr == -1) && PyErr_Occurred())
        return NULL;
    if (np_empty == NULL || !(PyList_CheckExact(ids) || PyTuple_CheckExact(ids)) || nb < 0 || nr < 1
        || __builtin_mul_overflow(nb, nr, &span))
        Py_RETURN_NONE;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(ids);
    long long total;
    if (__builtin_mul_overflow((long long)n, nr, &total) || total > PY_SSIZE_T_MAX / 8)
        Py_RETURN_NONE;
    PyObject *size = PyLong_FromLongLong(total);
    if (size == NULL)
        return NULL;
    PyObject *call[3] = {NULL, size, np_int64};
    PyObject *out = PyObject_Vectorcall(np_empty, call + 1, 2 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
    Py_DECREF(size);
    if (out == NULL)
        return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(out, &view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        Py_DECREF(out);
        return NULL;
    }
    long long *dst = view.buf;
    PyObject **items = PySequence_Fast_ITEMS(ids);  /* a list cannot change size: no Python code runs */
    int taken = 1;
    for (Py_ssize_t i = 0; i < n; i++) {
        int overflow;
        long long v = PyLong_CheckExact(items[i]) ? PyLong_AsLongLongAndOverflow(items[i], &overflow) : -1;
        if (v < 0 || v >= nb) {  /* not an int (bool, numpy scalar, float), or out of range */
            taken = 0;
            break;
        }
        for (long long r = 0; r < nr; r++)
            dst[r * n + i] = r * nb + v;
    }
    PyBuffer_Release(&view);
    if (!taken) {
        Py_DECREF(out);
        Py_RETURN_NONE;
    }
    return out;
}

/* ------------------------------------------------------------------ module */

static PyObject *
setup(PyObject *module, PyObject *args)
{
    PyObject *tt, *ce, *ih, *ps, *ds, *em, *i64;
    if (!PyArg_ParseTuple(args, "O!OOOOOO:setup", &PyType_Type, &tt, &ce, &ih, &ps, &ds, &em, &i64))
        return NULL;
    if (!PyType_IsSubtype((PyTypeObject *)tt, &TransferCoreType)) {
        PyErr_SetString(PyExc_TypeError, "setup() needs a subclass of TransferCore");
        return NULL;
    }
    Py_XSETREF(transfer_type, (PyTypeObject *)Py_NewRef(tt));
    Py_XSETREF(closed_error, Py_NewRef(ce));
    Py_XSETREF(invalid_handle, Py_NewRef(ih));
    Py_XSETREF(proc_status, Py_NewRef(ps));
    Py_XSETREF(done_state, Py_NewRef(ds));
    Py_XSETREF(np_empty, Py_NewRef(em));
    Py_XSETREF(np_int64, Py_NewRef(i64));
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"setup", setup, METH_VARARGS,
     "setup(Transfer, ClosedError, InvalidHandle, Status.PROC, XferState.DONE, numpy.empty, "
     "numpy.dtype(numpy.int64)): "
     "what the post path and block_index build and raise."},
    {"block_index", (PyCFunction)(void (*)(void))block_index, METH_FASTCALL,
     "block_index(block_ids, num_blocks, regions) -> int64 array, region-major, or None: "
     "only a list or tuple of ints in [0, num_blocks) is taken."},
    {NULL}
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvt._fastpath", "kvt.Agent's post path in C (see kvt/_fastpath.c).", -1,
    module_methods,
};

PyMODINIT_FUNC
PyInit__fastpath(void)
{
    if (PyType_Ready(&RouteCoreType) < 0 || PyType_Ready(&AgentCoreType) < 0 || PyType_Ready(&TransferCoreType) < 0)
        return NULL;
    if (!(s_transfer = PyUnicode_InternFromString("transfer")) || !(s_check_state = PyUnicode_InternFromString(
            "check_state")) || !(s_release = PyUnicode_InternFromString("release"))
        || !(s_status = PyUnicode_InternFromString("status")) || !(s_slow = PyUnicode_InternFromString(
            "_transfer_blocks")) || !(s_kv = PyUnicode_InternFromString("kv")))
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, "RouteCore", (PyObject *)&RouteCoreType) < 0
        || PyModule_AddObjectRef(m, "AgentCore", (PyObject *)&AgentCoreType) < 0
        || PyModule_AddObjectRef(m, "TransferCore", (PyObject *)&TransferCoreType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
