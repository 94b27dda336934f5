// XLA FFI handlers for cuDNN fused attention, and the nanobind module that
// hands them to Python (jax_ring/_src/cudnn.py registers them with jax).
//
// Buffers are BSHD; see sdpa.h for the mask attributes. B' below is the
// number of virtual batches: B, or B * slots with packed documents. Failures come back
// as ffi::Error with a message; nothing here aborts the process.
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

#include <cuda_runtime.h>
#include <cudnn.h>
#include <nanobind/nanobind.h>

#include "sdpa.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
namespace nb = nanobind;

namespace jax_ring {
namespace {

struct Mask {
  int64_t row_start, col_start, right_bound, left_bound;
  bool padding;
  float softcap;
  int64_t slots;
};

std::string Shape(const ffi::AnyBuffer& x) {
  std::string s = "(";
  for (size_t i = 0; i < x.dimensions().size(); ++i) {
    s += (i ? ", " : "") + std::to_string(x.dimensions()[i]);
  }
  return s + ")";
}

// Checks q (B, T, N, H) and k/v (B, S, K, H) and fills the key's shapes.
ffi::Error Describe(const ffi::AnyBuffer& q, const ffi::AnyBuffer& k,
                    const ffi::AnyBuffer& v, const Mask& mask, bool backward,
                    int32_t device, float scale, SdpaKey* key) {
  if (q.dimensions().size() != 4 || k.dimensions().size() != 4 ||
      v.dimensions().size() != 4) {
    return ffi::Error::InvalidArgument(
        "jax_ring cuDNN attention: q, k, v must be rank 4, got q " + Shape(q) +
        ", k " + Shape(k) + ", v " + Shape(v));
  }
  auto qd = q.dimensions(), kd = k.dimensions();
  if (q.element_type() != k.element_type() ||
      q.element_type() != v.element_type() ||
      (q.element_type() != ffi::BF16 && q.element_type() != ffi::F16)) {
    return ffi::Error::InvalidArgument(
        "jax_ring cuDNN attention: q, k, v must all be bfloat16 or float16");
  }
  if (kd[0] != qd[0] || kd[3] != qd[3] || qd[2] % kd[2] != 0 ||
      Shape(k) != Shape(v)) {
    return ffi::Error::InvalidArgument(
        "jax_ring cuDNN attention: incompatible q " + Shape(q) + ", k " +
        Shape(k) + ", v " + Shape(v));
  }
  if (mask.row_start < 0 || mask.row_start >= qd[1] || mask.col_start < 0 ||
      mask.col_start >= kd[1]) {
    return ffi::Error::InvalidArgument(
        "jax_ring cuDNN attention: row_start/col_start out of range");
  }
  if (mask.slots < 0 || (mask.slots > 0 && (mask.row_start || mask.col_start))) {
    return ffi::Error::InvalidArgument(
        "jax_ring cuDNN attention: packed documents (slots = " +
        std::to_string(mask.slots) + ") need row_start = col_start = 0");
  }
  *key = SdpaKey{backward,
                 q.element_type() == ffi::BF16 ? Dtype::kBF16 : Dtype::kF16,
                 device, qd[0], qd[1], kd[1], qd[2], kd[2], qd[3],
                 mask.slots, mask.row_start, mask.col_start, mask.right_bound,
                 mask.left_bound, mask.padding, scale, mask.softcap};
  return ffi::Error::Success();
}

// Device pointers of one call by Uid. BSHD buffers start at the window's
// first query row (q side) or first key (kv side): no copies.
struct VariantPack {
  explicit VariantPack(const SdpaKey& key) : key(key) {}
  void QSide(Uid uid, void* base) { Set(uid, base, key.row_start, key.n); }
  void KvSide(Uid uid, void* base) { Set(uid, base, key.col_start, key.k); }
  void Set(Uid uid, void* base, int64_t row, int64_t heads) {
    ptrs[uid] = static_cast<char*>(base) + row * heads * key.h * 2;  // 16-bit
  }

