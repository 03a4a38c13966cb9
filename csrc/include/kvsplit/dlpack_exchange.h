// The pieces of the DLPack C ABI (https://github.com/dmlc/dlpack, version 1.x)
// that the binding's per-call path reads: a tensor description and the table
// of C functions that a framework publishes on its tensor type as the capsule
// `__dlpack_c_exchange_api__` (torch >= 2.11; torch 2.10 published its address
// as the int `__c_dlpack_exchange_api__`). Declared here from the spec so
// that the build needs no torch headers; the layouts must match the spec's
// byte for byte, and the binding checks the table's major version before use.
#pragma once

#include <cstdint>

namespace kvsplit::dlpack {

struct Version {
  uint32_t major;
  uint32_t minor;
};

// DLDeviceType: an int-sized enum in the spec.
enum DeviceType : int32_t { kCpu = 1, kCuda = 2 };

struct Device {
  int32_t device_type;
  int32_t device_id;
};

struct DataType {
  uint8_t code;
  uint8_t bits;
  uint16_t lanes;
};

// DLTensor. `strides` are in elements; `data` + `byte_offset` is the first element.
struct Tensor {
  void* data;
  Device device;
  int32_t ndim;
  DataType dtype;
  int64_t* shape;
  int64_t* strides;
  uint64_t byte_offset;
};

struct ExchangeApiHeader {
  Version version;
  ExchangeApiHeader* prev_api;
};

// DLPackExchangeAPI: the header, then five function pointers in this order.
// Only the last two are called here; the others are opaque.
struct ExchangeApi {
  ExchangeApiHeader header;
  void* managed_tensor_allocator;
  void* managed_tensor_from_py_object_no_sync;
  void* managed_tensor_to_py_object_no_sync;
  // Fills `out` (shape and strides stay owned by the framework, valid until
  // control returns to it); 0, or -1 with a Python exception set.
  int (*dltensor_from_py_object_no_sync)(void* py_object, Tensor* out);
  // The framework's current stream of (device_type, device_id); 0 or -1.
  int (*current_work_stream)(int32_t device_type, int32_t device_id, void** out_stream);
};

inline constexpr uint32_t kMajorVersion = 1;
inline constexpr const char* kCapsuleName = "dlpack_exchange_api";

}  // namespace kvsplit::dlpack
