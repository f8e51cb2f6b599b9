/*
 * kvt_ucx._ucp: the ucx backend's binding to UCX's one-sided API (UCP RMA).
 *
 * One Worker owns a UCP context and worker and one progress thread (a plain
 * pthread that never takes the GIL).  Every UCP call, from that thread or from
 * Python, runs under the worker's mutex (the worker is created SERIALIZED).
 * The thread sleeps on the worker's event fd (ucp_worker_arm) and wakes for
 * network events or an eventfd poke; Python's polling calls also progress the
 * worker, so a caller that polls completes as fast as it polls.
 *
 * A transfer is one post() call: every row is a ucp_get_nbx/ucp_put_nbx whose
 * request is released at once; one ucp_ep_flush_nbx after the last row ends
 * the transfer (every row completed at both ends, or the endpoint's error),
 * and only then is its notification sent as an active message.  The target
 * does nothing for the data: only memory it mapped has remote keys.
 *
 * Same-host requests of at least split_bytes run on two lanes: the request
 * becomes one list of chunks (runs cut to a quarter of split_bytes); the caller
 * posts chunks from the front on the first worker while a helper thread posts
 * from the back on a second UCP worker (worker1: its own mutex, endpoints and
 * keys).  Between processes on one host UCX copies with cma inside the posting
 * call, one CPU per call; two lanes use two.  A helper that wakes late just
 * takes fewer chunks (none: the caller ends its part).  The transfer ends when
 * both lanes are flushed.
 *
 * Nothing here aborts: every UCX status becomes a Python exception
 * (_ucp.Error with .status) or a transfer state.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>

#include <ucp/api/ucp.h>

#define AM_NOTIF 0x6b76 /* active message id of notifications */
#define MAX_NAME 1024   /* longest sender name accepted in a notification */

static PyObject *UcpError;

/* ------------------------------------------------------------------------ */

typedef struct notif_s {
    struct notif_s *next;
    size_t name_len, len;
    char data[]; /* name, then message */
} notif_t;

typedef struct {
    PyObject_HEAD
    ucp_context_h ctx;
    ucp_worker_h worker;
    pthread_mutex_t mu;
    pthread_t thread;
    int thread_started;
    int efd, wakefd, epfd;
    volatile int stop;
    int closed;
    long inflight;            /* transfers not yet ended */
    char *name;
    size_t name_len;
    size_t max_notif, max_queue, max_queue_bytes;
    notif_t *head, *tail;
    size_t queued, queued_bytes, dropped;
    /* the second lane (split_bytes > 0): worker1 under mu1, fed by the helper thread */
    size_t split_bytes, chunk; /* chunk: a quarter of split_bytes, 64 KiB to 1 MiB, whole pages */
    ucp_worker_h worker1;
    pthread_mutex_t mu1, qmu; /* order: mu1, then mu, then qmu (or a job's mu); mu is never held while waiting for mu1 */
    pthread_cond_t qcv;
    struct job_s *jobs, *jobs_tail, *current, *done; /* queued, running, finished (under qmu) */
    pthread_t helper;
    int helper_started;
} Worker;

typedef struct {
    ucs_status_t status;      /* UCS_OK while usable; the error UCX (or the pid watch) reported */
    int closing;              /* under mu: the endpoint is closed (nothing more is sent on it) */
    int pidfd;                /* the peer process (same host), watched by the progress thread; or -1 */
    int refs;                 /* under mu: the open endpoint and each transfer posted on it */
    int watched;              /* named by an epoll event and by ep1's error handler: never freed */
} ep_state_t;

/* Teardown and use from several Python threads: every call that releases the
   GIL (to wait for mu or mu1, or while posting a large request) checks again,
   once it holds the lock, that what it uses is still there.  ep and st are
   cleared under mu, ep1 under mu1 and mu (read under either), a key's rkey and
   rkey1 under mu1 and mu; teardown takes what it frees out of the object under
   the lock (so two threads never free one handle) and frees it after. */
typedef struct {
    PyObject_HEAD
    Worker *w;
    ucp_ep_h ep;
    ep_state_t *st;
    int peer_mode;
    void *addr;     /* the peer's worker address (padded copy), for ep1; freed with the object */
    ucp_ep_h ep1;   /* on worker1: same-host peers only (see watch) */
} Endpoint;

typedef struct {
    PyObject_HEAD
    Endpoint *ep;
    ucp_rkey_h rkey;
    ucp_rkey_h rkey1; /* the same key unpacked on ep1, or NULL */
} RemoteKey;

typedef struct {
    PyObject_HEAD
    Worker *w;
    ucp_mem_h memh; /* cleared under mu */
} MemHandle;

typedef struct xfer_s {
    int refs;                 /* the Python Xfer and each outstanding request */
    ucs_status_t status;      /* UCS_INPROGRESS until it ends */
    Worker *w;
    ucp_ep_h ep;
    ep_state_t *st;           /* ep's state (a reference): no notification once it is closing */
    char *notif;              /* name, then message */
    size_t name_len, notif_len;
    int parts;                /* flushes still to come: 1, or 2 when split across lanes */
    int helper_out;           /* the helper's half is still running */
    ucs_status_t part_err;    /* the first error of any part */
} xfer_t;

/* A run of pairs, contiguous on both sides under one key: what post() posts,
   gathered from the caller's tables while checking them (read once). */
typedef struct {
    uint64_t laddr, raddr, len, k;
} run_t;

/* A split request: chunks that the caller claims from the front and the helper from the back. */
typedef struct {
    uint64_t laddr, raddr, len;
    ucp_rkey_h key0, key1; /* the remote key on each lane's endpoint */
} chunk_t;

enum { JOB_QUEUED, JOB_RUNNING, JOB_ABANDONED };

typedef struct job_s {
    struct job_s *next;
    xfer_t *x;
    ucp_ep_h ep;            /* ep1; NULL once the endpoint or a key of it went away: nothing is posted */
    volatile ucs_status_t flush_st;
    int op, state, refs;    /* state, refs (caller and helper): under mu */
    int leak;               /* its flush is still out: never freed */
    ucs_status_t result;    /* the helper's lane, for drain_done */
    pthread_mutex_t mu;
    size_t lo, hi;          /* chunks [lo, hi) are unclaimed */
    chunk_t chunks[];
} job_t;

typedef struct {
    PyObject_HEAD
    Worker *w;
    xfer_t *x;
} Xfer;

static PyTypeObject WorkerType, EndpointType, RemoteKeyType, MemHandleType, XferType;

static PyObject *raise_status(ucs_status_t st, const char *what)
{
    /* Error(message, status) */
    PyObject *v = Py_BuildValue("(Ni)", PyUnicode_FromFormat("%s: %s", what, ucs_status_string(st)), (int)st);
    if (v != NULL) {
        PyErr_SetObject(UcpError, v);
        Py_DECREF(v);
    }
    return NULL;
}

static int check_open(Worker *w)
{
    if (w->closed || w->worker == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "the UCX worker is closed");
        return -1;
    }
    return 0;
}

/* The endpoint (or a key of it) went away meanwhile: the module's Error, status NOT_CONNECTED. */
static PyObject *raise_gone(const char *what)
{
    PyObject *v = Py_BuildValue("(si)", what, (int)UCS_ERR_NOT_CONNECTED);
    if (v != NULL) {
        PyErr_SetObject(UcpError, v);
        Py_DECREF(v);
    }
    return NULL;
}

/* With the GIL: take mu, letting other threads run while waiting.  Never call
   into Python (anything that allocates objects may run finalizers) holding it. */
static void lock(Worker *w)
{
    if (pthread_mutex_trylock(&w->mu) != 0) {
        Py_BEGIN_ALLOW_THREADS
        pthread_mutex_lock(&w->mu);
        Py_END_ALLOW_THREADS
    }
}

static void unlock(Worker *w) { pthread_mutex_unlock(&w->mu); }

/* lock(), then whether the worker is still open (else unlocked, RuntimeError set). */
static int lock_open(Worker *w)
{
    lock(w);
    if (w->closed || w->worker == NULL) {
        unlock(w);
        PyErr_SetString(PyExc_RuntimeError, "the UCX worker is closed");
        return -1;
    }
    return 0;
}

/* With the GIL: take mu1 (the second lane's), which may be held for a whole job. */
static void lock1(Worker *w)
{
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&w->mu1);
    Py_END_ALLOW_THREADS
}

#define LOAD(p) __atomic_load_n((p), __ATOMIC_RELAXED) /* read once: the caller's memory may change meanwhile */

/* Under mu: drop a reference to an endpoint's state. */
static void st_unref(ep_state_t *s)
{
    if (s != NULL && --s->refs == 0 && !s->watched)
        free(s);
}

static void poke(Worker *w)
{
    uint64_t one = 1;
    ssize_t r = write(w->wakefd, &one, sizeof(one));
    (void)r;
}

/* -- transfers' end -------------------------------------------------------- */

static void xfer_decref(xfer_t *x)
{
    if (--x->refs == 0) {
        st_unref(x->st);
        free(x->notif);
        free(x);
    }
}

