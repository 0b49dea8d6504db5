/* igemm's launch step in C: a launch record's argument binds and cuLaunchKernel calls, for conv plan calls
 * (launch), for a converted model's whole inference forward (program: igemm/nn/_program.py) and for every other
 * launcher (raw; coop for a cooperative one). A CPython extension, built on first use
 * by igemm/_hostlaunch.py with the host C compiler; no CUDA headers: the driver's cuLaunchKernel,
 * cuLaunchCooperativeKernel, cuCtxGetCurrent, cuEventRecord and cuStreamWaitEvent are found with dlsym in the
 * libcuda.so.1 the process has loaded (init), or set by set_driver (the CPU tests' stand-ins).
 * Why C: the same binds through cuda.bindings cost a conv plan call ~1.8x the host time relative to PyTorch's
 * own call (docs/performance.md: host-c-bind-step).
 *
 * A launch record is a bytes object of int64 fields, written once per plan variant by
 * igemm/conv/_launch.py (LaunchRecord._pack), which also runs the same record without this module:
 *   [0] number of steps (1..MAX_STEPS), then per step:
 *   CUfunction, kernelParams (void**), the argument buffer (uint64 slots), grid[3], block[3], shared memory,
 *   the number of binds (0..MAX_BINDS), then per bind: slot, source, base  ->  buffer[slot] = base + value,
 *   value = {0, x, w, y, residual, mask}[source].
 * The steps launch in order on one stream (a preparation's copies, then the conv). A program is a record of up
 * to MAX_PROGRAM steps whose binds take their values from the tuple it is called with (source i: vals[i]).
 * A step whose CUfunction is 0 is a stream step (no binds), grid[0] the operation, grid[1] a CUevent and grid[2]
 * a second stream: FORK records the event on the call's stream, makes the second stream wait for it and
 * launches the next steps there; MAIN launches the next steps on the call's stream again; JOIN records the
 * event on the second stream and makes the call's stream wait for it (a branch of a program running beside
 * the steps after it: igemm/nn/_program.py).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <stdint.h>
#include <string.h>

typedef int (*cu_launch_t)(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                           unsigned bz, unsigned smem, void *stream, void **params, void **extra);
typedef int (*cu_coop_t)(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                         unsigned smem, void *stream, void **params);
typedef int (*cu_ctx_get_t)(void **ctx);
typedef int (*cu_record_t)(void *event, void *stream);
typedef int (*cu_wait_t)(void *stream, void *event, unsigned flags);

static cu_launch_t g_launch = NULL;
static cu_coop_t g_coop = NULL;   /* NULL with a stand-in driver that has none: coop goes through g_launch */
static cu_ctx_get_t g_ctx_get = NULL;
static cu_record_t g_record = NULL;
static cu_wait_t g_wait = NULL;

enum { STEP = 11, BIND = 3, MAX_STEPS = 4, MAX_BINDS = 16, SOURCES = 6, MAX_PROGRAM = 4096, MAX_SOURCES = 64 };
enum { FORK = 1, MAIN = 2, JOIN = 3 };

static int read_u64(PyObject *o, uint64_t *v) {
    *v = PyLong_AsUnsignedLongLong(o);
    return !(*v == (uint64_t)-1 && PyErr_Occurred());
}

static int launch_step(const int64_t *d, void *stream) {
    return g_launch((void *)(uintptr_t)d[0], (unsigned)d[3], (unsigned)d[4], (unsigned)d[5], (unsigned)d[6],
                    (unsigned)d[7], (unsigned)d[8], (unsigned)d[9], stream, (void **)(uintptr_t)d[1], NULL);
}

/* The record's steps with these values: -1 (exception set) for a malformed record, else the first failing
 * CUresult (0: every step launched). Nothing is written for a malformed record: it is checked whole first. */
