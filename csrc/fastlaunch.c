/* igemm's host fast path: launches, and a conv plan call's checks, slot writes and launches, in C.
 *
 * Built on first use by igemm/_fastlaunch.py with the host C compiler (no CUDA headers: the driver's
 * cuLaunchKernel and cuCtxGetCurrent are found with dlsym in the libcuda the process has loaded, or set by
 * set_launch() / set_ctx_get()). raw() is cuLaunchKernel for every Launcher; launch() writes a lean
 * record's slots into the plan's packed argument buffer and launches; conv() (below) runs a whole plan
 * call for the common case and returns None for anything else, which the Python path then handles.
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

/* The record's launches with these pointers: -1 (exception set) for a malformed record, else the
 * CUresult (0: launched). */
static int launch_record(PyObject *rec, uint64_t stream_, uint64_t x, uint64_t w, uint64_t y, uint64_t res,
                         uint64_t mask) {
    Py_ssize_t n = PyBytes_GET_SIZE(rec);
    int64_t r[HEAD + PREP * MAX_PREP];
    if (n < (Py_ssize_t)(HEAD * 8) || n > (Py_ssize_t)sizeof(r) || n % 8)
        goto bad;
    memcpy(r, PyBytes_AS_STRING(rec), (size_t)n);
    if (r[21] < 0 || r[21] > MAX_PREP || n != (Py_ssize_t)(8 * (HEAD + PREP * r[21])))
        goto bad;
    void *stream = (void *)(uintptr_t)stream_;
    for (int p = 0; p < r[21]; ++p) {   /* the preparations read the caller's x and w */
        const int64_t *d = r + HEAD + PREP * p;
        uint64_t *u = (uint64_t *)(uintptr_t)d[2];
        const uint64_t sel[4] = {0, x, w, 0};
        u[d[10]] = sel[d[12] & 3];
        u[d[11]] = sel[d[13] & 3];
        int err = launch_one(d, stream);
        if (err)
            return err;
    }
    if (r[19] >= 0)
        x = (uint64_t)r[19];
    if (r[20] >= 0)
        w = (uint64_t)r[20];
    uint64_t *u = (uint64_t *)(uintptr_t)r[2];
    const uint64_t vals[5] = {x, w, y, res, mask};
    for (int i = 0; i < 5; ++i)
        if (r[10 + i] >= 0)
            u[r[10 + i]] = vals[i];
    if (r[15] >= 0) {
        u[r[15]] = (uint64_t)r[16] + x;
        if (r[17] >= 0)
            u[r[17]] = (uint64_t)r[18] + w;
    }
    return launch_one(r, stream);
bad:
    PyErr_SetString(PyExc_ValueError, "igemm fast launch: malformed launch record");
    return -1;
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
    uint64_t v[6];   /* stream, x, w, y, residual, mask */
    for (int i = 0; i < 6; ++i)
        if (!read_u64(args[i + 1], &v[i]))
            return NULL;
    int err = launch_record(args[0], v[0], v[1], v[2], v[3], v[4], v[5]);
    return err < 0 ? NULL : PyLong_FromLong(err);
}

/* ---- a plan call's checks, in C -------------------------------------------------------------------------
 * conv(st, x, w, out, residual, mask_out) -> y, (y, mask), or None: not this path (the caller then takes
 * its Python path, which raises the precise error for a bad argument). The common case only: torch tensors
 * of the plan's dtype, device and shape, contiguous, x and w 16-byte aligned, the current stream, the plan's
 * context current, and the plan's argument buffer armed (st[16][0] == 1: Python arms it after a lean launch
 * of this record's launcher, and disarms it before any other write into the buffer). st is a tuple:
 *   0 torch.Tensor  1 dtype  2 residual dtype or None  3 torch.int32  4 device index
 *   5 x shape  6 w shape  7 y shape (tuples of ints)  8 x bytes  9 w bytes  10 y bytes  11 residual bytes
 *   12 mask words (0: no mask)  13 y's allocation template (None: x itself, when y has x's shape)
 *   14 the mask's template or None  15 current_stream(device) callable
 *   16 armed (bytearray of 1)  17 launch record (bytes)  18 context id  19 the Add epilogue (its .residual:
 *   the plan's own residual) or None: no residual input  20 torch.nn.Parameter (w may be one; exact types
 *   only otherwise: a tensor subclass may override what these accessors mean)  21 torch.empty_like
 * Outputs are allocated as torch.empty_like(template): the cheapest of torch's allocators from Python (no
 * size, dtype or device to parse). A template is a one-element tensor expanded to the output's shape (not
 * dense, so empty_like returns a contiguous tensor); the result is checked to be contiguous.
 * Every torch call (accessors, allocation) comes before the armed check; from the check to the launch
 * nothing can release the GIL, so no other thread writes the buffer in between.
 */
static PyObject *s_dtype, *s_get_device, *s_shape, *s_is_contiguous, *s_data_ptr, *s_residual;

static int tensor_ok_typed(PyObject *t, PyObject *dtype, long dev, PyObject *shape, uint64_t *ptr);

