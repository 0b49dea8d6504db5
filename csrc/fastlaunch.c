/* igemm's host fast path: a plan call's pointer-slot writes and its cuLaunchKernel in one C call.
 *
 * Built on first use by igemm/_fastlaunch.py with the host C compiler (no CUDA headers: the driver's
 * cuLaunchKernel is found with dlsym in the libcuda the process has loaded, or set by set_launch()).
 * Python keeps every check; this only replaces, for one launch, the slot writes into the plan's packed
 * argument buffer and the cuda.bindings call (whose argument conversion costs microseconds).
 *
 * A launch record ("rec") is a bytes object of int64 fields, packed once per plan and launcher
 * (igemm/_fastlaunch.py:pack):
 *   [0] CUfunction  [1] kernelParams (void**)  [2] the argument buffer (uint64 slots)
 *   [3..5] grid  [6..8] block  [9] dynamic shared memory
 *   [10..14] slots of x, w, y, residual, mask (-1: none)
 *   [15] ia [16] oa [17] ib [18] ob: tensor-map address words (-1: none) written as oa + x, ob + w
 *   [19] cx [20] cw: the addresses the conv reads instead of x, w after its preparations (-1: x, w)
 *   [21] number of preparation launches (0..2), then per preparation 14 fields:
 *        CUfunction, kernelParams, buffer, grid[3], block[3], smem, slot0, slot1, sel0, sel1
 *        (sel: 0 -> 0, 1 -> x, 2 -> w: what the preparation's two slots receive).
 * launch(rec, stream, x, w, y, residual, mask) -> the CUresult (0: launched).
 * ctx() -> the current context as an int: a plan call's "is my context current" check, without
 * cuda.bindings' object for it.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <stdint.h>
#include <string.h>

typedef int (*cu_launch_t)(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                           unsigned bz, unsigned smem, void *stream, void **params, void **extra);

typedef int (*cu_ctx_get_t)(void **ctx);

static cu_launch_t g_launch = NULL;
static cu_ctx_get_t g_ctx_get = NULL;

enum { HEAD = 22, PREP = 14, MAX_PREP = 2 };

static int launch_one(const int64_t *d, void *stream) {
    return g_launch((void *)(uintptr_t)d[0], (unsigned)d[3], (unsigned)d[4], (unsigned)d[5], (unsigned)d[6],
                    (unsigned)d[7], (unsigned)d[8], (unsigned)d[9], stream, (void **)(uintptr_t)d[1], NULL);
}

static int read_u64(PyObject *o, uint64_t *v) {
    *v = PyLong_AsUnsignedLongLong(o);
    return !(*v == (uint64_t)-1 && PyErr_Occurred());
}

static PyObject *fl_launch(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 7 || !PyBytes_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "launch(rec: bytes, stream, x, w, y, residual, mask)");
        return NULL;
    }
    if (g_launch == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "igemm fast launch: no cuLaunchKernel (call init() first)");
        return NULL;
    }
    Py_ssize_t n = PyBytes_GET_SIZE(args[0]);
    int64_t r[HEAD + PREP * MAX_PREP];
    if (n < (Py_ssize_t)(HEAD * 8) || n > (Py_ssize_t)sizeof(r) || n % 8) {
        PyErr_SetString(PyExc_ValueError, "igemm fast launch: malformed launch record");
        return NULL;
    }
    memcpy(r, PyBytes_AS_STRING(args[0]), (size_t)n);
    if (r[21] < 0 || r[21] > MAX_PREP || n != (Py_ssize_t)(8 * (HEAD + PREP * r[21]))) {
        PyErr_SetString(PyExc_ValueError, "igemm fast launch: malformed launch record");
        return NULL;
    }
    uint64_t v[6];   /* stream, x, w, y, residual, mask */
    for (int i = 0; i < 6; ++i)
        if (!read_u64(args[i + 1], &v[i]))
            return NULL;
    void *stream = (void *)(uintptr_t)v[0];
    uint64_t x = v[1], w = v[2];
    for (int p = 0; p < r[21]; ++p) {   /* the preparations read the caller's x and w */
        const int64_t *d = r + HEAD + PREP * p;
        uint64_t *u = (uint64_t *)(uintptr_t)d[2];
        const uint64_t sel[3] = {0, x, w};
        u[d[10]] = sel[d[12] & 3];
        u[d[11]] = sel[d[13] & 3];
        int err = launch_one(d, stream);
        if (err)
            return PyLong_FromLong(err);
    }
    if (r[19] >= 0)
        x = (uint64_t)r[19];
    if (r[20] >= 0)
        w = (uint64_t)r[20];
    uint64_t *u = (uint64_t *)(uintptr_t)r[2];
    const uint64_t vals[5] = {x, w, v[3], v[4], v[5]};
    for (int i = 0; i < 5; ++i)
        if (r[10 + i] >= 0)
            u[r[10 + i]] = vals[i];
    if (r[15] >= 0) {
        u[r[15]] = (uint64_t)r[16] + x;
        if (r[17] >= 0)
            u[r[17]] = (uint64_t)r[18] + w;
    }
    return PyLong_FromLong(launch_one(r, stream));
}

