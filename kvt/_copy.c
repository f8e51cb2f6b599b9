/* kvt._copy: scatter/gather memory copies of (dst, src, len) descriptor arrays.
 *
 * The GIL is released for the whole copy.  Address arrays may be strided
 * (a column of a (n, 2) or (n, 3) row array needs no copy); lengths are an
 * array or one int for uniform blocks.  Runs contiguous on both sides merge
 * into one memmove.  Large requests are cut into pieces (up to 1 MiB) that
 * the caller and parked helper threads claim in turn; the helpers are kept
 * off the caller's CPU.  Requests of at least
 * `stream_bytes` in total are written with non-temporal stores (x86-64).
 * Callers (kvt/memcopy.py) vouch that every address is mapped: this module
 * checks shapes and types, not memory; but it refuses (ValueError) a row
 * whose address + length wraps past 2**64, which no mapping can hold.
 *
 * copy_indexed is a whole same-host request in one call: rows picked by
 * index from tables prepared once (bounds and pairwise lengths checked
 * before any byte moves), the copy, and the guards around it (the copy
 * announced in the caller's slot of the owner's epoch page, or else a shared
 * lock on that page, for the copy's duration; the epoch word before and
 * after; the owner's liveness word, or else its pidfd, after), so a request
 * costs one C call instead of microseconds of Python and system calls.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#if defined(__x86_64__)
#include <emmintrin.h>
#endif

#define MAX_THREADS 16

#if defined(__x86_64__) || defined(__i386__)
#define CPU_RELAX() __builtin_ia32_pause()
#elif defined(__aarch64__)
#define CPU_RELAX() __asm__ __volatile__("yield" ::: "memory")
#else
#define CPU_RELAX() ((void)0)
#endif

typedef struct {
    const char *dst, *src, *len;           /* NULL len: every row is ulen bytes */
    Py_ssize_t dstride, sstride, lstride;
    const char *di, *si;                   /* NULL: row i is entry i; else entry di[i] (lengths follow dst) */
    Py_ssize_t distride, sistride;
    uint64_t ulen;
    Py_ssize_t n;
} Plan;

#define AT(base, stride, i) (*(const uint64_t *)((base) + (i) * (stride)))

static inline Py_ssize_t dix(const Plan *p, Py_ssize_t i)
{
    return p->di ? (Py_ssize_t)AT(p->di, p->distride, i) : i;
}

static inline Py_ssize_t six(const Plan *p, Py_ssize_t i)
{
    return p->si ? (Py_ssize_t)AT(p->si, p->sistride, i) : i;
}

static inline uint64_t row_len(const Plan *p, Py_ssize_t i)
{
    return p->len ? AT(p->len, p->lstride, dix(p, i)) : p->ulen;
}

static inline uint64_t row_dst(const Plan *p, Py_ssize_t i)
{
    return AT(p->dst, p->dstride, dix(p, i));
}

static inline uint64_t row_src(const Plan *p, Py_ssize_t i)
{
    return AT(p->src, p->sstride, six(p, i));
}

/* Row i's dst or src range wraps past 2**64 (then it cannot be memory): ValueError set, -1. */
static int check_wrap(const Plan *p, Py_ssize_t i, uint64_t l)
{
    uint64_t d = row_dst(p, i), s = row_src(p, i);
    if (d + l < d || s + l < s) {
        PyErr_Format(PyExc_ValueError, "row %zd: address + length wraps past 2**64 (dst %llu, src %llu, %llu bytes)",
                     i, (unsigned long long)d, (unsigned long long)s, (unsigned long long)l);
        return -1;
    }
    return 0;
}

/* Requests of at least this many bytes in total are written with non-temporal
   stores: a KV load's source and destination come from memory, not cache (the
   blocks were written a step or more ago, a pool far larger than any cache),
   and a store that misses must first read its line for ownership; streaming
   stores skip that read and leave the cache to the engine.  Measured on the
   2-CPU VM (docs/performance.md): a 16 MiB copy from and into memory 1.6-2.2x
   faster, a warm 4 MiB one 0-20% slower (so kvt.memcopy sets 16 MiB).  0: never.
   Set by set_stream. */
static uint64_t stream_bytes;

#if defined(__x86_64__)
/* memcpy with non-temporal stores (SSE2: every x86-64 has it); the caller
   fences once after its last row (streaming stores are weakly ordered). */
static void copy_stream(char *d, const char *s, uint64_t l)
{
    uint64_t head = (16 - ((uintptr_t)d & 15)) & 15;
    memcpy(d, s, head);
    d += head, s += head, l -= head;
    for (; l >= 64; d += 64, s += 64, l -= 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)s), b = _mm_loadu_si128((const __m128i *)(s + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(s + 32)), e = _mm_loadu_si128((const __m128i *)(s + 48));
        _mm_stream_si128((__m128i *)d, a), _mm_stream_si128((__m128i *)(d + 16), b);
        _mm_stream_si128((__m128i *)(d + 32), c), _mm_stream_si128((__m128i *)(d + 48), e);
    }
    memcpy(d, s, l);
}
#define STREAM_FENCE() _mm_sfence()
#else
#define STREAM_FENCE() ((void)0)
#endif

