/* qmoe._fastlaunch: the hit path of qmoe._triton.launch in C (the cache key, the kernel
 * parameters, cuLaunchKernelEx), built at the first CUDA launch by qmoe._triton.
 *
 * A plain CPython extension: no torch headers (tensors are read through their Python
 * attributes), the CUDA driver API from Triton's bundled cuda.h, the driver library
 * opened at the first launch. The table is qmoe._triton's dict of native entries: written
 * once per key (compiled kernels and their launch facts, no data), read here.
 *
 * init(tensor_type, stream_fn, runtime_knobs, compilation_knobs, driver_path): torch.Tensor,
 *   the function giving a device's current stream (torch._C._cuda_getCurrentRawStream),
 *   triton.knobs.runtime and triton.knobs.compilation (read on every launch: the launch
 *   hooks, `debug`, `instrumentation_mode`), the driver library ("libcuda.so.1"; tests
 *   pass a recording stand-in).
 * key(kernel, device, args, options, need_cuda) -> tuple or None: id(kernel) (the entry
 *   keeps the kernel alive), device, each option's name, value and type, then per runtime
 *   argument what Triton specializes on, or finer:
 *     tensor: its dtype and 400 + (address % 16) (two items: the dtype first, so that a
 *             tensor never lines up with another kind of argument at the same position)
 *     int in [-2**31, 2**31): v % 16, or 16 when v == 1 (a constant to Triton)
 *     int in [2**31, 2**63) or below -2**31: 32 + v % 16; in [2**63, 2**64): 64 + v % 16
 *     bool: 200 + value; float: 300; None: None
 *   None (no key) for anything else, an int past 64 bits, more than MAX_ARGS arguments or
 *   MAX_OPTIONS options, and with need_cuda a tensor not on a GPU (Triton's own launch
 *   checks such an address; the C launch would not) or a first argument not a tensor.
 * launch(table, kernel, grid, args, options, device) -> True once launched on the
 *   current stream of `device`; False where the table has no entry for the call's key
 *   (qmoe._triton's Python path launches and writes one); None where the C launch does
 *   not serve the call (no key, an entry of None, a grid it does not take, a Triton launch
 *   hook, `debug` or instrumentation set, no driver library): the Python path launches.
 * entry tuple (written by qmoe._triton): (function, num_warps, num_ctas, shared_bytes,
 *   pdl, cooperative, types, compiled): types a bytes object, one code per runtime
 *   argument: 'p' pointer, 'i' int32 (and i1), 'l' int64, 'I' uint32 (and u1), 'L' uint64,
 *   'b' int8, 'h' int16, 'B' uint8, 'H' uint16, 'f' fp32, 'd' fp64, '-' not a kernel
 *   parameter (specialized to a constant: None, an int equal to 1); compiled: Triton's
 *   CompiledKernel, kept alive with its function. Two null pointers follow the arguments
 *   (Triton's global and profile scratch; the driver reads as many parameters as the
 *   kernel has).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <cuda.h>
#include <dlfcn.h>
#include <stdint.h>
#include <string.h>

#define MAX_ARGS 64
#define MAX_OPTIONS 64
#define MAX_KEY (2 + 3 * MAX_OPTIONS + 2 * MAX_ARGS)
#define ENTRY_SIZE 8

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
static int driver_missing = 0;  /* the driver library did not open: never serve */

static PyObject *tensor_type = NULL;        /* set by init() */
static PyObject *stream_fn = NULL;
static PyObject *runtime_knobs = NULL;
static PyObject *compilation_knobs = NULL;
static PyObject *driver_path = NULL;
static PyObject *s_is_cuda, *s_dtype, *s_data_ptr, *s_calls, *s_enter, *s_exit, *s_debug,
    *s_instrumentation;

