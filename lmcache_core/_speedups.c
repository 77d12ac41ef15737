/*
 * lmcache_core._speedups: optional compiled helpers of the pure-Python core.
 *
 * Built by `pip install` when a C compiler is present (setup.py marks the extension
 * optional: a failed build leaves the pure-Python path, which gives identical results).
 * Every function here answers only the common case and returns None for anything else,
 * so the Python caller keeps one place for input rules and error messages.
 *
 * int32_le(tokens) -> bytes | None
 *     The int32 little-endian bytes of a list or tuple of token ids, when every element
 *     is an exact Python int in [-2**31, 2**31); None otherwise (another sequence type,
 *     a bool, a numpy integer scalar, an id out of range, anything else). No Python code
 *     runs while it reads the sequence (exact ints only), so the list cannot change
 *     under it.
 *
 * copy_shared(dst, src, n) -> None
 *     Copy n bytes between two non-overlapping host addresses with the GIL released,
 *     shared with one helper thread (a plain pthread, started on first use and again in
 *     a forked child). The algorithm of lmcache_core.memory's Python helper, without its
 *     wake-up cost (a Python thread needs the GIL to start: ~0.1 ms here; a pthread
 *     blocked on a condition variable needs only to be scheduled): the caller posts the copy and copies the
 *     first half; then both take pieces of the rest under one mutex, the caller from the
 *     front, the helper from the back. The caller never waits for a helper that has not
 *     started, only for the one piece the helper may hold when the caller runs out, and
 *     returns only when every byte is in place. One copy is shared at a time: a second
 *     caller meanwhile copies alone, as do overlapping ranges.
 *
 *     Stalls pause sharing. A stall: the caller waited over 1 ms for the helper's
 *     piece, or a shared copy ran over 1 ms longer than 4 GB/s would (a 4 MiB copy takes
 *     ~0.3 ms alone) while the helper copied under a quarter of it (a late or
 *     descheduled helper: with other work on every core, waking a second thread of ours
 *     displaces that work and one of our threads gets descheduled; a copy slowed for
 *     both threads, as by page faults in a fresh buffer, is no reason to stop sharing).
 *     An isolated stall (none in the previous 32 shared copies) pauses sharing for
 *     50 ms: contention often comes in bursts, such as torch's OpenMP threads spinning
 *     for a moment after a parallel region. Stalls that recur within 32 shared copies
 *     pause it for 1 s, doubling per further recurrence up to 30 s: other work holds the
 *     cores, and one memmove alone is the better copy there.
 * copy_stats() -> (helped, stalls, paused_s)
 * copy_debug(claim_delay_us, piece_delay_us[, caller_delay_us]) -> None
 *     (tests: a slow helper, a caller descheduled after posting its copy)
 * copy_reset() -> None        (tests: clear the pause and the stall history)
 *
 * turns_new(n[, idle_ms]) -> capsule
 * turns_preadv(turns, fd, buffers, offset) -> int
 *     os.preadv through a device's read queue: at most n reads on the device at once,
 *     each issued by one of at most n reader threads (plain pthreads, started when jobs
 *     wait and none is idle; a thread idle for idle_ms, default 2 s, exits). The caller
 *     queues its job and waits with the GIL released. A reader thread whose read
 *     completes takes the next queued job and issues it at once, so the device gets its
 *     next request without waking any thread; the caller it finished for is woken to
 *     checksum and copy, off the device's path. With turns handed between the callers
 *     themselves, each hand-over waits for a sleeping thread to be scheduled, which
 *     takes long while other threads checksum and copy on every core
 *     (docs/performance.md, "A read queue with its own threads"). Where no thread can
 *     be started the caller reads itself. Fork-safe (a child starts with an empty queue).
 * turns_stats(turns) -> (n, threads, queued, reading, reads)
 *
 * sync_fds(fds, datasync) -> list[int]
 *     fsync (fdatasync where datasync[i] is true) every descriptor of fds, all at once:
 *     one plain pthread per call (at most 64; the caller takes calls too) with the GIL
 *     released; returns each call's errno (0: it succeeded). Flushes issued together
 *     join one journal commit and share device cache flushes; issued from Python
 *     threads, each waits for its thread to be scheduled and to get the GIL, and those
 *     that arrive after a commit each pay a device flush of their own
 *     (docs/performance.md, "Flushes issued at once"). Where no thread can be started
 *     the caller makes the calls itself.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <pthread.h>
#include <sys/uio.h>
#include <unistd.h>
#include <limits.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

static PyObject *
int32_le(PyObject *module, PyObject *tokens)
{
    (void)module;
    Py_ssize_t n;
    PyObject **items;
    if (PyList_CheckExact(tokens)) {
        n = PyList_GET_SIZE(tokens);
        items = ((PyListObject *)tokens)->ob_item;
    } else if (PyTuple_CheckExact(tokens)) {
        n = PyTuple_GET_SIZE(tokens);
        items = ((PyTupleObject *)tokens)->ob_item;
    } else {
        Py_RETURN_NONE;
    }
    if (n > PY_SSIZE_T_MAX / 4) {
        Py_RETURN_NONE;
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, n * 4);
    if (out == NULL) {
        return NULL;
    }
    unsigned char *p = (unsigned char *)PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = items[i];
        if (!PyLong_CheckExact(item)) {
            goto decline;
        }
        int overflow = 0;
        long v = PyLong_AsLongAndOverflow(item, &overflow);
        if (overflow != 0 || v < INT32_MIN || v > INT32_MAX) {
            goto decline;
        }
        uint32_t u = (uint32_t)(int32_t)v;
        p[0] = (unsigned char)u;
        p[1] = (unsigned char)(u >> 8);
        p[2] = (unsigned char)(u >> 16);
        p[3] = (unsigned char)(u >> 24);
        p += 4;
    }
    return out;

decline:
    Py_DECREF(out);
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------ shared copies */