/* One run: streamed when asked, long enough to pay and not overlapping. */
static inline void move(uint64_t d, uint64_t s, uint64_t l, int stream)
{
#if defined(__x86_64__)
    if (stream && l >= 4096 && (d + l <= s || s + l <= d)) {
        copy_stream((char *)(uintptr_t)d, (const char *)(uintptr_t)s, l);
        return;
    }
#endif
    (void)stream;
    memmove((void *)(uintptr_t)d, (const void *)(uintptr_t)s, (size_t)l);
}

/* Every row, merging runs contiguous on both sides. */
static void copy_all(const Plan *p, int stream)
{
    Py_ssize_t i = 0;
    while (i < p->n) {
        uint64_t d = row_dst(p, i), s = row_src(p, i), l = row_len(p, i);
        for (i++; i < p->n; i++) {
            uint64_t nl = row_len(p, i);
            if (row_dst(p, i) != d + l || row_src(p, i) != s + l)
                break;
            l += nl;
        }
        if (l)
            move(d, s, l, stream);
    }
    if (stream)
        STREAM_FENCE();
}

/* A split request: pieces (merged runs cut at CHUNK bytes) that threads claim
   one at a time, so a thread that starts late (waking one costs tens of
   microseconds on a VM) only copies fewer pieces instead of holding up the end.
   The helpers are started once and then parked: creating a thread per request
   cost 60-100 us in an engine process with large mappings.  A request is cut
   into about four pieces per thread, of 64 KiB to 1 MiB. */
#define CHUNK ((uint64_t)1 << 20)
#define MIN_CHUNK ((uint64_t)64 << 10)

static uint64_t mono_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

typedef struct {
    uint64_t d, s, l;
} Piece;

typedef struct {
    const Piece *pieces;
    const size_t *units;  /* unit u is pieces units[u] .. units[u + 1] - 1: about one chunk of bytes */
    size_t n, next;       /* n units; next: claimed with an atomic add (one claim per chunk, not per row) */
    int stream;           /* non-temporal stores (see stream_bytes) */
} Work;

static void *drain(void *arg)
{
    Work *w = arg;
    size_t i;
    while ((i = __atomic_fetch_add(&w->next, 1, __ATOMIC_RELAXED)) < w->n)
        for (size_t j = w->units[i]; j < w->units[i + 1]; j++)
            move(w->pieces[j].d, w->pieces[j].s, w->pieces[j].l, w->stream);
    if (w->stream)
        STREAM_FENCE(); /* before this thread reports its pieces done */
    return NULL;
}

/* The parked helpers.  One split request at a time uses them (`work`); a
   request that finds them busy drains its pieces alone.  `want` closes the
   request to helpers that wake after its caller finished; `active` counts
   those still draining it, which the caller waits for (its pieces live on
   its stack).
   Waking a parked helper costs tens of microseconds on a VM, as much as
   copying 1 MiB.  So a request under WAKE_WORTH is split only when it comes
   back to back (the previous request of at least the split size ended less
   than 4 x `spin_ns` before it started: a loop's Python between two requests
   can outlast one spin, and a CPU that just went idle wakes fast), and then
   a helper that finishes its part watches for the next request for up to
   `spin_ns` before parking.
   Isolated requests (an engine's step every few ms) never spin, and under
   WAKE_WORTH the posting thread copies them alone. */
#define WAKE_WORTH ((uint64_t)16 << 20)
static struct {
    pthread_mutex_t mu;
    pthread_cond_t go, idle;
    Work *work;
    unsigned long gen;     /* bumped per request: a helper takes each at most once */
    int want, taken, active, started;
    int spin;              /* this request came back to back: helpers spin after it */
    uint64_t spin_ns, finished_ns;
    int ntids, steered;    /* helpers' thread ids known; the CPU they are kept off (-1: none yet) */
    pid_t tids[MAX_THREADS];
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, PTHREAD_COND_INITIALIZER, NULL, 0, 0, 0, 0, 0,
          0, 0, 0, 0, -1, {0}};

/* Keep the helpers off the caller's CPU (called locked).  On a VM the guest
   sees an idle vCPU the host took away as busy, so the scheduler wakes a
   helper onto the caller's own CPU: the two take turns there while the other
   CPU idles, and a split copy runs at one thread's speed (16 MiB: 1.25 ms
   against 0.7, docs/performance.md).  Aimed again only when the caller's CPU
   changed or a helper started; a caller that may run on one CPU only (pinned,
   or a one-CPU cpuset) leaves the helpers as they are. */
static void steer_helpers(void)
{
    int cpu = sched_getcpu();
    cpu_set_t set;
    if (cpu < 0 || cpu == pool.steered || pool.ntids == 0)
        return;
    if (sched_getaffinity(0, sizeof set, &set) != 0 || !CPU_ISSET(cpu, &set) || CPU_COUNT(&set) < 2)
        return;
    CPU_CLR(cpu, &set);
    for (int i = 0; i < pool.ntids; i++)
        (void)sched_setaffinity(pool.tids[i], sizeof set, &set); /* a failure leaves that one as it was */
    pool.steered = cpu;
}

/* The previous request of at least the split size ended less than 4 x spin_ns ago
   (read unlocked: a heuristic, a stale answer costs a wake or a helper). */
static int back_to_back(void)
{
    uint64_t ns = __atomic_load_n(&pool.spin_ns, __ATOMIC_RELAXED);
    uint64_t end = __atomic_load_n(&pool.finished_ns, __ATOMIC_RELAXED);
    return ns && end && mono_ns() - end <= 4 * ns;
}

