// Launcher error messages, the shared reduction-block policy, whether wgmma kernels may run, and the
// host Philox (for tests).
#include <cstdarg>
#include <cstdio>
#include <string_view>

#include "common.cuh"

namespace bertfast {

namespace {
thread_local char g_message[1024] = "";
}

const char* last_error() { return g_message; }

void clear_error() { g_message[0] = '\0'; }

int fail(int status, const char* fmt, ...) {
  va_list args;
  va_start(args, fmt);
  vsnprintf(g_message, sizeof(g_message), fmt, args);
  va_end(args);
  return status;
}

int fail_cuda(const char* where, cudaError_t err) {
  snprintf(g_message, sizeof(g_message), "%s: CUDA error %d (%s): %s", where, (int)err,
           cudaGetErrorName(err), cudaGetErrorString(err));
  return (int)err;
}

int64_t reduction_blocks(int64_t n_rows) {
  // Enough blocks to fill an H100 several times over, few enough that the fp32 partials
  // (blocks x columns) stay small next to the [n_rows, columns] tensors they summarise.
  const int64_t kMaxBlocks = 1024;
  if (n_rows <= 0) return 1;
  return n_rows < kMaxBlocks ? n_rows : kMaxBlocks;
}

// wgmma is an arch-specific feature of sm_90: its kernels run on an sm_90 GPU (H100, H200) from the
// sm_90a build (BERTFAST_CUDA_ARCHS naming 90a; an sm_90 or later build has no such code). The CPU
// emulator emulates an sm_90 device (emu_runtime.cpp; BERTFAST_EMU_ARCH may say another).
bool wgmma_available() {
#if defined(BERTFAST_EMU)
  constexpr bool kBuilt = true;
#elif defined(BERTFAST_CUDA_ARCHS)
  constexpr bool kBuilt = std::string_view(BERTFAST_CUDA_ARCHS).find("90a") != std::string_view::npos;
#else
  constexpr bool kBuilt = false;
#endif
  int dev = 0, major = 0, minor = 0;
  if (!kBuilt || cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess) {
    cudaGetLastError();  // no sticky error left for the next launch's check
    return false;
  }
  return major == 9 && minor == 0;
}

void philox4x32_10_host(const uint32_t c[4], const uint32_t k[2], uint32_t out[4]) {
  const U4 r = philox4x32_10(U4{c[0], c[1], c[2], c[3]}, k[0], k[1]);
  out[0] = r.x;
  out[1] = r.y;
  out[2] = r.z;
  out[3] = r.w;
}

}  // namespace bertfast