/* 1: t is a contiguous tensor of this type, dtype, device and shape (shape NULL: not checked), *ptr set;
 * 0: it is not (or an accessor raised: cleared). */
static int tensor_ok(PyObject *t, PyObject *T, PyObject *dtype, long dev, PyObject *shape, uint64_t *ptr) {
    if ((PyObject *)Py_TYPE(t) != T)
        return 0;
    return tensor_ok_typed(t, dtype, dev, shape, ptr);
}

/* tensor_ok without the type check (the caller has made it) */
static int tensor_ok_typed(PyObject *t, PyObject *dtype, long dev, PyObject *shape, uint64_t *ptr) {
    int ok = 0;
    PyObject *o = PyObject_GetAttr(t, s_dtype);
    if (o == NULL || o != dtype)
        goto done;
    Py_DECREF(o);
    o = PyObject_CallMethodNoArgs(t, s_get_device);
    if (o == NULL || PyLong_AsLong(o) != dev)
        goto done;
    Py_DECREF(o);
    if (shape != NULL) {
        o = PyObject_GetAttr(t, s_shape);
        if (o == NULL || !PyTuple_Check(o) || PyTuple_GET_SIZE(o) != PyTuple_GET_SIZE(shape))
            goto done;
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(shape); ++i)
            if (PyLong_AsLongLong(PyTuple_GET_ITEM(o, i)) != PyLong_AsLongLong(PyTuple_GET_ITEM(shape, i)))
                goto done;
        Py_DECREF(o);
    }
    o = PyObject_CallMethodNoArgs(t, s_is_contiguous);
    if (o != Py_True)
        goto done;
    Py_DECREF(o);
    o = PyObject_CallMethodNoArgs(t, s_data_ptr);
    if (o == NULL)
        goto done;
    *ptr = PyLong_AsUnsignedLongLong(o);
    ok = !PyErr_Occurred();
done:
    Py_XDECREF(o);
    PyErr_Clear();
    return ok;
}