/* Up to spin_ns for the generation to move on from `seen` (called unlocked). */
static void spin_for_next(unsigned long seen, uint64_t spin_ns)
{
    uint64_t end = mono_ns() + spin_ns;
    for (unsigned k = 1; __atomic_load_n(&pool.gen, __ATOMIC_ACQUIRE) == seen; k++) {
        CPU_RELAX();
        if (k % 64 == 0 && mono_ns() > end)
            return;
    }
}

static void *helper(void *arg)
{
    unsigned long seen = (unsigned long)(uintptr_t)arg; /* the generation before the request that started it */
    pthread_mutex_lock(&pool.mu);
    pool.tids[pool.ntids++] = (pid_t)syscall(SYS_gettid);
    pool.steered = -1; /* the next request aims this one too */
    for (;;) {
        if (pool.spin && pool.gen == seen) {
            uint64_t ns = pool.spin_ns;
            pthread_mutex_unlock(&pool.mu);
            spin_for_next(seen, ns);
            pthread_mutex_lock(&pool.mu);
        }
        while (pool.gen == seen)
            pthread_cond_wait(&pool.go, &pool.mu);
        seen = pool.gen;
        if (pool.work == NULL || pool.taken >= pool.want)
            continue;
        Work *w = pool.work;
        pool.taken++;
        __atomic_store_n(&pool.active, pool.active + 1, __ATOMIC_RELAXED);
        pthread_mutex_unlock(&pool.mu);
        drain(w);
        pthread_mutex_lock(&pool.mu);
        __atomic_store_n(&pool.active, pool.active - 1, __ATOMIC_RELEASE); /* the caller may spin on it */
        if (pool.active == 0)
            pthread_cond_signal(&pool.idle);
    }
    return NULL;
}

/* A forked child has none of its parent's helpers (and maybe a lock a helper held). */
static void pool_after_fork(void)
{
    pthread_mutex_init(&pool.mu, NULL);
    pthread_cond_init(&pool.go, NULL);
    pthread_cond_init(&pool.idle, NULL);
    pool.work = NULL;
    pool.want = pool.taken = pool.active = pool.started = pool.spin = pool.ntids = 0;
    pool.finished_ns = 0;
    pool.steered = -1;
}

/* Hand `w` to up to `helpers` parked threads (starting them on first use);
   0 if they are busy with another request. */
static int pool_start(Work *w, int helpers)
{
    pthread_mutex_lock(&pool.mu);
    if (pool.work != NULL) {
        pthread_mutex_unlock(&pool.mu);
        return 0;
    }
    while (pool.started < helpers) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int bad = pthread_create(&t, &attr, helper, (void *)(uintptr_t)pool.gen);
        pthread_attr_destroy(&attr);
        if (bad)
            break; /* fewer helpers (or none): the caller takes the rest */
        pool.started++;
    }
    steer_helpers();
    pool.work = w;
    pool.want = helpers;
    pool.taken = 0;
    pool.spin = back_to_back();
    __atomic_store_n(&pool.gen, pool.gen + 1, __ATOMIC_RELEASE); /* spinning helpers read it unlocked */
    pthread_cond_broadcast(&pool.go);
    pthread_mutex_unlock(&pool.mu);
    return 1;
}

/* After the caller drained: close the request and wait for helpers still in it. */
static void pool_finish(void)
{
    pthread_mutex_lock(&pool.mu);
    pool.want = 0;
    if (pool.active > 0) {
        /* a helper is finishing its last piece: watch for it rather than park,
           since being woken costs more than a piece takes to copy */
        uint64_t ns = pool.spin_ns;
        pthread_mutex_unlock(&pool.mu);
        uint64_t end = mono_ns() + ns;
        for (unsigned k = 1; ns && __atomic_load_n(&pool.active, __ATOMIC_ACQUIRE) > 0; k++) {
            CPU_RELAX();
            if (k % 64 == 0 && mono_ns() > end)
                break;
        }
        pthread_mutex_lock(&pool.mu);
    }
    while (pool.active > 0)
        pthread_cond_wait(&pool.idle, &pool.mu);
    pool.work = NULL;
    __atomic_store_n(&pool.finished_ns, mono_ns(), __ATOMIC_RELAXED);
    pthread_mutex_unlock(&pool.mu);
}

static void copy_split(const Plan *p, uint64_t total, int threads, int stream)
{
    uint64_t chunk = total / ((uint64_t)threads * 4);
    chunk = chunk < MIN_CHUNK ? MIN_CHUNK : chunk > CHUNK ? CHUNK : (chunk + 4095) & ~(uint64_t)4095;
    size_t cap = (size_t)p->n + total / chunk + 1;
    Piece *pc = malloc((sizeof(Piece) + sizeof(size_t)) * cap + sizeof(size_t));
    if (pc == NULL) {
        copy_all(p, stream);
        return;
    }
    size_t m = 0;
    for (Py_ssize_t i = 0; i < p->n;) {
        uint64_t d = row_dst(p, i), s = row_src(p, i), l = row_len(p, i);
        for (i++; i < p->n; i++) { /* merge runs contiguous on both sides, as copy_all does */
            if (row_dst(p, i) != d + l || row_src(p, i) != s + l)
                break;
            l += row_len(p, i);
        }
        for (uint64_t off = 0; off < l; off += chunk)
            pc[m++] = (Piece){d + off, s + off, l - off < chunk ? l - off : chunk};
    }
    size_t *units = (size_t *)(pc + cap), nu = 0;
    uint64_t acc = 0;
    for (size_t j = 0; j < m; j++) { /* short rows grouped: a unit closes once it holds a chunk */
        if (acc == 0)
            units[nu++] = j;
        acc += pc[j].l;
        if (acc >= chunk)
            acc = 0;
    }
    units[nu] = m;
    Work w = {pc, units, nu, 0, stream};
    int helped = pool_start(&w, threads - 1);
    drain(&w);
    if (helped)
        pool_finish();
    free(pc);
}

