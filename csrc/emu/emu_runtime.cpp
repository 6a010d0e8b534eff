// The few CUDA runtime entry points the launchers call, for the CPU emulation (see emu.h).
#include <cstring>

#include "emu.h"

extern "C" {

cudaError_t cudaGetLastError(void) { return cudaSuccess; }
cudaError_t cudaGetDevice(int* device) {
  *device = 0;
  return cudaSuccess;
}
cudaError_t cudaDeviceGetAttribute(int* value, enum cudaDeviceAttr attr, int) {
  *value = attr == cudaDevAttrMaxSharedMemoryPerBlockOptin ? 227 * 1024 : 0;
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
