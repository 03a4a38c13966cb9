// The per-call path of an eager merge whose call layout was seen before.
//
// kvsplit.merge validates a call layout in Python once, builds its Launch and
// registers it here (fast_add) under a key of everything the plan depends on:
// each tensor's dtype, device, shape and strides, the format, the LSE base,
// kv_split and the four KVSPLIT_* variables. fast_merge reads the same facts
// of every call through torch's DLPack exchange table (no torch headers, no
// Python objects built per tensor), checks what depends on addresses
// (alignment, aliasing, grad) and launches. Anything it does not recognise
// (another layout, a tensor subclass, a bad address, an input that requires
// grad in grad mode) returns False and the caller takes the Python path,
// which raises the same errors as always: no check is skipped for a call
// whose tensors changed, and no message lives here.
#include <Python.h>

#include <cfloat>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <unordered_map>
#include <vector>

#include "binding_launch.h"
#include "kvsplit/dlpack_exchange.h"

namespace kvsplit::binding {

namespace {

// Argument order of fast_merge and the first eight of fast_add.
enum Arg { kFormat, kPartialO, kStats, kScalar, kSinks, kSplitCounts, kOut, kKvSplit, kCallArgs };

// The tensors of a call, in key order; the last two are optional.
enum Slot { kSlotPartialO, kSlotStats, kSlotOut, kSlotSinks, kSlotSplitCounts, kSlots };
constexpr Arg kSlotArg[kSlots] = {kPartialO, kStats, kOut, kSinks, kSplitCounts};

constexpr int kMaxDims = 8;
constexpr int kHeaderWords = 3;  // format and optional tensors, kv_split, LSE base
constexpr int kKeyWords = kHeaderWords + kSlots * (2 + 2 * kMaxDims);
constexpr const char* kEnvironment[] = {"KVSPLIT_MODE", "KVSPLIT_MAX_SPLIT", "KVSPLIT_DB",
                                        "KVSPLIT_PDL"};
constexpr int kEnvironmentSize = 4;

struct Key {
  int64_t words[kKeyWords];
  int size = 0;

  void push(int64_t word) { words[size++] = word; }
  uint64_t hash() const {
    uint64_t h = 0x9e3779b97f4a7c15ull;
    for (int i = 0; i < size; ++i) {
      h ^= static_cast<uint64_t>(words[i]) + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
    }
    return h;
  }
};

// A variable's value as the plan saw it (absent and empty are different values).
struct Setting {
  bool set = false;
  std::string value;