static void run(const Plan *p, uint64_t total, int threads, uint64_t split)
{
    if (threads > MAX_THREADS)
        threads = MAX_THREADS;
    int splittable = threads > 1 && total >= split && total >= (uint64_t)threads * 65536;
    uint64_t sb = __atomic_load_n(&stream_bytes, __ATOMIC_RELAXED);
    int stream = sb && total >= sb;
    if (splittable && (total >= WAKE_WORTH || back_to_back())) {
        copy_split(p, total, threads, stream);
    } else {
        copy_all(p, stream);
        if (splittable) /* the next one may come back to back */
            __atomic_store_n(&pool.finished_ns, mono_ns(), __ATOMIC_RELAXED);
    }
}

/* A 1-D buffer of 8-byte unsigned ints (strides allowed). */
static int get_column(PyObject *obj, Py_buffer *view, const char *what)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_RECORDS_RO) < 0)
        return -1;
    const char *f = view->format && view->format[0] ? view->format : "B"; /* "" would index f[-1] */
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
    for (Py_ssize_t i = 0; i < p.n; i++)
        if (check_wrap(&p, i, row_len(&p, i)) < 0)
            goto done;
    Py_BEGIN_ALLOW_THREADS
    run(&p, total, threads, split);
    Py_END_ALLOW_THREADS
    out = PyLong_FromUnsignedLongLong(total);
done:
    if (have_l)
        PyBuffer_Release(&lv);
    PyBuffer_Release(&sv);
    PyBuffer_Release(&dv);
    return out;
}

/* A 1-D buffer of 8-byte signed ints (strides allowed): block indices. */
static int get_index(PyObject *obj, Py_buffer *view, const char *what)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_RECORDS_RO) < 0)
        return -1;
    const char *f = view->format && view->format[0] ? view->format : "B";
    char code = f[strlen(f) - 1];
    if (view->ndim != 1 || view->itemsize != 8 || !strchr("qln", code) || (f[0] && strchr(">!", f[0]))) {
        PyErr_Format(PyExc_TypeError, "%s must be a 1-D array of native int64 (got ndim %d, format '%s')",
                     what, view->ndim, f);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* Outcomes of copy_indexed other than a byte count (mirrored in kvt/memcopy.py). */
enum { STALE = -1, TOO_BIG = -2, DEAD = -3, STALE_AFTER = -4 };

static inline uint64_t epoch_now(uintptr_t epoch)
{
    return __atomic_load_n((const uint64_t *)epoch, __ATOMIC_ACQUIRE);
}

/* A pidfd turns readable when its process exits; an error counts as gone (trust nothing then). */
static int exited(int pidfd)
{
    struct pollfd pfd = {pidfd, POLLIN, 0};
    return poll(&pfd, 1, 0) != 0;
}

/* A guard slot (kvt/epoch.py) counts its copier's copies under way.  Copier:
 * increment, fence, read the epoch.  Owner: bump the epoch, fence, read the
 * slots.  Each side's load comes after its own store, so one of them sees the
 * other's: a copy either sees the new epoch (and does not happen) or is
 * counted when the owner looks.  No system call, unlike a shared flock. */
static inline void slot_enter(uint64_t *slot)
{
    __atomic_add_fetch(slot, 1, __ATOMIC_SEQ_CST);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
}

static inline void slot_leave(uint64_t *slot)
{
    __atomic_sub_fetch(slot, 1, __ATOMIC_RELEASE);
}

/* The owner's liveness word (kvt/epoch.py) holds the id of a thread of the
 * owner's that does nothing else; the kernel clears it (FUTEX_OWNER_DIED)
 * as that thread exits, however the process dies: see keep_alive. */
static inline int word_gone(uintptr_t word, uint32_t tid)
{
    return (__atomic_load_n((const uint32_t *)word, __ATOMIC_ACQUIRE) & FUTEX_TID_MASK) != tid;
}

PyDoc_STRVAR(copy_indexed_doc,
"copy_indexed(dst, di, src, si, lengths, src_lengths=None, max_bytes=2**64-1,\n"
"             epoch=0, seen=0, pidfd=-1, threads=<set_split>, lock=-1, slot=0,\n"
"             alive=0, tid=0) -> int\n\n"
"For every k copy the row di[k] of table (dst, lengths) from row si[k] of\n"
"table (src, src_lengths): dst, src are 1-D uint64 address tables, di, si\n"
"1-D int64 indices, lengths a uint64 table or one int (uniform rows).\n"
"Before any byte moves: IndexError for an index outside its table,\n"
"ValueError for paired rows of different lengths (src_lengths given).\n"
"Returns the bytes copied, or without copying -1 if the word at address\n"
"epoch (when non-zero) differs from seen or the file lock (when >= 0)\n"
"cannot be held shared (its owner holds it exclusively, to drain the\n"
"copies under way; held, else, until the copy and its checks end),\n"
"-2 if the total exceeds\n"
"max_bytes; after copying -3 if pidfd (when >= 0) shows its process\n"
"exited, -4 if the epoch word moved meanwhile.  slot (when non-zero; then\n"
"lock is not taken): the address of a guard slot, a uint64 counter raised\n"
"(with a full fence) before the first epoch check and lowered after the\n"
"last.  alive (when non-zero; then pidfd is not polled): the address of\n"
"the owner's liveness word, which must hold tid after the copy (else -3).\n"
"threads: at most this many for a request of at least set_split's size.\n"
"The GIL is released for the copy.  kvt.memcopy.copy_indexed is this\n"
"function when the extension is built (the same signature).");

/* copy_indexed's arguments, parsed. */
typedef struct {
    PyObject *dobj, *diobj, *sobj, *siobj, *lobj, *slobj;
    int threads, pidfd, lock;
    unsigned long long split, max_bytes, epoch, seen, slot, alive;
    unsigned int tid;
} IndexedArgs;

static PyObject *copy_indexed_run(const IndexedArgs *a);

/* What kvt.memcopy configures once (set_split): the split size and the default thread count. */
static unsigned long long split_default;
static int threads_default = 1;

static PyObject *py_copy_indexed(PyObject *self, PyObject *args, PyObject *kw)
{
    static char *names[] = {"dst", "di", "src", "si", "lengths", "src_lengths", "max_bytes", "epoch", "seen",
                            "pidfd", "threads", "lock", "slot", "alive", "tid", NULL};
    IndexedArgs a = {.slobj = Py_None, .threads = threads_default, .pidfd = -1, .lock = -1,
                     .split = split_default, .max_bytes = UINT64_MAX};
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOO|OKKKiiiKKI", names, &a.dobj, &a.diobj, &a.sobj, &a.siobj,
                                     &a.lobj, &a.slobj, &a.max_bytes, &a.epoch, &a.seen, &a.pidfd, &a.threads,
                                     &a.lock, &a.slot, &a.alive, &a.tid))
        return NULL;
    return copy_indexed_run(&a);
}