typedef struct {
    char *dst;
    const char *src;
    size_t piece;
    size_t front; /* the caller's next byte; guarded by mu */
    size_t back;  /* the end of what is left for the helper; guarded by mu */
    int busy;     /* the helper is copying a piece it claimed */
    int waiting;  /* the caller waits for that piece */
} shared_job;

#define ISOLATED_PAUSE_NS ((int64_t)50000000LL)
#define RECUR_PAUSE_NS ((int64_t)1000000000LL)
#define RECUR_WINDOW 32

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t job_posted = PTHREAD_COND_INITIALIZER;
static pthread_cond_t piece_done = PTHREAD_COND_INITIALIZER;
static shared_job *current;       /* the copy being shared, NULL when none */
static unsigned long generation;  /* bumped per posted copy */
static int helper_running;        /* in this process (reset in a forked child) */
static unsigned long long n_helped, n_stalls;
static int64_t paused_until_ns;
static int stall_streak;          /* stalls in a row that recurred within RECUR_WINDOW */
static int shared_since_stall = RECUR_WINDOW; /* shared copies since the last stall */
static unsigned claim_delay_us, piece_delay_us, caller_delay_us; /* tests only */

#define PIECE_MIN ((size_t)256 << 10)
#define STALL_NS ((int64_t)1000000)
#define MAX_PAUSE_NS ((int64_t)30000000000LL)

static int64_t
now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000LL + t.tv_nsec;
}

static void
sleep_us(unsigned us)
{
    struct timespec t = {us / 1000000u, (long)(us % 1000000u) * 1000L};
    while (nanosleep(&t, &t) != 0 && errno == EINTR) {
    }
}