/* Open the driver library once; 0 (no exception) where it is missing or lacks a symbol. */
static int load_driver(void) {
  if (launch_ex != NULL) return 1;
  if (driver_missing) return 0;
  const char *path = PyUnicode_AsUTF8(driver_path);
  if (path == NULL) return -1;
  void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (lib != NULL) {
    ctx_get = (ctx_get_t)dlsym(lib, "cuCtxGetCurrent");
    ctx_set = (ctx_set_t)dlsym(lib, "cuCtxSetCurrent");
    primary_retain = (primary_retain_t)dlsym(lib, "cuDevicePrimaryCtxRetain");
    device_get = (device_get_t)dlsym(lib, "cuDeviceGet");
    error_string = (error_string_t)dlsym(lib, "cuGetErrorString");
    launch_ex_t l = (launch_ex_t)dlsym(lib, "cuLaunchKernelEx");
    if (ctx_get && ctx_set && primary_retain && device_get && error_string && l) {
      launch_ex = l;
      return 1;
    }
  }
  driver_missing = 1;
  return 0;
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

/* The key of (kernel, device, args, options), or NULL with no exception set where there is
 * none (see the file's head); NULL with an exception on error. vals (may be NULL)
 * receives each argument's value. The items gather in a C array and become a tuple only
 * when all are made (no half-filled tuple is ever visible to the garbage collector). */
static PyObject *make_key(PyObject *kernel, PyObject *device, PyObject *args,
                          PyObject *options, ArgValue *vals, int need_cuda) {
  if (tensor_type == NULL) {
    PyErr_SetString(PyExc_RuntimeError, "qmoe._fastlaunch: init() was not called");
    return NULL;
  }
  Py_ssize_t n = PyTuple_GET_SIZE(args);
  if (n > MAX_ARGS || PyDict_GET_SIZE(options) > MAX_OPTIONS || (need_cuda && n == 0))
    return NULL;
  PyObject *items[MAX_KEY];
  Py_ssize_t k = 0;
  PyObject *kid = PyLong_FromVoidPtr(kernel);
  if (kid == NULL) return NULL;
  items[k++] = kid;
  Py_INCREF(device);
  items[k++] = device;
  Py_ssize_t pos = 0;
  PyObject *ok, *ov;
  while (PyDict_Next(options, &pos, &ok, &ov)) {
    Py_INCREF(ok);
    items[k++] = ok;
    Py_INCREF(ov);
    items[k++] = ov;
    Py_INCREF((PyObject *)Py_TYPE(ov));  /* True, 1 and 1.0 are equal but compile apart */
    items[k++] = (PyObject *)Py_TYPE(ov);
  }
  for (Py_ssize_t i = 0; i < n; i++) {
    PyObject *a = PyTuple_GET_ITEM(args, i);
    long code;
    if (a == Py_None) {
      if (need_cuda && i == 0) goto none;
      Py_INCREF(Py_None);
      items[k++] = Py_None;
      if (vals) vals[i].bits = 0;
      continue;
    } else if (PyBool_Check(a)) {
      if (need_cuda && i == 0) goto none;
      code = 200 + (a == Py_True);
      if (vals) vals[i].bits = (a == Py_True), vals[i].f = (a == Py_True);
    } else if (PyLong_CheckExact(a)) {
      if (need_cuda && i == 0) goto none;
      int overflow = 0;
      long long v = PyLong_AsLongLongAndOverflow(a, &overflow);
      if (v == -1 && PyErr_Occurred()) goto fail;
      if (overflow > 0) {  /* maybe a uint64 */
        unsigned long long u = PyLong_AsUnsignedLongLong(a);
        if (u == (unsigned long long)-1 && PyErr_Occurred()) {
          PyErr_Clear();
          goto none;
        }
        code = 64 + (long)(u & 15);
        if (vals) vals[i].bits = u, vals[i].f = (double)u;
      } else if (overflow < 0) {
        goto none;
      } else {
        if (v >= -2147483648LL && v < 2147483648LL) code = v == 1 ? 16 : (long)(v & 15);
        else code = 32 + (long)(v & 15);
        if (vals) vals[i].bits = (uint64_t)v, vals[i].f = (double)v;
      }
    } else if (PyFloat_CheckExact(a)) {
      if (need_cuda && i == 0) goto none;
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
      if (!cuda && need_cuda) goto none;
      PyObject *dt = PyObject_GetAttr(a, s_dtype);
      if (dt == NULL) goto fail;
      items[k++] = dt;
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
    items[k++] = co;
  }
  PyObject *key = PyTuple_New(k);
  if (key == NULL) goto fail;
  for (Py_ssize_t j = 0; j < k; j++) PyTuple_SET_ITEM(key, j, items[j]);  /* steals */
  return key;
none:
fail:  /* (none: no exception set; fail: one set) */
  for (Py_ssize_t j = 0; j < k; j++) Py_DECREF(items[j]);
  return NULL;
}

static PyObject *fl_init(PyObject *self, PyObject *const *a, Py_ssize_t n) {
  if (n != 5 || !PyUnicode_Check(a[4])) {
    PyErr_SetString(PyExc_TypeError, "init(tensor_type, stream_fn, runtime_knobs, "
                                     "compilation_knobs, driver_path: str)");
    return NULL;
  }
  Py_XSETREF(tensor_type, Py_NewRef(a[0]));
  Py_XSETREF(stream_fn, Py_NewRef(a[1]));
  Py_XSETREF(runtime_knobs, Py_NewRef(a[2]));
  Py_XSETREF(compilation_knobs, Py_NewRef(a[3]));
  Py_XSETREF(driver_path, Py_NewRef(a[4]));
  Py_RETURN_NONE;
}

/* key(kernel, device, args, options, need_cuda): the key, or None where there is none. */
static PyObject *fl_key(PyObject *self, PyObject *const *a, Py_ssize_t n) {
  if (n != 5 || !PyTuple_Check(a[2]) || !PyDict_Check(a[3])) {
    PyErr_SetString(PyExc_TypeError,
                    "key(kernel, device, args: tuple, options: dict, need_cuda)");
    return NULL;
  }
  int need_cuda = PyObject_IsTrue(a[4]);
  if (need_cuda < 0) return NULL;
  PyObject *key = make_key(a[0], a[1], a[2], a[3], NULL, need_cuda);
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

/* Whether knob `name` of `knobs` is truthy (0 where the knob does not exist); -1 on error. */
static int knob_set(PyObject *knobs, PyObject *name) {
  PyObject *v = PyObject_GetAttr(knobs, name);
  if (v == NULL) {
    if (!PyErr_ExceptionMatches(PyExc_AttributeError)) return -1;
    PyErr_Clear();
    return 0;
  }
  int set = PyObject_IsTrue(v);
  Py_DECREF(v);
  return set;
}

/* Whether the C launch stands aside for this call: a launch hook (a profiler), Triton's
 * `debug` knob or an instrumentation mode (they change what Triton compiles, which the key
 * does not hold); -1 on error. */
static int stand_aside(void) {
  int r;
  if ((r = hook_set(s_enter)) != 0) return r;
  if ((r = hook_set(s_exit)) != 0) return r;
  if ((r = knob_set(runtime_knobs, s_debug)) != 0) return r;
  return knob_set(compilation_knobs, s_instrumentation);
}

/* Pack argument value v of type t into slot s (8 bytes, little-endian: the low bytes). */
static int pack(char t, const ArgValue *v, uint64_t *s) {
  *s = 0;
  switch (t) {
    case 'p': case 'l': case 'L': *s = v->bits; return 1;
    case 'i': case 'I': { uint32_t x = (uint32_t)v->bits; memcpy(s, &x, 4); return 1; }
    case 'h': case 'H': { uint16_t x = (uint16_t)v->bits; memcpy(s, &x, 2); return 1; }
    case 'b': case 'B': { uint8_t x = (uint8_t)v->bits; memcpy(s, &x, 1); return 1; }
    case 'f': { float x = (float)v->f; memcpy(s, &x, 4); return 1; }  /* (ints converted) */
    case 'd': { memcpy(s, &v->f, 8); return 1; }
    default:
      PyErr_Format(PyExc_RuntimeError, "qmoe._fastlaunch: unknown parameter code %c", t);
      return 0;
  }
}

/* pack_params(types, args): the 8-byte slot each kernel parameter would get (tests). */
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
  PyObject *key = dev && opts ? make_key(Py_None, dev, a[1], opts, vals, 0) : NULL;
  Py_XDECREF(dev);
  Py_XDECREF(opts);
  if (key == NULL) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "pack_params: no key");
    return NULL;
  }
  Py_DECREF(key);
  PyObject *out = PyList_New(0);
  if (out == NULL) return NULL;
  const char *types = PyBytes_AS_STRING(a[0]);
  for (Py_ssize_t i = 0; i < na; i++) {
    if (types[i] == '-') continue;
    uint64_t s;
    PyObject *b = pack(types[i], &vals[i], &s)
                      ? PyBytes_FromStringAndSize((const char *)&s, 8) : NULL;
    if (b == NULL || PyList_Append(out, b) < 0) {
      Py_XDECREF(b);
      Py_DECREF(out);
      return NULL;
    }
    Py_DECREF(b);
  }
  return out;
}