/* An int argument of the fast call below: 'i' (checked) or, as 'K' and 'I', its low bits. */
static int fast_int(PyObject *o, int *out)
{
    int overflow;
    long v = PyLong_AsLongAndOverflow(o, &overflow);
    if (overflow || v < INT_MIN || v > INT_MAX)
        return -1;
    *out = (int)v;
    return 0;
}

/* The per-request call (the host backend passes all 15 arguments by
   position, its ints as ints): parsed without building an argument tuple,
   which cost a third of a small request's call.  Anything else (keywords,
   fewer arguments, an int subclass, an int out of range) takes the general
   parser above, which also raises its errors. */
static PyObject *py_copy_indexed_fast(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    if (kwnames == NULL && nargs == 15) {
        int ok = 1;
        for (int i = 6; i < 15; i++)
            ok &= PyLong_CheckExact(args[i]);
        IndexedArgs a = {args[0], args[1], args[2], args[3], args[4], args[5], .split = split_default};
        if (ok && fast_int(args[9], &a.pidfd) == 0 && fast_int(args[10], &a.threads) == 0 &&
            fast_int(args[11], &a.lock) == 0) {
            a.max_bytes = PyLong_AsUnsignedLongLongMask(args[6]), a.epoch = PyLong_AsUnsignedLongLongMask(args[7]);
            a.seen = PyLong_AsUnsignedLongLongMask(args[8]), a.slot = PyLong_AsUnsignedLongLongMask(args[12]);
            a.alive = PyLong_AsUnsignedLongLongMask(args[13]);
            a.tid = (unsigned int)PyLong_AsUnsignedLongMask(args[14]);
            return copy_indexed_run(&a);  /* (exact ints: the masks cannot fail) */
        }
    }
    PyObject *tuple = PyTuple_New(nargs), *kw = NULL, *out = NULL;
    if (tuple == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < nargs; i++)
        PyTuple_SET_ITEM(tuple, i, Py_NewRef(args[i]));
    if (kwnames != NULL) {
        if ((kw = PyDict_New()) == NULL)
            goto done;
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(kwnames); i++)
            if (PyDict_SetItem(kw, PyTuple_GET_ITEM(kwnames, i), args[nargs + i]) < 0)
                goto done;
    }
    out = py_copy_indexed(self, tuple, kw);
done:
    Py_DECREF(tuple);
    Py_XDECREF(kw);
    return out;
}

PyDoc_STRVAR(set_split_doc,
"set_split(split_bytes, threads) -> None\n\n"
"copy_indexed's configuration (kvt.memcopy sets it at import): requests of\n"
"at least split_bytes may be split across threads, and threads is the\n"
"default of its threads argument.");

static PyObject *py_set_split(PyObject *self, PyObject *args)
{
    unsigned long long split;
    int threads;
    if (!PyArg_ParseTuple(args, "Ki", &split, &threads))
        return NULL;
    split_default = split, threads_default = threads;
    Py_RETURN_NONE;
}

