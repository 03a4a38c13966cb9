// What the statically linked CUDA runtime knows about itself and the machine:
// versions, and an error's text with, for an install that does not fit the
// machine, its cause and remedy. Built into kvsplit._ext and kvsplit._bench.
#include <cuda_runtime.h>

#include <string>

#include "kvsplit/launch.h"

namespace kvsplit {
namespace {

std::string version_text(int version) {
  return std::to_string(version / 1000) + "." + std::to_string(version % 1000 / 10);
}

// "sm_86" for `device` (-1: the current one), or "this GPU" when the runtime cannot say.
std::string sm_of(int device) {
  int major = 0, minor = 0;
  if ((device < 0 && cudaGetDevice(&device) != cudaSuccess) ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
    return "this GPU";
  }
  return "sm_" + std::to_string(major) + std::to_string(minor);
}

std::string cause_and_remedy(cudaError_t error, int device) {
  const std::string runtime = version_text(cuda_runtime_version());
  const std::string min_driver = std::to_string(cuda_min_driver());
  switch (error) {
    case cudaErrorInsufficientDriver: {
      const int driver = cuda_driver_version();
      const std::string found =
          driver == 0 ? "no NVIDIA driver was found (libcuda.so.1 did not load)"
                      : "the NVIDIA driver supports CUDA " + version_text(driver);
      return found + ", but this kvsplit build carries the CUDA " + runtime +
             " runtime, which needs driver " + min_driver +
             " or newer. Update the NVIDIA driver, or build kvsplit from source with a CUDA "
             "toolkit no newer than the driver's CUDA version (nvidia-smi shows it)";
    }
    case cudaErrorNoKernelImageForDevice: {
      const std::string sm = sm_of(device);
      return "this kvsplit build has no code that runs on " + sm + ": it was built for " +
             KVSPLIT_CUDA_ARCHITECTURES +
             " (machine code runs on its own GPU family only, PTX on that one and newer). "
             "Install a kvsplit wheel built for " + sm +
             ", or build from source with CUDAARCHS set to it (e.g. CUDAARCHS=" +
             (sm.rfind("sm_", 0) == 0 ? sm.substr(3) : std::string("NN")) + "-real)";
    }
    case cudaErrorUnsupportedPtxVersion:
      return "this kvsplit build's PTX (CUDA " + runtime +
             ") is newer than the NVIDIA driver can compile. Update the driver to " +
             min_driver + " or newer, or install a build with machine code for this GPU";
    case cudaErrorSystemDriverMismatch:
      return "the NVIDIA kernel module and the user-space driver library differ in version "
             "(a driver update without a reboot?). Reboot, or reinstall the driver";
    case cudaErrorNoDevice:
      return "no CUDA device is visible to this process (check CUDA_VISIBLE_DEVICES)";
    default:
      return "";
  }
}

}  // namespace

int cuda_runtime_version() { return CUDART_VERSION; }

int cuda_driver_version() {
  int version = 0;
  return cudaDriverGetVersion(&version) == cudaSuccess ? version : 0;
}

// The minimum Linux driver of each CUDA major version under minor-version
// compatibility (NVIDIA's CUDA compatibility guide).
int cuda_min_driver() {
  switch (CUDART_VERSION / 1000) {
    case 11: return 450;
    case 12: return 525;
    default: return 580;  // 13.x
  }
}

std::string cuda_error_string(int64_t error, int device) {
  const auto value = static_cast<cudaError_t>(error);
  std::string description = cudaGetErrorString(value);
  while (!description.empty() && description.back() == '.') description.pop_back();
  std::string text = std::string(cudaGetErrorName(value)) + ": " + description;
  const std::string remedy = cause_and_remedy(value, device);
  if (!remedy.empty()) text += "; " + remedy;
  return text;
}

}  // namespace kvsplit
