// The few CUDA runtime entry points the launchers call, for the CPU emulation (see emu.h).
#include <cstdlib>
#include <cstring>

#include "emu.h"

extern "C" {

cudaError_t cudaGetLastError(void) { return cudaSuccess; }
cudaError_t cudaGetDevice(int* device) {
  *device = 0;
  return cudaSuccess;
}
// An sm_90 device (H100), or the compute capability BERTFAST_EMU_ARCH gives ("80": an A100, whose
// launches take no wgmma kernel), read at each call so that a test may set it.
cudaError_t cudaDeviceGetAttribute(int* value, enum cudaDeviceAttr attr, int) {
  const char* arch = std::getenv("BERTFAST_EMU_ARCH");
  const int cc = arch && *arch ? std::atoi(arch) : 90;
  if (attr == cudaDevAttrMaxSharedMemoryPerBlockOptin) {
    *value = 227 * 1024;
  } else if (attr == cudaDevAttrComputeCapabilityMajor) {
    *value = cc / 10;
  } else if (attr == cudaDevAttrComputeCapabilityMinor) {
    *value = cc % 10;
  } else {
    *value = 0;
  }
  return cudaSuccess;
}
cudaError_t cudaFuncSetAttribute(const void*, enum cudaFuncAttribute, int) { return cudaSuccess; }
cudaError_t cudaMemsetAsync(void* p, int value, size_t count, cudaStream_t) {
  std::memset(p, value, count);
  return cudaSuccess;
}
const char* cudaGetErrorName(cudaError_t) { return "cudaErrorEmulated"; }
const char* cudaGetErrorString(cudaError_t) { return "error in the CPU emulation"; }

}  // extern "C"