static PyObject *copy_indexed_run(const IndexedArgs *a)
{
    PyObject *dobj = a->dobj, *diobj = a->diobj, *sobj = a->sobj, *siobj = a->siobj, *lobj = a->lobj,
             *slobj = a->slobj;
    int threads = a->threads, pidfd = a->pidfd, lock = a->lock;
    unsigned long long split = a->split, max_bytes = a->max_bytes, epoch = a->epoch, seen = a->seen,
                       slot = a->slot, alive = a->alive;
    unsigned int tid = a->tid;
    if (slot % 8 || alive % 4) {  /* an atomic across cache lines may fault (split-lock detection) */
        PyErr_SetString(PyExc_ValueError, "slot must be 8-byte and alive 4-byte aligned");
        return NULL;
    }
    Py_buffer views[6];
    int nviews = 0;
    PyObject *out = NULL;
    Plan p = {0};
    Py_ssize_t ndst, nsrc;
    const char *sl = NULL;
    Py_ssize_t slstride = 0;
#define TAKE(fn, obj, what) do { if (fn(obj, &views[nviews], what) < 0) goto done; nviews++; } while (0)
    TAKE(get_column, dobj, "dst");
    TAKE(get_index, diobj, "di");
    TAKE(get_column, sobj, "src");
    TAKE(get_index, siobj, "si");
    p.dst = views[0].buf, p.dstride = views[0].strides[0], ndst = views[0].shape[0];
    p.di = views[1].buf, p.distride = views[1].strides[0], p.n = views[1].shape[0];
    p.src = views[2].buf, p.sstride = views[2].strides[0], nsrc = views[2].shape[0];
    p.si = views[3].buf, p.sistride = views[3].strides[0];
    if (views[3].shape[0] != p.n) {
        PyErr_Format(PyExc_ValueError, "di selects %zd rows but si %zd; they are paired one to one",
                     p.n, views[3].shape[0]);
        goto done;
    }
    if (PyLong_Check(lobj)) {
        p.ulen = PyLong_AsUnsignedLongLong(lobj);
        if (PyErr_Occurred())
            goto done;
    } else {
        TAKE(get_column, lobj, "lengths");
        if (views[nviews - 1].shape[0] != ndst) {
            PyErr_Format(PyExc_ValueError, "lengths has %zd rows, dst %zd", views[nviews - 1].shape[0], ndst);
            goto done;
        }
        p.len = views[nviews - 1].buf, p.lstride = views[nviews - 1].strides[0];
    }
    if (slobj != Py_None) {
        TAKE(get_column, slobj, "src_lengths");
        if (views[nviews - 1].shape[0] != nsrc) {
            PyErr_Format(PyExc_ValueError, "src_lengths has %zd rows, src %zd", views[nviews - 1].shape[0], nsrc);
            goto done;
        }
        sl = views[nviews - 1].buf, slstride = views[nviews - 1].strides[0];
    }
#undef TAKE
    /* every check before the first byte moves; as int64 viewed unsigned, a negative index is past any table */
    uint64_t total = 0;
    for (Py_ssize_t i = 0; i < p.n; i++) {
        uint64_t d = AT(p.di, p.distride, i), s = AT(p.si, p.sistride, i);
        if (d >= (uint64_t)ndst || s >= (uint64_t)nsrc) {
            PyErr_Format(PyExc_IndexError, "pair %zd: index %lld or %lld outside tables of %zd and %zd rows", i,
                         (long long)d, (long long)s, ndst, nsrc);
            goto done;
        }
        uint64_t l = row_len(&p, i);
        if (sl && AT(sl, slstride, s) != l) {
            PyErr_Format(PyExc_ValueError, "pair %zd: rows of %llu and %llu bytes", i, (unsigned long long)l,
                         (unsigned long long)AT(sl, slstride, s));
            goto done;
        }
        if (check_wrap(&p, i, l) < 0)
            goto done;
        if (total + l < total) {
            PyErr_SetString(PyExc_OverflowError, "lengths sum past 2**64");
            goto done;
        }
        total += l;
    }
    long long code = (long long)total;
    if (total > max_bytes) {
        code = TOO_BIG;
    } else if (total > (uint64_t)INT64_MAX) { /* the count would read as a negative outcome (STALE...) */
        PyErr_SetString(PyExc_OverflowError, "lengths sum past 2**63");
        goto done;
    } else {
        Py_BEGIN_ALLOW_THREADS
        /* the slot or the lock first: an owner that bumped the epoch and now drains either waits
         * for this copy or made us see the new epoch; any lock failure (not only EWOULDBLOCK)
         * copies nothing */
        if (slot) {
            slot_enter((uint64_t *)(uintptr_t)slot);
            lock = -1;
        }
        if (lock >= 0 && flock(lock, LOCK_SH | LOCK_NB) != 0) {
            code = STALE;
        } else {
            if (epoch && epoch_now((uintptr_t)epoch) != seen) {
                code = STALE;
            } else {
                run(&p, total, threads, split);
                if (alive ? word_gone((uintptr_t)alive, tid) : pidfd >= 0 && exited(pidfd))
                    code = DEAD;  /* a dead peer's pages stay mapped; its data no longer counts */
                else if (epoch && epoch_now((uintptr_t)epoch) != seen)
                    code = STALE_AFTER;  /* it deregistered while we copied */
            }
            if (lock >= 0)
                flock(lock, LOCK_UN);
        }
        if (slot)
            slot_leave((uint64_t *)(uintptr_t)slot);
        Py_END_ALLOW_THREADS
    }
    out = PyLong_FromLongLong(code);
done:
    while (nviews)
        PyBuffer_Release(&views[--nviews]);
    return out;
}