  bool matches(const char* now) const { return now ? set && value == now : !set; }
};

struct Entry {
  std::vector<int64_t> key;
  PyObject* launch_object = nullptr;  // owned: keeps `launch` alive
  const Launch* launch = nullptr;
  int device_index = -1;              // -1: the CPU implementation
  int64_t store_bytes = 16;
  int64_t extents[kSlots] = {};       // bytes spanned by each slot's tensor (0: empty/absent)
  bool fixed_scale = false;           // LSE: log2_scale below; maxsum: the call's scalar
  float log2_scale = 1.f;
  Setting environment[kEnvironmentSize];
};

struct State {
  const dlpack::ExchangeApi* api = nullptr;
  PyTypeObject* tensor_type = nullptr;
  PyObject* is_grad_enabled = nullptr;
  PyObject* requires_grad = nullptr;  // the interned attribute name
  std::unordered_map<uint64_t, Entry> entries;
  uint64_t hits = 0;
  uint64_t misses = 0;
};

// Never destroyed: its entries hold Python references, which must not be
// released after the interpreter is gone.
State& state() {
  static State* s = new State;
  return *s;
}

uintptr_t address_of(const dlpack::Tensor& t) {
  return reinterpret_cast<uintptr_t>(t.data) + static_cast<uintptr_t>(t.byte_offset);
}

// Appends a tensor's dtype, device, shape and strides to `key`; false when
// `object` is not a plain torch.Tensor that DLPack describes.
bool read_tensor(const State& s, PyObject* object, dlpack::Tensor& t, Key& key) {
  if (Py_TYPE(object) != s.tensor_type) return false;
  if (s.api->dltensor_from_py_object_no_sync(object, &t) != 0) {
    PyErr_Clear();
    return false;
  }
  if (t.ndim < 0 || t.ndim > kMaxDims || (t.ndim > 0 && (t.shape == nullptr || t.strides == nullptr))) {
    return false;
  }
  key.push(static_cast<int64_t>(t.dtype.code) | static_cast<int64_t>(t.dtype.bits) << 8 |
           static_cast<int64_t>(t.dtype.lanes) << 16 |
           static_cast<int64_t>(static_cast<uint32_t>(t.device.device_type)) << 32);
  key.push(static_cast<int64_t>(static_cast<uint32_t>(t.device.device_id)) |
           static_cast<int64_t>(t.ndim) << 32);
  for (int i = 0; i < t.ndim; ++i) key.push(t.shape[i]);
  for (int i = 0; i < t.ndim; ++i) key.push(t.strides[i]);
  return true;
}

// Reads a call's key and tensors; false when the call is not one the fast
// path serves (the caller then takes the Python path).
bool read_call(const State& s, PyObject* const* args, Key& key, dlpack::Tensor (&tensors)[kSlots],
               bool (&present)[kSlots], double* scalar) {
  const long format = PyLong_CheckExact(args[kFormat]) ? PyLong_AsLong(args[kFormat]) : -1;
  const bool maxsum = format == static_cast<long>(StatsFormat::kMaxSum);
  if (!maxsum && format != static_cast<long>(StatsFormat::kLse)) return false;
  if (!PyFloat_CheckExact(args[kScalar])) return false;
  *scalar = PyFloat_AS_DOUBLE(args[kScalar]);
  // maxsum: the Python path converts and checks any other scale.
  if (maxsum && !(*scalar > 0 && *scalar <= FLT_MAX)) return false;
  int64_t kv_split = 0;
  bool forced = false;
  if (args[kKvSplit] != Py_None) {
    if (!PyLong_CheckExact(args[kKvSplit])) return false;  // bool included: it has its own type
    int overflow = 0;
    kv_split = PyLong_AsLongLongAndOverflow(args[kKvSplit], &overflow);
    if (overflow || (kv_split == -1 && PyErr_Occurred())) {
      PyErr_Clear();
      return false;
    }
    forced = true;
  }
  int64_t scalar_bits = 0;
  if (!maxsum) std::memcpy(&scalar_bits, scalar, sizeof scalar_bits);  // the LSE base keys the plan
  int64_t mask = 0;
  for (int slot = 0; slot < kSlots; ++slot) {
    present[slot] = args[kSlotArg[slot]] != Py_None;
    mask |= static_cast<int64_t>(present[slot]) << slot;
  }
  if (!present[kSlotPartialO] || !present[kSlotStats] || !present[kSlotOut]) return false;
  key.push(format | mask << 8 | static_cast<int64_t>(forced) << 16);
  key.push(kv_split);
  key.push(scalar_bits);
  for (int slot = 0; slot < kSlots; ++slot) {
    if (present[slot] && !read_tensor(s, args[kSlotArg[slot]], tensors[slot], key)) return false;
  }
  return true;
}

bool same_key(const Entry& entry, const Key& key) {
  return entry.key.size() == static_cast<size_t>(key.size) &&
         std::memcmp(entry.key.data(), key.words, sizeof(int64_t) * key.size) == 0;
}

// True when grad mode is on and partial_o, the stats or sinks require grad
// (the Python path raises then); false also when the question cannot be read.
bool grad_refused(State& s, PyObject* const* args) {
  bool requires = false;
  for (const Arg arg : {kPartialO, kStats, kSinks}) {
    if (args[arg] == Py_None) continue;
    PyObject* value = PyObject_GetAttr(args[arg], s.requires_grad);
    if (value == nullptr) {
      PyErr_Clear();
      return true;
    }
    requires = requires || value == Py_True;
    Py_DECREF(value);
  }
  if (!requires) return false;
  PyObject* enabled = PyObject_CallNoArgs(s.is_grad_enabled);
  if (enabled == nullptr) {
    PyErr_Clear();
    return true;
  }
  const bool on = enabled != Py_False;
  Py_DECREF(enabled);
  return on;
}

bool overlaps(uintptr_t a, int64_t a_bytes, uintptr_t b, int64_t b_bytes) {
  return a && b && a_bytes > 0 && b_bytes > 0 && a < b + static_cast<uintptr_t>(b_bytes) &&
         b < a + static_cast<uintptr_t>(a_bytes);
}

PyObject* answer(bool launched) {
  State& s = state();
  ++(launched ? s.hits : s.misses);
  return PyBool_FromLong(launched);
}

// fast_merge(format, partial_o, stats, scalar, sinks, split_counts, out, kv_split) -> bool
PyObject* fast_merge(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  State& s = state();
  if (nargs != kCallArgs) {
    PyErr_Format(PyExc_TypeError, "fast_merge takes %d arguments, got %zd", int{kCallArgs}, nargs);
    return nullptr;
  }
  if (s.api == nullptr || s.entries.empty()) return answer(false);
  Key key;
  dlpack::Tensor t[kSlots];
  bool present[kSlots];
  double scalar = 0;
  if (!read_call(s, args, key, t, present, &scalar)) return answer(false);
  const auto found = s.entries.find(key.hash());
  if (found == s.entries.end() || !same_key(found->second, key)) return answer(false);
  const Entry& entry = found->second;
  for (int i = 0; i < kEnvironmentSize; ++i) {
    if (!entry.environment[i].matches(std::getenv(kEnvironment[i]))) return answer(false);
  }
  uintptr_t a[kSlots] = {};
  for (int slot = 0; slot < kSlots; ++slot) a[slot] = present[slot] ? address_of(t[slot]) : 0;
  if (a[kSlotPartialO] % 16 || a[kSlotOut] % static_cast<uintptr_t>(entry.store_bytes)) {
    return answer(false);
  }
  for (const Slot input : {kSlotPartialO, kSlotStats, kSlotSinks, kSlotSplitCounts}) {
    if (overlaps(a[kSlotOut], entry.extents[kSlotOut], a[input], entry.extents[input])) {
      return answer(false);
    }
  }
  if (grad_refused(s, args)) return answer(false);
  const bool cuda = entry.device_index >= 0;
  void* stream = nullptr;
  if (cuda && s.api->current_work_stream(dlpack::kCuda, entry.device_index, &stream) != 0) {
    PyErr_Clear();
    return answer(false);
  }
  const float log2_scale = entry.fixed_scale ? entry.log2_scale : static_cast<float>(scalar);
  PyObject* done = guarded([&] {
    raise_for(launch_at(*entry.launch, a[kSlotPartialO], a[kSlotStats], a[kSlotSplitCounts],
                        a[kSlotSinks], a[kSlotOut], 0, log2_scale, cuda, stream));
  });
  if (done == nullptr) return nullptr;
  Py_DECREF(done);
  return answer(true);
}

// fast_add(<fast_merge's arguments>, launch, device_index, store_bytes, extents, log2_scale)
// -> bool: registers the plan that the Python path just launched this call with.
// extents: (partial_o, stats, split_counts, sinks, out, ...) bytes, as kvsplit.layout keeps them.
PyObject* fast_add(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  State& s = state();
  constexpr Py_ssize_t kArgs = kCallArgs + 5;
  if (nargs != kArgs) {
    PyErr_Format(PyExc_TypeError, "fast_add takes %zd arguments, got %zd", kArgs, nargs);
    return nullptr;
  }
  if (s.api == nullptr) Py_RETURN_FALSE;
  Key key;
  dlpack::Tensor t[kSlots];
  bool present[kSlots];
  double scalar = 0;
  if (!read_call(s, args, key, t, present, &scalar)) Py_RETURN_FALSE;
  PyObject* launch_object = args[kCallArgs];
  const Launch* launch = nullptr;
  try {
    launch = &py::handle(launch_object).cast<const Launch&>();
  } catch (const py::cast_error&) {
    PyErr_SetString(PyExc_TypeError, "fast_add: launch must be a Launch");
    return nullptr;
  }
  Entry entry;
  entry.key.assign(key.words, key.words + key.size);
  entry.launch = launch;
  entry.device_index = static_cast<int>(PyLong_AsLong(args[kCallArgs + 1]));
  entry.store_bytes = PyLong_AsLongLong(args[kCallArgs + 2]);
  PyObject* extents = args[kCallArgs + 3];
  if (PyErr_Occurred()) return nullptr;
  if (!PyTuple_Check(extents) || PyTuple_GET_SIZE(extents) < 5 || entry.store_bytes <= 0) {
    PyErr_SetString(PyExc_ValueError, "fast_add: extents must be a tuple of at least 5 ints");
    return nullptr;
  }
  // layout.py's order: partial_o, stats, split_counts, sinks, out.
  constexpr Slot kExtentSlots[] = {kSlotPartialO, kSlotStats, kSlotSplitCounts, kSlotSinks, kSlotOut};
  for (int i = 0; i < 5; ++i) {
    entry.extents[kExtentSlots[i]] = PyLong_AsLongLong(PyTuple_GET_ITEM(extents, i));
  }
  if (PyErr_Occurred()) return nullptr;
  if (args[kCallArgs + 4] != Py_None) {
    entry.fixed_scale = true;
    entry.log2_scale = static_cast<float>(PyFloat_AsDouble(args[kCallArgs + 4]));
    if (PyErr_Occurred()) return nullptr;
  }
  for (int i = 0; i < kEnvironmentSize; ++i) {
    const char* value = std::getenv(kEnvironment[i]);
    entry.environment[i] = {value != nullptr, value ? value : ""};
  }
  Py_INCREF(launch_object);
  entry.launch_object = launch_object;
  Entry& slot = s.entries[key.hash()];
  Py_XDECREF(slot.launch_object);
  slot = std::move(entry);
  Py_RETURN_TRUE;
}

PyObject* fast_clear(PyObject*, PyObject*) {
  State& s = state();
  // Moved out first: a release may run Python code that registers again.
  std::unordered_map<uint64_t, Entry> old;
  old.swap(s.entries);
  for (auto& [hash, entry] : old) Py_XDECREF(entry.launch_object);
  Py_RETURN_NONE;
}

PyObject* fast_info(PyObject*, PyObject*) {
  const State& s = state();
  return Py_BuildValue("{s:O,s:n,s:K,s:K}", "enabled", s.api ? Py_True : Py_False, "entries",
                       static_cast<Py_ssize_t>(s.entries.size()), "hits",
                       static_cast<unsigned long long>(s.hits), "misses",
                       static_cast<unsigned long long>(s.misses));
}

// fast_init(exchange_api, tensor_type, is_grad_enabled) -> bool; exchange_api is the
// capsule (or, from torch 2.10, the int address) that the tensor type publishes.
PyObject* fast_init(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  State& s = state();
  if (nargs != 3) {
    PyErr_Format(PyExc_TypeError, "fast_init takes 3 arguments, got %zd", nargs);
    return nullptr;
  }
  if (!PyType_Check(args[1]) || !PyCallable_Check(args[2])) Py_RETURN_FALSE;
  const dlpack::ExchangeApi* api = nullptr;
  if (PyCapsule_IsValid(args[0], dlpack::kCapsuleName)) {
    api = static_cast<const dlpack::ExchangeApi*>(PyCapsule_GetPointer(args[0], dlpack::kCapsuleName));
  } else if (PyLong_CheckExact(args[0])) {  // torch 2.10's `__c_dlpack_exchange_api__`: the address
    api = static_cast<const dlpack::ExchangeApi*>(PyLong_AsVoidPtr(args[0]));
  }
  if (api == nullptr) {
    PyErr_Clear();
    Py_RETURN_FALSE;
  }
  // A newer major version may be reached through the chain of older tables.
  const dlpack::ExchangeApiHeader* header = &api->header;
  while (header != nullptr && header->version.major != dlpack::kMajorVersion) header = header->prev_api;
  api = reinterpret_cast<const dlpack::ExchangeApi*>(header);
  if (api == nullptr || api->dltensor_from_py_object_no_sync == nullptr ||
      api->current_work_stream == nullptr) {
    Py_RETURN_FALSE;
  }
  if (s.requires_grad == nullptr) s.requires_grad = PyUnicode_InternFromString("requires_grad");
  Py_INCREF(args[1]);
  Py_INCREF(args[2]);
  Py_XDECREF(reinterpret_cast<PyObject*>(s.tensor_type));
  Py_XDECREF(s.is_grad_enabled);
  s.tensor_type = reinterpret_cast<PyTypeObject*>(args[1]);
  s.is_grad_enabled = args[2];
  s.api = api;
  Py_RETURN_TRUE;
}

template <typename Fn>
PyCFunction as_function(Fn fn) {
  return reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(fn));
}

}  // namespace

