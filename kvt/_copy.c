/* kvt._copy: scatter/gather memory copies of (dst, src, len) descriptor arrays.
 *
 * The GIL is released for the whole copy.  Address arrays may be strided
 * (a column of a (n, 2) or (n, 3) row array needs no copy); lengths are an
 * array or one int for uniform blocks.  Runs contiguous on both sides merge
 * into one memmove.  Large requests may be split by bytes across threads.
 * Callers (kvt/memcopy.py) vouch that every address is mapped: this module
 * checks shapes and types, not memory.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#define MAX_THREADS 16

typedef struct {
    const char *dst, *src, *len;           /* NULL len: every row is ulen bytes */
    Py_ssize_t dstride, sstride, lstride;
    uint64_t ulen;
    Py_ssize_t n;
} Plan;

#define AT(base, stride, i) (*(const uint64_t *)((base) + (i) * (stride)))

static inline uint64_t row_len(const Plan *p, Py_ssize_t i)
{
    return p->len ? AT(p->len, p->lstride, i) : p->ulen;
}

/* Every row, merging runs contiguous on both sides. */
static void copy_all(const Plan *p)
{
    Py_ssize_t i = 0;
    while (i < p->n) {
        uint64_t d = AT(p->dst, p->dstride, i), s = AT(p->src, p->sstride, i), l = row_len(p, i);
        for (i++; i < p->n; i++) {
            uint64_t nl = row_len(p, i);
            if (AT(p->dst, p->dstride, i) != d + l || AT(p->src, p->sstride, i) != s + l)
                break;
            l += nl;
        }
        if (l)
            memmove((void *)(uintptr_t)d, (const void *)(uintptr_t)s, (size_t)l);
    }
}

typedef struct {
    const Plan *plan;
    uint64_t begin, end;  /* byte range of the concatenated rows */
} Part;

/* The bytes [begin, end) of the concatenated rows. */
static void *copy_part(void *arg)
{
    const Part *part = arg;
    const Plan *p = part->plan;
    uint64_t off = 0;
    for (Py_ssize_t i = 0; i < p->n && off < part->end; i++) {
        uint64_t l = row_len(p, i);
        uint64_t lo = part->begin > off ? part->begin - off : 0;
        uint64_t hi = part->end - off < l ? part->end - off : l;
        if (lo < hi)
            memmove((void *)(uintptr_t)(AT(p->dst, p->dstride, i) + lo),
                    (const void *)(uintptr_t)(AT(p->src, p->sstride, i) + lo), (size_t)(hi - lo));
        off += l;
    }
    return NULL;
}

static void copy_split(const Plan *p, uint64_t total, int threads)
{
    pthread_t tid[MAX_THREADS];
    Part parts[MAX_THREADS];
    int started = 0;
    for (int t = 0; t < threads; t++) {
        /* page-aligned boundaries: no two threads write one page */
        parts[t].plan = p;
        parts[t].begin = t ? parts[t - 1].end : 0;
        parts[t].end = t == threads - 1 ? total : (total / threads * (t + 1)) & ~(uint64_t)4095;
    }
    for (int t = 1; t < threads; t++) {
        if (pthread_create(&tid[t], NULL, copy_part, &parts[t]) != 0)
            break;
        started = t;
    }
    copy_part(&parts[0]);
    for (int t = started + 1; t < threads; t++)  /* threads that could not start: do their part here */
        copy_part(&parts[t]);
    for (int t = 1; t <= started; t++)
        pthread_join(tid[t], NULL);
}