/* raw(func, gx, gy, gz, bx, by, bz, smem, stream, params) -> CUresult: cuLaunchKernel, nothing else. */
static PyObject *fl_raw(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 10) {
        PyErr_SetString(PyExc_TypeError, "raw(func, gx, gy, gz, bx, by, bz, smem, stream, params)");
        return NULL;
    }
    if (g_launch == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "igemm fast launch: no cuLaunchKernel (call init() first)");
        return NULL;
    }
    int64_t d[10];
    uint64_t v;
    for (int i = 0; i < 10; ++i) {
        if (!read_u64(args[i], &v))
            return NULL;
        d[i] = (int64_t)v;
    }
    /* launch_one's layout: func, params, (buffer), grid, block, smem */
    const int64_t e[10] = {d[0], d[9], 0, d[1], d[2], d[3], d[4], d[5], d[6], d[7]};
    return PyLong_FromLong(launch_one(e, (void *)(uintptr_t)d[8]));
}

/* ctx() -> the current CUcontext as an int (0: none, or the driver failed). */
static PyObject *fl_ctx(PyObject *self, PyObject *noargs) {
    (void)self; (void)noargs;
    void *c = NULL;
    if (g_ctx_get == NULL || g_ctx_get(&c) != 0)
        c = NULL;
    return PyLong_FromUnsignedLongLong((unsigned long long)(uintptr_t)c);
}

/* init() -> True when cuLaunchKernel and cuCtxGetCurrent were found in the process's libcuda (loaded by
 * cuda.bindings). */
static PyObject *fl_init(PyObject *self, PyObject *noargs) {
    (void)self; (void)noargs;
    if (g_launch == NULL || g_ctx_get == NULL) {
        void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
        if (h == NULL)
            h = dlopen("libcuda.so.1", RTLD_NOW);
        if (h != NULL) {
            g_launch = (cu_launch_t)dlsym(h, "cuLaunchKernel");
            g_ctx_get = (cu_ctx_get_t)dlsym(h, "cuCtxGetCurrent");
        }
    }
    return PyBool_FromLong(g_launch != NULL && g_ctx_get != NULL);
}

/* set_launch(address) -> None: use this function as cuLaunchKernel (the CPU tests pass a recorder). */
static PyObject *fl_set_launch(PyObject *self, PyObject *arg) {
    (void)self;
    uint64_t v;
    if (!read_u64(arg, &v))
        return NULL;
    g_launch = (cu_launch_t)(uintptr_t)v;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"launch", (PyCFunction)(void (*)(void))fl_launch, METH_FASTCALL, "Write a plan call's slots and launch."},
    {"raw", (PyCFunction)(void (*)(void))fl_raw, METH_FASTCALL, "cuLaunchKernel with these arguments."},
    {"ctx", fl_ctx, METH_NOARGS, "The current CUcontext as an int (0: none)."},
    {"init", fl_init, METH_NOARGS, "Find cuLaunchKernel and cuCtxGetCurrent in the loaded libcuda."},
    {"set_launch", fl_set_launch, METH_O, "Use this address as cuLaunchKernel."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "igemm_fastlaunch", NULL, -1, methods,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit_igemm_fastlaunch(void) { return PyModule_Create(&module); }