static void *
helper_main(void *arg)
{
    (void)arg;
    unsigned long seen = 0;
    pthread_mutex_lock(&mu);
    for (;;) {
        while (current == NULL || generation == seen) {
            pthread_cond_wait(&job_posted, &mu);
        }
        seen = generation;
        shared_job *job = current;
        if (claim_delay_us) {
            unsigned d = claim_delay_us;
            pthread_mutex_unlock(&mu);
            sleep_us(d);
            pthread_mutex_lock(&mu);
        }
        int helped = 0;
        /* `job` is only touched under mu while it is `current`: the caller clears
           `current` (and may return) only when no piece of the helper is in flight. */
        while (current == job && !job->waiting && job->back > job->front) {
            size_t end = job->back;
            size_t start = end - job->front > job->piece ? end - job->piece : job->front;
            job->back = start;
            job->busy = 1;
            unsigned d = piece_delay_us;
            pthread_mutex_unlock(&mu);
            if (d) {
                sleep_us(d);
            }
            memcpy(job->dst + start, job->src + start, end - start);
            pthread_mutex_lock(&mu);
            job->busy = 0;
            helped = 1;
            if (job->waiting) {
                pthread_cond_signal(&piece_done);
            }
        }
        if (helped) {
            n_helped++;
        }
    }
    return NULL;
}

/* fork(): the forking thread holds mu across it (no copy is half-posted in the child);
   the child then starts from fresh primitives with no helper until its first shared copy
   (threads, the helper and any other caller, do not come along). */
static void
before_fork(void)
{
    pthread_mutex_lock(&mu);
}

static void
after_fork_parent(void)
{
    pthread_mutex_unlock(&mu);
}

static void
after_fork_child(void)
{
    pthread_mutex_init(&mu, NULL);
    pthread_cond_init(&job_posted, NULL);
    pthread_cond_init(&piece_done, NULL);
    current = NULL;
    helper_running = 0;
    stall_streak = 0;
    shared_since_stall = RECUR_WINDOW;
    paused_until_ns = 0;
}

/* Called with mu held. 0 when the helper runs (or was started). */
static int
ensure_helper(void)
{
    if (helper_running) {
        return 0;
    }
    pthread_attr_t attr;
    pthread_t tid;
    if (pthread_attr_init(&attr) != 0) {
        return -1;
    }
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    pthread_attr_setstacksize(&attr, 256 << 10);
    int rc = pthread_create(&tid, &attr, helper_main, NULL);
    pthread_attr_destroy(&attr);
    if (rc != 0) {
        return -1;
    }
    helper_running = 1;
    return 0;
}

/* The copy itself, without the GIL. */
static void
shared_copy(char *dst, const char *src, size_t n)
{
    int64_t t_start = now_ns();
    pthread_mutex_lock(&mu);
    if (current != NULL || (paused_until_ns && now_ns() < paused_until_ns) ||
        ensure_helper() != 0) {
        pthread_mutex_unlock(&mu);
        memmove(dst, src, n);
        return;
    }
    shared_job job;
    job.dst = dst;
    job.src = src;
    job.piece = (n / 16) & ~(size_t)4095;
    if (job.piece < PIECE_MIN) {
        job.piece = PIECE_MIN;
    }
    job.front = (n / 2) & ~(size_t)4095;
    job.back = n;
    job.busy = 0;
    job.waiting = 0;
    current = &job;
    generation++;
    pthread_cond_signal(&job_posted);
    size_t first = job.front;
    unsigned caller_delay = caller_delay_us;
    pthread_mutex_unlock(&mu);

    if (caller_delay) {
        sleep_us(caller_delay);
    }
    memcpy(dst, src, first);

    int64_t waited = -1; /* -1: the helper took no part */
    pthread_mutex_lock(&mu);
    for (;;) {
        if (job.front >= job.back) {
            if (job.busy) {
                int64_t t0 = now_ns();
                job.waiting = 1;
                while (job.busy) {
                    pthread_cond_wait(&piece_done, &mu);
                }
                waited = now_ns() - t0;
            } else if (job.back < n) {
                waited = 0;
            }
            break;
        }
        size_t start = job.front;
        size_t end = start + job.piece < job.back ? start + job.piece : job.back;
        job.front = end;
        pthread_mutex_unlock(&mu);
        memcpy(dst + start, src + start, end - start);
        pthread_mutex_lock(&mu);
    }
    current = NULL; /* nothing is left for a late helper; it lets go of `job` */
    /* A stall (see the top of this file): waited for the helper, or ran long. */
    size_t helper_bytes = n - job.front; /* the caller's share ends at job.front */
    int64_t slow = STALL_NS + (int64_t)(n >> 2);
    if (waited > STALL_NS || (helper_bytes < n / 4 && now_ns() - t_start > slow)) {
        n_stalls++;
        int64_t pause = ISOLATED_PAUSE_NS;
        if (shared_since_stall < RECUR_WINDOW) {
            stall_streak++;
            int shift = stall_streak - 1 < 10 ? stall_streak - 1 : 10;
            pause = RECUR_PAUSE_NS << shift;
            if (pause > MAX_PAUSE_NS) {
                pause = MAX_PAUSE_NS;
            }
        } else {
            stall_streak = 0;
        }
        shared_since_stall = 0;
        paused_until_ns = now_ns() + pause;
    } else if (waited >= 0 && shared_since_stall < RECUR_WINDOW) {
        shared_since_stall++;
    }
    pthread_mutex_unlock(&mu);
}