static void xfer_end(xfer_t *x, ucs_status_t st)
{
    if (x->status == UCS_INPROGRESS) {
        x->status = st;
        x->w->inflight--;
    }
}

static void am_sent_cb(void *req, ucs_status_t st, void *user)
{
    xfer_t *x = user;
    ucp_request_free(req);
    xfer_end(x, st);
    xfer_decref(x);
}

static ucs_status_t send_notif(Worker *w, ucp_ep_h ep, const char *buf, size_t name_len, size_t len,
                               ucp_send_nbx_callback_t cb, void *user, void **req_out)
{
    ucp_request_param_t p;
    memset(&p, 0, sizeof(p));
    p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    p.flags = UCP_AM_SEND_FLAG_EAGER; /* whole message in the receiver's callback: no rendezvous */
    p.cb.send = cb;
    p.user_data = user;
    ucs_status_ptr_t r = ucp_am_send_nbx(ep, AM_NOTIF, buf, name_len, buf + name_len, len - name_len, &p);
    *req_out = NULL;
    if (UCS_PTR_IS_ERR(r))
        return UCS_PTR_STATUS(r);
    if (r == NULL)
        return UCS_OK;
    *req_out = r;
    return UCS_INPROGRESS;
}

/* After the flush: every row is complete, so now the notification. */
static void flushed(xfer_t *x, ucs_status_t st)
{
    if (x->status != UCS_INPROGRESS)
        return; /* cancelled or timed out meanwhile */
    if (st != UCS_OK || x->notif == NULL) {
        xfer_end(x, st);
        return;
    }
    if (x->w->closed || x->st == NULL || x->st->closing) { /* its endpoint is closed (or going): not sent */
        xfer_end(x, UCS_ERR_CANCELED);
        return;
    }
    void *req;
    x->refs++;
    st = send_notif(x->w, x->ep, x->notif, x->name_len, x->notif_len, am_sent_cb, x, &req);
    if (st != UCS_INPROGRESS) {
        x->refs--;
        xfer_end(x, st);
    }
}

/* One lane's flush completed (under mu): the last one ends the transfer. */
static void part_done(xfer_t *x, ucs_status_t st)
{
    if (st != UCS_OK && x->part_err == UCS_OK)
        x->part_err = st;
    if (--x->parts == 0)
        flushed(x, x->part_err);
}

static void flush_cb(void *req, ucs_status_t st, void *user)
{
    xfer_t *x = user;
    ucp_request_free(req);
    part_done(x, st);
    xfer_decref(x);
}

/* -- active messages and endpoint errors ------------------------------------ */

static ucs_status_t am_notif_cb(void *arg, const void *header, size_t header_len, void *data, size_t len,
                                const ucp_am_recv_param_t *param)
{
    Worker *w = arg;
    /* a rendezvous message (not sent by kvt) is dropped without fetching its data */
    if ((param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) || header_len == 0 || header_len > MAX_NAME ||
        len > w->max_notif || w->queued >= w->max_queue || w->queued_bytes + len > w->max_queue_bytes) {
        w->dropped++;
        return UCS_OK;
    }
    notif_t *n = malloc(sizeof(*n) + header_len + len);
    if (n == NULL) {
        w->dropped++;
        return UCS_OK;
    }
    n->next = NULL;
    n->name_len = header_len;
    n->len = len;
    memcpy(n->data, header, header_len);
    if (len)
        memcpy(n->data + header_len, data, len);
    if (w->tail)
        w->tail->next = n;
    else
        w->head = n;
    w->tail = n;
    w->queued++;
    w->queued_bytes += len;
    return UCS_OK;
}

static void ep_error_cb(void *arg, ucp_ep_h ep, ucs_status_t st)
{
    ep_state_t *s = arg;
    (void)ep;
    if (s->status == UCS_OK)
        s->status = st;
}

/* -- the progress thread ----------------------------------------------------- */

static double now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

#define SPIN_S 50e-6 /* keep progressing this long after the last event */

static void drain_done(Worker *w);

static void *progress_main(void *arg)
{
    Worker *w = arg;
    double last = now_s();
    pthread_mutex_lock(&w->mu);
    while (!w->stop) {
        int got = 0;
        drain_done(w);
        while (ucp_worker_progress(w->worker))
            got = 1;
        double t = now_s();
        if (got)
            last = t;
        if (t - last < SPIN_S) {
            pthread_mutex_unlock(&w->mu);
            pthread_mutex_lock(&w->mu);
            continue;
        }
        ucs_status_t st = ucp_worker_arm(w->worker);
        if (st == UCS_ERR_BUSY)
            continue;
        /* transfers in flight: wake now and then even if a transport has no events */
        int timeout_ms = w->inflight > 0 ? 1 : 100;
        pthread_mutex_unlock(&w->mu);
        struct epoll_event ev[16];
        int n = epoll_wait(w->epfd, ev, 16, timeout_ms);
        pthread_mutex_lock(&w->mu);
        for (int i = 0; i < n; i++) {
            if (ev[i].data.ptr == &w->wakefd) {
                uint64_t v;
                ssize_t r = read(w->wakefd, &v, sizeof(v));
                (void)r;
            } else if (ev[i].data.ptr != &w->efd) { /* a watched peer process exited */
                ep_state_t *s = ev[i].data.ptr;
                if (s->status == UCS_OK)
                    s->status = UCS_ERR_CONNECTION_RESET;
                epoll_ctl(w->epfd, EPOLL_CTL_DEL, s->pidfd, NULL);
            }
        }
        last = now_s();
    }
    pthread_mutex_unlock(&w->mu);
    return NULL;
}

/* -- the second lane: the helper thread -------------------------------------- */

static void job_flushed(void *req, ucs_status_t st, void *user)
{
    volatile ucs_status_t *out = user;
    ucp_request_free(req);
    *out = st;
}

/* The next unclaimed chunk from the front (the caller) or the back (the helper), or NULL. */
static chunk_t *claim(job_t *j, int back)
{
    chunk_t *c = NULL;
    pthread_mutex_lock(&j->mu);
    if (j->lo < j->hi)
        c = back ? &j->chunks[--j->hi] : &j->chunks[j->lo++];
    pthread_mutex_unlock(&j->mu);
    return c;
}

/* Drop one of the job's two references (caller's, helper's); the last frees it. */
static void job_unref(job_t *j)
{
    pthread_mutex_lock(&j->mu);
    int last = --j->refs == 0;
    pthread_mutex_unlock(&j->mu);
    if (last) {
        pthread_mutex_destroy(&j->mu);
        free(j);
    }
}

static ucs_status_t post_one(ucp_ep_h ep, int op, uint64_t laddr, uint64_t raddr, uint64_t len, ucp_rkey_h key,
                             ucp_request_param_t *p)
{
    void *buf = (void *)(uintptr_t)laddr;
    ucs_status_ptr_t r = op ? ucp_put_nbx(ep, buf, len, raddr, key, p) : ucp_get_nbx(ep, buf, len, raddr, key, p);
    if (UCS_PTR_IS_ERR(r))
        return UCS_PTR_STATUS(r);
    if (r != NULL)
        ucp_request_free(r); /* the flush reports its completion */
    return UCS_OK;
}

#define JOB_GIVE_UP_S 10.0 /* a flush that never completes (not seen with cma): stop spinning */

/* The helper's lane of a job: claim chunks from the back until none is left,
   post them on worker1, flush, progress until flushed.  Returns the status;
   *leak is set when the flush is still out after JOB_GIVE_UP_S (its callback
   then still names the job: the job must live on). */
static ucs_status_t run_job(Worker *w, job_t *j, int *leak)
{
    ucs_status_t st = UCS_OK;
    pthread_mutex_lock(&w->mu1);
    if (j->ep == NULL) { /* cancelled (its endpoint or keys went away) */
        pthread_mutex_unlock(&w->mu1);
        return UCS_ERR_CANCELED;
    }
    ucp_request_param_t p;
    memset(&p, 0, sizeof(p));
    chunk_t *c;
    while (st == UCS_OK && (c = claim(j, 1)) != NULL) {
        st = post_one(j->ep, j->op, c->laddr, c->raddr, c->len, c->key1, &p);
        while (ucp_worker_progress(w->worker1)) /* copy it now: a claim is work done, not queued */
            ;
    }
    if (st == UCS_OK) {
        volatile ucs_status_t *done = &j->flush_st;
        *done = UCS_INPROGRESS;
        p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
        p.cb.send = job_flushed;
        p.user_data = (void *)done;
        ucs_status_ptr_t q = ucp_ep_flush_nbx(j->ep, &p);
        if (q == NULL || UCS_PTR_IS_ERR(q)) {
            st = UCS_PTR_STATUS(q);
        } else {
            double give_up = now_s() + JOB_GIVE_UP_S;
            while (*done == UCS_INPROGRESS && now_s() < give_up)
                if (!ucp_worker_progress(w->worker1))
                    sched_yield();
            while (ucp_worker_progress(w->worker1)) /* deferred releases (registration cache) */
                ;
            st = *done;
            if (st == UCS_INPROGRESS) {
                *leak = 1;
                st = UCS_ERR_TIMED_OUT;
            }
        }
    } else {
        pthread_mutex_lock(&j->mu); /* failed: the caller posts no more either */
        j->hi = j->lo;
        pthread_mutex_unlock(&j->mu);
    }
    pthread_mutex_unlock(&w->mu1);
    return st;
}