/* One grid dimension: 1 <= g < limit, else 0 (0 or below: nothing to launch, -1: not
 * served) with no exception, or -2 with one. */
static long long grid_dim(PyObject *o, long long limit) {
  if (!PyLong_CheckExact(o)) return -1;
  int overflow = 0;
  long long g = PyLong_AsLongLongAndOverflow(o, &overflow);
  if (g == -1 && PyErr_Occurred()) return -2;
  if (overflow || g >= limit) return -1;
  return g <= 0 ? 0 : g;
}

static PyObject *do_launch(PyObject *entry, PyObject *grid, PyObject *args, PyObject *device,
                           ArgValue *vals) {
  Py_ssize_t na = PyTuple_GET_SIZE(args);
  PyObject *types_obj = PyTuple_GET_ITEM(entry, 6);
  if (!PyBytes_Check(types_obj) || PyBytes_GET_SIZE(types_obj) != na) Py_RETURN_NONE;
  const char *types = PyBytes_AS_STRING(types_obj);
  Py_ssize_t ng = PyTuple_GET_SIZE(grid);
  if (ng < 1 || ng > 3) Py_RETURN_NONE;  /* (Triton's path raises its own error) */
  long long g[3] = {1, 1, 1};
  const long long limits[3] = {2147483648LL, 65536, 65536};
  for (Py_ssize_t i = 0; i < ng; i++) {
    g[i] = grid_dim(PyTuple_GET_ITEM(grid, i), limits[i]);
    if (g[i] == -2) return NULL;
    if (g[i] == -1) Py_RETURN_NONE;
  }
  unsigned long long function = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(entry, 0));
  long num_warps = PyLong_AsLong(PyTuple_GET_ITEM(entry, 1));
  long num_ctas = PyLong_AsLong(PyTuple_GET_ITEM(entry, 2));
  long shared = PyLong_AsLong(PyTuple_GET_ITEM(entry, 3));
  int pdl = PyObject_IsTrue(PyTuple_GET_ITEM(entry, 4));
  int coop = PyObject_IsTrue(PyTuple_GET_ITEM(entry, 5));
  int dev = (int)PyLong_AsLong(device);
  if (PyErr_Occurred()) return NULL;
  if (num_ctas != 1 || num_warps < 1 || num_warps > 32 || shared < 0) Py_RETURN_NONE;
  if (g[0] == 0 || g[1] == 0 || g[2] == 0) Py_RETURN_TRUE;  /* Triton launches nothing */

  uint64_t slots[MAX_ARGS + 2];
  void *params[MAX_ARGS + 2];
  int np = 0;
  for (Py_ssize_t i = 0; i < na; i++) {
    if (types[i] == '-') continue;
    if (!pack(types[i], &vals[i], &slots[np])) return NULL;
    params[np] = &slots[np];
    np++;
  }
  slots[np] = 0; params[np] = &slots[np]; np++;  /* global scratch: none */
  slots[np] = 0; params[np] = &slots[np]; np++;  /* profile scratch: none */

  int loaded = load_driver();
  if (loaded < 0) return NULL;
  if (loaded == 0) Py_RETURN_NONE;  /* no driver library: Triton's path, with its error */
  PyObject *st = PyObject_CallOneArg(stream_fn, device);
  if (st == NULL) return NULL;
  unsigned long long stream = PyLong_AsUnsignedLongLong(st);
  Py_DECREF(st);
  if (PyErr_Occurred()) return NULL;
  if (!ensure_context(dev)) return NULL;

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
  config.gridDimX = (unsigned)g[0];
  config.gridDimY = (unsigned)g[1];
  config.gridDimZ = (unsigned)g[2];
  config.blockDimX = 32 * (unsigned)num_warps;
  config.blockDimY = 1;
  config.blockDimZ = 1;
  config.sharedMemBytes = (unsigned)shared;
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
  int aside = stand_aside();
  if (aside < 0) return NULL;
  if (aside) Py_RETURN_NONE;
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
  if (!PyTuple_Check(entry) || PyTuple_GET_SIZE(entry) != ENTRY_SIZE) Py_RETURN_NONE;
  Py_INCREF(entry);  /* held while Python code may run (the stream call) */
  PyObject *r = do_launch(entry, grid, args, device, vals);
  Py_DECREF(entry);
  return r;
}

