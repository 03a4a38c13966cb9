// The one per-call path of every eager merge: the public API's and every
// kvsplit.compat adapter's.
//
// A call form names the role of each argument of an entry point (a partial
// output or its stats, a part of them, an output, sinks, a value that keys the
// plan, the maxsum scale, ...). Python validates a call layout once, builds its
// CallPlan (the Launch plus what the per-call checks need) and registers it
// here (call_add) under a key of the form and of everything the plan depends
// on: each tensor argument's dtype, device, shape and strides, each keyed
// value, which output is which input for forms that may merge in place, and
// the KVSPLIT_* variables. call_fast reads the same facts of every call
// through torch's DLPack exchange table (no torch headers, no Python objects
// built per tensor) and launches a registered plan. Calls it does not
// recognise (another layout, a tensor subclass, an input that requires grad
// in grad mode) return False and the caller takes the Python path, which
// validates, plans, registers and launches through the same CallPlan.
//
// What depends on addresses (alignment, the distance between parts, in-place
// identity, aliasing) is checked in CallPlan::launch and only there, for both
// paths, with the argument names the entry point's users know.
#include <Python.h>
#include <pybind11/stl.h>

#include <cfloat>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "binding_launch.h"
#include "kvsplit/dlpack_exchange.h"

namespace kvsplit::binding {

namespace {

// The role of an argument of a call form.
enum Role : int {
  kKey = 0,     // a value the plan depends on (None, bool, int, float)
  kScale,       // the maxsum scale: a positive finite float, per call
  kPartialO,    // partial outputs, stacked, or one part of them (in order)
  kStats,       // their stats, stacked or one part
  kOut,
  kOutStats,
  kSinks,
  kSplitCounts,
  kRowMask,
  kOutScale,
  kGroupScales,
  kRequestStarts,  // TensorRT-LLM's per-request ops: the requests' token offsets
  kRequestOps,     // and each request's op
  kRoles,
};

constexpr int kMaxDims = 8;
constexpr int kMaxArgs = 16;
constexpr int kMaxParts = 2;  // forms name parts one by one: FlashInfer's, vLLM's, SGLang's two
constexpr const char* kEnvironment[] = {"KVSPLIT_MODE", "KVSPLIT_MAX_SPLIT", "KVSPLIT_DB",
                                        "KVSPLIT_PDL"};
constexpr int kEnvironmentSize = 4;

struct Form {
  std::vector<Role> roles;
  bool in_place = false;  // outputs may be inputs: which is which keys the plan
  // The outputs are the first part's own tensors, not passed again (an op that
  // merges into its first state: TensorRT-LLM's, FlashInfer's in-place merge).
  bool into_first = false;
};

struct Key {
  std::vector<int64_t> words;
  uint64_t hash() const {
    uint64_t h = 0x9e3779b97f4a7c15ull;
    for (const int64_t w : words) {
      h ^= static_cast<uint64_t>(w) + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
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

}  // namespace

// Addresses of one call, in the plan's part order (0: absent).
struct CallAddresses {
  std::vector<uintptr_t> o, s;  // one address a part (stacked: one)
  uintptr_t split_counts = 0, sinks = 0, out = 0, out_stats = 0, row_mask = 0, indptr = 0,
            out_scale = 0, group_scales = 0, request_starts = 0, request_ops = 0;
};

// Everything a launch of one call layout needs besides its addresses: the
// Launch, and what the per-call checks read (extents, alignment, names).
struct CallPlan {
  Launch launch;
  int device_index = -1;  // -1: the CPU implementation
  int64_t store_bytes = 16, o_bytes = 2;
  int parts = 0;          // 0: stacked partials (their split strides are the params')
  bool in_place = false;  // out and out_stats are part 0's output and stats
  std::optional<float> log2_scale;  // fixed (LSE bases); maxsum: the call's scale
  // Bytes spanned: partial_o (one part), stats (one part), split_counts, sinks, out,
  // out_stats, row_mask, indptr, out_scale, group_scales, request_starts, request_ops.
  std::vector<int64_t> extents;
  // The names the entry point's users know, same order (parts: one name each).
  std::vector<std::string> o_names, s_names;
  std::vector<std::string> names;

  void check(CallAddresses& a, int64_t& o_split, int64_t& s_split) const;
  void launch_at(const CallAddresses& a, float scale, int64_t o_split, int64_t s_split,
                 void* stream) const;
};

namespace {

enum Extent { kEO, kES, kECounts, kESinks, kEOut, kEOutStats, kEMask, kEIndptr, kEOutScale,
              kEGroupScales, kERequestStarts, kERequestOps, kExtents };

bool overlaps(uintptr_t a, int64_t a_bytes, uintptr_t b, int64_t b_bytes) {
  return a && b && a_bytes > 0 && b_bytes > 0 && a < b + static_cast<uintptr_t>(b_bytes) &&
         b < a + static_cast<uintptr_t>(a_bytes);
}

// The split stride of parts held apart: their distance, in elements of `bytes`.
int64_t split_step(const std::string& name, const std::vector<uintptr_t>& at, int64_t align,
                   int64_t bytes) {
  if (at.size() < 2) return 0;
  const int64_t step = static_cast<int64_t>(at[1] - at[0]);
  for (size_t i = 2; i < at.size(); ++i) {
    if (static_cast<int64_t>(at[i] - at[i - 1]) != step) {
      throw py::value_error(name + ": parts must lie equally far apart in memory (two always "
                            "do); stack them into one tensor");
    }
  }
  if (step % align) {
    throw py::value_error(name + ": parts must lie a multiple of " + std::to_string(align) +
                          " bytes apart");
  }
  return step / bytes;
}

}  // namespace

void CallPlan::check(CallAddresses& a, int64_t& o_split, int64_t& s_split) const {
  if (a.o[0] % 16) throw py::value_error(o_names[0] + " must be 16-byte aligned");
  if (parts) {
    if (a.o.size() != static_cast<size_t>(parts) || a.s.size() != a.o.size()) {
      throw py::value_error(names[kEO] + ": " + std::to_string(parts) + " parts expected");
    }
    // Two parts are named one by one; more are a list.
    o_split = split_step(parts == 2 ? o_names[0] + " and " + o_names[1] : names[kEO], a.o, 16,
                         o_bytes);
    s_split = split_step(parts == 2 ? s_names[0] + " and " + s_names[1] : names[kES], a.s, 4, 4);
  } else {
    o_split = launch.params.o_stride_split;
    s_split = launch.params.stats_stride_split;
  }
  if (in_place) {
    if (a.out != a.o[0]) {
      throw py::value_error("an in-place merge writes " + names[kEOut] + " over " + o_names[0] +
                            ": pass that tensor");
    }
    if (a.out_stats != a.s[0]) {
      throw py::value_error("an in-place merge writes " + names[kEOutStats] + " over " +
                            s_names[0] + ": pass that tensor");
    }
  }
  if (a.out % static_cast<uintptr_t>(store_bytes)) {
    throw py::value_error(names[kEOut] + " and each of its rows must be " +
                          std::to_string(store_bytes) + "-byte aligned");
  }
  struct Span {
    const std::string* name;
    uintptr_t at;
    int64_t bytes;
  };
  const size_t n = parts ? parts : 1;
  std::vector<Span> inputs;
  inputs.reserve(2 * n + 7);
  for (size_t i = 0; i < n; ++i) inputs.push_back({&o_names[i], a.o[i], extents[kEO]});
  for (size_t i = 0; i < n; ++i) inputs.push_back({&s_names[i], a.s[i], extents[kES]});
  inputs.push_back({&names[kECounts], a.split_counts, extents[kECounts]});
  inputs.push_back({&names[kESinks], a.sinks, extents[kESinks]});
  inputs.push_back({&names[kEMask], a.row_mask, extents[kEMask]});
  inputs.push_back({&names[kEIndptr], a.indptr, extents[kEIndptr]});
  inputs.push_back({&names[kEOutScale], a.out_scale, extents[kEOutScale]});
  inputs.push_back({&names[kERequestStarts], a.request_starts, extents[kERequestStarts]});
  inputs.push_back({&names[kERequestOps], a.request_ops, extents[kERequestOps]});
  const Span outputs[] = {{&names[kEOut], a.out, extents[kEOut]},
                          {&names[kEOutStats], a.out_stats, extents[kEOutStats]},
                          {&names[kEGroupScales], a.group_scales, extents[kEGroupScales]}};
  for (int k = 0; k < 3; ++k) {
    const Span& out = outputs[k];
    for (const Span& in : inputs) {
      // An in-place merge writes its output and stats over part 0's own.
      if (in_place && ((k == 0 && in.name == &o_names[0]) || (k == 1 && in.name == &s_names[0]))) {
        continue;
      }
      if (overlaps(out.at, out.bytes, in.at, in.bytes)) {
        throw py::value_error(*out.name + " overlaps " + *in.name +
                              ": outputs must not alias inputs");
      }
    }
    for (int j = 0; j < k; ++j) {
      if (overlaps(out.at, out.bytes, outputs[j].at, outputs[j].bytes)) {
        throw py::value_error(*out.name + " overlaps " + *outputs[j].name +
                              ": outputs must not alias each other");
      }
    }
  }
}

void CallPlan::launch_at(const CallAddresses& a, float scale, int64_t o_split, int64_t s_split,
                         void* stream) const {
  MergeParams p = with_addresses(launch.params, a.o[0], a.s[0], a.split_counts, a.sinks, a.out,
                                 a.out_stats, log2_scale ? *log2_scale : scale);
  p.row_mask = as_pointer<const uint8_t>(a.row_mask);
  p.indptr = as_pointer<const void>(a.indptr);
  p.out_scale = as_pointer<const float>(a.out_scale);
  p.group_scales = as_pointer<void>(a.group_scales);
  p.request_starts = as_pointer<const int64_t>(a.request_starts);
  p.request_ops = as_pointer<const int64_t>(a.request_ops);
  p.o_stride_split = o_split;
  p.stats_stride_split = s_split;
  const KernelConfig config = launch.config;
  if (device_index < 0) {
    raise_for(merge_cpu_released(p, config));
    return;
  }
  CudaTarget target = launch.target;
  target.stream = stream;
  raise_for(merge_cuda(p, config, target));
}

namespace {

struct Entry {
  std::vector<int64_t> key;
  PyObject* plan_object = nullptr;  // owned: keeps `plan` alive
  const CallPlan* plan = nullptr;
  bool reversed = false;            // the plan takes the form's two parts in reverse order
  Setting environment[kEnvironmentSize];
};

struct State {
  const dlpack::ExchangeApi* api = nullptr;
  PyTypeObject* tensor_type = nullptr;
  PyObject* is_grad_enabled = nullptr;
  PyObject* requires_grad = nullptr;  // the interned attribute name
  std::vector<Form> forms;
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
  if (t.ndim < 0 || t.ndim > kMaxDims ||
      (t.ndim > 0 && (t.shape == nullptr || t.strides == nullptr))) {
    return false;
  }
  key.words.push_back(static_cast<int64_t>(t.dtype.code) | static_cast<int64_t>(t.dtype.bits) << 8 |
                      static_cast<int64_t>(t.dtype.lanes) << 16 |
                      static_cast<int64_t>(static_cast<uint32_t>(t.device.device_type)) << 32);
  key.words.push_back(static_cast<int64_t>(static_cast<uint32_t>(t.device.device_id)) |
                      static_cast<int64_t>(t.ndim) << 32);
  key.words.insert(key.words.end(), t.shape, t.shape + t.ndim);
  key.words.insert(key.words.end(), t.strides, t.strides + t.ndim);
  return true;
}

// Appends a keyed value; false for a value the key cannot hold exactly.
bool read_value(PyObject* value, Key& key) {
  if (value == Py_None) {
    key.words.push_back(0);
  } else if (PyBool_Check(value)) {
    key.words.push_back(value == Py_True ? 2 : 1);
  } else if (PyLong_CheckExact(value)) {
    int overflow = 0;
    const long long v = PyLong_AsLongLongAndOverflow(value, &overflow);
    if (overflow || (v == -1 && PyErr_Occurred())) {
      PyErr_Clear();
      return false;
    }
    key.words.push_back(3);
    key.words.push_back(v);
  } else if (PyFloat_CheckExact(value)) {
    const double v = PyFloat_AS_DOUBLE(value);
    int64_t bits = 0;
    std::memcpy(&bits, &v, sizeof bits);
    key.words.push_back(4);
    key.words.push_back(bits);
  } else {
    return false;
  }
  return true;
}

// One call as the form reads it.
struct Call {
  Key key;
  dlpack::Tensor tensors[kMaxArgs];
  bool present[kMaxArgs] = {};
  float scale = 0.f;
};

// Reads a call's key and tensors; false when the call is not one this path serves.
bool read_call(const State& s, PyObject* const* args, Py_ssize_t nargs, Call& call) {
  if (nargs < 1 || !PyLong_CheckExact(args[0])) return false;
  const long form_id = PyLong_AsLong(args[0]);
  if (form_id < 0 || form_id >= static_cast<long>(s.forms.size())) return false;
  const Form& form = s.forms[form_id];
  const Py_ssize_t n = nargs - 1;
  if (n != static_cast<Py_ssize_t>(form.roles.size())) return false;
  call.key.words.reserve(64);
  call.key.words.push_back(form_id);
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* value = args[i + 1];
    const Role role = form.roles[i];
    if (role == kKey) {
      if (!read_value(value, call.key)) return false;
    } else if (role == kScale) {
      if (!PyFloat_CheckExact(value)) return false;
      const double scale = PyFloat_AS_DOUBLE(value);
      // A normal float32 (a smaller one flushes to 0 in the kernels): else the Python path
      // converts or refuses.
      if (!(scale >= FLT_MIN && scale <= FLT_MAX)) return false;
      call.scale = static_cast<float>(scale);
    } else if (value == Py_None) {
      call.key.words.push_back(-1);
    } else {
      call.present[i] = true;
      if (!read_tensor(s, value, call.tensors[i], call.key)) return false;
    }
  }
  if (form.in_place) {  // which output is which input
    int64_t same = 0, bit = 0;
    uintptr_t outputs[2] = {};
    for (Py_ssize_t i = 0; i < n; ++i) {
      if (call.present[i] && (form.roles[i] == kOut || form.roles[i] == kOutStats)) {
        outputs[form.roles[i] == kOutStats] = address_of(call.tensors[i]);
      }
    }
    for (Py_ssize_t i = 0; i < n; ++i) {
      if (form.roles[i] != kPartialO && form.roles[i] != kStats) continue;
      const uintptr_t at = call.present[i] ? address_of(call.tensors[i]) : 0;
      same |= static_cast<int64_t>(at != 0 && at == outputs[form.roles[i] == kStats]) << bit++;
    }
    call.key.words.push_back(same);
  }
  return true;
}

// The addresses of a call in the plan's part order.
CallAddresses addresses_of(const Form& form, const Call& call, bool reversed) {
  CallAddresses a;
  a.o.reserve(kMaxParts);
  a.s.reserve(kMaxParts);
  for (size_t i = 0; i < form.roles.size(); ++i) {
    const uintptr_t at = call.present[i] ? address_of(call.tensors[i]) : 0;
    switch (form.roles[i]) {
      case kPartialO: a.o.push_back(at); break;
      case kStats: a.s.push_back(at); break;
      case kOut: a.out = at; break;
      case kOutStats: a.out_stats = at; break;
      case kSinks: a.sinks = at; break;
      case kSplitCounts: a.split_counts = at; break;
      case kRowMask: a.row_mask = at; break;
      case kOutScale: a.out_scale = at; break;
      case kGroupScales: a.group_scales = at; break;
      case kRequestStarts: a.request_starts = at; break;
      case kRequestOps: a.request_ops = at; break;
      default: break;
    }
  }
  if (form.into_first) {  // the form's first part (its plans take the parts in order)
    a.out = a.o[0];
    a.out_stats = a.s.empty() ? 0 : a.s[0];
  }
  if (reversed && a.o.size() == 2 && a.s.size() == 2) {
    std::swap(a.o[0], a.o[1]);
    std::swap(a.s[0], a.s[1]);
  }
  return a;
}

bool same_key(const Entry& entry, const Key& key) { return entry.key == key.words; }

// True when grad mode is on and an input requires grad (the Python path raises
// then); true also when the question cannot be read.
bool grad_refused(State& s, const Form& form, PyObject* const* args) {
  bool requires = false;
  for (size_t i = 0; i < form.roles.size(); ++i) {
    const Role role = form.roles[i];
    if ((role != kPartialO && role != kStats && role != kSinks) || args[i + 1] == Py_None) continue;
    PyObject* value = PyObject_GetAttr(args[i + 1], s.requires_grad);
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

PyObject* answer(bool launched) {
  State& s = state();
  ++(launched ? s.hits : s.misses);
  return PyBool_FromLong(launched);
}

// call_fast(form, *args) -> bool: launches a call of a registered layout.
PyObject* call_fast(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  State& s = state();
  if (s.api == nullptr || s.entries.empty()) return answer(false);
  Call call;
  if (!read_call(s, args, nargs, call)) return answer(false);
  const auto found = s.entries.find(call.key.hash());
  if (found == s.entries.end() || !same_key(found->second, call.key)) return answer(false);
  const Entry& entry = found->second;
  for (int i = 0; i < kEnvironmentSize; ++i) {
    if (!entry.environment[i].matches(std::getenv(kEnvironment[i]))) return answer(false);
  }
  const Form& form = s.forms[PyLong_AsLong(args[0])];
  if (grad_refused(s, form, args)) return answer(false);
  const CallPlan& plan = *entry.plan;
  CallAddresses a = addresses_of(form, call, entry.reversed);
  void* stream = nullptr;
  if (plan.device_index >= 0 &&
      s.api->current_work_stream(dlpack::kCuda, plan.device_index, &stream) != 0) {
    PyErr_Clear();
    return answer(false);
  }
  // The entry may be released by a launch that runs Python code (it never does
  // today); hold the plan meanwhile.
  PyObject* keep = entry.plan_object;
  Py_INCREF(keep);
  PyObject* done = guarded([&] {
    int64_t o_split = 0, s_split = 0;
    plan.check(a, o_split, s_split);
    plan.launch_at(a, call.scale, o_split, s_split, stream);
  });
  Py_DECREF(keep);
  if (done == nullptr) return nullptr;
  Py_DECREF(done);
  return answer(true);
}

// call_add(plan, reversed, form, *args) -> bool: registers the plan that the
// Python path just built for this call.
PyObject* call_add(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  State& s = state();
  if (nargs < 3) {
    PyErr_SetString(PyExc_TypeError, "call_add(plan, reversed, form, *args)");
    return nullptr;
  }
  // A form that merges into its first part writes over that part: plans take it first.
  if (args[1] == Py_True && PyLong_CheckExact(args[2])) {
    const long form_id = PyLong_AsLong(args[2]);
    if (form_id >= 0 && form_id < static_cast<long>(s.forms.size()) && s.forms[form_id].into_first) {
      PyErr_SetString(PyExc_ValueError, "call_add: a form that merges into its first part takes "
                                        "its parts in order");
      return nullptr;
    }
  }
  if (s.api == nullptr) Py_RETURN_FALSE;
  const CallPlan* plan = nullptr;
  try {
    plan = &py::handle(args[0]).cast<const CallPlan&>();
  } catch (const py::cast_error&) {
    PyErr_SetString(PyExc_TypeError, "call_add: plan must be a CallPlan");
    return nullptr;
  }
  Call call;
  if (!read_call(s, args + 2, nargs - 2, call)) Py_RETURN_FALSE;
  Entry entry;
  entry.key = call.key.words;
  entry.plan = plan;
  entry.reversed = args[1] == Py_True;
  for (int i = 0; i < kEnvironmentSize; ++i) {
    const char* value = std::getenv(kEnvironment[i]);
    entry.environment[i] = {value != nullptr, value ? value : ""};
  }
  Py_INCREF(args[0]);
  entry.plan_object = args[0];
  Entry& slot = s.entries[call.key.hash()];
  PyObject* old = slot.plan_object;
  slot = std::move(entry);
  Py_XDECREF(old);
  Py_RETURN_TRUE;
}

PyObject* fast_clear(PyObject*, PyObject*) {
  State& s = state();
  // Moved out first: a release may run Python code that registers again.
  std::unordered_map<uint64_t, Entry> old;
  old.swap(s.entries);
  for (auto& [hash, entry] : old) Py_XDECREF(entry.plan_object);
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

uintptr_t at(const py::sequence& values, size_t i) {
  return i < values.size() ? values[i].cast<uintptr_t>() : 0;
}

}  // namespace

void def_fast_call(py::module_& m) {
  py::module_ roles = m.def_submodule("call_roles", "Roles of a call form's arguments");
  constexpr std::pair<const char*, Role> kRoleNames[] = {
      {"KEY", kKey},         {"SCALE", kScale},     {"PARTIAL_O", kPartialO},
      {"STATS", kStats},     {"OUT", kOut},         {"OUT_STATS", kOutStats},
      {"SINKS", kSinks},     {"SPLIT_COUNTS", kSplitCounts}, {"ROW_MASK", kRowMask},
      {"OUT_SCALE", kOutScale}, {"GROUP_SCALES", kGroupScales},
      {"REQUEST_STARTS", kRequestStarts}, {"REQUEST_OPS", kRequestOps}};
  for (const auto& [name, role] : kRoleNames) roles.attr(name) = static_cast<int>(role);

  m.def(
      "call_form",
      [](const std::vector<int>& roles, bool in_place, bool into_first) {
        State& s = state();
        if (roles.size() > kMaxArgs) throw py::value_error("call_form: too many arguments");
        Form form;
        int parts = 0, outputs = 0;
        for (const int role : roles) {
          if (role < 0 || role >= kRoles) throw py::value_error("call_form: unknown role");
          form.roles.push_back(static_cast<Role>(role));
          parts += role == kPartialO;
          outputs += role == kOut || role == kOutStats;
        }
        if (parts < 1 || parts > kMaxParts) {
          throw py::value_error("call_form: one or two partial-output arguments");
        }
        if (into_first && (parts != 2 || outputs || in_place)) {
          throw py::value_error("call_form: a form that merges into its first part has two "
                                "parts, names no outputs and is not in_place");
        }
        form.in_place = in_place;
        form.into_first = into_first;
        s.forms.push_back(std::move(form));
        return static_cast<int>(s.forms.size() - 1);
      },
      py::arg("roles"), py::arg("in_place") = false, py::arg("into_first") = false,
      "Registers a call form (the role of each argument of an entry point); returns its id.\n"
      "in_place: outputs may be inputs; into_first: the outputs are the first part's\n"
      "partial output and stats, not passed again");

  py::class_<CallPlan>(m, "CallPlan")
      .def(py::init([](const Launch& launch, int device_index, int64_t store_bytes,
                       int64_t o_bytes, int parts, bool in_place, std::optional<float> log2_scale,
                       std::vector<int64_t> extents, std::vector<std::string> o_names,
                       std::vector<std::string> s_names, std::vector<std::string> names) {
             if (extents.size() != kExtents || names.size() != kExtents || parts < 0 ||
                 o_names.size() != static_cast<size_t>(parts ? parts : 1) ||
                 s_names.size() != o_names.size() || store_bytes <= 0 || o_bytes <= 0) {
               throw py::value_error("CallPlan: inconsistent sizes");
             }
             return CallPlan{launch, device_index, store_bytes, o_bytes, parts, in_place,
                             log2_scale, std::move(extents), std::move(o_names),
                             std::move(s_names), std::move(names)};
           }),
           py::arg("launch"), py::arg("device_index"), py::arg("store_bytes"), py::arg("o_bytes"),
           py::arg("parts"), py::arg("in_place"), py::arg("log2_scale"), py::arg("extents"),
           py::arg("o_names"), py::arg("s_names"), py::arg("names"))
      .def_readonly("launch", &CallPlan::launch)
      .def(
          "__call__",
          [](const CallPlan& plan, const py::sequence& o, const py::sequence& stats,
             const py::sequence& others, float scale, uintptr_t stream) {
            CallAddresses a;
            for (size_t i = 0; i < o.size(); ++i) a.o.push_back(o[i].cast<uintptr_t>());
            for (size_t i = 0; i < stats.size(); ++i) a.s.push_back(stats[i].cast<uintptr_t>());
            if (a.o.empty() || a.s.empty()) throw py::value_error("CallPlan: no partials");
            a.split_counts = at(others, 0);
            a.sinks = at(others, 1);
            a.out = at(others, 2);
            a.out_stats = at(others, 3);
            a.row_mask = at(others, 4);
            a.indptr = at(others, 5);
            a.out_scale = at(others, 6);
            a.group_scales = at(others, 7);
            a.request_starts = at(others, 8);
            a.request_ops = at(others, 9);
            int64_t o_split = 0, s_split = 0;
            plan.check(a, o_split, s_split);
            plan.launch_at(a, scale, o_split, s_split, as_pointer<void>(stream));
          },
          py::arg("o"), py::arg("stats"), py::arg("others"), py::arg("scale"),
          py::arg("stream") = 0,
          "Checks these addresses (alignment, parts, in place, aliasing) and launches:\n"
          "o and stats one address per part, others (split_counts, sinks, out, out_stats, "
          "row_mask, indptr, out_scale, group_scales, request_starts, request_ops), 0 absent");

  static PyMethodDef methods[] = {
      {"call_fast", as_function(&call_fast), METH_FASTCALL,
       "call_fast(form, *args) -> bool\n"
       "Launches a call of a registered layout; False: not served here (take the Python path)"},
      {"call_add", as_function(&call_add), METH_FASTCALL,
       "call_add(plan, reversed, form, *args) -> bool\n"
       "Registers the CallPlan of a call that the Python path built"},
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