PyDoc_STRVAR(atomic_add_doc,
"atomic_add(address, delta) -> int\n\n"
"Add delta to the uint64 at address (modulo 2**64) atomically, then a full\n"
"fence; returns the new value.  The address must be 8-byte aligned and\n"
"mapped writable (the caller vouches, as for copy).");

/* The uint64 at addr, or NULL (ValueError) if it cannot be one: its mapping the caller vouches for. */
static uint64_t *word_at(unsigned long long addr)
{
    if (!addr || addr % 8) {
        PyErr_SetString(PyExc_ValueError, "address must be non-zero and 8-byte aligned");
        return NULL;
    }
    return (uint64_t *)(uintptr_t)addr;
}

static PyObject *py_atomic_add(PyObject *self, PyObject *args)
{
    unsigned long long addr, delta;
    uint64_t *w;
    if (!PyArg_ParseTuple(args, "KK", &addr, &delta) || !(w = word_at(addr)))
        return NULL;
    uint64_t v = __atomic_add_fetch(w, (uint64_t)delta, __ATOMIC_SEQ_CST);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    return PyLong_FromUnsignedLongLong(v);
}

PyDoc_STRVAR(atomic_cas_doc,
"atomic_cas(address, expected, new) -> bool\n\n"
"Store new in the uint64 at address if it holds expected, atomically;\n"
"True if it did.  Same address rules as atomic_add.");

static PyObject *py_atomic_cas(PyObject *self, PyObject *args)
{
    unsigned long long addr, expected, desired;
    uint64_t *w;
    if (!PyArg_ParseTuple(args, "KKK", &addr, &expected, &desired) || !(w = word_at(addr)))
        return NULL;
    uint64_t want = expected;
    return PyBool_FromLong(__atomic_compare_exchange_n(w, &want, (uint64_t)desired, 0, __ATOMIC_SEQ_CST,
                                                       __ATOMIC_SEQ_CST));
}

/* keep_alive: the owner's side of the liveness word.  The keeper thread
 * registers the word as its robust futex list's one entry (the entry itself
 * in private memory: a peer that can write the page cannot lengthen the
 * list), stores its id there, and blocks on a pipe.  At exit, by any cause,
 * the kernel marks every word on that list whose id is the dying thread's.
 * A raw set_robust_list replaces glibc's for this thread only, which holds
 * no pthread robust mutex.  Stopping empties the list before the word is
 * cleared and the thread exits.  The keeper maps the page itself and unmaps
 * it only after its thread ended: whatever order Python frees things in, the
 * word it writes is mapped, and the kernel never marks one it let go. */
#define PAGE_BYTES 4096

typedef struct {
    struct robust_list_head head;
    struct robust_list entry;
    void *page;  /* our own mapping of the owner's page */
    uint32_t *word;
    uint32_t tid;
    int rfd, wfd;
    pid_t pid;  /* the process that started it: a forked child must not join or clear */
    pthread_t thread;
} Keeper;

static void *keeper_main(void *arg)
{
    Keeper *k = arg;
    uint32_t tid = (uint32_t)syscall(SYS_gettid);
    k->entry.next = &k->head.list;
    k->head.list.next = &k->entry;
    k->head.futex_offset = (long)((char *)k->word - (char *)&k->entry);
    k->head.list_op_pending = NULL;
    if (syscall(SYS_set_robust_list, &k->head, sizeof k->head) == 0)
        __atomic_store_n(k->word, tid, __ATOMIC_SEQ_CST);
    else
        tid = UINT32_MAX;  /* no robust list here: the caller reports it */
    __atomic_store_n(&k->tid, tid, __ATOMIC_RELEASE);
    char c;
    while (read(k->rfd, &c, 1) < 0 && errno == EINTR)
        ;
    k->head.list.next = &k->head.list;  /* empty first: the kernel must not mark a word we let go */
    __atomic_store_n(k->word, 0, __ATOMIC_SEQ_CST);
    return NULL;
}

static void keeper_stop(Keeper *k)
{
    /* a byte wakes it, not the pipe's end: a forked child may hold a copy of the write end; and
     * only its own process may wake it (a forked child's stop must not end its parent's keeper) */
    if (k->pid == getpid()) {
        while (write(k->wfd, "", 1) < 0 && errno == EINTR)
            ;
        pthread_join(k->thread, NULL);  /* (with the GIL: the keeper never takes it, and ends at once) */
    }
    close(k->wfd);
    close(k->rfd);
    munmap(k->page, PAGE_BYTES);
    PyMem_RawFree(k);
}

static void keeper_capsule_free(PyObject *capsule)
{
    Keeper *k = PyCapsule_GetPointer(capsule, "kvt._copy.Keeper");
    if (k)
        keeper_stop(k);
}

PyDoc_STRVAR(keep_alive_doc,
"keep_alive(fd, offset) -> (tid, keeper)\n\n"
"Start a thread that holds the uint32 at offset (4-byte aligned, below\n"
"4096) of the shared file fd (at least 4096 bytes, writable) at its thread\n"
"id tid until stop_alive(keeper) clears it, or until this process dies:\n"
"then the kernel clears the id and sets FUTEX_OWNER_DIED.  OSError if the\n"
"page, the thread or its robust list cannot be had.");