void def_fast_call(py::module_& m) {
  static PyMethodDef methods[] = {
      {"fast_merge", as_function(&fast_merge), METH_FASTCALL,
       "fast_merge(format, partial_o, stats, scalar, sinks, split_counts, out, kv_split) -> bool\n"
       "Launches a call of a registered layout; False: not served here (take the Python path)"},
      {"fast_add", as_function(&fast_add), METH_FASTCALL,
       "fast_add(<fast_merge's arguments>, launch, device_index, store_bytes, extents, "
       "log2_scale) -> bool\nRegisters the plan of a call that the Python path launched"},
      {"fast_clear", as_function(&fast_clear), METH_NOARGS, "Forgets every registered layout"},
      {"fast_info", as_function(&fast_info), METH_NOARGS,
       "{'enabled', 'entries', 'hits', 'misses'} of the per-call path"},
      {"fast_init", as_function(&fast_init), METH_FASTCALL,
       "fast_init(exchange_api, torch.Tensor, torch.is_grad_enabled) -> bool\n"
       "exchange_api: torch.Tensor.__dlpack_c_exchange_api__ (or the address in "
       "__c_dlpack_exchange_api__). Enables the per-call path (False: this torch has no usable exchange table)"},
  };
  for (PyMethodDef& def : methods) {
    m.add_object(def.ml_name,
                 py::reinterpret_steal<py::object>(PyCFunction_NewEx(&def, nullptr, m.ptr())));
  }
}

}  // namespace kvsplit::binding