/* 1: t (a tensor this call allocated) is contiguous, *ptr = t.data_ptr(); 0: not, or it raised (cleared). */
static int alloc_ok(PyObject *t, uint64_t *ptr) {
    PyObject *o = PyObject_CallMethodNoArgs(t, s_is_contiguous);
    const int contig = o == Py_True;
    Py_XDECREF(o);
    if (!contig) {
        PyErr_Clear();
        return 0;
    }
    o = PyObject_CallMethodNoArgs(t, s_data_ptr);
    if (o == NULL) {
        PyErr_Clear();
        return 0;
    }
    *ptr = PyLong_AsUnsignedLongLong(o);
    Py_DECREF(o);
    if (PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    return 1;
}

/* bytes [p, p + n) overlap none of the (q, m) extents (q == 0: none) */
static int apart(uint64_t p, uint64_t n, const uint64_t *e, int k) {
    for (int i = 0; i < k; ++i)
        if (e[2 * i] && e[2 * i] < p + n && p < e[2 * i] + e[2 * i + 1])
            return 0;
    return 1;
}

static PyObject *fl_conv(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 6 || !PyTuple_Check(args[0]) || PyTuple_GET_SIZE(args[0]) != 22) {
        PyErr_SetString(PyExc_TypeError, "conv(st, x, w, out, residual, mask_out)");
        return NULL;
    }
    if (g_launch == NULL || g_ctx_get == NULL)
        Py_RETURN_NONE;
    PyObject *st = args[0], *x = args[1], *w = args[2], *out = args[3], *res = args[4], *mo = args[5];
#define ST(i) PyTuple_GET_ITEM(st, i)
    PyObject *T = ST(0), *tdt = ST(1);
    long dev = PyLong_AsLong(ST(4));
    void *c = NULL;
    if (g_ctx_get(&c) != 0 || (uint64_t)(uintptr_t)c != PyLong_AsUnsignedLongLong(ST(18)))
        Py_RETURN_NONE;
    uint64_t xp, wp, yp = 0, rp = 0, mp = 0;
    const int w_type = (PyObject *)Py_TYPE(w) == T || (PyObject *)Py_TYPE(w) == ST(20);
    if (!tensor_ok(x, T, tdt, dev, ST(5), &xp) || !w_type || !tensor_ok_typed(w, tdt, dev, ST(6), &wp) ||
        ((xp | wp) & 15))
        Py_RETURN_NONE;
    uint64_t xnb = PyLong_AsUnsignedLongLong(ST(8)), wnb = PyLong_AsUnsignedLongLong(ST(9));
    uint64_t ynb = PyLong_AsUnsignedLongLong(ST(10)), rnb = PyLong_AsUnsignedLongLong(ST(11));
    long mwords = PyLong_AsLong(ST(12));
    PyObject *add = ST(19);
    PyObject *rt = NULL, *y = NULL, *m = NULL, *h = NULL, *ret = NULL;
    if (add != Py_None) {                                  /* residual: the caller's, else the plan's own */
        rt = res != Py_None ? (Py_INCREF(res), res) : PyObject_GetAttr(add, s_residual);
        if (rt == NULL || !tensor_ok(rt, T, ST(2), dev, ST(7), &rp) || (rp & 15))
            goto fallback;
    } else if (res != Py_None) {
        goto fallback;
    }
    if (mwords == 0 && mo != Py_None)
        goto fallback;
    if (out == Py_None) {
        y = PyObject_CallOneArg(ST(21), ST(13) != Py_None ? ST(13) : x);
        if (y == NULL || !alloc_ok(y, &yp))
            goto fallback;
    } else {
        uint64_t ext[6] = {xp, xnb, wp, wnb, rp, rnb};
        if (!tensor_ok(out, T, tdt, dev, ST(7), &yp) || (yp & 15) || !apart(yp, ynb, ext, 3))
            goto fallback;
        Py_INCREF(out);
        y = out;
    }
    if (mwords > 0) {
        if (mo == Py_None) {
            m = PyObject_CallOneArg(ST(21), ST(14));
            if (m == NULL || !alloc_ok(m, &mp))
                goto fallback;
        } else {
            uint64_t ext[8] = {xp, xnb, wp, wnb, rp, rnb, yp, ynb};
            if (!tensor_ok(mo, T, ST(3), dev, NULL, &mp) || !apart(mp, 4 * (uint64_t)mwords, ext, 4))
                goto fallback;
            PyObject *sh = PyObject_GetAttr(mo, s_shape);     /* 1-D, at least mask-words long */
            int good = sh != NULL && PyTuple_Check(sh) && PyTuple_GET_SIZE(sh) == 1 &&
                       PyLong_AsLongLong(PyTuple_GET_ITEM(sh, 0)) >= mwords;
            Py_XDECREF(sh);
            if (!good)
                goto fallback;
            Py_INCREF(mo);
            m = mo;
        }
    }
    h = PyObject_CallOneArg(ST(15), ST(4));                /* the current stream */
    if (h == NULL)
        goto fallback;
    uint64_t hs = PyLong_AsUnsignedLongLong(h);
    if (PyErr_Occurred())
        goto fallback;
    /* from here on no Python code runs: the armed check, the slot writes and the launch are one step */
    if (!PyByteArray_Check(ST(16)) || PyByteArray_GET_SIZE(ST(16)) < 1 || PyByteArray_AS_STRING(ST(16))[0] != 1 ||
        !PyBytes_Check(ST(17)))
        goto fallback;
    {
        int err = launch_record(ST(17), hs, xp, wp, yp, rp, mp);
        if (err < 0)
            goto fallback;
        if (err > 0) {
            PyErr_Format(PyExc_RuntimeError, "kernel launch failed: CUresult %d", err);
            goto error;
        }
    }
    if (m != NULL) {
        ret = PyTuple_Pack(2, y, m);
    } else {
        Py_INCREF(y);
        ret = y;
    }
    goto done;
fallback:
    PyErr_Clear();
    Py_INCREF(Py_None);
    ret = Py_None;
    goto done;
error:
    ret = NULL;
done:
    Py_XDECREF(rt);
    Py_XDECREF(y);
    Py_XDECREF(m);
    Py_XDECREF(h);
    return ret;
#undef ST
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

/* set_ctx_get(address) -> None: use this function as cuCtxGetCurrent (the CPU tests pass a stand-in). */
static PyObject *fl_set_ctx_get(PyObject *self, PyObject *arg) {
    (void)self;
    uint64_t v;
    if (!read_u64(arg, &v))
        return NULL;
    g_ctx_get = (cu_ctx_get_t)(uintptr_t)v;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"launch", (PyCFunction)(void (*)(void))fl_launch, METH_FASTCALL, "Write a plan call's slots and launch."},
    {"raw", (PyCFunction)(void (*)(void))fl_raw, METH_FASTCALL, "cuLaunchKernel with these arguments."},
    {"conv", (PyCFunction)(void (*)(void))fl_conv, METH_FASTCALL, "A conv plan call's checks and launch."},
    {"ctx", fl_ctx, METH_NOARGS, "The current CUcontext as an int (0: none)."},
    {"init", fl_init, METH_NOARGS, "Find cuLaunchKernel and cuCtxGetCurrent in the loaded libcuda."},
    {"set_launch", fl_set_launch, METH_O, "Use this address as cuLaunchKernel."},
    {"set_ctx_get", fl_set_ctx_get, METH_O, "Use this address as cuCtxGetCurrent."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "igemm_fastlaunch", NULL, -1, methods,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit_igemm_fastlaunch(void) {
    s_dtype = PyUnicode_InternFromString("dtype");
    s_get_device = PyUnicode_InternFromString("get_device");
    s_shape = PyUnicode_InternFromString("shape");
    s_is_contiguous = PyUnicode_InternFromString("is_contiguous");
    s_data_ptr = PyUnicode_InternFromString("data_ptr");
    s_residual = PyUnicode_InternFromString("residual");
    if (!s_dtype || !s_get_device || !s_shape || !s_is_contiguous || !s_data_ptr || !s_residual)
        return NULL;
    return PyModule_Create(&module);
}
