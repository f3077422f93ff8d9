/* qmoe._fastlaunch: the hit path of qmoe._triton.launch in C (the cache key, the kernel
 * parameters, cuLaunchKernelEx), built at the first CUDA launch by qmoe._triton.
 *
 * A plain CPython extension: no torch headers (tensors are read through their Python
 * attributes), the CUDA driver API from Triton's bundled cuda.h, libcuda opened at the
 * first launch. The table is qmoe._triton's dict of native entries: written once per key
 * (compiled kernels and their launch facts, no data), read here.
 *
 * key(kernel, device, args, options) -> tuple: kernel, device, the options' items, then
 *   per runtime argument what Triton specializes on, or finer:
 *     tensor: its dtype and 400 + (address % 16) (two items: the dtype first, so that a
 *             tensor never lines up with another kind of argument at the same position)
 *     int in [-2**31, 2**31): v % 16, or 16 when v == 1 (a constant to Triton)
 *     int in [2**31, 2**63) or below -2**31: 32 + v % 16; in [2**63, 2**64): 64 + v % 16
 *     bool: 200 + value; float: 300; None: None
 *   anything else (or an int past 64 bits) makes no key: None.
 * launch(table, kernel, grid, args, options, device) -> True once launched on the
 *   current stream of `device`; False where the table has no entry for the call's key
 *   (qmoe._triton's Python path launches and writes one); None where the C launch does
 *   not serve the call (first argument not a CUDA tensor, no key, an entry of None, a
 *   Triton launch hook set): the Python path launches.
 * init(torch.Tensor, stream_fn, runtime_knobs): the tensor type, the function giving a
 *   device's current stream (torch._C._cuda_getCurrentRawStream) and triton.knobs.runtime
 *   (its launch hooks are read on every launch).
 * entry tuple (written by qmoe._triton): (function, num_warps, num_ctas, shared_bytes,
 *   pdl, cooperative, types): types a bytes object, one code per runtime argument:
 *   'p' pointer, 'i' int32 (and i1), 'l' int64, 'I' uint32 (and u1), 'L' uint64, 'b' int8,
 *   'h' int16, 'B' uint8, 'H' uint16, 'f' fp32, 'd' fp64, '-' not a kernel parameter
 *   (specialized to a constant: None, an int equal to 1). Two null pointers follow the
 *   arguments (Triton's global and profile scratch; the driver reads as many parameters
 *   as the kernel has).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <cuda.h>
#include <dlfcn.h>
#include <stdint.h>
#include <string.h>

#define MAX_ARGS 64

typedef CUresult (*launch_ex_t)(const CUlaunchConfig *, CUfunction, void **, void **);
typedef CUresult (*ctx_get_t)(CUcontext *);
typedef CUresult (*ctx_set_t)(CUcontext);
typedef CUresult (*primary_retain_t)(CUcontext *, CUdevice);
typedef CUresult (*device_get_t)(CUdevice *, int);
typedef CUresult (*error_string_t)(CUresult, const char **);

static launch_ex_t launch_ex = NULL;
static ctx_get_t ctx_get = NULL;
static ctx_set_t ctx_set = NULL;
static primary_retain_t primary_retain = NULL;
static device_get_t device_get = NULL;
static error_string_t error_string = NULL;

static PyObject *tensor_type = NULL;  /* torch.Tensor, set by init() */
static PyObject *stream_fn = NULL;    /* device -> its current stream, set by init() */
static PyObject *runtime_knobs = NULL;  /* triton.knobs.runtime, set by init() */
static PyObject *s_is_cuda, *s_dtype, *s_data_ptr, *s_calls, *s_enter, *s_exit;

static int load_driver(void) {
  if (launch_ex != NULL) return 1;
  void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
  if (lib == NULL) {
    PyErr_Format(PyExc_RuntimeError, "qmoe._fastlaunch: cannot open libcuda.so.1: %s",
                 dlerror());
    return 0;
  }
  ctx_get = (ctx_get_t)dlsym(lib, "cuCtxGetCurrent");
  ctx_set = (ctx_set_t)dlsym(lib, "cuCtxSetCurrent");
  primary_retain = (primary_retain_t)dlsym(lib, "cuDevicePrimaryCtxRetain");
  device_get = (device_get_t)dlsym(lib, "cuDeviceGet");
  error_string = (error_string_t)dlsym(lib, "cuGetErrorString");
  launch_ex_t l = (launch_ex_t)dlsym(lib, "cuLaunchKernelEx");
  if (!ctx_get || !ctx_set || !primary_retain || !device_get || !error_string || !l) {
    PyErr_SetString(PyExc_RuntimeError, "qmoe._fastlaunch: libcuda lacks a symbol it needs");
    return 0;
  }
  launch_ex = l;
  return 1;
}