#define HELPER_SPIN_S 200e-6 /* after a job, watch for the next this long before sleeping */

static void *helper_main(void *arg)
{
    Worker *w = arg;
    for (;;) {
        /* large requests come in series (one per layer or per request): waking a sleeping thread
           costs tens of microseconds on a VM, a large part of a 2 MiB copy, so wait awake briefly */
        for (double until = now_s() + HELPER_SPIN_S; *(struct job_s *volatile *)&w->jobs == NULL &&
                                                     !w->stop && now_s() < until;)
            sched_yield();
        pthread_mutex_lock(&w->qmu);
        while (!w->stop && w->jobs == NULL)
            pthread_cond_wait(&w->qcv, &w->qmu);
        job_t *j = w->jobs;
        if (j == NULL) { /* stopping, nothing queued */
            pthread_mutex_unlock(&w->qmu);
            return NULL;
        }
        w->jobs = j->next;
        if (w->jobs == NULL)
            w->jobs_tail = NULL;
        w->current = j;
        pthread_mutex_unlock(&w->qmu);
        pthread_mutex_lock(&j->mu);
        int abandoned = j->state == JOB_ABANDONED; /* the caller finished every chunk and our part */
        if (!abandoned)
            j->state = JOB_RUNNING;
        pthread_mutex_unlock(&j->mu);
        j->result = abandoned ? UCS_OK : run_job(w, j, &j->leak);
        /* the transfer's end is recorded under mu, here if mu is free, else by whoever holds it next
           (never waited for: the caller may hold mu for a whole large post, and this thread must be
           free for the next job); the progress thread is woken only then */
        pthread_mutex_lock(&w->qmu);
        w->current = NULL;
        j->next = w->done;
        w->done = j;
        pthread_mutex_unlock(&w->qmu);
        if (pthread_mutex_trylock(&w->mu) == 0) {
            drain_done(w);
            pthread_mutex_unlock(&w->mu);
        } else {
            poke(w);
        }
    }
}

/* With mu held: record the ends of the helper's finished lanes. */
static void drain_done(Worker *w)
{
    if (w->done == NULL) /* racy peek: a job finishing now is taken on the next call */
        return;
    pthread_mutex_lock(&w->qmu);
    job_t *j = w->done;
    w->done = NULL;
    pthread_mutex_unlock(&w->qmu);
    while (j != NULL) {
        job_t *next = j->next;
        if (j->state != JOB_ABANDONED) {
            j->x->helper_out = 0;
            part_done(j->x, j->result);
        }
        xfer_decref(j->x);
        if (!j->leak)
            job_unref(j);
        j = next;
    }
}

/* With mu1 held: queued (or about to run) jobs on ep1 post nothing. */
static void cancel_jobs(Worker *w, ucp_ep_h ep1)
{
    pthread_mutex_lock(&w->qmu);
    for (job_t *j = w->jobs; j != NULL; j = j->next)
        if (j->ep == ep1)
            j->ep = NULL;
    if (w->current != NULL && w->current->ep == ep1)
        w->current->ep = NULL;
    pthread_mutex_unlock(&w->qmu);
}

static void enqueue(Worker *w, job_t *j)
{
    pthread_mutex_lock(&w->qmu);
    if (w->jobs_tail)
        w->jobs_tail->next = j;
    else
        w->jobs = j;
    w->jobs_tail = j;
    pthread_cond_signal(&w->qcv);
    pthread_mutex_unlock(&w->qmu);
}

/* -- Worker ---------------------------------------------------------------- */

/* Close the worker (with the GIL; idempotent).  It is marked closed under mu
   first: a thread that passed check_open and then waited for mu sees it and
   does nothing; UCP objects are destroyed under their worker's lock. */
static void worker_free_ucx(Worker *w)
{
    lock(w);
    int was_closed = w->closed;
    w->closed = 1;
    unlock(w);
    if (was_closed)
        return;
    if (w->thread_started) {
        w->stop = 1;
        poke(w);
        Py_BEGIN_ALLOW_THREADS
        pthread_join(w->thread, NULL);
        Py_END_ALLOW_THREADS
        w->thread_started = 0;
    }
    if (w->helper_started) {
        pthread_mutex_lock(&w->qmu);
        w->stop = 1;
        pthread_cond_signal(&w->qcv);
        pthread_mutex_unlock(&w->qmu);
        Py_BEGIN_ALLOW_THREADS
        pthread_join(w->helper, NULL); /* it drains the queue first */
        Py_END_ALLOW_THREADS
        w->helper_started = 0;
        lock(w);
        drain_done(w);
        unlock(w);
    }
    lock1(w);
    if (w->worker1) {
        ucp_worker_destroy(w->worker1);
        w->worker1 = NULL;
    }
    pthread_mutex_unlock(&w->mu1);
    lock(w);
    if (w->worker) {
        ucp_worker_destroy(w->worker);
        w->worker = NULL;
    }
    if (w->ctx) {
        ucp_cleanup(w->ctx);
        w->ctx = NULL;
    }
    notif_t *n = w->head;
    w->head = w->tail = NULL;
    w->queued = w->queued_bytes = 0;
    unlock(w);
    while (n) {
        notif_t *next = n->next;
        free(n);
        n = next;
    }
    /* with the GIL: every poke() from Python runs with it, and the worker's own threads are gone */
    if (w->epfd >= 0)
        close(w->epfd);
    if (w->wakefd >= 0)
        close(w->wakefd);
    w->epfd = w->wakefd = -1;
}

/* Every fd -1 and the locks ready before __init__ (which may fail, or never run). */
static PyObject *Worker_new(PyTypeObject *type, PyObject *args, PyObject *kw)
{
    Worker *w = (Worker *)type->tp_alloc(type, 0);
    if (w == NULL)
        return NULL;
    w->efd = w->wakefd = w->epfd = -1;
    pthread_mutex_init(&w->mu, NULL);
    pthread_mutex_init(&w->mu1, NULL);
    pthread_mutex_init(&w->qmu, NULL);
    pthread_cond_init(&w->qcv, NULL);
    return (PyObject *)w;
}

