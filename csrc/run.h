// What the handler files share: running one cuDNN graph on XLA's stream,
// and the packed-pass handlers (pass.cc) that ffi.cc's module registers.
#pragma once

#include <cuda_runtime.h>

#include "sdpa.h"
#include "xla/ffi/api/ffi.h"

namespace jax_ring {

// Builds (or finds) `key`'s plan on its device's handle and, unless
// `workspace` is null (an INITIALIZE stage), runs it on `stream` with the
// device pointers `ptrs` (by Uid). The workspace is XLA's buffer of the
// bytes the Python side asked the same plan for.
xla::ffi::Error Run(const SdpaKey& key, cudaStream_t stream,
                    const xla::ffi::AnyBuffer* workspace, void* const* ptrs);

}  // namespace jax_ring

XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxRingPassForwardInit);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxRingPassForward);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxRingPassBackwardInit);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxRingPassBackward);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxRingUninitialized);