static PyObject *
copy_shared(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "copy_shared(dst, src, n) takes 3 arguments");
        return NULL;
    }
    uintptr_t dst = (uintptr_t)PyLong_AsVoidPtr(args[0]);
    if (PyErr_Occurred()) {
        return NULL;
    }
    uintptr_t src = (uintptr_t)PyLong_AsVoidPtr(args[1]);
    if (PyErr_Occurred()) {
        return NULL;
    }
    Py_ssize_t n = PyLong_AsSsize_t(args[2]);
    if (n == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (n < 0) {
        PyErr_SetString(PyExc_ValueError, "copy_shared: negative size");
        return NULL;
    }
    if (n == 0) {
        Py_RETURN_NONE;
    }
    int overlap = !(dst >= src + (size_t)n || src >= dst + (size_t)n);
    Py_BEGIN_ALLOW_THREADS
    if (overlap || (size_t)n < 2 * PIECE_MIN) {
        memmove((char *)dst, (const char *)src, (size_t)n);
    } else {
        shared_copy((char *)dst, (const char *)src, (size_t)n);
    }
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *
copy_stats(PyObject *module, PyObject *unused)
{
    (void)module;
    (void)unused;
    unsigned long long helped, stalls;
    int64_t paused;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&mu);
    helped = n_helped;
    stalls = n_stalls;
    paused = paused_until_ns ? paused_until_ns - now_ns() : 0;
    pthread_mutex_unlock(&mu);
    Py_END_ALLOW_THREADS
    return Py_BuildValue("(KKd)", helped, stalls, paused > 0 ? (double)paused / 1e9 : 0.0);
}

static PyObject *
copy_debug(PyObject *module, PyObject *args)
{
    (void)module;
    unsigned int claim_us, piece_us, caller_us = 0;
    if (!PyArg_ParseTuple(args, "II|I", &claim_us, &piece_us, &caller_us)) {
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&mu);
    claim_delay_us = claim_us;
    piece_delay_us = piece_us;
    caller_delay_us = caller_us;
    pthread_mutex_unlock(&mu);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *
copy_reset(PyObject *module, PyObject *unused)
{
    (void)module;
    (void)unused;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&mu);
    stall_streak = 0;
    shared_since_stall = RECUR_WINDOW;
    paused_until_ns = 0;
    pthread_mutex_unlock(&mu);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------ device read turns */

#define TURNS_NAME "lmcache_core._speedups.turns"

typedef struct read_job {
    struct read_job *next;
    int fd;
    const struct iovec *iov;
    int cnt;
    off_t off;
    ssize_t got;
    int err;
    int done;          /* guarded by the turns' mutex */
    pthread_cond_t cv; /* signalled (under the mutex) when done */
} read_job;

typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t posted;  /* a job was queued, or stop */
    pthread_cond_t gone;    /* the last reader thread exited */
    read_job *head, *tail;
    int n;                  /* reader threads at most: the turns */
    int live;               /* reader threads running */
    int idle;               /* of those, waiting for a job */
    int wakes;              /* idle threads signalled for a job and not yet awake */
    int reading;            /* reads on the device now */
    int stop;
    int idle_ms;            /* a reader thread idle this long exits */
    unsigned long long reads;
    pid_t pid;              /* the process the threads and the queue belong to */
} read_turns;