  const SdpaKey& key;
  void* ptrs[kRaggedKV + 1] = {};
};

ffi::Error Run(const SdpaKey& key, cudaStream_t stream,
               ffi::ScratchAllocator& scratch, void* const* ptrs) {
  std::string error;
  cudnnHandle_t handle = HandleFor(key.device, &error);
  if (handle == nullptr) return ffi::Error::Internal(error);
  auto lock = LockHandle(key.device);
  cudnnStatus_t status = cudnnSetStream(handle, stream);
  if (status != CUDNN_STATUS_SUCCESS) {
    return ffi::Error::Internal(std::string("cudnnSetStream: ") +
                                cudnnGetErrorString(status));
  }
  auto plan = GetPlan(key, handle, &error);
  if (!plan) return ffi::Error::Internal("jax_ring cuDNN attention: " + error);
  void* workspace = nullptr;
  if (int64_t bytes = WorkspaceSize(*plan); bytes > 0) {
    // XLA serves alignments up to 64 bytes; cuDNN needs 16.
    auto allocated = scratch.Allocate(bytes, 16);
    if (!allocated.has_value()) {
      return ffi::Error(ffi::ErrorCode::kResourceExhausted,
                        "jax_ring cuDNN attention: cannot allocate " +
                            std::to_string(bytes) + " bytes of workspace");
    }
    workspace = *allocated;
  }
  if (!Execute(*plan, handle, ptrs, workspace, &error)) {
    return ffi::Error::Internal("jax_ring cuDNN attention: " + error);
  }
  return ffi::Error::Success();
}

// The int32 vectors that describe the rows: window lengths, and the ragged
// offsets of packed documents.
struct Rows {
  ffi::Buffer<ffi::S32> seq_q, seq_kv, ragged_q, ragged_kv;
};

// What both handlers share: the key, and the pointers of q, k, v, the
// stats and (if padding or packed) the row vectors.
ffi::Error Prepare(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                   void* stats, const Rows& rows, const Mask& mask,
                   bool backward, int32_t device, float scale, SdpaKey* key,
                   VariantPack* pack) {
  if (auto e = Describe(q, k, v, mask, backward, device, scale, key);
      e.failure()) {
    return e;
  }
  pack->QSide(kQ, q.untyped_data());
  pack->KvSide(kK, k.untyped_data());
  pack->KvSide(kV, v.untyped_data());
  pack->ptrs[kStats] = stats;
  const int64_t batches = mask.slots > 0 ? key->b * mask.slots : key->b;
  if (mask.padding || mask.slots > 0) {
    if (rows.seq_q.element_count() != batches ||
        rows.seq_kv.element_count() != batches) {
      return ffi::Error::InvalidArgument(
          "jax_ring cuDNN attention: seq_q/seq_kv need " +
          std::to_string(batches) + " entries");
    }
    pack->ptrs[kSeqQ] = rows.seq_q.untyped_data();
    pack->ptrs[kSeqKV] = rows.seq_kv.untyped_data();
  }
  if (mask.slots > 0) {
    if (rows.ragged_q.element_count() != batches + 1 ||
        rows.ragged_kv.element_count() != batches + 1) {
      return ffi::Error::InvalidArgument(
          "jax_ring cuDNN attention: ragged offsets need " +
          std::to_string(batches + 1) + " entries");
    }
    pack->ptrs[kRaggedQ] = rows.ragged_q.untyped_data();
    pack->ptrs[kRaggedKV] = rows.ragged_kv.untyped_data();
  }
  return ffi::Error::Success();
}

ffi::Error Forward(cudaStream_t stream, ffi::ScratchAllocator scratch,
                   int32_t device, ffi::AnyBuffer q, ffi::AnyBuffer k,
                   ffi::AnyBuffer v, ffi::Buffer<ffi::S32> seq_q,
                   ffi::Buffer<ffi::S32> seq_kv,
                   ffi::Buffer<ffi::S32> ragged_q,
                   ffi::Buffer<ffi::S32> ragged_kv,
                   ffi::Result<ffi::AnyBuffer> out,
                   ffi::Result<ffi::AnyBuffer> lse, float scale,
                   int64_t row_start, int64_t col_start, int64_t right_bound,
                   int64_t left_bound, bool padding, float softcap,
                   int64_t slots) {
  SdpaKey key;
  VariantPack pack(key);
  Mask mask{row_start, col_start, right_bound, left_bound,
            padding,   softcap,   slots};
  Rows rows{seq_q, seq_kv, ragged_q, ragged_kv};
  if (auto e = Prepare(q, k, v, lse->untyped_data(), rows, mask, false,
                       device, scale, &key, &pack);
      e.failure()) {
    return e;
  }
  pack.QSide(kO, out->untyped_data());
  return Run(key, stream, scratch, pack.ptrs);
}

ffi::Error Backward(cudaStream_t stream, ffi::ScratchAllocator scratch,
                    int32_t device, ffi::AnyBuffer q, ffi::AnyBuffer k,
                    ffi::AnyBuffer v, ffi::AnyBuffer out, ffi::AnyBuffer lse,
                    ffi::AnyBuffer dout, ffi::Buffer<ffi::S32> seq_q,
                    ffi::Buffer<ffi::S32> seq_kv,
                    ffi::Buffer<ffi::S32> ragged_q,
                    ffi::Buffer<ffi::S32> ragged_kv,
                    ffi::Result<ffi::AnyBuffer> dq,
                    ffi::Result<ffi::AnyBuffer> dk,
                    ffi::Result<ffi::AnyBuffer> dv, float scale,
                    int64_t row_start, int64_t col_start, int64_t right_bound,
                    int64_t left_bound, bool padding, float softcap,
                    int64_t slots) {
  SdpaKey key;
  VariantPack pack(key);
  Mask mask{row_start, col_start, right_bound, left_bound,
            padding,   softcap,   slots};
  Rows rows{seq_q, seq_kv, ragged_q, ragged_kv};
  if (auto e = Prepare(q, k, v, lse.untyped_data(), rows, mask, true, device,
                       scale, &key, &pack);
      e.failure()) {
    return e;
  }
  pack.QSide(kO, out.untyped_data());
  pack.QSide(kDO, dout.untyped_data());
  pack.QSide(kDQ, dq->untyped_data());
  pack.KvSide(kDK, dk->untyped_data());
  pack.KvSide(kDV, dv->untyped_data());
  return Run(key, stream, scratch, pack.ptrs);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    SdpaForward, Forward,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()
        .Ctx<ffi::ScratchAllocator>()
        .Ctx<ffi::DeviceOrdinal>()
        .Arg<ffi::AnyBuffer>()     // q       (B, T, N, H)
        .Arg<ffi::AnyBuffer>()     // k       (B, S, K, H)
        .Arg<ffi::AnyBuffer>()     // v       (B, S, K, H)
        .Arg<ffi::Buffer<ffi::S32>>()  // seq_q   (B',) rows in the window
        .Arg<ffi::Buffer<ffi::S32>>()  // seq_kv  (B',) keys in the window
        .Arg<ffi::Buffer<ffi::S32>>()  // ragged_q  (B' + 1,) if slots > 0
        .Arg<ffi::Buffer<ffi::S32>>()  // ragged_kv (B' + 1,) if slots > 0
        .Ret<ffi::AnyBuffer>()     // out     (B, T, N, H)
        .Ret<ffi::AnyBuffer>()     // lse     (B', N, T - row_start) float32
        .Attr<float>("scale")
        .Attr<int64_t>("row_start")
        .Attr<int64_t>("col_start")
        .Attr<int64_t>("right_bound")
        .Attr<int64_t>("left_bound")
        .Attr<bool>("padding")
        .Attr<float>("softcap")
        .Attr<int64_t>("slots"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    SdpaBackward, Backward,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()
        .Ctx<ffi::ScratchAllocator>()
        .Ctx<ffi::DeviceOrdinal>()
        .Arg<ffi::AnyBuffer>()     // q       (B, T, N, H)
        .Arg<ffi::AnyBuffer>()     // k       (B, S, K, H)
        .Arg<ffi::AnyBuffer>()     // v       (B, S, K, H)
        .Arg<ffi::AnyBuffer>()     // out     (B, T, N, H), the global output
        .Arg<ffi::AnyBuffer>()     // lse     (B', N, T - row_start) f32, global
        .Arg<ffi::AnyBuffer>()     // dout    (B, T, N, H)
        .Arg<ffi::Buffer<ffi::S32>>()  // seq_q   (B',)
        .Arg<ffi::Buffer<ffi::S32>>()  // seq_kv  (B',)
        .Arg<ffi::Buffer<ffi::S32>>()  // ragged_q  (B' + 1,) if slots > 0
        .Arg<ffi::Buffer<ffi::S32>>()  // ragged_kv (B' + 1,) if slots > 0
        .Ret<ffi::AnyBuffer>()     // dq      (B, T, N, H)
        .Ret<ffi::AnyBuffer>()     // dk      (B, S, K, H)
        .Ret<ffi::AnyBuffer>()     // dv      (B, S, K, H)
        .Attr<float>("scale")
        .Attr<int64_t>("row_start")
        .Attr<int64_t>("col_start")
        .Attr<int64_t>("right_bound")
        .Attr<int64_t>("left_bound")
        .Attr<bool>("padding")
        .Attr<float>("softcap")
        .Attr<int64_t>("slots"));

}  // namespace jax_ring

namespace {

template <typename T>
nb::capsule Capsule(T* fn) {
  static_assert(std::is_invocable_r_v<XLA_FFI_Error*, T, XLA_FFI_CallFrame*>,
                "not an XLA FFI handler");
  return nb::capsule(reinterpret_cast<void*>(fn));
}

}  // namespace

NB_MODULE(_cudnn, m) {
  m.doc() = "jax_ring cuDNN fused-attention XLA FFI handlers";
  m.def("registrations", []() {
    nb::dict d;
    d["jax_ring_sdpa_fwd"] = Capsule(jax_ring::SdpaForward);
    d["jax_ring_sdpa_bwd"] = Capsule(jax_ring::SdpaBackward);
    return d;
  });
  m.def("cudnn_version", []() { return static_cast<int64_t>(cudnnGetVersion()); });
  // The workspace a call's graph needs (the graph is built and cached as
  // for a run). The handlers take it from XLA's allocator at run time, so a
  // compiled program's memory analysis leaves it out.
  m.def(
      "workspace_bytes",
      [](bool backward, bool bf16, int32_t device, int64_t b, int64_t t,
         int64_t s, int64_t n, int64_t k, int64_t h, int64_t slots,
         int64_t row_start, int64_t col_start, int64_t right_bound,
         int64_t left_bound, bool padding, float scale, float softcap) {
        jax_ring::SdpaKey key{
            backward, bf16 ? jax_ring::Dtype::kBF16 : jax_ring::Dtype::kF16,
            device, b, t, s, n, k, h, slots, row_start, col_start,
            right_bound, left_bound, padding, scale, softcap};
        std::string error;
        cudnnHandle_t handle = jax_ring::HandleFor(device, &error);
        if (handle == nullptr) throw std::runtime_error(error);
        auto lock = jax_ring::LockHandle(device);
        auto plan = jax_ring::GetPlan(key, handle, &error);
        if (!plan) throw std::runtime_error("jax_ring cuDNN attention: " + error);
        return jax_ring::WorkspaceSize(*plan);
      },
      nb::arg("backward"), nb::arg("bf16"), nb::arg("device"), nb::arg("b"),
      nb::arg("t"), nb::arg("s"), nb::arg("n"), nb::arg("k"), nb::arg("h"),
      nb::arg("slots"), nb::arg("row_start"), nb::arg("col_start"),
      nb::arg("right_bound"), nb::arg("left_bound"), nb::arg("padding"),
      nb::arg("scale"), nb::arg("softcap"));
}