static int cuda_error(CUresult r, const char *what) {
  const char *s = NULL;
  if (error_string != NULL) error_string(r, &s);
  PyErr_Format(PyExc_RuntimeError, "qmoe._fastlaunch: %s failed: %s (CUresult %d)", what,
               s ? s : "unknown error", (int)r);
  return 0;
}

/* A context current on this thread (a thread torch never used has none): the device's
 * primary context, which is torch's. */
static int ensure_context(int device) {
  CUcontext ctx = NULL;
  CUresult r = ctx_get(&ctx);
  if (r != CUDA_SUCCESS) return cuda_error(r, "cuCtxGetCurrent");
  if (ctx != NULL) return 1;
  CUdevice dev;
  if ((r = device_get(&dev, device)) != CUDA_SUCCESS) return cuda_error(r, "cuDeviceGet");
  if ((r = primary_retain(&ctx, dev)) != CUDA_SUCCESS)
    return cuda_error(r, "cuDevicePrimaryCtxRetain");
  if ((r = ctx_set(ctx)) != CUDA_SUCCESS) return cuda_error(r, "cuCtxSetCurrent");
  return 1;
}

/* What make_key found out about one argument, kept for the launch. */
typedef struct {
  uint64_t bits;  /* a tensor's address, or an int's value as two's complement */
  double f;       /* a float's value */
} ArgValue;

/* The key of (kernel, device, args, options), or NULL with no exception set when there is
 * none (an argument of a kind the key does not cover, or with need_cuda a first argument
 * that is not a CUDA tensor); NULL with an exception on error. vals (may be NULL) receives
 * each argument's value. */
static PyObject *make_key(PyObject *kernel, PyObject *device, PyObject *args,
                          PyObject *options, ArgValue *vals, int need_cuda) {
  if (tensor_type == NULL) {
    PyErr_SetString(PyExc_RuntimeError, "qmoe._fastlaunch: init() was not called");
    return NULL;
  }
  Py_ssize_t n = PyTuple_GET_SIZE(args);
  if (n > MAX_ARGS || (need_cuda && n == 0)) return NULL;
  Py_ssize_t nopt = PyDict_GET_SIZE(options);
  Py_ssize_t cap = 2 + 2 * nopt + 2 * n, k = 0;
  PyObject *key = PyTuple_New(cap);
  if (key == NULL) return NULL;
#define PUSH(o) PyTuple_SET_ITEM(key, k++, (o))
  Py_INCREF(kernel); PUSH(kernel);
  Py_INCREF(device); PUSH(device);
  Py_ssize_t pos = 0;
  PyObject *ok, *ov;
  while (PyDict_Next(options, &pos, &ok, &ov)) {
    Py_INCREF(ok); PUSH(ok);
    Py_INCREF(ov); PUSH(ov);
  }
  for (Py_ssize_t i = 0; i < n; i++) {
    PyObject *a = PyTuple_GET_ITEM(args, i);
    long code;
    if (need_cuda && i == 0 && (a == Py_None || PyLong_Check(a) || PyFloat_Check(a)))
      goto none;
    if (a == Py_None) {
      Py_INCREF(Py_None); PUSH(Py_None);
      if (vals) vals[i].bits = 0;
      continue;
    } else if (PyBool_Check(a)) {
      code = 200 + (a == Py_True);
      if (vals) vals[i].bits = (a == Py_True);
    } else if (PyLong_CheckExact(a)) {
      int overflow = 0;
      long long v = PyLong_AsLongLongAndOverflow(a, &overflow);
      if (v == -1 && PyErr_Occurred()) goto fail;
      if (overflow > 0) {  /* maybe a uint64 */
        unsigned long long u = PyLong_AsUnsignedLongLong(a);
        if (u == (unsigned long long)-1 && PyErr_Occurred()) { PyErr_Clear(); goto none; }
        code = 64 + (long)(u & 15);
        if (vals) vals[i].bits = u;
      } else if (overflow < 0) {
        goto none;
      } else {
        if (v >= -2147483648LL && v < 2147483648LL) code = v == 1 ? 16 : (long)(v & 15);
        else code = 32 + (long)(v & 15);
        if (vals) vals[i].bits = (uint64_t)v;
      }
    } else if (PyFloat_CheckExact(a)) {
      code = 300;
      if (vals) vals[i].f = PyFloat_AS_DOUBLE(a);
    } else {
      int is_tensor = PyObject_IsInstance(a, tensor_type);
      if (is_tensor < 0) goto fail;
      if (!is_tensor) goto none;
      PyObject *c = PyObject_GetAttr(a, s_is_cuda);
      if (c == NULL) goto fail;
      int cuda = c == Py_True;
      Py_DECREF(c);
      if (!cuda && need_cuda && i == 0) goto none;
      PyObject *dt = PyObject_GetAttr(a, s_dtype);
      if (dt == NULL) goto fail;
      PUSH(dt);
      PyObject *p = PyObject_CallMethodNoArgs(a, s_data_ptr);
      if (p == NULL) goto fail;
      unsigned long long addr = PyLong_AsUnsignedLongLong(p);
      Py_DECREF(p);
      if (addr == (unsigned long long)-1 && PyErr_Occurred()) goto fail;
      code = 400 + (long)(addr & 15) + (cuda ? 0 : 16);
      if (vals) vals[i].bits = addr;
    }
    PyObject *co = PyLong_FromLong(code);
    if (co == NULL) goto fail;
    PUSH(co);
  }
#undef PUSH
  /* unused trailing slots (options and ints take one item where two were reserved) */
  if (_PyTuple_Resize(&key, k) < 0) return NULL;
  return key;
none:
  Py_DECREF(key);
  return NULL;
fail:
  Py_DECREF(key);
  return NULL;
}