static void
turns_init_sync(read_turns *t)
{
    pthread_mutex_init(&t->mu, NULL);
    pthread_cond_init(&t->posted, NULL);
    pthread_cond_init(&t->gone, NULL);
    t->head = t->tail = NULL;
    t->live = t->idle = t->wakes = t->reading = t->stop = 0;
    t->pid = getpid();
}

static void *
turns_reader(void *arg)
{
    read_turns *t = arg;
    pthread_mutex_lock(&t->mu);
    for (;;) {
        if (t->head == NULL) {
            if (t->stop) {
                break;
            }
            struct timespec until;
            clock_gettime(CLOCK_REALTIME, &until);
            int64_t ns = until.tv_nsec + (int64_t)t->idle_ms * 1000000LL;
            until.tv_sec += (time_t)(ns / 1000000000LL);
            until.tv_nsec = (long)(ns % 1000000000LL);
            t->idle++;
            int rc = pthread_cond_timedwait(&t->posted, &t->mu, &until);
            t->idle--;
            if (t->wakes > 0) {
                t->wakes--;
            }
            if (rc == ETIMEDOUT && t->head == NULL) {
                break;
            }
            continue;
        }
        read_job *job = t->head;
        t->head = job->next;
        if (t->head == NULL) {
            t->tail = NULL;
        }
        t->reading++;
        pthread_mutex_unlock(&t->mu);
        ssize_t got;
        do {
            got = preadv(job->fd, job->iov, job->cnt, job->off);
        } while (got < 0 && errno == EINTR);
        int err = got < 0 ? errno : 0;
        pthread_mutex_lock(&t->mu);
        t->reading--;
        t->reads++;
        job->got = got;
        job->err = err;
        job->done = 1;
        pthread_cond_signal(&job->cv);
    }
    t->live--;
    if (t->live == 0) {
        pthread_cond_broadcast(&t->gone);
    }
    pthread_mutex_unlock(&t->mu);
    return NULL;
}

/* Queue the read and wait for it (the GIL released, t->mu not held). */
static ssize_t
turns_read(read_turns *t, int fd, const struct iovec *iov, int cnt, off_t off, int *err)
{
    read_job job;
    memset(&job, 0, sizeof job);
    job.fd = fd;
    job.iov = iov;
    job.cnt = cnt;
    job.off = off;
    pthread_cond_init(&job.cv, NULL);
    pthread_mutex_lock(&t->mu);
    if (t->tail != NULL) {
        t->tail->next = &job;
    } else {
        t->head = &job;
    }
    t->tail = &job;
    if (t->idle > t->wakes) {
        /* an idle thread not yet asked for another job (two signals before the first
         * thread wakes would otherwise go to one thread, leaving a turn unused) */
        t->wakes++;
        pthread_cond_signal(&t->posted);
    } else if (t->live < t->n) {
        pthread_attr_t attr;
        pthread_t tid;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        pthread_attr_setstacksize(&attr, 256 * 1024);
        if (pthread_create(&tid, &attr, turns_reader, t) == 0) {
            t->live++;
        }
        pthread_attr_destroy(&attr);
    }
    if (t->live == 0) {
        /* no reader thread could be started: take the job back and read here */
        read_job **link = &t->head;
        read_job *prev = NULL;
        while (*link != &job) {
            prev = *link;
            link = &(*link)->next;
        }
        *link = job.next;
        if (t->tail == &job) {
            t->tail = prev;
        }
        pthread_mutex_unlock(&t->mu);
        do {
            job.got = preadv(fd, iov, cnt, off);
        } while (job.got < 0 && errno == EINTR);
        job.err = job.got < 0 ? errno : 0;
    } else {
        while (!job.done) {
            pthread_cond_wait(&job.cv, &t->mu);
        }
        pthread_mutex_unlock(&t->mu);
    }
    pthread_cond_destroy(&job.cv);
    *err = job.err;
    return job.got;
}