static int run_record(PyObject *rec, void *stream, const uint64_t *vals, int64_t max_steps, int64_t sources) {
    const Py_ssize_t nbytes = PyBytes_GET_SIZE(rec);
    const int64_t *r = (const int64_t *)PyBytes_AS_STRING(rec);
    const Py_ssize_t n = nbytes / 8;
    if (nbytes % 8 || n < 1 || r[0] < 1 || r[0] > max_steps)
        goto bad;
    Py_ssize_t at = 1;
    for (int64_t s = 0; s < r[0]; ++s) {     /* the shape: every step and bind inside the record */
        if (at + STEP > n || r[at + 10] < 0 || r[at + 10] > MAX_BINDS)
            goto bad;
        const int64_t nb = r[at + 10];
        if (r[at] == 0 && (r[at + 3] < FORK || r[at + 3] > JOIN || nb != 0))
            goto bad;
        if (r[at] == 0 && (g_record == NULL || g_wait == NULL)) {
            PyErr_SetString(PyExc_RuntimeError,
                            "igemm launch: a stream step needs cuEventRecord and cuStreamWaitEvent");
            return -1;
        }
        at += STEP;
        if (at + BIND * nb > n)
            goto bad;
        for (int64_t b = 0; b < nb; ++b)
            if (r[at + BIND * b] < 0 || r[at + BIND * b + 1] < 0 || r[at + BIND * b + 1] >= sources)
                goto bad;
        at += BIND * nb;
    }
    if (at != n)
        goto bad;
    at = 1;
    void *cur = stream;
    for (int64_t s = 0; s < r[0]; ++s) {
        const int64_t *d = r + at;
        if (d[0] == 0) {                         /* a stream step */
            void *event = (void *)(uintptr_t)d[4], *side = (void *)(uintptr_t)d[5];
            int err = 0;
            if (d[3] == FORK) {
                err = g_record(event, stream);
                if (!err)
                    err = g_wait(side, event, 0);
                cur = side;
            } else if (d[3] == JOIN) {
                err = g_record(event, side);
                if (!err)
                    err = g_wait(stream, event, 0);
                cur = stream;
            } else {
                cur = stream;
            }
            if (err)
                return err;
            at += STEP;
            continue;
        }
        uint64_t *u = (uint64_t *)(uintptr_t)d[2];
        const int64_t *b = d + STEP;
        for (int64_t i = 0; i < d[10]; ++i, b += BIND)
            u[b[0]] = (uint64_t)b[2] + vals[b[1]];
        const int err = launch_step(d, cur);
        if (err)
            return err;
        at += STEP + BIND * d[10];
    }
    return 0;
bad:
    PyErr_SetString(PyExc_ValueError, "igemm launch: malformed launch record");
    return -1;
}

static int have_driver(void) {
    if (g_launch == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "igemm launch: no cuLaunchKernel (init() found no driver)");
        return 0;
    }
    return 1;
}

/* launch(rec: bytes, stream, x, w, y, residual, mask) -> CUresult (0: launched) */
static PyObject *hl_launch(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 7 || !PyBytes_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "launch(rec: bytes, stream, x, w, y, residual, mask)");
        return NULL;
    }
    if (!have_driver())
        return NULL;
    uint64_t stream, vals[SOURCES] = {0};
    if (!read_u64(args[1], &stream))
        return NULL;
    for (int i = 1; i < SOURCES; ++i)
        if (!read_u64(args[i + 1], &vals[i]))
            return NULL;
    const int err = run_record(args[0], (void *)(uintptr_t)stream, vals, MAX_STEPS, SOURCES);
    return err < 0 ? NULL : PyLong_FromLong(err);
}

/* program(rec: bytes, stream, vals: tuple of ints) -> CUresult (0: every step launched) */
static PyObject *hl_program(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 3 || !PyBytes_Check(args[0]) || !PyTuple_Check(args[2])
            || PyTuple_GET_SIZE(args[2]) > MAX_SOURCES) {
        PyErr_SetString(PyExc_TypeError, "program(rec: bytes, stream, vals: tuple of at most 64 ints)");
        return NULL;
    }
    if (!have_driver())
        return NULL;
    uint64_t stream, vals[MAX_SOURCES] = {0};
    const Py_ssize_t nv = PyTuple_GET_SIZE(args[2]);
    if (!read_u64(args[1], &stream))
        return NULL;
    for (Py_ssize_t i = 0; i < nv; ++i)
        if (!read_u64(PyTuple_GET_ITEM(args[2], i), &vals[i]))
            return NULL;
    const int err = run_record(args[0], (void *)(uintptr_t)stream, vals, MAX_PROGRAM, nv);
    return err < 0 ? NULL : PyLong_FromLong(err);
}

/* The ten arguments of raw / coop as int64 (0 with an exception set where one is not an int). */
static int read_launch(PyObject *const *args, Py_ssize_t nargs, const char *sig, int64_t d[10]) {
    if (nargs != 10) {
        PyErr_SetString(PyExc_TypeError, sig);
        return 0;
    }
    if (!have_driver())
        return 0;
    uint64_t v;
    for (int i = 0; i < 10; ++i) {
        if (!read_u64(args[i], &v))
            return 0;
        d[i] = (int64_t)v;
    }
    return 1;
}

/* One cuLaunchKernel of raw's ten arguments, as a launch step with no binds. */
static PyObject *plain_launch(const int64_t d[10]) {
    const int64_t step[STEP] = {d[0], d[9], 0, d[1], d[2], d[3], d[4], d[5], d[6], d[7], 0};
    return PyLong_FromLong(launch_step(step, (void *)(uintptr_t)d[8]));
}

