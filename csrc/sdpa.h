// cuDNN fused attention graphs (forward and backward), built once per shape.
//
// Layout: every tensor is BSHD in memory, as jax_ring passes it, with the
// query/key head dim H and the value head dim Hv (they may differ: MLA):
//   q, dq  (B, T, N, H)     out, dout  (B, T, N, Hv)
//   k, dk  (B, S, K, H)     v, dv      (B, S, K, Hv)
// A call may start at row `row_start` of q and column `col_start` of k/v
// (a diagonal shifted out of cuDNN's bounds, see
// ../jax_ring/_src/backends/cudnn/band.py): the graph then sees
// t = T - row_start rows and s = S - col_start keys, with the strides of the
// full buffers. The stats (logsumexp) are a packed float32 (B, N, t) buffer
// of the window's rows only.
//
// Mask, in the (row_start, col_start)-shifted local indices i, j:
//   right_bound >= 0 : keep j <= i + right_bound      (causal: 0)
//   left_bound  >= 1 : keep j >  i - left_bound       (window of left - 1)
//   padding          : keep i < seq_len_q[b], j < seq_len_kv[b]
//   slots > 0        : packed documents as ragged batches: every row b of
//                      the buffers holds up to `slots` documents, virtual
//                      batch b * slots + j has seq_len_q/kv[.] tokens and
//                      starts at element ragged_q[.] of q and dq,
//                      ragged_o[.] of out and dout, ragged_k[.] of k and dk,
//                      ragged_v[.] of v and dv (element offsets differ with
//                      the head dims); the mask applies inside each
//                      document. Stats are (B * slots, N, t).
//   ragged_len > 0   : (with slots) every virtual batch spans ragged_len
//                      rows and keys instead of the row's t and s: grids
//                      and stats (B * slots, N, ragged_len) sized by the
//                      documents, each no longer than ragged_len.
//   softcap > 0      : logits -> softcap * tanh(logits / softcap), through a
//                      cuDNN score modifier; the band then goes inside it
//                      (score modifiers exclude cuDNN's built-in masks), and
//                      padding is not served with it.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include <cuda_runtime.h>
#include <cudnn.h>

namespace jax_ring {

enum class Dtype : int32_t { kBF16 = 0, kF16 = 1 };

struct SdpaKey {
  bool backward;
  Dtype dtype;
  int32_t device;
  int64_t b, full_t, full_s, n, k;  // buffer shapes
  int64_t h, hv;  // head dims: q/k, v/out
  int64_t slots;  // > 0: packed documents per row, ragged (implies padding)
  int64_t ragged_len;  // > 0 (with slots): each virtual batch's rows and keys
  int64_t row_start, col_start;
  int64_t right_bound;  // < 0: none
  int64_t left_bound;   // < 1: none
  bool padding;
  float scale;
  float softcap;  // <= 0: none

  bool operator==(const SdpaKey&) const = default;
};

struct SdpaKeyHash {
  size_t operator()(const SdpaKey& key) const;
};

// Tensor uids in a graph's variant pack.
enum Uid : int64_t {
  kQ = 1, kK, kV, kO, kStats, kDO, kDQ, kDK, kDV, kSeqQ, kSeqKV, kRaggedQ,
  kRaggedK, kRaggedV, kRaggedO,
};

class SdpaPlan;  // opaque: a built cuDNN graph and its workspace size

// The plan for `key`, built on first use and cached for the process.
// Returns nullptr and sets `error` if cuDNN cannot build it.
std::shared_ptr<SdpaPlan> GetPlan(const SdpaKey& key, cudnnHandle_t handle,
                                  std::string* error);

int64_t WorkspaceSize(const SdpaPlan& plan);

// Runs the plan on `stream`, which is `handle`'s. `ptrs` maps Uid ->
// device pointer. Off a stream XLA captures, a set of pointers seen before
// replays as a CUDA graph (graphs.h).
bool Execute(SdpaPlan& plan, cudnnHandle_t handle, cudaStream_t stream,
             void* const* ptrs, void* workspace, std::string* error);

// The process's cuDNN handle for `device`, and the lock that serialises its
// use (a handle carries its stream, so two threads must not interleave).
cudnnHandle_t HandleFor(int32_t device, std::string* error);
std::unique_lock<std::mutex> LockHandle(int32_t device);

}  // namespace jax_ring
