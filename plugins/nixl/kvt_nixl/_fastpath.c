/* kvt_nixl._fastpath: the nixl backend's post and poll in C.
 *
 * A one-block transfer is two NIXL calls (makeXferReq, postXferReq) and a
 * status check; the backend's Python around them (handle lookups, the
 * stale-epoch check, the lock, the record) cost about as much again on a
 * slow CPU (docs/performance.md).  This module holds the fields the hot
 * path reads as C base types of NixlBackend and _Prep, and does the common
 * case of transfer() and check_state():
 *
 *   transfer     READ or WRITE, no notification, both preps known and
 *                current, the peer not silent, its epoch unmoved, 1-D
 *                index arrays of int32 or a few int64 (see side_open);
 *                NIXL called under the backend's _nixl lock.  A transfer
 *                NIXL did not finish within its post is recorded by
 *                NixlBackend._record, one NIXL refused by _refused.
 *   check_state  a transfer that finished within its post.
 *
 * Everything else goes to NixlBackend._transfer / _check_state (Python),
 * which also are the pure-Python twins (KVT_NATIVE=0, or no compiler).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <string.h>

#define FEW 16  /* int64 ids up to this many go to NIXL through a scratch array (backend.py: _FEW) */

static PyObject *op_read, *op_write, *xfer_type, *done_state, *ndarray_type;
static PyObject *s_transfer, *s_check_state, *s_acquire, *s_release, *s_handle, *s_address, *s_seen, *s_record,
    *s_refused, *empty_bytes;

/* ------------------------------------------------------------------ PrepCore */

typedef struct {
    PyObject_HEAD
    PyObject *peer, *descs, *side, *target, *old, *all, *epoch, *released;
} PrepCore;

static int
Prep_traverse(PrepCore *self, visitproc visit, void *arg)
{
    Py_VISIT(self->peer);
    Py_VISIT(self->descs);
    Py_VISIT(self->side);
    Py_VISIT(self->target);
    Py_VISIT(self->old);
    Py_VISIT(self->all);
    Py_VISIT(self->epoch);
    Py_VISIT(self->released);
    return 0;
}

static int
Prep_clear(PrepCore *self)
{
    Py_CLEAR(self->peer);
    Py_CLEAR(self->descs);
    Py_CLEAR(self->side);
    Py_CLEAR(self->target);
    Py_CLEAR(self->old);
    Py_CLEAR(self->all);
    Py_CLEAR(self->epoch);
    Py_CLEAR(self->released);
    return 0;
}

static void
Prep_dealloc(PrepCore *self)
{
    PyObject_GC_UnTrack(self);
    Prep_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);  /* (subtype_dealloc drops a heap subclass's type) */
}

static PyMemberDef Prep_members[] = {
    {"peer", T_OBJECT, offsetof(PrepCore, peer), 0, NULL},
    {"descs", T_OBJECT, offsetof(PrepCore, descs), 0, NULL},
    {"side", T_OBJECT, offsetof(PrepCore, side), 0, NULL},
    {"target", T_OBJECT, offsetof(PrepCore, target), 0, NULL},
    {"old", T_OBJECT, offsetof(PrepCore, old), 0, NULL},
    {"_all", T_OBJECT, offsetof(PrepCore, all), 0, NULL},
    {"epoch", T_OBJECT, offsetof(PrepCore, epoch), 0, NULL},
    {"released", T_OBJECT, offsetof(PrepCore, released), 0, NULL},
    {NULL}
};

static PyTypeObject PrepCoreType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvt_nixl._fastpath.PrepCore",
    .tp_basicsize = sizeof(PrepCore),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "The fields of kvt_nixl.backend._Prep.",
    .tp_traverse = (traverseproc)Prep_traverse,
    .tp_clear = (inquiry)Prep_clear,
    .tp_dealloc = (destructor)Prep_dealloc,
    .tp_members = Prep_members,
    .tp_new = PyType_GenericNew,
};

/* ------------------------------------------------------------------ NixlCore */

typedef struct {
    PyObject_HEAD
    PyObject *preps, *silent, *xfers, *ids, *lock, *make, *post, *read, *write, *ok, *scratch;
    char closed;
} NixlCore;

#define CORE_FIELDS(X) \
    X(preps) X(silent) X(xfers) X(ids) X(lock) X(make) X(post) X(read) X(write) X(ok) X(scratch)