/* raw(func, gx, gy, gz, bx, by, bz, smem, stream, params) -> CUresult: one cuLaunchKernel */
static PyObject *hl_raw(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    int64_t d[10];
    if (!read_launch(args, nargs, "raw(func, gx, gy, gz, bx, by, bz, smem, stream, params)", d))
        return NULL;
    return plain_launch(d);
}

/* coop(func, gx, gy, gz, bx, by, bz, smem, stream, params) -> CUresult: one cuLaunchCooperativeKernel (the grid
 * resident at once: a kernel with grid barriers) */
static PyObject *hl_coop(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    int64_t d[10];
    if (!read_launch(args, nargs, "coop(func, gx, gy, gz, bx, by, bz, smem, stream, params)", d))
        return NULL;
    if (g_coop == NULL)                     /* (a stand-in driver: through its launch) */
        return plain_launch(d);
    return PyLong_FromLong(g_coop((void *)(uintptr_t)d[0], (unsigned)d[1], (unsigned)d[2], (unsigned)d[3],
                                  (unsigned)d[4], (unsigned)d[5], (unsigned)d[6], (unsigned)d[7],
                                  (void *)(uintptr_t)d[8], (void **)(uintptr_t)d[9]));
}

/* ctx() -> the calling thread's current CUcontext as an int (0: none) */
static PyObject *hl_ctx(PyObject *self, PyObject *noargs) {
    (void)self;
    (void)noargs;
    if (g_ctx_get == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "igemm launch: no cuCtxGetCurrent (init() found no driver)");
        return NULL;
    }
    void *c = NULL;
    if (g_ctx_get(&c))
        c = NULL;
    return PyLong_FromUnsignedLongLong((uint64_t)(uintptr_t)c);
}

/* init() -> True when the loaded libcuda.so.1 provides the five entry points (it is not loaded here) */
static PyObject *hl_init(PyObject *self, PyObject *noargs) {
    (void)self;
    (void)noargs;
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (lib != NULL) {
        g_launch = (cu_launch_t)dlsym(lib, "cuLaunchKernel");
        g_coop = (cu_coop_t)dlsym(lib, "cuLaunchCooperativeKernel");
        g_ctx_get = (cu_ctx_get_t)dlsym(lib, "cuCtxGetCurrent");
        g_record = (cu_record_t)dlsym(lib, "cuEventRecord");
        g_wait = (cu_wait_t)dlsym(lib, "cuStreamWaitEvent");
        dlclose(lib);   /* (NOLOAD took a reference; the process's own keeps it loaded) */
    }
    return PyBool_FromLong(g_launch != NULL && g_coop != NULL && g_ctx_get != NULL && g_record != NULL
                           && g_wait != NULL);
}

/* set_driver(launch_address, ctx_address[, record_address, wait_address]): stand-in entry points (function
 * pointers as ints; no record and wait: stream steps fail); coop launches go through the launch stand-in */
static PyObject *hl_set_driver(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    uint64_t a, c, e = 0, w = 0;
    if (nargs != 2 && nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "set_driver(launch_address, ctx_address[, record_address, wait_address])");
        return NULL;
    }
    if (!read_u64(args[0], &a) || !read_u64(args[1], &c)
            || (nargs == 4 && (!read_u64(args[2], &e) || !read_u64(args[3], &w))))
        return NULL;
    g_launch = (cu_launch_t)(uintptr_t)a;
    g_coop = NULL;
    g_ctx_get = (cu_ctx_get_t)(uintptr_t)c;
    g_record = (cu_record_t)(uintptr_t)e;
    g_wait = (cu_wait_t)(uintptr_t)w;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"launch", (PyCFunction)(void (*)(void))hl_launch, METH_FASTCALL, "a launch record's binds and launches"},
    {"program", (PyCFunction)(void (*)(void))hl_program, METH_FASTCALL, "a program's binds and launches"},
    {"raw", (PyCFunction)(void (*)(void))hl_raw, METH_FASTCALL, "one cuLaunchKernel"},
    {"coop", (PyCFunction)(void (*)(void))hl_coop, METH_FASTCALL, "one cuLaunchCooperativeKernel"},
    {"ctx", hl_ctx, METH_NOARGS, "the current context as an int"},
    {"init", hl_init, METH_NOARGS, "find the driver's entry points"},
    {"set_driver", (PyCFunction)(void (*)(void))hl_set_driver, METH_FASTCALL, "stand-in entry points"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "igemm_hostlaunch", NULL, -1, methods,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit_igemm_hostlaunch(void) { return PyModule_Create(&module); }