static int worker_init(Worker *w, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"name", "config", "max_notif", "max_queue", "max_queue_bytes", "split_bytes", NULL};
    const char *name;
    Py_ssize_t name_len;
    PyObject *config;
    Py_ssize_t max_notif, max_queue, max_queue_bytes, split_bytes = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "y#O!nnn|n", kwlist, &name, &name_len, &PyDict_Type, &config,
                                     &max_notif, &max_queue, &max_queue_bytes, &split_bytes))
        return -1;
    if (w->ctx != NULL || w->closed) {
        PyErr_SetString(PyExc_RuntimeError, "Worker initialised twice");
        return -1;
    }
    if (name_len < 1 || name_len > MAX_NAME || max_notif < 0 || max_queue < 0 || max_queue_bytes < 0 ||
        split_bytes < 0) {
        PyErr_SetString(PyExc_ValueError, "bad worker name or limits");
        return -1;
    }
    if (w->name != NULL) { /* an earlier __init__ failed */
        PyErr_SetString(PyExc_RuntimeError, "Worker initialised twice");
        return -1;
    }
    w->name = PyMem_Malloc(name_len);
    if (w->name == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    memcpy(w->name, name, name_len);
    w->name_len = name_len;
    w->max_notif = max_notif;
    w->max_queue = max_queue;
    w->max_queue_bytes = max_queue_bytes;

    ucp_config_t *cfg;
    ucs_status_t st = ucp_config_read(NULL, NULL, &cfg);
    if (st != UCS_OK) {
        raise_status(st, "reading the UCX configuration");
        return -1;
    }
    PyObject *k, *v;
    Py_ssize_t pos = 0;
    while (PyDict_Next(config, &pos, &k, &v)) {
        const char *ks = PyUnicode_AsUTF8(k), *vs = ks ? PyUnicode_AsUTF8(v) : NULL;
        if (vs == NULL) {
            ucp_config_release(cfg);
            return -1;
        }
        st = ucp_config_modify(cfg, ks, vs);
        if (st != UCS_OK) {
            ucp_config_release(cfg);
            PyObject *what = PyUnicode_FromFormat("UCX setting %s=%s", ks, vs);
            raise_status(st, what ? PyUnicode_AsUTF8(what) : "UCX setting");
            Py_XDECREF(what);
            return -1;
        }
    }
    ucp_params_t pp;
    memset(&pp, 0, sizeof(pp));
    pp.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
    pp.features = UCP_FEATURE_RMA | UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
    pp.mt_workers_shared = split_bytes > 0; /* two workers on two threads share its registration cache */
    st = ucp_init(&pp, cfg, &w->ctx);
    ucp_config_release(cfg);
    if (st != UCS_OK) {
        w->ctx = NULL;
        raise_status(st, "creating the UCP context");
        return -1;
    }
    ucp_worker_params_t wp;
    memset(&wp, 0, sizeof(wp));
    wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wp.thread_mode = UCS_THREAD_MODE_SERIALIZED;
    st = ucp_worker_create(w->ctx, &wp, &w->worker);
    if (st != UCS_OK) {
        w->worker = NULL;
        raise_status(st, "creating the UCP worker");
        return -1;
    }
    ucp_am_handler_param_t ap;
    memset(&ap, 0, sizeof(ap));
    ap.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG |
                    UCP_AM_HANDLER_PARAM_FIELD_FLAGS;
    ap.id = AM_NOTIF;
    ap.cb = am_notif_cb;
    ap.arg = w;
    ap.flags = UCP_AM_FLAG_WHOLE_MSG;
    if ((st = ucp_worker_set_am_recv_handler(w->worker, &ap)) != UCS_OK ||
        (st = ucp_worker_get_efd(w->worker, &w->efd)) != UCS_OK) {
        raise_status(st, "setting up the UCP worker");
        return -1;
    }
    w->wakefd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    w->epfd = epoll_create1(EPOLL_CLOEXEC);
    if (w->wakefd < 0 || w->epfd < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    struct epoll_event ev = {.events = EPOLLIN};
    ev.data.ptr = &w->efd;
    epoll_ctl(w->epfd, EPOLL_CTL_ADD, w->efd, &ev);
    ev.data.ptr = &w->wakefd;
    epoll_ctl(w->epfd, EPOLL_CTL_ADD, w->wakefd, &ev);
    if (pthread_create(&w->thread, NULL, progress_main, w) != 0) {
        PyErr_SetString(PyExc_OSError, "cannot start the UCX progress thread");
        return -1;
    }
    w->thread_started = 1;
    if (split_bytes > 0) { /* the second lane; without it (or if it cannot start) requests are not split */
        if (ucp_worker_create(w->ctx, &wp, &w->worker1) != UCS_OK)
            w->worker1 = NULL;
        else if (pthread_create(&w->helper, NULL, helper_main, w) != 0) {
            ucp_worker_destroy(w->worker1);
            w->worker1 = NULL;
        } else {
            w->helper_started = 1;
            w->split_bytes = (size_t)split_bytes;
            size_t c = w->split_bytes / 4;
            w->chunk = (c < (64u << 10) ? (64u << 10) : c > (1u << 20) ? (1u << 20) : c) & ~(size_t)4095;
        }
    }
    return 0;
}

static int Worker_init(Worker *w, PyObject *args, PyObject *kw)
{
    int r = worker_init(w, args, kw);
    if (r < 0 && (w->ctx != NULL || w->thread_started)) { /* half made: closed now, not used half made */
        PyObject *et, *ev, *tb;
        PyErr_Fetch(&et, &ev, &tb);
        worker_free_ucx(w);
        PyErr_Restore(et, ev, tb);
    }
    return r;
}

static void Worker_dealloc(Worker *w)
{
    worker_free_ucx(w);
    PyMem_Free(w->name);
    Py_TYPE(w)->tp_free((PyObject *)w);
}

static PyObject *Worker_close(Worker *w, PyObject *noargs)
{
    worker_free_ucx(w);
    Py_RETURN_NONE;
}

static PyObject *Worker_address(Worker *w, PyObject *noargs)
{
    if (check_open(w) || lock_open(w))
        return NULL;
    ucp_address_t *a;
    size_t n;
    char *copy = NULL;
    ucs_status_t st = ucp_worker_get_address(w->worker, &a, &n);
    if (st == UCS_OK) {
        if ((copy = malloc(n ? n : 1)) != NULL)
            memcpy(copy, a, n);
        ucp_worker_release_address(w->worker, a);
    }
    unlock(w);
    if (st != UCS_OK)
        return raise_status(st, "getting the worker address");
    if (copy == NULL)
        return PyErr_NoMemory();
    PyObject *r = PyBytes_FromStringAndSize(copy, n);
    free(copy);
    return r;
}

static PyObject *Worker_mem_map(Worker *w, PyObject *args)
{
    unsigned long long addr, len;
    if (!PyArg_ParseTuple(args, "KK", &addr, &len) || check_open(w))
        return NULL;
    if (len == 0 || addr + len < addr) {
        PyErr_SetString(PyExc_ValueError, "memory range is empty or wraps");
        return NULL;
    }
    ucp_mem_map_params_t mp;
    memset(&mp, 0, sizeof(mp));
    mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
    mp.address = (void *)(uintptr_t)addr;
    mp.length = len;
    ucp_mem_h memh;
    void *rkey;
    size_t rkey_len;
    MemHandle *m = PyObject_New(MemHandle, &MemHandleType);
    if (m == NULL)
        return NULL;
    Py_INCREF(w);
    m->w = w;
    m->memh = NULL;
    if (lock_open(w)) {
        Py_DECREF(m);
        return NULL;
    }
    ucs_status_t st = ucp_mem_map(w->ctx, &mp, &memh);
    char *copy = NULL;
    if (st == UCS_OK) {
        st = ucp_rkey_pack(w->ctx, memh, &rkey, &rkey_len);
        if (st != UCS_OK) {
            ucp_mem_unmap(w->ctx, memh);
        } else {
            m->memh = memh; /* unmapped by its dealloc from here on */
            if ((copy = malloc(rkey_len ? rkey_len : 1)) != NULL)
                memcpy(copy, rkey, rkey_len);
            ucp_rkey_buffer_release(rkey);
        }
    }
    unlock(w);
    if (st != UCS_OK) {
        Py_DECREF(m);
        return raise_status(st, "registering memory with UCX");
    }
    PyObject *packed = copy ? PyBytes_FromStringAndSize(copy, rkey_len) : PyErr_NoMemory();
    free(copy);
    if (packed == NULL) {
        Py_DECREF(m);
        return NULL;
    }
    return Py_BuildValue("NN", (PyObject *)m, packed);
}

/* UCX parses worker addresses and remote keys without being told their
   length: give it a copy followed by zeros, so bytes a short, hostile one
   makes it read past its end are always zeros (the same here as in the
   sandbox process that tried them first, see sandbox.py), never our memory. */
#define PAD 4096
static void *padded(const char *buf, Py_ssize_t n)
{
    char *p = calloc(1, (size_t)n + PAD);
    if (p == NULL)
        return PyErr_NoMemory();
    memcpy(p, buf, n);
    return p;
}

static PyObject *Worker_connect(Worker *w, PyObject *args)
{
    const char *addr;
    Py_ssize_t n;
    int peer_mode;
    if (!PyArg_ParseTuple(args, "y#p", &addr, &n, &peer_mode) || check_open(w))
        return NULL;
    void *copy = padded(addr, n);
    if (copy == NULL)
        return NULL;
    ep_state_t *s = calloc(1, sizeof(*s));
    if (s == NULL) {
        free(copy);
        return PyErr_NoMemory();
    }
    s->pidfd = -1;
    s->refs = 1;
    ucp_ep_params_t ep;
    memset(&ep, 0, sizeof(ep));
    ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                    UCP_EP_PARAM_FIELD_ERR_HANDLER;
    ep.address = (const ucp_address_t *)copy;
    ep.err_mode = peer_mode ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE;
    ep.err_handler.cb = ep_error_cb;
    ep.err_handler.arg = s;
    ucp_ep_h h;
    if (lock_open(w)) {
        free(copy);
        free(s);
        return NULL;
    }
    ucs_status_t st = ucp_ep_create(w->worker, &ep, &h);
    unlock(w);
    if (st != UCS_OK) {
        free(copy);
        free(s);
        return raise_status(st, "connecting to the peer's worker");
    }
    Endpoint *e = PyObject_New(Endpoint, &EndpointType);
    if (e == NULL) {
        free(copy);
        s->closing = 1; /* leaked endpoint: closed with the worker */
        return NULL;
    }
    Py_INCREF(w);
    e->w = w;
    e->ep = h;
    e->st = s;
    e->peer_mode = peer_mode;
    e->addr = copy;
    e->ep1 = NULL;
    return (PyObject *)e;
}

static PyObject *Worker_take_notifs(Worker *w, PyObject *noargs)
{
    if (check_open(w) || lock_open(w))
        return NULL;
    notif_t *n = w->head;
    w->head = w->tail = NULL;
    w->queued = w->queued_bytes = 0;
    unlock(w);
    PyObject *out = PyList_New(0);
    while (n != NULL) {
        notif_t *next = n->next;
        if (out != NULL) {
            PyObject *t = Py_BuildValue("y#y#", n->data, (Py_ssize_t)n->name_len, n->data + n->name_len,
                                        (Py_ssize_t)n->len);
            if (t == NULL || PyList_Append(out, t) < 0)
                Py_CLEAR(out);
            Py_XDECREF(t);
        }
        free(n);
        n = next;
    }
    return out;
}

static PyObject *Worker_dropped(Worker *w, PyObject *noargs) { return PyLong_FromSize_t(w->dropped); }

static PyObject *Worker_progress(Worker *w, PyObject *noargs)
{
    if (check_open(w) || lock_open(w))
        return NULL;
    while (ucp_worker_progress(w->worker))
        ;
    unlock(w);
    Py_RETURN_NONE;
}

/* An index argument: None (every row) or a 1-D buffer of int64 or int32. */
typedef struct {
    Py_buffer b;
    int have, wide;
    Py_ssize_t n;
} index_t;

static int get_index(PyObject *o, index_t *ix, Py_ssize_t rows, const char *what)
{
    memset(ix, 0, sizeof(*ix));
    if (o == Py_None) {
        ix->n = rows;
        return 0;
    }
    if (PyObject_GetBuffer(o, &ix->b, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return -1;
    ix->have = 1;
    const char *f = ix->b.format ? ix->b.format : "B";
    if (*f == '<' || *f == '=' || *f == '@')
        f++;
    if (ix->b.ndim > 1 || (ix->b.itemsize != 8 && ix->b.itemsize != 4) || (f[0] != 'q' && f[0] != 'l' && f[0] != 'i')) {
        PyErr_Format(PyExc_ValueError, "%s must be a 1-D int64 or int32 array", what);
        return -1;
    }
    ix->wide = ix->b.itemsize == 8;
    ix->n = ix->b.len / ix->b.itemsize;
    return 0;
}

static void release_index(index_t *ix)
{
    if (ix->have)
        PyBuffer_Release(&ix->b);
}

/* Check the pairs (indices in range, equal lengths, rows that do not wrap)
   and gather them into runs: pairs that continue each other on both sides
   under one key merge.  Every index and table entry is read once, so what is
   checked is what is posted, whatever other threads do to the caller's arrays
   meanwhile (post reads only the runs afterwards).  Returns the number of
   runs (*total: the bytes), or -1 with an exception set. */
static Py_ssize_t gather_runs(const uint64_t *lt, Py_ssize_t nl, const index_t *li, const uint64_t *rt,
                              Py_ssize_t nr, const index_t *ri, Py_ssize_t nk, run_t *out, uint64_t *total)
{
    if (li->n != ri->n) {
        PyErr_Format(PyExc_ValueError, "local and remote index lists differ in length (%zd vs %zd)", li->n, ri->n);
        return -1;
    }
    Py_ssize_t m = 0;
    uint64_t sum = 0;
    for (Py_ssize_t i = 0; i < li->n; i++) {
        int64_t a = !li->have ? i : li->wide ? LOAD(&((const int64_t *)li->b.buf)[i])
                                             : LOAD(&((const int32_t *)li->b.buf)[i]);
        int64_t b = !ri->have ? i : ri->wide ? LOAD(&((const int64_t *)ri->b.buf)[i])
                                             : LOAD(&((const int32_t *)ri->b.buf)[i]);
        if (a < 0 || a >= nl || b < 0 || b >= nr) {
            PyErr_Format(PyExc_ValueError, "pair %zd: index out of range (local %lld of %zd, remote %lld of %zd)", i,
                         (long long)a, nl, (long long)b, nr);
            return -1;
        }
        uint64_t la = LOAD(&lt[2 * a]), len = LOAD(&lt[2 * a + 1]);
        uint64_t ra = LOAD(&rt[3 * b]), rlen = LOAD(&rt[3 * b + 1]), k = LOAD(&rt[3 * b + 2]);
        if (len != rlen) {
            PyErr_Format(PyExc_ValueError, "pair %zd differs in length: local %llu bytes vs remote %llu bytes", i,
                         (unsigned long long)len, (unsigned long long)rlen);
            return -1;
        }
        if (k >= (uint64_t)nk) {
            PyErr_SetString(PyExc_ValueError, "remote key index out of range");
            return -1;
        }
        if (la + len < la || ra + len < ra || __builtin_add_overflow(sum, len, &sum)) {
            PyErr_Format(PyExc_ValueError, "pair %zd: address range wraps or the lengths overflow", i);
            return -1;
        }
        run_t *r = m > 0 ? &out[m - 1] : NULL; /* rows do not wrap: neither does a run's end */
        if (r != NULL && r->k == k && r->laddr + r->len == la && r->raddr + r->len == ra)
            r->len += len;
        else
            out[m++] = (run_t){la, ra, len, k};
    }
    *total = sum;
    return m;
}

#define MAX_CHUNKS (1u << 24) /* more would be no real request: not split */

/* A split request as chunks (runs cut to at most `chunk` bytes), both lanes'
   keys in each.  NULL (no split) if some run's key has no twin on ep1, or no memory. */
static job_t *build_job(const run_t *runs, Py_ssize_t nruns, ucp_rkey_h *keys, ucp_rkey_h *keys1, uint64_t total,
                        uint64_t chunk)
{
    if (total / chunk > MAX_CHUNKS || (uint64_t)nruns > MAX_CHUNKS)
        return NULL;
    /* sum of ceil(len / chunk) <= total / chunk + nruns */
    size_t cap = (size_t)nruns + total / chunk + 1, m = 0;
    job_t *j = malloc(sizeof(*j) + sizeof(chunk_t) * cap);
    if (j == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < nruns; i++) {
        const run_t *r = &runs[i];
        if (r->len == 0)
            continue;
        if (keys[r->k] == NULL || keys1[r->k] == NULL) {
            free(j);
            return NULL;
        }
        for (uint64_t off = 0, left = r->len; left > 0;) {
            uint64_t len = left < chunk ? left : chunk;
            if (m >= cap) { /* cannot happen: the bound above */
                free(j);
                return NULL;
            }
            j->chunks[m++] = (chunk_t){r->laddr + off, r->raddr + off, len, keys[r->k], keys1[r->k]};
            off += len;
            left -= len;
        }
    }
    memset(j, 0, sizeof(*j));
    pthread_mutex_init(&j->mu, NULL);
    j->lo = 0;
    j->hi = m;
    j->refs = 2;
    j->state = JOB_QUEUED;
    return j;
}

#define SMALL_POST 64 /* pairs: above, post lets other Python threads run meanwhile */

/* post(op, ep, local_table, local_idx, remote_table, remote_idx, rkeys, notif) -> Xfer

   local_table: (n, 2) uint64 rows (address, length); remote_table: (m, 3)
   uint64 rows (address, length, key index into rkeys, RemoteKeys of ep).
   The indices pick the pairs (None: every row).  op 0 = GET (READ), 1 = PUT.
   Raises Error (status NOT_CONNECTED) if the endpoint or a key was closed,
   also by another thread while this call ran. */
static PyObject *Worker_post(Worker *w, PyObject *args)
{
    int op;
    Endpoint *e;
    Py_buffer lb, rb;
    PyObject *lio, *rio, *rkeys, *notif;
    if (!PyArg_ParseTuple(args, "iO!y*Oy*OOO", &op, &EndpointType, &e, &lb, &lio, &rb, &rio, &rkeys, &notif))
        return NULL;
    PyObject *result = NULL, *seq = NULL;
    RemoteKey **kobj = NULL; /* our references: the objects live while the GIL is released */
    ucp_rkey_h *keys = NULL, *keys1 = NULL;
    Py_ssize_t nk = 0;
    xfer_t *x = NULL;
    Xfer *xo = NULL;
    index_t li = {0}, ri = {0};
    run_t small[SMALL_POST], *runs = small;
    Py_ssize_t nl = lb.len / 16, nr = rb.len / 24;
    /* first what may run Python code (a generator of keys may close the endpoint): checks come after */
    seq = PySequence_Fast(rkeys, "rkeys must be a sequence of RemoteKey");
    if (seq == NULL)
        goto out;
    nk = PySequence_Fast_GET_SIZE(seq);
    kobj = PyMem_Malloc((sizeof(*kobj) + 2 * sizeof(*keys)) * (nk ? nk : 1));
    if (kobj == NULL) {
        nk = 0;
        PyErr_NoMemory();
        goto out;
    }
    keys = (ucp_rkey_h *)(kobj + (nk ? nk : 1));
    keys1 = keys + (nk ? nk : 1);
    for (Py_ssize_t i = 0; i < nk; i++) {
        PyObject *o = PySequence_Fast_GET_ITEM(seq, i);
        kobj[i] = o == Py_None ? NULL : (RemoteKey *)o;
        Py_XINCREF(kobj[i]);
    }
    Py_CLEAR(seq);
    if (check_open(w))
        goto out;
    if (e->w != w) {
        PyErr_SetString(PyExc_ValueError, "endpoint belongs to another worker");
        goto out;
    }
    if (e->ep == NULL) {
        raise_gone("post: the endpoint is closed");
        goto out;
    }
    if ((op != 0 && op != 1) || lb.len % 16 || rb.len % 24) {
        PyErr_SetString(PyExc_ValueError, "post: tables must be (n, 2) and (m, 3) uint64");
        goto out;
    }
    if (notif != Py_None && (!PyBytes_Check(notif) || (size_t)PyBytes_GET_SIZE(notif) > w->max_notif)) {
        PyErr_SetString(PyExc_ValueError, "notif must be bytes within the notification limit");
        goto out;
    }
    for (Py_ssize_t i = 0; i < nk; i++) {
        RemoteKey *k = kobj[i];
        if (k != NULL && (!PyObject_TypeCheck(k, &RemoteKeyType) || k->ep != e)) {
            PyErr_SetString(PyExc_ValueError, "rkeys must be RemoteKeys of this endpoint");
            goto out;
        }
        if (k != NULL && k->rkey == NULL) {
            raise_gone("post: a remote key was destroyed");
            goto out;
        }
    }
    if (get_index(lio, &li, nl, "local_idx") < 0 || get_index(rio, &ri, nr, "remote_idx") < 0)
        goto out;
    Py_ssize_t n = li.n;
    if (n > SMALL_POST && (runs = PyMem_Malloc(sizeof(*runs) * n)) == NULL) {
        PyErr_NoMemory();
        goto out;
    }
    uint64_t total;
    Py_ssize_t nruns = gather_runs(lb.buf, nl, &li, rb.buf, nr, &ri, nk, runs, &total);
    if (nruns < 0)
        goto out;
    x = calloc(1, sizeof(*x));
    if (x == NULL) {
        PyErr_NoMemory();
        goto out;
    }
    x->refs = 1;
    x->parts = 1;
    x->status = UCS_INPROGRESS;
    x->w = w;
    if (notif != Py_None) {
        x->name_len = w->name_len;
        x->notif_len = w->name_len + PyBytes_GET_SIZE(notif);
        x->notif = malloc(x->notif_len);
        if (x->notif == NULL) {
            PyErr_NoMemory();
            goto out;
        }
        memcpy(x->notif, w->name, w->name_len);
        memcpy(x->notif + w->name_len, PyBytes_AS_STRING(notif), PyBytes_GET_SIZE(notif));
    }
    xo = PyObject_New(Xfer, &XferType);
    if (xo == NULL)
        goto out;
    Py_INCREF(w);
    xo->w = w;
    xo->x = NULL;
    /* large requests let other Python threads run meanwhile; small ones keep the GIL (cheaper) */
    PyThreadState *ts = n > SMALL_POST ? PyEval_SaveThread() : NULL;
    if (ts != NULL)
        pthread_mutex_lock(&w->mu);
    else
        lock(w);
    /* under mu now: the endpoint and keys stay as they are until unlock; were they closed meanwhile? */
    const char *gone = NULL;
    if (w->closed || w->worker == NULL)
        gone = "post: the worker is closed";
    else if (e->ep == NULL)
        gone = "post: the endpoint is closed";
    for (Py_ssize_t i = 0; gone == NULL && i < nk; i++) {
        keys[i] = kobj[i] ? kobj[i]->rkey : NULL;
        keys1[i] = kobj[i] ? kobj[i]->rkey1 : NULL;
        if (kobj[i] && keys[i] == NULL)
            gone = "post: a remote key was destroyed";
    }
    if (gone != NULL) {
        pthread_mutex_unlock(&w->mu);
        if (ts != NULL)
            PyEval_RestoreThread(ts);
        if (w->closed)
            PyErr_SetString(PyExc_RuntimeError, "the UCX worker is closed");
        else
            raise_gone(gone);
        goto out;
    }
    ucp_ep_h ep = e->ep;
    x->ep = ep;
    x->st = e->st;
    e->st->refs++;
    xo->x = x;
    job_t *job = NULL;
    ucp_ep_h ep1 = e->ep1;
    if (ep1 != NULL && w->split_bytes && total >= w->split_bytes &&
        (job = build_job(runs, nruns, keys, keys1, total, w->chunk)) != NULL) {
        job->x = x; /* the helper starts from the back now; this thread from the front */
        job->ep = ep1;
        job->op = op;
        x->parts = 2;
        x->helper_out = 1;
        x->refs++;
        enqueue(w, job); /* under mu: a key's or ep1's teardown (after mu, under mu1) cancels it */
    }
    ucs_status_t st = e->st->status;
    w->inflight++;
    ucp_request_param_t p;
    memset(&p, 0, sizeof(p));
    int took_helpers_part = 0;
    if (job != NULL) {
        chunk_t *c;
        while (st == UCS_OK && (c = claim(job, 0)) != NULL) {
            st = post_one(ep, op, c->laddr, c->raddr, c->len, c->key0, &p);
            while (ucp_worker_progress(w->worker)) /* UCX may queue it: copy it before claiming more */
                ;
        }
        pthread_mutex_lock(&job->mu);
        if (st != UCS_OK)
            job->hi = job->lo; /* failed: the helper posts no more */
        if (job->state == JOB_QUEUED) { /* the helper has not woken yet: its part is done here */
            job->state = JOB_ABANDONED;
            took_helpers_part = 1;
        }
        pthread_mutex_unlock(&job->mu);
        job_unref(job);
    }
    for (Py_ssize_t i = 0; i < nruns && job == NULL && st == UCS_OK; i++) {
        const run_t *r = &runs[i];
        if (r->len == 0)
            continue;
        if (keys[r->k] == NULL) {
            st = UCS_ERR_INVALID_PARAM;
            break;
        }
        st = post_one(ep, op, r->laddr, r->raddr, r->len, keys[r->k], &p);
    }
    if (took_helpers_part) {
        x->helper_out = 0;
        part_done(x, UCS_OK);
    }
    if (st == UCS_OK) {
        p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
        p.cb.send = flush_cb;
        p.user_data = x;
        x->refs++;
        ucs_status_ptr_t r = ucp_ep_flush_nbx(ep, &p);
        if (r == NULL || UCS_PTR_IS_ERR(r)) {
            x->refs--;
            part_done(x, UCS_PTR_STATUS(r));
        }
        /* small transfers often finish within a few progress calls: no thread hand-off */
        for (int j = 0; j < 64 && x->status == UCS_INPROGRESS && x->parts > x->helper_out; j++)
            ucp_worker_progress(w->worker);
        drain_done(w);
    } else {
        xfer_end(x, st);
    }
    /* still waiting for this worker (not just for the helper's half): the progress thread takes over */
    int pending = x->status == UCS_INPROGRESS && x->parts > x->helper_out;
    pthread_mutex_unlock(&w->mu);
    if (ts != NULL)
        PyEval_RestoreThread(ts);
    if (pending)
        poke(w); /* the progress thread takes over */
    x = NULL;
    result = (PyObject *)xo;
    xo = NULL;
out:
    Py_XDECREF(xo); /* not posted: holds no transfer */
    if (x != NULL) {
        free(x->notif);
        free(x);
    }
    if (runs != small)
        PyMem_Free(runs);
    release_index(&li);
    release_index(&ri);
    for (Py_ssize_t i = 0; i < nk; i++)
        Py_XDECREF(kobj[i]);
    PyMem_Free(kobj);
    Py_XDECREF(seq);
    PyBuffer_Release(&lb);
    PyBuffer_Release(&rb);
    return result;
}

static PyMethodDef Worker_methods[] = {
    {"close", (PyCFunction)Worker_close, METH_NOARGS, "Stop the progress thread, free UCX. Idempotent."},
    {"address", (PyCFunction)Worker_address, METH_NOARGS, "This worker's packed UCX address."},
    {"mem_map", (PyCFunction)Worker_mem_map, METH_VARARGS, "mem_map(addr, len) -> (MemHandle, packed rkey)"},
    {"connect", (PyCFunction)Worker_connect, METH_VARARGS, "connect(address, peer_mode) -> Endpoint"},
    {"post", (PyCFunction)Worker_post, METH_VARARGS,
     "post(op, ep, local_table, local_idx, remote_table, remote_idx, rkeys, notif) -> Xfer (op 0 GET, 1 PUT)"},
    {"take_notifs", (PyCFunction)Worker_take_notifs, METH_NOARGS, "[(sender, message)] received so far"},
    {"dropped", (PyCFunction)Worker_dropped, METH_NOARGS, "notifications dropped (over a limit)"},
    {"progress", (PyCFunction)Worker_progress, METH_NOARGS, "progress the worker until idle"},
    {NULL}};

/* -- MemHandle -------------------------------------------------------------- */

static PyObject *MemHandle_unmap(MemHandle *m, PyObject *noargs)
{
    if (m->memh != NULL) {
        lock(m->w);
        ucp_mem_h h = m->memh; /* taken under mu: unmapped once */
        m->memh = NULL;
        if (h != NULL && !m->w->closed) /* else the context took it with it */
            ucp_mem_unmap(m->w->ctx, h);
        unlock(m->w);
    }
    Py_RETURN_NONE;
}

static void MemHandle_dealloc(MemHandle *m)
{
    PyObject *r = MemHandle_unmap(m, NULL);
    Py_XDECREF(r);
    Py_DECREF(m->w);
    PyObject_Free(m);
}

static PyMethodDef MemHandle_methods[] = {
    {"unmap", (PyCFunction)MemHandle_unmap, METH_NOARGS, "Unregister (idempotent)."}, {NULL}};

/* -- Endpoint and RemoteKey ------------------------------------------------ */

static void ep_close_cb(void *req, ucs_status_t st, void *user)
{
    (void)st;
    ucp_request_free(req);
    st_unref(user);
}

/* Under mu1: close ep1 (its queued jobs post nothing), finishing the request here. */
static void close_ep1(Worker *w, ucp_ep_h ep1, int force)
{
    ucp_request_param_t p;
    memset(&p, 0, sizeof(p));
    p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
    cancel_jobs(w, ep1);
    ucs_status_ptr_t r = ucp_ep_close_nbx(ep1, &p);
    if (UCS_PTR_IS_PTR(r)) { /* finish it here: nobody else progresses worker1 unasked */
        for (int i = 0; i < 1000 && ucp_request_check_status(r) == UCS_INPROGRESS; i++)
            ucp_worker_progress(w->worker1);
        ucp_request_free(r); /* UCX completes and releases it later if still out */
    }
}

/* With the GIL; idempotent, also when two threads close at once: the handles
   are taken out of the object under mu1 and mu, and closed by whoever took them. */
static void endpoint_close(Endpoint *e)
{
    if (e->ep == NULL)
        return;
    Worker *w = e->w;
    int lane1 = w->split_bytes != 0;
    if (lane1)
        lock1(w); /* waits for a job of this endpoint that is running */
    lock(w);
    ucp_ep_h ep = e->ep, ep1 = e->ep1;
    ep_state_t *s = e->st;
    e->ep = e->ep1 = NULL;
    e->st = NULL;
    if (ep == NULL || w->closed) { /* closed by another thread, or the worker took the endpoint with it */
        if (ep != NULL && s->pidfd >= 0) { /* no progress thread or epoll set any more */
            close(s->pidfd);
            s->pidfd = -1;
        }
        unlock(w);
        if (lane1)
            pthread_mutex_unlock(&w->mu1);
        return; /* (a closed worker's endpoint states leak: tiny) */
    }
    ucp_request_param_t p;
    memset(&p, 0, sizeof(p));
    p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    /* without peer error handling UCX may not force-close; flush-close then */
    p.flags = e->peer_mode ? UCP_EP_CLOSE_FLAG_FORCE : 0;
    p.cb.send = ep_close_cb;
    p.user_data = s; /* the endpoint's reference, dropped once closed */
    s->closing = 1; /* transfers still out send no notification on it */
    if (s->pidfd >= 0) {
        epoll_ctl(w->epfd, EPOLL_CTL_DEL, s->pidfd, NULL);
        close(s->pidfd);
        s->pidfd = -1;
    }
    ucs_status_ptr_t r = ucp_ep_close_nbx(ep, &p);
    if (r == NULL || UCS_PTR_IS_ERR(r))
        st_unref(s);
    unlock(w);
    if (lane1) {
        if (ep1 != NULL && w->worker1 != NULL)
            close_ep1(w, ep1, e->peer_mode);
        pthread_mutex_unlock(&w->mu1);
    }
    poke(w);
}

static PyObject *Endpoint_close(Endpoint *e, PyObject *noargs)
{
    endpoint_close(e);
    Py_RETURN_NONE;
}

static void Endpoint_dealloc(Endpoint *e)
{
    endpoint_close(e);
    free(e->addr);
    Py_DECREF(e->w);
    PyObject_Free(e);
}

static PyObject *Endpoint_lanes(Endpoint *e, PyObject *noargs)
{
    return PyLong_FromLong(e->ep1 != NULL ? 2 : 1);
}

static PyObject *Endpoint_error(Endpoint *e, PyObject *noargs)
{
    /* with the GIL: e->st is cleared (with the GIL) before it can be freed */
    ep_state_t *s = e->st;
    return PyLong_FromLong(s == NULL ? UCS_ERR_CANCELED : s->status);
}

/* Whether UCX reaches this peer with cma: then RMA is a copy done inside the
   posting call, which is what the second lane parallelises; over messages
   (tcp, shm without cma) a split would only wait twice. */
static int uses_cma(ucp_ep_h ep) /* under mu */
{
    ucp_transport_entry_t ent[16];
    ucp_ep_attr_t a;
    memset(&a, 0, sizeof(a));
    a.field_mask = UCP_EP_ATTR_FIELD_TRANSPORTS;
    a.transports.entries = ent;
    a.transports.num_entries = 16;
    a.transports.entry_size = sizeof(ent[0]);
    ucs_status_t st = ucp_ep_query(ep, &a);
    if (st != UCS_OK)
        return 0;
    for (unsigned i = 0; i < a.transports.num_entries && i < 16; i++)
        if (ent[i].transport_name != NULL && strcmp(ent[i].transport_name, "cma") == 0)
            return 1;
    return 0;
}

static PyObject *Endpoint_watch(Endpoint *e, PyObject *args)
{
    int fd;
    if (!PyArg_ParseTuple(args, "i", &fd) || check_open(e->w))
        return NULL;
    Worker *w = e->w;
    if (lock_open(w))
        return NULL;
    if (e->ep == NULL || e->st->pidfd >= 0) {
        unlock(w);
        PyErr_SetString(PyExc_ValueError, "endpoint closed or already watched");
        return NULL;
    }
    struct epoll_event ev = {.events = EPOLLIN};
    ev.data.ptr = e->st;
    int rc = epoll_ctl(w->epfd, EPOLL_CTL_ADD, fd, &ev), err = errno;
    int cma = 0;
    if (rc == 0) {
        e->st->pidfd = fd;
        e->st->watched = 1; /* an event may name it from now on */
        cma = w->worker1 != NULL && e->ep1 == NULL && uses_cma(e->ep);
    }
    unlock(w);
    if (rc != 0) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    poke(w);
    if (cma) { /* same host, cma: a second lane */
        ucp_ep_params_t ep;
        memset(&ep, 0, sizeof(ep));
        ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                        UCP_EP_PARAM_FIELD_ERR_HANDLER;
        ep.address = (const ucp_address_t *)e->addr; /* lives as long as e */
        ep.err_mode = e->peer_mode ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE;
        ep.err_handler.cb = ep_error_cb;
        ep.err_handler.arg = e->st; /* watched: never freed */
        ucp_ep_h h = NULL;
        Py_BEGIN_ALLOW_THREADS
        pthread_mutex_lock(&w->mu1);
        if (w->worker1 != NULL && ucp_ep_create(w->worker1, &ep, &h) != UCS_OK)
            h = NULL; /* this peer's requests are not split */
        if (h != NULL) {
            pthread_mutex_lock(&w->mu); /* order: mu1, then mu */
            if (e->ep != NULL && e->ep1 == NULL) { /* still open, and no other watch won */
                e->ep1 = h;
                h = NULL;
            }
            pthread_mutex_unlock(&w->mu);
            if (h != NULL)
                close_ep1(w, h, 1);
        }
        pthread_mutex_unlock(&w->mu1);
        Py_END_ALLOW_THREADS
    }
    Py_RETURN_NONE;
}

/* With the GIL: a key (taken out of its RemoteKey) destroyed under its lane's lock, unless its endpoint is gone. */
static void destroy_keys(Endpoint *e, RemoteKey *k)
{
    Worker *w = e->w;
    int lane1 = w->split_bytes != 0;
    if (lane1)
        lock1(w);
    lock(w);
    ucp_rkey_h rk = k->rkey, rk1 = k->rkey1;
    k->rkey = k->rkey1 = NULL; /* a post that takes mu after this sees the key gone */
    if (rk != NULL && e->ep != NULL && !w->closed)
        ucp_rkey_destroy(rk);
    unlock(w);
    if (lane1) {
        if (rk1 != NULL && e->ep1 != NULL && w->worker1 != NULL) {
            cancel_jobs(w, e->ep1); /* no queued job may use it afterwards */
            ucp_rkey_destroy(rk1);
        }
        pthread_mutex_unlock(&w->mu1);
    }
}

static PyObject *Endpoint_unpack(Endpoint *e, PyObject *args)
{
    const char *buf;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "y#", &buf, &n) || check_open(e->w))
        return NULL;
    if (e->ep == NULL)
        return raise_gone("unpack: the endpoint is closed");
    Worker *w = e->w;
    void *copy = padded(buf, n);
    if (copy == NULL)
        return NULL;
    ucp_rkey_h rk, rk1 = NULL;
    if (lock_open(w)) {
        free(copy);
        return NULL;
    }
    if (e->ep == NULL) {
        unlock(w);
        free(copy);
        return raise_gone("unpack: the endpoint is closed");
    }
    ucs_status_t st = ucp_ep_rkey_unpack(e->ep, copy, &rk);
    unlock(w);
    if (st == UCS_OK && w->split_bytes != 0 && e->ep1 != NULL) {
        Py_BEGIN_ALLOW_THREADS
        pthread_mutex_lock(&w->mu1);
        if (e->ep1 == NULL || w->worker1 == NULL || ucp_ep_rkey_unpack(e->ep1, copy, &rk1) != UCS_OK)
            rk1 = NULL; /* requests with this key are not split */
        pthread_mutex_unlock(&w->mu1);
        Py_END_ALLOW_THREADS
    }
    free(copy);
    if (st != UCS_OK)
        return raise_status(st, "unpacking a remote key");
    RemoteKey *k = PyObject_New(RemoteKey, &RemoteKeyType);
    if (k == NULL) {
        RemoteKey tmp = {.rkey = rk, .rkey1 = rk1};
        destroy_keys(e, &tmp);
        return NULL;
    }
    Py_INCREF(e);
    k->ep = e;
    k->rkey = rk;
    k->rkey1 = rk1;
    return (PyObject *)k;
}

static void notify_cb(void *req, ucs_status_t st, void *user)
{
    (void)st;
    ucp_request_free(req);
    free(user);
}

static PyObject *Endpoint_notify(Endpoint *e, PyObject *args)
{
    const char *msg;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "y#", &msg, &n) || check_open(e->w))
        return NULL;
    Worker *w = e->w;
    if ((size_t)n > w->max_notif) {
        PyErr_SetString(PyExc_ValueError, "message over the notification limit");
        return NULL;
    }
    if (e->ep == NULL)
        return raise_gone("notify: the endpoint is closed");
    char *buf = malloc(w->name_len + n);
    if (buf == NULL)
        return PyErr_NoMemory();
    memcpy(buf, w->name, w->name_len);
    memcpy(buf + w->name_len, msg, n);
    void *req;
    if (lock_open(w)) {
        free(buf);
        return NULL;
    }
    if (e->ep == NULL) {
        unlock(w);
        free(buf);
        return raise_gone("notify: the endpoint is closed");
    }
    ucs_status_t st = e->st->status;
    if (st == UCS_OK)
        st = send_notif(w, e->ep, buf, w->name_len, w->name_len + n, notify_cb, buf, &req);
    unlock(w);
    poke(w);
    if (st != UCS_INPROGRESS)
        free(buf);
    if (st != UCS_OK && st != UCS_INPROGRESS)
        return raise_status(st, "sending a notification");
    Py_RETURN_NONE;
}