static int
Core_traverse(NixlCore *self, visitproc visit, void *arg)
{
#define VISIT(f) Py_VISIT(self->f);
    CORE_FIELDS(VISIT)
#undef VISIT
    return 0;
}

static int
Core_clear(NixlCore *self)
{
#define CLEAR(f) Py_CLEAR(self->f);
    CORE_FIELDS(CLEAR)
#undef CLEAR
    return 0;
}

static void
Core_dealloc(NixlCore *self)
{
    PyObject_GC_UnTrack(self);
    Core_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* self.<name>(*args, **kwargs in kwnames): the Python path, or a Python helper */
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

static PyObject *
call0(PyObject *obj, PyObject *name)
{
    PyObject *args[2] = {NULL, obj};
    return PyObject_VectorcallMethod(name, args + 1, 1 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
}

/* Has the same-host peer deregistered memory since its metadata was loaded?
 * 1 yes, 0 no, -1 cannot tell here (the watch was closed: the Python path). */
static int
epoch_moved(PyObject *watch)
{
    PyObject *a = PyObject_GetAttr(watch, s_address), *seen;
    if (a == NULL)
        return -1;
    uintptr_t addr = (uintptr_t)PyLong_AsVoidPtr(a);
    Py_DECREF(a);
    if (addr == 0 || (seen = PyObject_GetAttr(watch, s_seen)) == NULL)
        return -1;
    unsigned long long want = PyLong_AsUnsignedLongLong(seen);
    Py_DECREF(seen);
    if (want == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    /* the mapping lives while address is set: EpochWatch.close zeroes it first, under the GIL we hold */
    return __atomic_load_n((volatile uint64_t *)addr, __ATOMIC_ACQUIRE) != want;
}

/* NIXL's indices for one side.  An int32 array goes as it is.  A few int64
 * ids (what engines hold) are copied, under the _nixl lock, into one of the
 * backend's int32 scratch arrays (NIXL reads them within makeXferReq only):
 * NIXL takes an int32 array faster than a list, by ~0.5 us here, and would
 * wrap an int64 array's wide values, which are checked here instead. */
typedef struct {
    PyObject *idx;    /* the caller's array (borrowed) */
    Py_buffer view;   /* held for a few int64 ids */
    Py_ssize_t few;   /* how many (0: the array goes as it is) */
} Side;

/* 1: the fast path can take it; 0: the Python path (no error set) */
static int
side_open(Side *side, PyObject *idx)
{
    side->idx = idx;
    side->few = 0;
    if ((PyObject *)Py_TYPE(idx) != ndarray_type)
        return 0;
    if (PyObject_GetBuffer(idx, &side->view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) {
        PyErr_Clear();
        return 0;
    }
    const char *f = side->view.format ? side->view.format : "B";
    Py_ssize_t n = side->view.ndim == 1 ? side->view.shape[0] : -1;
    if (n >= 0 && side->view.itemsize == 4 && strcmp(f, "i") == 0) {
        PyBuffer_Release(&side->view);
        return 1;
    }
    if (n >= 1 && n <= FEW && side->view.itemsize == 8 && (strcmp(f, "l") == 0 || strcmp(f, "q") == 0)) {
        const long long *v = side->view.buf;
        for (Py_ssize_t i = 0; i < n; i++)
            if (v[i] < INT32_MIN || v[i] > INT32_MAX)
                goto no;  /* NIXL must see the value to refuse it */
        side->few = n;
        return 1;
    }
no:
    PyBuffer_Release(&side->view);
    return 0;
}

static void
side_close(Side *side)
{
    if (side->few)
        PyBuffer_Release(&side->view);
    side->few = 0;
}

/* What NIXL gets for this side (the caller holds _nixl); NULL with an error set. */
static PyObject *
side_indices(Side *side, PyObject *scratch, int row)
{
    if (!side->few)
        return Py_NewRef(side->idx);
    PyObject *arr = PyTuple_GET_ITEM(PyTuple_GET_ITEM(scratch, row), side->few - 1);
    Py_buffer out;
    if (PyObject_GetBuffer(arr, &out, PyBUF_WRITABLE | PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    if (out.itemsize != 4 || out.len != side->few * 4) {
        PyBuffer_Release(&out);
        PyErr_SetString(PyExc_RuntimeError, "kvt_nixl: a scratch index array has the wrong size");
        return NULL;
    }
    const long long *v = side->view.buf;
    int32_t *o = out.buf;
    for (Py_ssize_t i = 0; i < side->few; i++)
        o[i] = (int32_t)v[i];
    PyBuffer_Release(&out);
    return Py_NewRef(arr);
}

/* the backend's scratch arrays: two rows (local, remote) of FEW int32 arrays of 1..FEW elements */
static int
scratch_ok(PyObject *scratch)
{
    if (scratch == NULL || !PyTuple_CheckExact(scratch) || PyTuple_GET_SIZE(scratch) != 2)
        return 0;
    for (int i = 0; i < 2; i++) {
        PyObject *row = PyTuple_GET_ITEM(scratch, i);
        if (!PyTuple_CheckExact(row) || PyTuple_GET_SIZE(row) != FEW)
            return 0;
    }
    return 1;
}

static PyObject *
Core_transfer(NixlCore *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    if (kwnames != NULL || nargs < 5 || nargs > 6 || self->closed || (nargs == 6 && args[5] != Py_None)
        || (args[0] != op_read && args[0] != op_write) || self->preps == NULL || !PyDict_CheckExact(self->preps)
        || self->silent == NULL || !PyDict_CheckExact(self->silent) || PyDict_GET_SIZE(self->silent)
        || self->xfers == NULL || self->lock == NULL || self->make == NULL || self->make == Py_None
        || self->post == NULL || self->post == Py_None || self->ok == NULL || self->ids == NULL)
        goto slow;
    PyObject *op = args[0];
    /* int handles: their lookups run no Python code, so no other thread can drop the preps we
       read before we hold them (another kind of handle, e.g. a subclass: the Python path) */
    if (!PyLong_CheckExact(args[1]) || !PyLong_CheckExact(args[3]))
        goto slow;
    PyObject *lpo = PyDict_GetItemWithError(self->preps, args[1]);
    PyObject *rpo = lpo ? PyDict_GetItemWithError(self->preps, args[3]) : NULL;
    if (rpo == NULL) {
        PyErr_Clear();  /* (an unhashable handle: the Python path says so) */
        goto slow;
    }
    if (!PyObject_TypeCheck(lpo, &PrepCoreType) || !PyObject_TypeCheck(rpo, &PrepCoreType))
        goto slow;
    PrepCore *lp = (PrepCore *)lpo, *rp = (PrepCore *)rpo;
    if (rp->epoch != NULL && rp->epoch != Py_None) {
        int moved = epoch_moved(rp->epoch);
        if (moved != 0) {
            PyErr_Clear();
            goto slow;  /* RemoteRejected, worded there */
        }
    }
    PyObject *lside = lp->side, *rside = rp->target;
    if (lside == NULL || lside == Py_None || rside == NULL || rside == Py_None)
        goto slow;  /* (re)prepped there */
    Side ls, rs;
    if (!side_open(&ls, args[2]))
        goto slow;
    if (!side_open(&rs, args[4])) {
        side_close(&ls);
        goto slow;
    }
    if ((ls.few || rs.few) && !scratch_ok(self->scratch)) {
        side_close(&ls);
        side_close(&rs);
        goto slow;
    }
    /* our references: another thread may retire the preps' lists and drop the preps meanwhile */
    Py_INCREF(lp);
    Py_INCREF(rp);
    Py_INCREF(lside);
    Py_INCREF(rside);
    PyObject *lh = PyObject_GetAttr(lside, s_handle), *rh = lh ? PyObject_GetAttr(rside, s_handle) : NULL;
    PyObject *lock = Py_NewRef(self->lock), *result = NULL, *taken = NULL;
    PyObject *xh = NULL, *s = NULL, *x = NULL, *h = NULL, *backends = NULL, *li = NULL, *ri = NULL;
    int is_slow = 0;
    if (rh == NULL)
        goto out;
    taken = call0(lock, s_acquire);
    if (taken == NULL)
        goto out;
    /* another thread may have closed the backend, or retired these lists, since we read them */
    if (self->closed || lp->side != lside || rp->target != rside || self->make == NULL || self->make == Py_None) {
        is_slow = 1;
        goto unlock;
    }
    backends = PyList_New(0);
    if (backends == NULL || (li = side_indices(&ls, self->scratch, 0)) == NULL
        || (ri = side_indices(&rs, self->scratch, 1)) == NULL)
        goto unlock;
    {
        PyObject *margs[8] = {op == op_read ? self->read : self->write, lh, li, rh, ri, empty_bytes, backends,
                              Py_False};
        xh = PyObject_Vectorcall(self->make, margs, 8, NULL);
    }
    if (xh == NULL) {  /* NIXL would not create it: _refused says why, outside the lock */
        PyObject *et, *ev, *tb;
        PyErr_Fetch(&et, &ev, &tb);
        PyErr_NormalizeException(&et, &ev, &tb);
        PyObject *r = call0(lock, s_release);
        Py_XDECREF(r);
        Py_CLEAR(taken);
        if (r == NULL) {
            Py_XDECREF(et);
            Py_XDECREF(ev);
            Py_XDECREF(tb);
            goto out;
        }
        if (ev != NULL && tb != NULL)
            PyException_SetTraceback(ev, tb);
        PyObject *rargs[7] = {ev ? ev : Py_None, op, (PyObject *)lp, args[2], (PyObject *)rp, args[4], Py_None};
        result = call_method((PyObject *)self, s_refused, rargs, 7, NULL);
        Py_XDECREF(et);
        Py_XDECREF(ev);
        Py_XDECREF(tb);
        goto out;
    }
    {
        PyObject *pargs[2] = {xh, empty_bytes};
        s = PyObject_Vectorcall(self->post, pargs, 2, NULL);
    }
    int finished = 0;
    PyObject *perr = NULL;
    if (s == NULL) {  /* e.g. the peer is already gone */
        PyObject *et, *tb;
        PyErr_Fetch(&et, &perr, &tb);
        PyErr_NormalizeException(&et, &perr, &tb);
        Py_XDECREF(et);
        Py_XDECREF(tb);
        if (perr == NULL)
            perr = Py_NewRef(Py_None);
    } else {
        finished = PyObject_RichCompareBool(s, self->ok, Py_EQ);
        if (finished < 0)
            goto unlock;
    }
    if (finished) {
        x = Py_NewRef(xh);  /* NIXL's handle alone is the cheapest record of a finished transfer */
    } else {
        PyObject *rargs[5] = {xh, s ? s : Py_None, perr ? perr : Py_None, op, (PyObject *)rp};
        x = call_method((PyObject *)self, s_record, rargs, 5, NULL);
    }
    Py_XDECREF(perr);
    if (x == NULL)
        goto unlock;
    h = PyIter_Next(self->ids);
    if (h == NULL) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_RuntimeError, "the backend's handle ids ran out");
        goto unlock;
    }
    if (PyDict_SetItem(self->xfers, h, x) < 0)
        Py_CLEAR(h);
    result = h;
unlock:
    if (taken != NULL) {
        PyObject *et, *ev, *tb;
        PyErr_Fetch(&et, &ev, &tb);
        PyObject *r = call0(lock, s_release);
        if (r == NULL) {
            Py_XDECREF(et);
            Py_XDECREF(ev);
            Py_XDECREF(tb);
            Py_CLEAR(result);
        } else {
            Py_DECREF(r);
            PyErr_Restore(et, ev, tb);
        }
    }
out:
    Py_XDECREF(taken);
    Py_XDECREF(backends);
    Py_XDECREF(xh);
    Py_XDECREF(s);
    Py_XDECREF(x);
    Py_XDECREF(lh);
    Py_XDECREF(rh);
    Py_DECREF(lock);
    Py_XDECREF(li);
    Py_XDECREF(ri);
    side_close(&ls);
    side_close(&rs);
    Py_DECREF(lside);
    Py_DECREF(rside);
    Py_DECREF(lp);
    Py_DECREF(rp);
    if (!is_slow)
        return result;
slow:
    return call_method((PyObject *)self, s_transfer, args, nargs, kwnames);
}

static PyObject *
Core_check_state(NixlCore *self, PyObject *handle)
{
    if (!self->closed && self->xfers != NULL && PyDict_CheckExact(self->xfers)) {
        PyObject *x = PyDict_GetItemWithError(self->xfers, handle);
        if (x != NULL && (PyObject *)Py_TYPE(x) != xfer_type)  /* NIXL's handle alone: DONE within its post */
            return Py_NewRef(done_state);
        PyErr_Clear();
    }
    return call_method((PyObject *)self, s_check_state, &handle, 1, NULL);
}

static PyMethodDef Core_methods[] = {
    {"transfer", (PyCFunction)(void (*)(void))Core_transfer, METH_FASTCALL | METH_KEYWORDS,
     "transfer(op, local_prep, local_idx, remote_prep, remote_idx, notif=None)\n--\n\n"
     "Post a transfer (kvt.backend.Backend.transfer)."},
    {"check_state", (PyCFunction)Core_check_state, METH_O,
     "check_state(handle)\n--\n\nThe transfer's XferState (kvt.backend.Backend.check_state)."},
    {NULL}
};

static PyMemberDef Core_members[] = {
    {"_preps", T_OBJECT, offsetof(NixlCore, preps), 0, NULL},
    {"_silent", T_OBJECT, offsetof(NixlCore, silent), 0, NULL},
    {"_xfers", T_OBJECT, offsetof(NixlCore, xfers), 0, NULL},
    {"_ids", T_OBJECT, offsetof(NixlCore, ids), 0, NULL},
    {"_nixl", T_OBJECT, offsetof(NixlCore, lock), 0, NULL},
    {"_make", T_OBJECT, offsetof(NixlCore, make), 0, NULL},
    {"_post", T_OBJECT, offsetof(NixlCore, post), 0, NULL},
    {"_read", T_OBJECT, offsetof(NixlCore, read), 0, NULL},
    {"_write", T_OBJECT, offsetof(NixlCore, write), 0, NULL},
    {"_ok", T_OBJECT, offsetof(NixlCore, ok), 0, NULL},
    {"_scratch", T_OBJECT, offsetof(NixlCore, scratch), 0, NULL},
    {"_closed", T_BOOL, offsetof(NixlCore, closed), 0, NULL},
    {NULL}
};

static PyTypeObject NixlCoreType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvt_nixl._fastpath.NixlCore",
    .tp_basicsize = sizeof(NixlCore),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "NixlBackend's hot fields and the common case of transfer() and check_state().",
    .tp_traverse = (traverseproc)Core_traverse,
    .tp_clear = (inquiry)Core_clear,
    .tp_dealloc = (destructor)Core_dealloc,
    .tp_methods = Core_methods,
    .tp_members = Core_members,
    .tp_new = PyType_GenericNew,
};

/* ------------------------------------------------------------------ module */

static PyObject *
setup(PyObject *module, PyObject *args)
{
    PyObject *r, *w, *x, *d, *nd;
    if (!PyArg_ParseTuple(args, "OOOOO:setup", &r, &w, &x, &d, &nd))
        return NULL;
    Py_XSETREF(op_read, Py_NewRef(r));
    Py_XSETREF(op_write, Py_NewRef(w));
    Py_XSETREF(xfer_type, Py_NewRef(x));
    Py_XSETREF(done_state, Py_NewRef(d));
    Py_XSETREF(ndarray_type, Py_NewRef(nd));
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"setup", setup, METH_VARARGS, "setup(Op.READ, Op.WRITE, _Xfer, XferState.DONE, numpy.ndarray)"},
    {NULL}
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvt_nixl._fastpath", "The nixl backend's post and poll in C (kvt_nixl/_fastpath.c).", -1,
    module_methods,
};

PyMODINIT_FUNC
PyInit__fastpath(void)
{
    if (PyType_Ready(&PrepCoreType) < 0 || PyType_Ready(&NixlCoreType) < 0)
        return NULL;
    if (!(s_transfer = PyUnicode_InternFromString("_transfer"))
        || !(s_check_state = PyUnicode_InternFromString("_check_state"))
        || !(s_acquire = PyUnicode_InternFromString("acquire")) || !(s_release = PyUnicode_InternFromString("release"))
        || !(s_handle = PyUnicode_InternFromString("_handle")) || !(s_address = PyUnicode_InternFromString("address"))
        || !(s_seen = PyUnicode_InternFromString("seen")) || !(s_record = PyUnicode_InternFromString("_record"))
        || !(s_refused = PyUnicode_InternFromString("_refused")) || !(empty_bytes = PyBytes_FromStringAndSize("", 0)))
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, "PrepCore", (PyObject *)&PrepCoreType) < 0
        || PyModule_AddObjectRef(m, "NixlCore", (PyObject *)&NixlCoreType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