static void
turns_free(PyObject *capsule)
{
    read_turns *t = PyCapsule_GetPointer(capsule, TURNS_NAME);
    if (t == NULL) {
        return;
    }
    if (t->pid == getpid()) {
        /* No job can be queued (every caller holds a reference to the capsule), so the
         * reader threads are idle: they exit as soon as they see stop. They never take
         * the GIL, which is kept here (this may run during finalization). */
        pthread_mutex_lock(&t->mu);
        t->stop = 1;
        pthread_cond_broadcast(&t->posted);
        while (t->live > 0) {
            pthread_cond_wait(&t->gone, &t->mu);
        }
        pthread_mutex_unlock(&t->mu);
        pthread_cond_destroy(&t->posted);
        pthread_cond_destroy(&t->gone);
        pthread_mutex_destroy(&t->mu);
    }
    PyMem_RawFree(t);
}

static PyObject *
turns_new(PyObject *module, PyObject *args)
{
    (void)module;
    int n, idle_ms = 2000;
    if (!PyArg_ParseTuple(args, "i|i", &n, &idle_ms)) {
        return NULL;
    }
    if (n < 1 || n > 1024 || idle_ms < 1) {
        PyErr_SetString(PyExc_ValueError, "turns_new: n must be in 1..1024, idle_ms >= 1");
        return NULL;
    }
    read_turns *t = PyMem_RawCalloc(1, sizeof(read_turns));
    if (t == NULL) {
        return PyErr_NoMemory();
    }
    t->n = n;
    t->idle_ms = idle_ms;
    turns_init_sync(t);
    PyObject *capsule = PyCapsule_New(t, TURNS_NAME, turns_free);
    if (capsule == NULL) {
        PyMem_RawFree(t);
    }
    return capsule;
}

static read_turns *
turns_get(PyObject *capsule)
{
    read_turns *t = PyCapsule_GetPointer(capsule, TURNS_NAME);
    if (t != NULL && t->pid != getpid()) {
        /* a forked child: the parent's reader threads and queued jobs do not exist
         * here, and its mutex may have been copied locked */
        turns_init_sync(t);
    }
    return t;
}