static PyMethodDef Endpoint_methods[] = {
    {"close", (PyCFunction)Endpoint_close, METH_NOARGS, "Close (force-close with peer error handling)."},
    {"error", (PyCFunction)Endpoint_error, METH_NOARGS, "UCX status of the endpoint (0 while healthy)."},
    {"lanes", (PyCFunction)Endpoint_lanes, METH_NOARGS, "2 if large requests are split across two workers, else 1"},
    {"watch", (PyCFunction)Endpoint_watch, METH_VARARGS,
     "watch(pidfd): the endpoint fails when that process exits (takes the fd)"},
    {"unpack", (PyCFunction)Endpoint_unpack, METH_VARARGS, "unpack(packed rkey) -> RemoteKey"},
    {"notify", (PyCFunction)Endpoint_notify, METH_VARARGS, "notify(msg): an active message to the peer"},
    {NULL}};

static PyObject *RemoteKey_destroy(RemoteKey *k, PyObject *noargs)
{
    if (k->rkey != NULL || k->rkey1 != NULL)
        destroy_keys(k->ep, k);
    Py_RETURN_NONE;
}

static void RemoteKey_dealloc(RemoteKey *k)
{
    PyObject *r = RemoteKey_destroy(k, NULL);
    Py_XDECREF(r);
    Py_DECREF(k->ep);
    PyObject_Free(k);
}