static PyObject *py_keep_alive(PyObject *self, PyObject *args)
{
    int fd;
    unsigned int offset;
    if (!PyArg_ParseTuple(args, "iI", &fd, &offset))
        return NULL;
    if (offset % 4 || offset > PAGE_BYTES - 4) {
        PyErr_SetString(PyExc_ValueError, "offset must be 4-byte aligned and below 4096");
        return NULL;
    }
    Keeper *k = PyMem_RawCalloc(1, sizeof *k);
    if (!k)
        return PyErr_NoMemory();
    int fds[2];
    k->page = mmap(NULL, PAGE_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (k->page == MAP_FAILED || pipe2(fds, O_CLOEXEC) != 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        if (k->page != MAP_FAILED)
            munmap(k->page, PAGE_BYTES);
        PyMem_RawFree(k);
        return NULL;
    }
    k->rfd = fds[0], k->wfd = fds[1], k->word = (uint32_t *)((char *)k->page + offset), k->pid = getpid();
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, 64 * 1024);
    int bad = pthread_create(&k->thread, &attr, keeper_main, k);
    pthread_attr_destroy(&attr);
    if (bad) {
        close(fds[0]), close(fds[1]);
        munmap(k->page, PAGE_BYTES);
        PyMem_RawFree(k);
        errno = bad;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    uint32_t tid = 0;
    Py_BEGIN_ALLOW_THREADS
    struct timespec nap = {0, 20000};
    for (int i = 0; i < 250000 && !(tid = __atomic_load_n(&k->tid, __ATOMIC_ACQUIRE)); i++)
        nanosleep(&nap, NULL);  /* it starts in microseconds; 5 s bounds a stalled machine */
    Py_END_ALLOW_THREADS
    if (tid == 0 || tid == UINT32_MAX) {  /* (not started yet: the join waits for it to start and wake) */
        keeper_stop(k);
        PyErr_SetString(PyExc_OSError, tid ? "kvt._copy.keep_alive: set_robust_list failed"
                                           : "kvt._copy.keep_alive: the keeper thread did not start within 5 s");
        return NULL;
    }
    PyObject *capsule = PyCapsule_New(k, "kvt._copy.Keeper", keeper_capsule_free);
    if (!capsule) {
        keeper_stop(k);
        return NULL;
    }
    return Py_BuildValue("(IN)", tid, capsule);
}

PyDoc_STRVAR(stop_alive_doc,
"stop_alive(keeper) -> None\n\n"
"Clear the word keep_alive holds and end its thread (idempotent).");

static const char STOPPED[] = "kvt._copy.Keeper(stopped)";

static PyObject *py_stop_alive(PyObject *self, PyObject *capsule)
{
    if (PyCapsule_CheckExact(capsule) && PyCapsule_GetName(capsule) == STOPPED)
        Py_RETURN_NONE;
    Keeper *k = PyCapsule_GetPointer(capsule, "kvt._copy.Keeper");
    if (!k)
        return NULL;
    if (PyCapsule_SetDestructor(capsule, NULL) != 0)
        return NULL;
    keeper_stop(k);
    /* a stopped keeper's capsule points at nothing: a second stop is a no-op */
    PyCapsule_SetName(capsule, STOPPED);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(set_spin_doc,
"set_spin(ns) -> None\n\n"
"How long a copy helper watches for the next of back-to-back split requests\n"
"before parking (0: it parks at once).");

/* A setter's argument: a Python int in 0 .. 2**64 - 1. */
static int u64_arg(PyObject *arg, uint64_t *out)
{
    unsigned long long v = PyLong_AsUnsignedLongLong(arg);
    if (v == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    *out = v;
    return 0;
}

static PyObject *py_set_spin(PyObject *self, PyObject *arg)
{
    uint64_t ns;
    if (u64_arg(arg, &ns) < 0)
        return NULL;
    pthread_mutex_lock(&pool.mu);
    __atomic_store_n(&pool.spin_ns, ns, __ATOMIC_RELAXED);
    pthread_mutex_unlock(&pool.mu);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(set_stream_doc,
"set_stream(nbytes) -> None\n\n"
"Requests of at least nbytes in total are written with non-temporal stores\n"
"(x86-64; elsewhere ignored).  0: never.");

static PyObject *py_set_stream(PyObject *self, PyObject *arg)
{
    uint64_t n;
    if (u64_arg(arg, &n) < 0)
        return NULL;
    __atomic_store_n(&stream_bytes, n, __ATOMIC_RELAXED);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"set_spin", py_set_spin, METH_O, set_spin_doc},
    {"set_stream", py_set_stream, METH_O, set_stream_doc},
    {"set_split", py_set_split, METH_VARARGS, set_split_doc},
    {"copy", (PyCFunction)(void (*)(void))py_copy, METH_VARARGS | METH_KEYWORDS, copy_doc},
    {"copy_indexed", (PyCFunction)(void (*)(void))py_copy_indexed_fast, METH_FASTCALL | METH_KEYWORDS,
     copy_indexed_doc},
    {"atomic_add", py_atomic_add, METH_VARARGS, atomic_add_doc},
    {"atomic_cas", py_atomic_cas, METH_VARARGS, atomic_cas_doc},
    {"keep_alive", py_keep_alive, METH_VARARGS, keep_alive_doc},
    {"stop_alive", py_stop_alive, METH_O, stop_alive_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvt._copy", "Scatter/gather memory copies in C with the GIL released.", -1, methods,
};

PyMODINIT_FUNC PyInit__copy(void)
{
    if (pthread_atfork(NULL, NULL, pool_after_fork) != 0)
        return PyErr_Format(PyExc_OSError, "kvt._copy: pthread_atfork failed");
    return PyModule_Create(&module);
}
