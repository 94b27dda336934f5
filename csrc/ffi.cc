// XLA FFI handlers for cuDNN fused attention, and the nanobind module that
// hands them to Python (jax_ring/_src/backends/cudnn/ffi.py registers them
// with jax).
//
// Buffers are BSHD, with the query/key head dim H and the value head dim Hv
// (see sdpa.h, also for the mask attributes). B' below is the number of
// virtual batches: B, or B * slots with packed documents; t = T - row_start,
// or ragged_len where a packed call sets it.
// Failures come back as ffi::Error with a message; nothing here aborts the
// process.
#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <cuda_runtime.h>
#include <cudnn.h>
#include <nanobind/nanobind.h>

#include "checks.h"
#include "graphs.h"
#include "run.h"
#include "sdpa.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
namespace nb = nanobind;

namespace jax_ring {

// run.h states the contract. No allocation happens here, so a call can be
// traced into a CUDA graph (command buffer) and replayed.
ffi::Error Run(const SdpaKey& key, cudaStream_t stream,
               const ffi::AnyBuffer* workspace, void* const* ptrs) {
  std::string error;
  cudnnHandle_t handle = HandleFor(key.device, &error);
  if (handle == nullptr) return ffi::Error::Internal(error);
  auto lock = LockHandle(key.device);
  auto plan = GetPlan(key, handle, &error);
  if (!plan) return ffi::Error::Internal("jax_ring cuDNN attention: " + error);
  if (workspace == nullptr) return ffi::Error::Success();
  const int64_t need = WorkspaceSize(*plan);
  if (static_cast<int64_t>(workspace->size_bytes()) < need) {
    return Invalid("the workspace buffer has " +
                   std::to_string(workspace->size_bytes()) +
                   " bytes, the graph on device " +
                   std::to_string(key.device) + " needs " +
                   std::to_string(need));
  }
  cudnnStatus_t status = cudnnSetStream(handle, stream);
  if (status != CUDNN_STATUS_SUCCESS) {
    return ffi::Error::Internal(std::string("cudnnSetStream: ") +
                                cudnnGetErrorString(status));
  }
  if (!Execute(*plan, handle, stream, ptrs,
               need > 0 ? workspace->untyped_data() : nullptr, &error)) {
    return ffi::Error::Internal("jax_ring cuDNN attention: " + error);
  }
  return ffi::Error::Success();
}

namespace {

struct Mask {
  int64_t row_start, col_start, right_bound, left_bound;
  bool padding;
  float softcap;
  int64_t slots, ragged_len;
};

// Checks q (B, T, N, H), k (B, S, K, H), v (B, S, K, Hv) and fills the
// key's shapes.
ffi::Error Describe(const ffi::AnyBuffer& q, const ffi::AnyBuffer& k,
                    const ffi::AnyBuffer& v, const Mask& mask, bool backward,
                    int32_t device, float scale, SdpaKey* key) {
  // Formatted only for a message: XLA calls every handler at every run.
  auto shapes = [&] {
    return "q " + Shape(q) + ", k " + Shape(k) + ", v " + Shape(v);
  };
  if (q.dimensions().size() != 4 || k.dimensions().size() != 4 ||
      v.dimensions().size() != 4) {
    return Invalid("q, k, v must be rank 4, got " + shapes());
  }
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  if (q.element_type() != k.element_type() ||
      q.element_type() != v.element_type() ||
      (q.element_type() != ffi::BF16 && q.element_type() != ffi::F16)) {
    return Invalid("q, k, v must all be bfloat16 or float16");
  }
  if (kd[0] != qd[0] || kd[3] != qd[3] || qd[2] % kd[2] != 0 ||
      !(vd.first(3) == kd.first(3))) {
    return Invalid("incompatible " + shapes() +
                   ": need q (B, T, N, H), k (B, S, K, H), v (B, S, K, Hv) "
                   "with N % K == 0");
  }
  if (mask.row_start < 0 || mask.row_start >= qd[1] || mask.col_start < 0 ||
      mask.col_start >= kd[1]) {
    return Invalid("row_start " + std::to_string(mask.row_start) +
                   " / col_start " + std::to_string(mask.col_start) +
                   " out of range for " + shapes());
  }
  if (mask.slots < 0 || (mask.slots > 0 && (mask.row_start || mask.col_start))) {
    return Invalid("packed documents (slots = " + std::to_string(mask.slots) +
                   ") need row_start = col_start = 0");
  }
  if (mask.ragged_len < 0 || (mask.ragged_len > 0 && mask.slots == 0) ||
      mask.ragged_len > std::max(qd[1], kd[1])) {
    return Invalid("ragged_len " + std::to_string(mask.ragged_len) +
                   " needs packed documents (slots > 0) and at most the "
                   "longer of " + shapes() + "'s sequence lengths");
  }
  *key = SdpaKey{backward,
                 q.element_type() == ffi::BF16 ? Dtype::kBF16 : Dtype::kF16,
                 device, qd[0], qd[1], kd[1], qd[2], kd[2], qd[3], vd[3],
                 mask.slots, mask.ragged_len, mask.row_start, mask.col_start,
                 mask.right_bound,
                 mask.left_bound, mask.padding, scale, mask.softcap};
  return ffi::Error::Success();
}

// Device pointers of one call by Uid. BSHD buffers start at the window's
// first query row (q side) or first key (kv side): no copies. `h` is the
// buffer's head dim (H or Hv).
struct VariantPack {
  explicit VariantPack(const SdpaKey& key) : key(key) {}
  void QSide(Uid uid, void* base, int64_t h) {
    Set(uid, base, key.row_start * key.n * h);
  }
  void KvSide(Uid uid, void* base, int64_t h) {
    Set(uid, base, key.col_start * key.k * h);
  }
  void Set(Uid uid, void* base, int64_t elements) {
    ptrs[uid] = static_cast<char*>(base) + elements * 2;  // 16-bit
  }