/* A 1-D buffer of 8-byte unsigned ints (strides allowed). */
static int get_column(PyObject *obj, Py_buffer *view, const char *what)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_RECORDS_RO) < 0)
        return -1;
    const char *f = view->format ? view->format : "B";
    char code = f[strlen(f) - 1];
    if (view->ndim != 1 || view->itemsize != 8 || !strchr("QLN", code) || (f[0] && strchr(">!", f[0]))) {
        PyErr_Format(PyExc_TypeError, "%s must be a 1-D array of native uint64 (got ndim %d, format '%s')",
                     what, view->ndim, f);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(copy_doc,
"copy(dst, src, lengths, threads=1, split_bytes=0) -> int\n\n"
"Copy lengths[i] bytes from address src[i] to address dst[i] for every i.\n"
"dst, src: 1-D uint64 arrays (strided views allowed); lengths: such an\n"
"array or one int (uniform blocks).  With threads > 1 and at least\n"
"split_bytes in total, the bytes are split evenly across threads.\n"
"Returns the number of bytes copied.  The GIL is released meanwhile.");

static PyObject *py_copy(PyObject *self, PyObject *args, PyObject *kw)
{
    static char *names[] = {"dst", "src", "lengths", "threads", "split_bytes", NULL};
    PyObject *dobj, *sobj, *lobj;
    int threads = 1;
    unsigned long long split = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOO|iK", names, &dobj, &sobj, &lobj, &threads, &split))
        return NULL;
    Py_buffer dv, sv, lv;
    int have_l = 0;
    PyObject *out = NULL;
    Plan p = {0};
    if (get_column(dobj, &dv, "dst") < 0)
        return NULL;
    if (get_column(sobj, &sv, "src") < 0) {
        PyBuffer_Release(&dv);
        return NULL;
    }
    if (PyLong_Check(lobj)) {
        p.ulen = PyLong_AsUnsignedLongLong(lobj);
        if (PyErr_Occurred())
            goto done;
    } else {
        if (get_column(lobj, &lv, "lengths") < 0)
            goto done;
        have_l = 1;
        if (lv.shape[0] != dv.shape[0]) {
            PyErr_Format(PyExc_ValueError, "lengths has %zd rows, dst %zd", lv.shape[0], dv.shape[0]);
            goto done;
        }
        p.len = lv.buf;
        p.lstride = lv.strides[0];
    }
    if (sv.shape[0] != dv.shape[0]) {
        PyErr_Format(PyExc_ValueError, "src has %zd rows, dst %zd", sv.shape[0], dv.shape[0]);
        goto done;
    }
    p.dst = dv.buf, p.dstride = dv.strides[0];
    p.src = sv.buf, p.sstride = sv.strides[0];
    p.n = dv.shape[0];
    uint64_t total = 0;
    if (p.len) {
        for (Py_ssize_t i = 0; i < p.n; i++) {
            uint64_t l = AT(p.len, p.lstride, i);
            if (total + l < total) {
                PyErr_SetString(PyExc_OverflowError, "lengths sum past 2**64");
                goto done;
            }
            total += l;
        }
    } else if (p.n && p.ulen > UINT64_MAX / (uint64_t)p.n) {
        PyErr_SetString(PyExc_OverflowError, "lengths sum past 2**64");
        goto done;
    } else {
        total = p.ulen * (uint64_t)p.n;
    }
    if (threads > MAX_THREADS)
        threads = MAX_THREADS;
    Py_BEGIN_ALLOW_THREADS
    if (threads > 1 && total >= split && total >= (uint64_t)threads * 65536)
        copy_split(&p, total, threads);
    else
        copy_all(&p);
    Py_END_ALLOW_THREADS
    out = PyLong_FromUnsignedLongLong(total);
done:
    if (have_l)
        PyBuffer_Release(&lv);
    PyBuffer_Release(&sv);
    PyBuffer_Release(&dv);
    return out;
}

static PyMethodDef methods[] = {
    {"copy", (PyCFunction)(void (*)(void))py_copy, METH_VARARGS | METH_KEYWORDS, copy_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvt._copy", "Scatter/gather memory copies in C with the GIL released.", -1, methods,
};

PyMODINIT_FUNC PyInit__copy(void)
{
    return PyModule_Create(&module);
}