static PyMethodDef RemoteKey_methods[] = {
    {"destroy", (PyCFunction)RemoteKey_destroy, METH_NOARGS, "Free the key (idempotent)."}, {NULL}};

/* -- Xfer ------------------------------------------------------------------ */

#define EXITED 2 /* status(pidfd): done, but the same-host peer process has exited meanwhile */

static PyObject *Xfer_status(Xfer *o, PyObject *args)
{
    int pidfd = -1;
    if (!PyArg_ParseTuple(args, "|i", &pidfd))
        return NULL;
    Worker *w = o->w;
    if (o->x == NULL)
        return PyLong_FromLong(UCS_ERR_CANCELED);
    if (o->x->status == UCS_INPROGRESS && !w->closed) {
        /* the poller completes its own transfer instead of waiting for a wake-up */
        lock(w);
        if (!w->closed) {
            drain_done(w);
            ucp_worker_progress(w->worker);
        }
        unlock(w);
    }
    ucs_status_t st = o->x->status;
    if (st == UCS_OK && pidfd >= 0) {
        /* a cma copy from a process that exited before the pid watch noticed fails
           without failing the flush: a dead peer's DONE does not count.  Polled here,
           GIL held (a zero-timeout poll), rather than by a Python poll object, whose
           GIL release costs more than the syscall. */
        struct pollfd pf = {.fd = pidfd, .events = POLLIN};
        if (poll(&pf, 1, 0) > 0)
            return PyLong_FromLong(EXITED);
    }
    return PyLong_FromLong(st);
}