static PyObject *fl_init(PyObject *self, PyObject *const *a, Py_ssize_t n) {
  if (n != 3) {
    PyErr_SetString(PyExc_TypeError, "init(tensor_type, stream_fn, runtime_knobs)");
    return NULL;
  }
  Py_XSETREF(tensor_type, Py_NewRef(a[0]));
  Py_XSETREF(stream_fn, Py_NewRef(a[1]));
  Py_XSETREF(runtime_knobs, Py_NewRef(a[2]));
  Py_RETURN_NONE;
}

/* key(kernel, device, args, options, need_cuda): the key, or None where there is none. */
static PyObject *fl_key(PyObject *self, PyObject *const *a, Py_ssize_t n) {
  if (n != 5 || !PyTuple_Check(a[2]) || !PyDict_Check(a[3])) {
    PyErr_SetString(PyExc_TypeError, "key(kernel, device, args: tuple, options: dict, need_cuda)");
    return NULL;
  }
  PyObject *key = make_key(a[0], a[1], a[2], a[3], NULL, PyObject_IsTrue(a[4]));
  if (key == NULL && !PyErr_Occurred()) Py_RETURN_NONE;
  return key;
}

/* Whether Triton's launch hook `name` is set: not None, and not a HookChain with no
 * calls (Triton's default); -1 on error. */
static int hook_set(PyObject *name) {
  PyObject *h = PyObject_GetAttr(runtime_knobs, name);
  if (h == NULL) return -1;
  int set = 0;
  if (h != Py_None) {
    PyObject *calls = PyObject_GetAttr(h, s_calls);
    if (calls == NULL) {
      PyErr_Clear();
      set = 1;
    } else {
      set = !(PyList_Check(calls) && PyList_GET_SIZE(calls) == 0);
      Py_DECREF(calls);
    }
  }
  Py_DECREF(h);
  return set;
}

/* Pack argument i of type t into slot s (8 bytes, little-endian: the low bytes first). */
static int pack(char t, PyObject *a, const ArgValue *v, uint64_t *s) {
  *s = 0;
  switch (t) {
    case 'p': case 'l': case 'L': *s = v->bits; return 1;
    case 'i': case 'I': { uint32_t x = (uint32_t)v->bits; memcpy(s, &x, 4); return 1; }
    case 'h': case 'H': { uint16_t x = (uint16_t)v->bits; memcpy(s, &x, 2); return 1; }
    case 'b': case 'B': { uint8_t x = (uint8_t)v->bits; memcpy(s, &x, 1); return 1; }
    case 'f': {
      float x = PyFloat_CheckExact(a) ? (float)v->f : (float)(int64_t)v->bits;
      memcpy(s, &x, 4); return 1;
    }
    case 'd': {
      double x = PyFloat_CheckExact(a) ? v->f : (double)(int64_t)v->bits;
      memcpy(s, &x, 8); return 1;
    }
    default:
      PyErr_Format(PyExc_RuntimeError, "qmoe._fastlaunch: unknown parameter code %c", t);
      return 0;
  }
}