static PyObject *
turns_preadv(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError,
                        "turns_preadv(turns, fd, buffers, offset) takes 4 arguments");
        return NULL;
    }
    read_turns *t = turns_get(args[0]);
    if (t == NULL) {
        return NULL;
    }
    int fd = PyObject_AsFileDescriptor(args[1]);
    if (fd < 0) {
        return NULL;
    }
    long long off = PyLong_AsLongLong(args[3]);
    if (off == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (off < 0) {
        PyErr_SetString(PyExc_ValueError, "turns_preadv: negative offset");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(args[2], "turns_preadv: buffers must be a sequence");
    if (seq == NULL) {
        return NULL;
    }
    Py_ssize_t cnt = PySequence_Fast_GET_SIZE(seq);
    if (cnt == 0) {
        Py_DECREF(seq);
        return PyLong_FromLong(0);
    }
    if (cnt > IOV_MAX) {
        Py_DECREF(seq);
        errno = EINVAL;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    Py_buffer *views = PyMem_Calloc((size_t)cnt, sizeof(Py_buffer));
    struct iovec *iov = PyMem_Calloc((size_t)cnt, sizeof(struct iovec));
    Py_ssize_t held = 0;
    PyObject *result = NULL;
    if (views == NULL || iov == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (; held < cnt; held++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, held);
        if (PyObject_GetBuffer(item, &views[held], PyBUF_WRITABLE) != 0) {
            goto done;
        }
        iov[held].iov_base = views[held].buf;
        iov[held].iov_len = (size_t)views[held].len;
    }
    ssize_t got;
    int err = 0;
    Py_BEGIN_ALLOW_THREADS
    got = turns_read(t, fd, iov, (int)cnt, (off_t)off, &err);
    Py_END_ALLOW_THREADS
    if (got < 0) {
        errno = err;
        PyErr_SetFromErrno(PyExc_OSError);
        goto done;
    }
    result = PyLong_FromSsize_t((Py_ssize_t)got);
done:
    for (Py_ssize_t i = 0; i < held; i++) {
        PyBuffer_Release(&views[i]);
    }
    PyMem_Free(views);
    PyMem_Free(iov);
    Py_DECREF(seq);
    return result;
}

static PyObject *
turns_stats(PyObject *module, PyObject *capsule)
{
    (void)module;
    read_turns *t = turns_get(capsule);
    if (t == NULL) {
        return NULL;
    }
    int live, queued = 0, reading;
    unsigned long long reads;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&t->mu);
    live = t->live;
    reading = t->reading;
    reads = t->reads;
    for (read_job *j = t->head; j != NULL; j = j->next) {
        queued++;
    }
    pthread_mutex_unlock(&t->mu);
    Py_END_ALLOW_THREADS
    return Py_BuildValue("(iiiiK)", t->n, live, queued, reading, reads);
}

static int fork_handler_set;


/* ------------------------------------------------------------------ sync_fds */
#define SYNC_MAX_THREADS 64

typedef struct {
    const int *fds;
    const char *datasync;
    int *errs;
    Py_ssize_t n;
    Py_ssize_t next; /* next call to take (atomic) */
} sync_wave;

static void
sync_wave_work(sync_wave *w)
{
    for (;;) {
        Py_ssize_t i = __atomic_fetch_add(&w->next, 1, __ATOMIC_RELAXED);
        if (i >= w->n) {
            return;
        }
        int rc = w->datasync[i] ? fdatasync(w->fds[i]) : fsync(w->fds[i]);
        w->errs[i] = rc == 0 ? 0 : errno;
    }
}

static void *
sync_wave_thread(void *arg)
{
    sync_wave_work((sync_wave *)arg);
    return NULL;
}

static PyObject *
sync_fds(PyObject *module, PyObject *args)
{
    (void)module;
    PyObject *fds_obj, *data_obj;
    if (!PyArg_ParseTuple(args, "OO:sync_fds", &fds_obj, &data_obj)) {
        return NULL;
    }
    PyObject *fseq = PySequence_Fast(fds_obj, "sync_fds: fds must be a sequence");
    if (fseq == NULL) {
        return NULL;
    }
    PyObject *dseq = PySequence_Fast(data_obj, "sync_fds: datasync must be a sequence");
    if (dseq == NULL) {
        Py_DECREF(fseq);
        return NULL;
    }
    PyObject *result = NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fseq);
    int *fds = NULL, *errs = NULL;
    char *datasync = NULL;
    if (PySequence_Fast_GET_SIZE(dseq) != n) {
        PyErr_SetString(PyExc_ValueError, "sync_fds: fds and datasync differ in length");
        goto done;
    }
    fds = PyMem_Calloc((size_t)n + 1, sizeof(int));
    errs = PyMem_Calloc((size_t)n + 1, sizeof(int));
    datasync = PyMem_Calloc((size_t)n + 1, 1);
    if (fds == NULL || errs == NULL || datasync == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        fds[i] = PyObject_AsFileDescriptor(PySequence_Fast_GET_ITEM(fseq, i));
        if (fds[i] < 0) {
            goto done;
        }
        int truth = PyObject_IsTrue(PySequence_Fast_GET_ITEM(dseq, i));
        if (truth < 0) {
            goto done;
        }
        datasync[i] = (char)truth;
    }
    sync_wave w = {fds, datasync, errs, n, 0};
    Py_BEGIN_ALLOW_THREADS
    pthread_t threads[SYNC_MAX_THREADS];
    int started = 0;
    Py_ssize_t want = n - 1 < SYNC_MAX_THREADS ? n - 1 : SYNC_MAX_THREADS;
    pthread_attr_t attr;
    int have_attr = pthread_attr_init(&attr) == 0;
    if (have_attr) {
        pthread_attr_setstacksize(&attr, 64 * 1024);
    }
    for (; started < want; started++) {
        if (pthread_create(&threads[started], have_attr ? &attr : NULL, sync_wave_thread,
                           &w) != 0) {
            break; /* the caller and the threads already started take the rest */
        }
    }
    if (have_attr) {
        pthread_attr_destroy(&attr);
    }
    sync_wave_work(&w);
    for (int i = 0; i < started; i++) {
        pthread_join(threads[i], NULL);
    }
    Py_END_ALLOW_THREADS
    result = PyList_New(n);
    if (result == NULL) {
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *v = PyLong_FromLong(errs[i]);
        if (v == NULL) {
            Py_CLEAR(result);
            goto done;
        }
        PyList_SET_ITEM(result, i, v);
    }
done:
    PyMem_Free(fds);
    PyMem_Free(errs);
    PyMem_Free(datasync);
    Py_DECREF(fseq);
    Py_DECREF(dseq);
    return result;
}