  const SdpaKey& key;
  void* ptrs[kRaggedO + 1] = {};
};

// The int32 vectors that describe the rows: window lengths, and the ragged
// element offsets of packed documents in the q/dq, k/dk, v/dv and out/dout
// buffers (one each: they differ when H and Hv do).
struct Rows {
  ffi::Buffer<ffi::S32> seq_q, seq_kv, ragged_q, ragged_k, ragged_v, ragged_o;
};

// What all handlers share: the key, and the pointers of q, k, v, the
// stats and (if padding or packed) the row vectors.
ffi::Error Prepare(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                   const ffi::AnyBuffer& stats, const Rows& rows,
                   const Mask& mask, bool backward, int32_t device,
                   float scale, SdpaKey* key, VariantPack* pack) {
  if (auto e = Describe(q, k, v, mask, backward, device, scale, key);
      e.failure()) {
    return e;
  }
  const int64_t batches = mask.slots > 0 ? key->b * mask.slots : key->b;
  const int64_t stat_rows =
      mask.ragged_len > 0 ? mask.ragged_len : key->full_t - key->row_start;
  if (auto e = Expect("lse", stats, {batches, key->n, stat_rows},
                      "(B', N, t)", ffi::F32);
      e.failure()) {
    return e;
  }
  pack->QSide(kQ, q.untyped_data(), key->h);
  pack->KvSide(kK, k.untyped_data(), key->h);
  pack->KvSide(kV, v.untyped_data(), key->hv);
  pack->ptrs[kStats] = stats.untyped_data();
  auto count = [](const ffi::Buffer<ffi::S32>& x) {
    return static_cast<int64_t>(x.element_count());
  };
  if (mask.padding || mask.slots > 0) {
    if (count(rows.seq_q) != batches || count(rows.seq_kv) != batches) {
      return Invalid("seq_q/seq_kv need " + std::to_string(batches) +
                     " entries, got " +
                     std::to_string(count(rows.seq_q)) + " and " +
                     std::to_string(count(rows.seq_kv)));
    }
    pack->ptrs[kSeqQ] = rows.seq_q.untyped_data();
    pack->ptrs[kSeqKV] = rows.seq_kv.untyped_data();
  }
  if (mask.slots > 0) {
    const std::pair<Uid, const ffi::Buffer<ffi::S32>*> ragged[] = {
        {kRaggedQ, &rows.ragged_q}, {kRaggedK, &rows.ragged_k},
        {kRaggedV, &rows.ragged_v}, {kRaggedO, &rows.ragged_o}};
    for (const auto& [uid, buffer] : ragged) {
      if (count(*buffer) != batches + 1) {
        return Invalid("ragged offsets need " + std::to_string(batches + 1) +
                       " entries each, got " + std::to_string(count(*buffer)));
      }
      pack->ptrs[uid] = buffer->untyped_data();
    }
  }
  return ffi::Error::Success();
}

// (B, T, N, Hv): the shape of out and dout.
std::vector<int64_t> OutDims(const SdpaKey& key) {
  return {key.b, key.full_t, key.n, key.hv};
}

// kRun = false is the INITIALIZE stage: XLA calls it before it runs (or
// records into a command buffer) the program, so the handle and the plan
// are built outside any stream capture. kRun = true is the EXECUTE stage.
template <bool kRun>
ffi::Error Forward(cudaStream_t stream, int32_t device, ffi::AnyBuffer q,
                   ffi::AnyBuffer k, ffi::AnyBuffer v,
                   ffi::Buffer<ffi::S32> seq_q, ffi::Buffer<ffi::S32> seq_kv,
                   ffi::Buffer<ffi::S32> ragged_q,
                   ffi::Buffer<ffi::S32> ragged_k,
                   ffi::Buffer<ffi::S32> ragged_v,
                   ffi::Buffer<ffi::S32> ragged_o,
                   ffi::Result<ffi::AnyBuffer> out,
                   ffi::Result<ffi::AnyBuffer> lse,
                   ffi::Result<ffi::AnyBuffer> workspace, float scale,
                   int64_t row_start, int64_t col_start, int64_t right_bound,
                   int64_t left_bound, bool padding, float softcap,
                   int64_t slots, int64_t ragged_len) {
  SdpaKey key{};
  VariantPack pack(key);
  Mask mask{row_start, col_start, right_bound, left_bound,
            padding,   softcap,   slots,     ragged_len};
  Rows rows{seq_q, seq_kv, ragged_q, ragged_k, ragged_v, ragged_o};
  if (auto e = Prepare(q, k, v, *lse, rows, mask, false, device, scale, &key,
                       &pack);
      e.failure()) {
    return e;
  }
  if (auto e = Expect("out", *out, OutDims(key), "(B, T, N, Hv)",
                      q.element_type());
      e.failure()) {
    return e;
  }
  pack.QSide(kO, out->untyped_data(), key.hv);
  return Run(key, stream, kRun ? &*workspace : nullptr, pack.ptrs);
}

// The backward of the handlers, with dq, dk and dv written to the given
// device pointers (separate buffers, or the halves of one stacked buffer),
// once `check_grads()` (their shapes) succeeds.
template <bool kRun, typename CheckGrads>
ffi::Error RunBackward(cudaStream_t stream, int32_t device, ffi::AnyBuffer q,
                        ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer out,
                        ffi::AnyBuffer lse, ffi::AnyBuffer dout,
                        const Rows& rows, void* dq, void* dk, void* dv,
                        ffi::AnyBuffer& workspace, float scale,
                        const Mask& mask, CheckGrads check_grads) {
  SdpaKey key{};
  VariantPack pack(key);
  if (auto e = Prepare(q, k, v, lse, rows, mask, true, device, scale, &key,
                       &pack);
      e.failure()) {
    return e;
  }
  const ffi::DataType dtype = q.element_type();
  if (auto e = FirstFailure(
          {Expect("out", out, OutDims(key), "(B, T, N, Hv)", dtype),
           Expect("dout", dout, OutDims(key), "(B, T, N, Hv)", dtype),
           check_grads()});
      e.failure()) {
    return e;
  }
  pack.QSide(kO, out.untyped_data(), key.hv);
  pack.QSide(kDO, dout.untyped_data(), key.hv);
  pack.QSide(kDQ, dq, key.h);
  pack.KvSide(kDK, dk, key.h);
  pack.KvSide(kDV, dv, key.hv);
  return Run(key, stream, kRun ? &workspace : nullptr, pack.ptrs);
}

// dk and dv as two results.
template <bool kRun>
ffi::Error Backward(cudaStream_t stream, int32_t device, ffi::AnyBuffer q,
                    ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer out,
                    ffi::AnyBuffer lse, ffi::AnyBuffer dout,
                    ffi::Buffer<ffi::S32> seq_q, ffi::Buffer<ffi::S32> seq_kv,
                    ffi::Buffer<ffi::S32> ragged_q,
                    ffi::Buffer<ffi::S32> ragged_k,
                    ffi::Buffer<ffi::S32> ragged_v,
                    ffi::Buffer<ffi::S32> ragged_o,
                    ffi::Result<ffi::AnyBuffer> dq,
                    ffi::Result<ffi::AnyBuffer> dk,
                    ffi::Result<ffi::AnyBuffer> dv,
                    ffi::Result<ffi::AnyBuffer> workspace, float scale,
                    int64_t row_start, int64_t col_start, int64_t right_bound,
                    int64_t left_bound, bool padding, float softcap,
                    int64_t slots, int64_t ragged_len) {
  auto check_grads = [&]() {
    const ffi::DataType dtype = q.element_type();
    return FirstFailure({Expect("dq", *dq, DimsOf(q), "(q's shape)", dtype),
                         Expect("dk", *dk, DimsOf(k), "(k's shape)", dtype),
                         Expect("dv", *dv, DimsOf(v), "(v's shape)", dtype)});
  };
  return RunBackward<kRun>(
      stream, device, q, k, v, out, lse, dout,
      Rows{seq_q, seq_kv, ragged_q, ragged_k, ragged_v, ragged_o},
      dq->untyped_data(), dk->untyped_data(), dv->untyped_data(), *workspace,
      scale,
      Mask{row_start, col_start, right_bound, left_bound, padding, softcap,
           slots, ragged_len},
      check_grads);
}

// dk and dv stacked in one (2, B, S, K, H) result, as the ring sends them:
// no stacking copy after the call. Only for H == Hv (k and v alike).
template <bool kRun>
ffi::Error BackwardDkv(cudaStream_t stream, int32_t device, ffi::AnyBuffer q,
                       ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer out,
                       ffi::AnyBuffer lse, ffi::AnyBuffer dout,
                       ffi::Buffer<ffi::S32> seq_q,
                       ffi::Buffer<ffi::S32> seq_kv,
                       ffi::Buffer<ffi::S32> ragged_q,
                       ffi::Buffer<ffi::S32> ragged_k,
                       ffi::Buffer<ffi::S32> ragged_v,
                       ffi::Buffer<ffi::S32> ragged_o,
                       ffi::Result<ffi::AnyBuffer> dq,
                       ffi::Result<ffi::AnyBuffer> dkv,
                       ffi::Result<ffi::AnyBuffer> workspace, float scale,
                       int64_t row_start, int64_t col_start,
                       int64_t right_bound, int64_t left_bound, bool padding,
                       float softcap, int64_t slots, int64_t ragged_len) {
  auto check_grads = [&]() {
    if (!(k.dimensions() == v.dimensions())) {
      return Invalid("stacked dK/dV need k and v of one shape (one head "
                     "dim), got k " + Shape(k) + ", v " + Shape(v));
    }
    const ffi::DataType dtype = q.element_type();
    return FirstFailure(
        {Expect("dq", *dq, DimsOf(q), "(q's shape)", dtype),
         Expect("dkv", *dkv, DimsOf(k, {2}), "(2, B, S, K, H)", dtype)});
  };
  char* dk = static_cast<char*>(dkv->untyped_data());
  return RunBackward<kRun>(
      stream, device, q, k, v, out, lse, dout,
      Rows{seq_q, seq_kv, ragged_q, ragged_k, ragged_v, ragged_o},
      dq->untyped_data(), dk, dk + k.size_bytes(), *workspace, scale,
      Mask{row_start, col_start, right_bound, left_bound, padding, softcap,
           slots, ragged_len},
      check_grads);
}

// The packed calls that write into buffers they are given (XLA aliases
// each accumulator operand to its result): rows and keys outside the
// call's documents keep what they held, so calls on disjoint documents
// fill one buffer without a merge. The accumulators are not read here.
template <bool kRun>
ffi::Error ForwardInto(cudaStream_t stream, int32_t device, ffi::AnyBuffer q,
                       ffi::AnyBuffer k, ffi::AnyBuffer v,
                       ffi::Buffer<ffi::S32> seq_q,
                       ffi::Buffer<ffi::S32> seq_kv,
                       ffi::Buffer<ffi::S32> ragged_q,
                       ffi::Buffer<ffi::S32> ragged_k,
                       ffi::Buffer<ffi::S32> ragged_v,
                       ffi::Buffer<ffi::S32> ragged_o, ffi::AnyBuffer,
                       ffi::Result<ffi::AnyBuffer> out,
                       ffi::Result<ffi::AnyBuffer> lse,
                       ffi::Result<ffi::AnyBuffer> workspace, float scale,
                       int64_t row_start, int64_t col_start,
                       int64_t right_bound, int64_t left_bound, bool padding,
                       float softcap, int64_t slots, int64_t ragged_len) {
  return Forward<kRun>(stream, device, q, k, v, seq_q, seq_kv, ragged_q,
                       ragged_k, ragged_v, ragged_o, out, lse, workspace,
                       scale, row_start, col_start, right_bound, left_bound,
                       padding, softcap, slots, ragged_len);
}

template <bool kRun>
ffi::Error BackwardIntoGiven(
    cudaStream_t stream, int32_t device, ffi::AnyBuffer q, ffi::AnyBuffer k,
    ffi::AnyBuffer v, ffi::AnyBuffer out, ffi::AnyBuffer lse,
    ffi::AnyBuffer dout, ffi::Buffer<ffi::S32> seq_q,
    ffi::Buffer<ffi::S32> seq_kv, ffi::Buffer<ffi::S32> ragged_q,
    ffi::Buffer<ffi::S32> ragged_k, ffi::Buffer<ffi::S32> ragged_v,
    ffi::Buffer<ffi::S32> ragged_o, ffi::AnyBuffer, ffi::AnyBuffer,
    ffi::AnyBuffer, ffi::Result<ffi::AnyBuffer> dq,
    ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dv,
    ffi::Result<ffi::AnyBuffer> workspace, float scale, int64_t row_start,
    int64_t col_start, int64_t right_bound, int64_t left_bound, bool padding,
    float softcap, int64_t slots, int64_t ragged_len) {
  return Backward<kRun>(stream, device, q, k, v, out, lse, dout, seq_q,
                        seq_kv, ragged_q, ragged_k, ragged_v, ragged_o, dq, dk,
                        dv, workspace, scale, row_start, col_start,
                        right_bound, left_bound, padding, softcap, slots,
                        ragged_len);
}

// The mask attributes the handlers take, after their buffers.
template <typename Binding>
auto MaskAttrs(Binding&& binding) {
  return std::move(binding)
      .template Attr<float>("scale")
      .template Attr<int64_t>("row_start")
      .template Attr<int64_t>("col_start")
      .template Attr<int64_t>("right_bound")
      .template Attr<int64_t>("left_bound")
      .template Attr<bool>("padding")
      .template Attr<float>("softcap")
      .template Attr<int64_t>("slots")
      .template Attr<int64_t>("ragged_len");
}

// The row vectors: window lengths and ragged offsets.
template <typename Binding>
auto RowArgs(Binding&& binding) {
  return std::move(binding)
      .template Arg<ffi::Buffer<ffi::S32>>()   // seq_q    (B',)
      .template Arg<ffi::Buffer<ffi::S32>>()   // seq_kv   (B',)
      .template Arg<ffi::Buffer<ffi::S32>>()   // ragged_q (B' + 1,) if slots
      .template Arg<ffi::Buffer<ffi::S32>>()   // ragged_k (B' + 1,) if slots
      .template Arg<ffi::Buffer<ffi::S32>>()   // ragged_v (B' + 1,) if slots
      .template Arg<ffi::Buffer<ffi::S32>>();  // ragged_o (B' + 1,) if slots
}

// kInto: an out (B, T, N, Hv) operand after the row vectors, aliased to
// the out result.
template <ffi::ExecutionStage kStage, bool kInto = false>
auto ForwardBinding() {
  auto b = ffi::Ffi::Bind<kStage>()
               .template Ctx<ffi::PlatformStream<cudaStream_t>>()
               .template Ctx<ffi::DeviceOrdinal>()
               .template Arg<ffi::AnyBuffer>()   // q   (B, T, N, H)
               .template Arg<ffi::AnyBuffer>()   // k   (B, S, K, H)
               .template Arg<ffi::AnyBuffer>();  // v   (B, S, K, Hv)
  if constexpr (kInto) {
    return MaskAttrs(RowArgs(std::move(b))
                         .template Arg<ffi::AnyBuffer>()    // out operand
                         .template Ret<ffi::AnyBuffer>()    // out
                         .template Ret<ffi::AnyBuffer>()    // lse
                         .template Ret<ffi::AnyBuffer>());  // workspace
  } else {
    return MaskAttrs(RowArgs(std::move(b))
                         .template Ret<ffi::AnyBuffer>()    // out (B, T, N, Hv)
                         .template Ret<ffi::AnyBuffer>()    // lse (B', N, t) f32
                         .template Ret<ffi::AnyBuffer>());  // workspace (W,) u8
  }
}

// The backward's results after dq: dk and dv, or dK/dV stacked.
template <bool kStacked, typename Binding>
auto StackedOrNot(Binding&& b) {
  if constexpr (kStacked) {
    return MaskAttrs(std::move(b)
                         .template Ret<ffi::AnyBuffer>()    // dkv (2,B,S,K,H)
                         .template Ret<ffi::AnyBuffer>());  // workspace (W,)
  } else {
    return MaskAttrs(std::move(b)
                         .template Ret<ffi::AnyBuffer>()    // dk (B, S, K, H)
                         .template Ret<ffi::AnyBuffer>()    // dv (B, S, K, Hv)
                         .template Ret<ffi::AnyBuffer>());  // workspace (W,)
  }
}

// kInto: dq, dk, dv operands after the row vectors, aliased to the
// results (not stacked).
template <ffi::ExecutionStage kStage, bool kStacked, bool kInto = false>
auto BackwardBinding() {
  static_assert(!(kStacked && kInto), "the aliased backward is not stacked");
  auto b = RowArgs(ffi::Ffi::Bind<kStage>()
                       .template Ctx<ffi::PlatformStream<cudaStream_t>>()
                       .template Ctx<ffi::DeviceOrdinal>()
                       .template Arg<ffi::AnyBuffer>()   // q    (B, T, N, H)
                       .template Arg<ffi::AnyBuffer>()   // k    (B, S, K, H)
                       .template Arg<ffi::AnyBuffer>()   // v    (B, S, K, Hv)
                       .template Arg<ffi::AnyBuffer>()   // out  (B, T, N, Hv)
                       .template Arg<ffi::AnyBuffer>()   // lse  (B', N, t) f32
                       .template Arg<ffi::AnyBuffer>());  // dout (B, T, N, Hv)
  if constexpr (kInto) {
    return MaskAttrs(std::move(b)
                         .template Arg<ffi::AnyBuffer>()    // dq operand
                         .template Arg<ffi::AnyBuffer>()    // dk operand
                         .template Arg<ffi::AnyBuffer>()    // dv operand
                         .template Ret<ffi::AnyBuffer>()    // dq
                         .template Ret<ffi::AnyBuffer>()    // dk
                         .template Ret<ffi::AnyBuffer>()    // dv
                         .template Ret<ffi::AnyBuffer>());  // workspace
  } else {
    return StackedOrNot<kStacked>(
        std::move(b).template Ret<ffi::AnyBuffer>());  // dq (B, T, N, H)
  }
}

constexpr auto kInit = ffi::ExecutionStage::kInitialize;
constexpr auto kExec = ffi::ExecutionStage::kExecute;

}  // namespace

// Every stage is safe to trace into a command buffer: the execute stage
// only launches cuDNN's kernels on XLA's stream, into XLA's buffers.
XLA_FFI_DEFINE_HANDLER_SYMBOL(SdpaForwardInit, Forward<false>,
                              ForwardBinding<kInit>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(SdpaForward, Forward<true>,
                              ForwardBinding<kExec>(),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(SdpaBackwardInit, Backward<false>,
                              (BackwardBinding<kInit, false>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(SdpaBackward, Backward<true>,
                              (BackwardBinding<kExec, false>()),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(SdpaForwardIntoInit, ForwardInto<false>,
                              (ForwardBinding<kInit, true>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(SdpaForwardInto, ForwardInto<true>,
                              (ForwardBinding<kExec, true>()),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(SdpaBackwardIntoInit, BackwardIntoGiven<false>,
                              (BackwardBinding<kInit, false, true>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(SdpaBackwardInto, BackwardIntoGiven<true>,
                              (BackwardBinding<kExec, false, true>()),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(SdpaBackwardDkvInit, BackwardDkv<false>,
                              (BackwardBinding<kInit, true>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(SdpaBackwardDkv, BackwardDkv<true>,
                              (BackwardBinding<kExec, true>()),
                              {ffi::Traits::kCmdBufferCompatible});

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
  // name -> {stage: handler}, for jax.ffi.register_ffi_target.
  m.def("registrations", []() {
    auto stages = [](auto* init, auto* execute) {
      nb::dict d;
      d["initialize"] = Capsule(init);
      d["execute"] = Capsule(execute);
      return d;
    };
    nb::dict d;
    d["jax_ring_sdpa_fwd"] =
        stages(jax_ring::SdpaForwardInit, jax_ring::SdpaForward);
    d["jax_ring_sdpa_bwd"] =
        stages(jax_ring::SdpaBackwardInit, jax_ring::SdpaBackward);
    d["jax_ring_sdpa_bwd_dkv"] =
        stages(jax_ring::SdpaBackwardDkvInit, jax_ring::SdpaBackwardDkv);
    d["jax_ring_sdpa_fwd_into"] =
        stages(jax_ring::SdpaForwardIntoInit, jax_ring::SdpaForwardInto);
    d["jax_ring_sdpa_bwd_into"] =
        stages(jax_ring::SdpaBackwardIntoInit, jax_ring::SdpaBackwardInto);
    d["jax_ring_sdpa_fwd_pass"] =
        stages(JaxRingPassForwardInit, JaxRingPassForward);
    d["jax_ring_sdpa_bwd_pass"] =
        stages(JaxRingPassBackwardInit, JaxRingPassBackward);
    d["jax_ring_uninitialized"] = Capsule(JaxRingUninitialized);
    return d;
  });
  // CUDA-graph replays of cuDNN's launches (graphs.h): a switch for A/B
  // measurements, and the counts (launched, recorded, plans unsupported).
  m.def("use_graphs", [](bool on) { jax_ring::SetGraphsEnabled(on); });
  m.def("graph_counts", []() {
    auto c = jax_ring::GraphCounts();
    return nb::make_tuple(c[0], c[1], c[2]);
  });
  m.def("cudnn_version", []() { return static_cast<int64_t>(cudnnGetVersion()); });
  // The workspace a call's graph needs (the graph is built and cached as
  // for a run). The Python side asks XLA for it as the call's last result.
  m.def(
      "workspace_bytes",
      [](bool backward, bool bf16, int32_t device, int64_t b, int64_t t,
         int64_t s, int64_t n, int64_t k, int64_t h, int64_t hv,
         int64_t slots, int64_t row_start, int64_t col_start,
         int64_t right_bound, int64_t left_bound, bool padding, float scale,
         float softcap, int64_t ragged_len) {
        jax_ring::SdpaKey key{
            backward, bf16 ? jax_ring::Dtype::kBF16 : jax_ring::Dtype::kF16,
            device, b, t, s, n, k, h, hv, slots, ragged_len, row_start,
            col_start, right_bound, left_bound, padding, scale, softcap};
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
      nb::arg("hv"), nb::arg("slots"), nb::arg("row_start"),
      nb::arg("col_start"), nb::arg("right_bound"), nb::arg("left_bound"),
      nb::arg("padding"), nb::arg("scale"), nb::arg("softcap"),
      nb::arg("ragged_len") = 0);
}