static PyObject *Xfer_cancel(Xfer *o, PyObject *args)
{
    int st;
    if (!PyArg_ParseTuple(args, "i", &st))
        return NULL;
    if (o->x != NULL && !o->w->closed) {
        lock(o->w);
        if (!o->w->closed)
            xfer_end(o->x, st < 0 ? (ucs_status_t)st : UCS_ERR_CANCELED);
        unlock(o->w);
    }
    Py_RETURN_NONE;
}

static void Xfer_dealloc(Xfer *o)
{
    if (o->x != NULL) {
        lock(o->w);
        if (!o->w->closed) {
            xfer_end(o->x, UCS_ERR_CANCELED);
            xfer_decref(o->x);
        } /* else UCX may still hold it: leak rather than risk a late callback */
        unlock(o->w);
        o->x = NULL;
    }
    Py_DECREF(o->w);
    PyObject_Free(o);
}

static PyMethodDef Xfer_methods[] = {
    {"status", (PyCFunction)Xfer_status, METH_VARARGS,
     "status(pidfd=-1): 1 (UCS_INPROGRESS) while running, 0 done, <0 a UCX error; 2 done but the process "
     "behind pidfd (a same-host peer) has exited, so the bytes cannot be trusted"},
    {"cancel", (PyCFunction)Xfer_cancel, METH_VARARGS, "cancel(status): end it now with that error"},
    {NULL}};