static PyMethodDef methods[] = {
    {"init", (PyCFunction)(void (*)(void))fl_init, METH_FASTCALL,
     "init(tensor_type, stream_fn, runtime_knobs, compilation_knobs, driver_path)"},
    {"key", (PyCFunction)(void (*)(void))fl_key, METH_FASTCALL,
     "key(kernel, device, args, options, need_cuda) -> tuple or None"},
    {"pack_params", (PyCFunction)(void (*)(void))fl_pack_params, METH_FASTCALL,
     "pack_params(types, args) -> list of 8-byte parameter slots"},
    {"launch", (PyCFunction)(void (*)(void))fl_launch, METH_FASTCALL,
     "launch(table, kernel, grid, args, options, device) -> True, False or None"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fastlaunch", NULL, -1, methods};

PyMODINIT_FUNC PyInit__fastlaunch(void) {
  s_is_cuda = PyUnicode_InternFromString("is_cuda");
  s_dtype = PyUnicode_InternFromString("dtype");
  s_data_ptr = PyUnicode_InternFromString("data_ptr");
  s_calls = PyUnicode_InternFromString("calls");
  s_enter = PyUnicode_InternFromString("launch_enter_hook");
  s_exit = PyUnicode_InternFromString("launch_exit_hook");
  s_debug = PyUnicode_InternFromString("debug");
  s_instrumentation = PyUnicode_InternFromString("instrumentation_mode");
  if (!s_is_cuda || !s_dtype || !s_data_ptr || !s_calls || !s_enter || !s_exit || !s_debug ||
      !s_instrumentation)
    return NULL;
  return PyModule_Create(&module);
}