static PyMethodDef speedups_methods[] = {
    {"int32_le", int32_le, METH_O,
     "int32_le(tokens) -> bytes | None: int32 little-endian bytes of a list or tuple of "
     "exact ints in the int32 range; None for any other input."},
    {"copy_shared", (PyCFunction)(void (*)(void))copy_shared, METH_FASTCALL,
     "copy_shared(dst, src, n): copy n bytes between host addresses, the GIL released, "
     "shared with a helper thread when large enough and not overlapping."},
    {"copy_stats", copy_stats, METH_NOARGS,
     "copy_stats() -> (helped, stalls, paused_s): copies the helper took part in, waits "
     "over 1 ms for it, seconds left of the current pause of sharing."},
    {"copy_debug", copy_debug, METH_VARARGS,
     "copy_debug(claim_delay_us, piece_delay_us[, caller_delay_us]): make the helper or "
     "the caller of a shared copy slow (tests only)."},
    {"copy_reset", copy_reset, METH_NOARGS, "copy_reset(): end a pause of sharing."},
    {"turns_new", turns_new, METH_VARARGS,
     "turns_new(n[, idle_ms]) -> capsule: a device's read queue with at most n reader "
     "threads (each exits after idle_ms without a job; default 2000)."},
    {"turns_preadv", (PyCFunction)(void (*)(void))turns_preadv, METH_FASTCALL,
     "turns_preadv(turns, fd, buffers, offset) -> int: os.preadv by one of the queue's "
     "reader threads; the caller waits with the GIL released."},
    {"turns_stats", turns_stats, METH_O,
     "turns_stats(turns) -> (n, threads, queued, reading, reads)."},
    {"sync_fds", sync_fds, METH_VARARGS,
     "sync_fds(fds, datasync) -> list of errno: fsync/fdatasync every fd at once."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef speedups_module = {
    PyModuleDef_HEAD_INIT,
    "lmcache_core._speedups",
    "Optional compiled helpers of lmcache_core (pure-Python fallbacks give identical results).",
    0,
    speedups_methods,
    NULL,
    NULL,
    NULL,
    NULL,
};

PyMODINIT_FUNC
PyInit__speedups(void)
{
    if (!fork_handler_set) {
        if (pthread_atfork(before_fork, after_fork_parent, after_fork_child) != 0) {
            PyErr_SetString(PyExc_OSError, "pthread_atfork failed");
            return NULL;
        }
        fork_handler_set = 1;
    }
    return PyModuleDef_Init(&speedups_module);
}