/* -- module ---------------------------------------------------------------- */

static PyObject *status_string(PyObject *mod, PyObject *arg)
{
    long st = PyLong_AsLong(arg);
    if (st == -1 && PyErr_Occurred())
        return NULL;
    return PyUnicode_FromString(ucs_status_string((ucs_status_t)st));
}

static PyObject *version(PyObject *mod, PyObject *noargs)
{
    return PyUnicode_FromString(ucp_get_version_string());
}

static PyMethodDef module_methods[] = {
    {"status_string", status_string, METH_O, "UCX's text for a status code"},
    {"version", version, METH_NOARGS, "the UCX library's version"},
    {NULL}};

static struct PyModuleDef moduledef = {PyModuleDef_HEAD_INIT, "_ucp", "kvt's binding to UCP RMA", -1,
                                       module_methods};

#define TYPE(T, doc, ...)                                                                                         \
    static PyTypeObject T##Type = {PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvt_ucx._ucp." #T,                   \
                                   .tp_basicsize = sizeof(T), .tp_flags = Py_TPFLAGS_DEFAULT, .tp_doc = doc,      \
                                   .tp_methods = T##_methods, .tp_dealloc = (destructor)T##_dealloc, __VA_ARGS__};

TYPE(Worker, "Worker(name, config, max_notif, max_queue, max_queue_bytes): UCP context, worker, progress thread",
     .tp_init = (initproc)Worker_init, .tp_new = Worker_new)
TYPE(Endpoint, "A connection to a peer's worker (from Worker.connect).", )
TYPE(RemoteKey, "A peer's unpacked remote key (from Endpoint.unpack).", )
TYPE(MemHandle, "Registered memory (from Worker.mem_map).", )
TYPE(Xfer, "One posted transfer (from Worker.post).", )

PyMODINIT_FUNC PyInit__ucp(void)
{
    PyTypeObject *types[] = {&WorkerType, &EndpointType, &RemoteKeyType, &MemHandleType, &XferType};
    PyObject *m = PyModule_Create(&moduledef);
    if (m == NULL)
        return NULL;
    for (size_t i = 0; i < sizeof(types) / sizeof(*types); i++) {
        if (PyType_Ready(types[i]) < 0)
            return NULL;
        Py_INCREF(types[i]);
        PyModule_AddObject(m, types[i]->tp_name + strlen("kvt_ucx._ucp."), (PyObject *)types[i]);
    }
    UcpError = PyErr_NewException("kvt_ucx._ucp.Error", NULL, NULL);
    if (UcpError == NULL) {
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(UcpError);
    if (PyModule_AddObject(m, "Error", UcpError) < 0) {
        Py_DECREF(UcpError);
        Py_DECREF(m);
        return NULL;
    }
    PyModule_AddIntConstant(m, "INPROGRESS", UCS_INPROGRESS);
    PyModule_AddIntConstant(m, "ERR_TIMED_OUT", UCS_ERR_TIMED_OUT);
    PyModule_AddIntConstant(m, "ERR_CANCELED", UCS_ERR_CANCELED);
    PyModule_AddIntConstant(m, "ERR_CONNECTION_RESET", UCS_ERR_CONNECTION_RESET);
    return m;
}