/* pack_params(types, args): the bytes each kernel parameter would get (tests). */
static PyObject *fl_pack_params(PyObject *self, PyObject *const *a, Py_ssize_t n) {
  if (n != 2 || !PyBytes_Check(a[0]) || !PyTuple_Check(a[1])) {
    PyErr_SetString(PyExc_TypeError, "pack_params(types: bytes, args: tuple)");
    return NULL;
  }
  Py_ssize_t na = PyTuple_GET_SIZE(a[1]);
  if (PyBytes_GET_SIZE(a[0]) != na || na > MAX_ARGS) {
    PyErr_SetString(PyExc_ValueError, "pack_params: one type per argument, at most 64");
    return NULL;
  }
  ArgValue vals[MAX_ARGS];
  PyObject *dev = PyLong_FromLong(0), *opts = PyDict_New();
  PyObject *key = make_key(Py_None, dev, a[1], opts, vals, 0);
  Py_DECREF(dev); Py_DECREF(opts);
  if (key == NULL) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "pack_params: no key");
    return NULL;
  }
  Py_DECREF(key);
  PyObject *out = PyList_New(0);
  const char *types = PyBytes_AS_STRING(a[0]);
  for (Py_ssize_t i = 0; i < na; i++) {
    if (types[i] == '-') continue;
    uint64_t s;
    if (!pack(types[i], PyTuple_GET_ITEM(a[1], i), &vals[i], &s)) { Py_DECREF(out); return NULL; }
    PyObject *b = PyBytes_FromStringAndSize((const char *)&s, 8);
    PyList_Append(out, b);
    Py_DECREF(b);
  }
  return out;
}

