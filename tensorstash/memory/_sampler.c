/* The peak sampler: a thread that reads the process's resident set without the GIL
 * (NOTE [ Real memory ] in _memory.py, rule 1).
 *
 * A step's real peak is taken without touching the counters a user reads
 * (VmHWM, getrusage's ru_maxrss): a native thread reads /proc/self/statm
 * every `interval` seconds and keeps the most it saw. It holds no Python
 * object and never takes the interpreter's lock, so it samples while the
 * training thread runs Python as well as while a kernel runs.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

typedef struct {
    PyObject_HEAD
    pthread_t thread;
    int running;
    pid_t owner; /* the process that started the thread: a forked child has none */
    int fd;
    long page;
    struct timespec interval;
    atomic_int stop;
    atomic_llong most;
    atomic_llong samples;
} SamplerObject;

/* The resident set in bytes, or -1: the second field of /proc/self/statm, in pages. */
static long long resident(int fd, long page) {
    char buf[160];
    ssize_t n = pread(fd, buf, sizeof(buf) - 1, 0);
    if (n <= 0) {
        return -1;
    }
    buf[n] = '\0';
    char *p = buf;
    while (*p && *p != ' ') {
        p++;
    }
    if (*p != ' ') {
        return -1;
    }
    return strtoll(p + 1, NULL, 10) * page;
}

static void note(SamplerObject *self) {
    long long now = resident(self->fd, self->page);
    long long most = atomic_load_explicit(&self->most, memory_order_relaxed);
    while (now > most &&
           !atomic_compare_exchange_weak_explicit(&self->most, &most, now, memory_order_relaxed,
                                                  memory_order_relaxed)) {
    }
    atomic_fetch_add_explicit(&self->samples, 1, memory_order_relaxed);
}

static void *run(void *arg) {
    SamplerObject *self = (SamplerObject *)arg;
    while (!atomic_load_explicit(&self->stop, memory_order_acquire)) {
        note(self);
        struct timespec left = self->interval;
        while (nanosleep(&left, &left) != 0 && errno == EINTR) {
        }
    }
    return NULL;
}

static int Sampler_init(SamplerObject *self, PyObject *args, PyObject *kwds) {
    static char *names[] = {"interval_s", NULL};
    double interval = 0.0005;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|d", names, &interval)) {
        return -1;
    }
    if (!(interval > 0 && interval < 1)) {
        PyErr_Format(PyExc_ValueError,
                     "tensorstash: the peak sampler's interval must be in (0, 1) seconds; got %R",
                     PyTuple_GET_ITEM(args, 0));
        return -1;
    }
    self->interval.tv_sec = 0;
    self->interval.tv_nsec = (long)(interval * 1e9);
    self->page = sysconf(_SC_PAGESIZE);
    if (self->fd < 0) {
        self->fd = open("/proc/self/statm", O_RDONLY | O_CLOEXEC);
        if (self->fd < 0) {
            PyErr_SetFromErrnoWithFilename(PyExc_OSError, "/proc/self/statm");
            return -1;
        }
    }
    return 0;
}

static PyObject *Sampler_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    SamplerObject *self = (SamplerObject *)type->tp_alloc(type, 0);
    if (self != NULL) {
        self->fd = -1;
        self->running = 0;
        atomic_init(&self->stop, 0);
        atomic_init(&self->most, 0);
        atomic_init(&self->samples, 0);
    }
    return (PyObject *)self;
}

static void join(SamplerObject *self) {
    if (!self->running) {
        return;
    }
    if (self->owner != getpid()) {
        self->running = 0; /* started before a fork: the thread is the parent's */
        return;
    }
    atomic_store_explicit(&self->stop, 1, memory_order_release);
    Py_BEGIN_ALLOW_THREADS pthread_join(self->thread, NULL);
    Py_END_ALLOW_THREADS self->running = 0;
}

static PyObject *Sampler_start(SamplerObject *self, PyObject *unused) {
    join(self);
    atomic_store(&self->most, 0);
    atomic_store(&self->samples, 0);
    atomic_store(&self->stop, 0);
    note(self);
    int failed = pthread_create(&self->thread, NULL, run, self);
    if (failed) {
        errno = failed;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    self->running = 1;
    self->owner = getpid();
    Py_RETURN_NONE;
}

static PyObject *Sampler_stop(SamplerObject *self, PyObject *unused) {
    join(self);
    note(self);
    return PyLong_FromLongLong(atomic_load(&self->most));
}

static PyObject *Sampler_peak(SamplerObject *self, PyObject *unused) {
    note(self);
    return PyLong_FromLongLong(atomic_load(&self->most));
}

static PyObject *Sampler_samples(SamplerObject *self, void *closure) {
    return PyLong_FromLongLong(atomic_load(&self->samples));
}

static PyObject *Sampler_running(SamplerObject *self, void *closure) {
    return PyBool_FromLong(self->running && self->owner == getpid());
}

static void Sampler_dealloc(SamplerObject *self) {
    join(self);
    if (self->fd >= 0) {
        close(self->fd);
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef Sampler_methods[] = {
    {"start", (PyCFunction)Sampler_start, METH_NOARGS,
     "Sample from now (the most seen starts at the resident set now)."},
    {"stop", (PyCFunction)Sampler_stop, METH_NOARGS,
     "Stop sampling; the most resident bytes seen, this moment's included."},
    {"peak", (PyCFunction)Sampler_peak, METH_NOARGS,
     "The most resident bytes seen so far, this moment's included (sampling goes on)."},
    {NULL},
};

static PyGetSetDef Sampler_getset[] = {
    {"samples", (getter)Sampler_samples, NULL, "How many readings were taken.", NULL},
    {"running", (getter)Sampler_running, NULL, "Whether the thread samples now.", NULL},
    {NULL},
};

static PyTypeObject SamplerType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "tensorstash.memory._sampler.Sampler",
    .tp_basicsize = sizeof(SamplerObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Sampler(interval_s=0.0005): the most resident bytes a native thread read "
              "between start() and stop(), without the GIL and without resetting VmHWM.",
    .tp_new = Sampler_new,
    .tp_init = (initproc)Sampler_init,
    .tp_dealloc = (destructor)Sampler_dealloc,
    .tp_methods = Sampler_methods,
    .tp_getset = Sampler_getset,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_sampler", "The peak sampler (see _memory.py).", -1, NULL,
};

PyMODINIT_FUNC PyInit__sampler(void) {
    if (PyType_Ready(&SamplerType) < 0) {
        return NULL;
    }
    PyObject *made = PyModule_Create(&module);
    if (made == NULL) {
        return NULL;
    }
    Py_INCREF(&SamplerType);
    if (PyModule_AddObject(made, "Sampler", (PyObject *)&SamplerType) < 0) {
        Py_DECREF(&SamplerType);
        Py_DECREF(made);
        return NULL;
    }
    return made;
}