/* launch(table, kernel, grid, args, options, device) */
static PyObject *fl_launch(PyObject *self, PyObject *const *a, Py_ssize_t n) {
  if (n != 6 || !PyDict_Check(a[0]) || !PyTuple_Check(a[2]) || !PyTuple_Check(a[3]) ||
      !PyDict_Check(a[4]) || tensor_type == NULL) {
    PyErr_SetString(PyExc_TypeError,
                    "launch(table: dict, kernel, grid: tuple, args: tuple, options: dict, "
                    "device), after init()");
    return NULL;
  }
  PyObject *table = a[0], *kernel = a[1], *grid = a[2], *args = a[3], *options = a[4];
  PyObject *device = a[5];
  int enter = hook_set(s_enter), leave = enter == 0 ? hook_set(s_exit) : 0;
  if (enter < 0 || leave < 0) return NULL;
  if (enter || leave) Py_RETURN_NONE;
  ArgValue vals[MAX_ARGS];
  PyObject *key = make_key(kernel, device, args, options, vals, 1);
  if (key == NULL) {
    if (PyErr_Occurred()) return NULL;
    Py_RETURN_NONE;
  }
  PyObject *entry = PyDict_GetItemWithError(table, key);  /* borrowed */
  Py_DECREF(key);
  if (entry == NULL) {
    if (PyErr_Occurred()) return NULL;
    Py_RETURN_FALSE;
  }
  if (!PyTuple_Check(entry) || PyTuple_GET_SIZE(entry) != 7) Py_RETURN_NONE;
  PyObject *types_obj = PyTuple_GET_ITEM(entry, 6);
  Py_ssize_t na = PyTuple_GET_SIZE(args);
  if (!PyBytes_Check(types_obj) || PyBytes_GET_SIZE(types_obj) != na) Py_RETURN_NONE;
  const char *types = PyBytes_AS_STRING(types_obj);

  unsigned long long function = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(entry, 0));
  int num_warps = (int)PyLong_AsLong(PyTuple_GET_ITEM(entry, 1));
  int num_ctas = (int)PyLong_AsLong(PyTuple_GET_ITEM(entry, 2));
  int shared = (int)PyLong_AsLong(PyTuple_GET_ITEM(entry, 3));
  int pdl = PyObject_IsTrue(PyTuple_GET_ITEM(entry, 4));
  int coop = PyObject_IsTrue(PyTuple_GET_ITEM(entry, 5));
  Py_ssize_t ng = PyTuple_GET_SIZE(grid);
  long g[3] = {1, 1, 1};
  for (Py_ssize_t i = 0; i < ng && i < 3; i++) g[i] = PyLong_AsLong(PyTuple_GET_ITEM(grid, i));
  int dev = (int)PyLong_AsLong(device);
  if (PyErr_Occurred()) return NULL;
  if (g[0] * g[1] * g[2] <= 0) Py_RETURN_TRUE;  /* Triton launches nothing either */

  uint64_t slots[MAX_ARGS + 2];
  void *params[MAX_ARGS + 2];
  int np = 0;
  for (Py_ssize_t i = 0; i < na; i++) {
    if (types[i] == '-') continue;
    if (!pack(types[i], PyTuple_GET_ITEM(args, i), &vals[i], &slots[np])) return NULL;
    params[np] = &slots[np];
    np++;
  }
  slots[np] = 0; params[np] = &slots[np]; np++;  /* global scratch: none */
  slots[np] = 0; params[np] = &slots[np]; np++;  /* profile scratch: none */

  PyObject *st = PyObject_CallOneArg(stream_fn, device);
  if (st == NULL) return NULL;
  unsigned long long stream = PyLong_AsUnsignedLongLong(st);
  Py_DECREF(st);
  if (PyErr_Occurred()) return NULL;
  if (!load_driver() || !ensure_context(dev)) return NULL;

  CUlaunchAttribute attrs[2];
  int nattr = 0;
  if (pdl) {
    attrs[nattr].id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attrs[nattr].value.programmaticStreamSerializationAllowed = 1;
    nattr++;
  }
  if (coop) {
    attrs[nattr].id = CU_LAUNCH_ATTRIBUTE_COOPERATIVE;
    attrs[nattr].value.cooperative = 1;
    nattr++;
  }
  CUlaunchConfig config;
  memset(&config, 0, sizeof(config));
  config.gridDimX = (unsigned)(g[0] * num_ctas);
  config.gridDimY = (unsigned)g[1];
  config.gridDimZ = (unsigned)g[2];
  config.blockDimX = 32 * num_warps;
  config.blockDimY = 1;
  config.blockDimZ = 1;
  config.sharedMemBytes = shared;
  config.hStream = (CUstream)(uintptr_t)stream;
  config.attrs = attrs;
  config.numAttrs = nattr;
  CUresult r;
  Py_BEGIN_ALLOW_THREADS;
  r = launch_ex(&config, (CUfunction)(uintptr_t)function, params, NULL);
  Py_END_ALLOW_THREADS;
  if (r != CUDA_SUCCESS) {
    cuda_error(r, "cuLaunchKernelEx");
    return NULL;
  }
  Py_RETURN_TRUE;
}

static PyMethodDef methods[] = {
    {"init", (PyCFunction)(void (*)(void))fl_init, METH_FASTCALL,
     "init(tensor_type, stream_fn, runtime_knobs)"},
    {"key", (PyCFunction)(void (*)(void))fl_key, METH_FASTCALL,
     "key(kernel, device, args, options, need_cuda) -> tuple or None"},
    {"pack_params", (PyCFunction)(void (*)(void))fl_pack_params, METH_FASTCALL,
     "pack_params(types, args) -> list of 8-byte parameter slots"},
    {"launch", (PyCFunction)(void (*)(void))fl_launch, METH_FASTCALL,
     "launch(table, kernel, grid, args, options, device, stream_fn, enter, exit) -> bool"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fastlaunch", NULL, -1, methods};

PyMODINIT_FUNC PyInit__fastlaunch(void) {
  s_is_cuda = PyUnicode_InternFromString("is_cuda");
  s_dtype = PyUnicode_InternFromString("dtype");
  s_data_ptr = PyUnicode_InternFromString("data_ptr");
  s_calls = PyUnicode_InternFromString("calls");
  s_enter = PyUnicode_InternFromString("launch_enter_hook");
  s_exit = PyUnicode_InternFromString("launch_exit_hook");
  if (!s_is_cuda || !s_dtype || !s_data_ptr || !s_calls || !s_enter || !s_exit) return NULL;
  return PyModule_Create(&module);
}
