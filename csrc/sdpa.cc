// cuDNN SDPA graph construction and the per-process plan cache.
#include "sdpa.h"

#include <functional>
#include <optional>
#include <type_traits>
#include <unordered_map>
#include <vector>

#include <cuda_runtime.h>
#include <cudnn_frontend.h>

#include "graphs.h"

namespace fe = cudnn_frontend;

namespace jax_ring {

class SdpaPlan {
 public:
  std::shared_ptr<fe::graph::Graph> graph;
  int64_t workspace = 0;
  GraphCache graphs;  // its launches by pointers, under the device's lock
};

size_t SdpaKeyHash::operator()(const SdpaKey& key) const {
  size_t h = 0;
  auto mix = [&h](auto v) {
    h ^= std::hash<decltype(v)>()(v) + 0x9e3779b97f4a7c15ULL + (h << 6) +
         (h >> 2);
  };
  mix(key.backward);
  mix(static_cast<int32_t>(key.dtype));
  mix(key.device);
  for (int64_t v : {key.b, key.full_t, key.full_s, key.n, key.k, key.h,
                    key.hv, key.slots, key.ragged_len, key.row_start,
                    key.col_start, key.right_bound, key.left_bound}) {
    mix(v);
  }
  mix(key.padding);
  mix(key.scale);
  mix(key.softcap);
  return h;
}

namespace {

using TensorPtr = std::shared_ptr<fe::graph::Tensor_attributes>;

// (B, heads, rows, H) view of a BSHD buffer with `full_rows` rows; with a
// ragged offset tensor, B counts virtual batches that start at its offsets.
TensorPtr Bshd(fe::graph::Graph& g, const char* name, Uid uid, int64_t b,
               int64_t heads, int64_t rows, int64_t full_rows, int64_t h,
               const TensorPtr& ragged) {
  auto t = g.tensor(fe::graph::Tensor_attributes()
                        .set_name(name)
                        .set_uid(uid)
                        .set_dim({b, heads, rows, h})
                        .set_stride({full_rows * heads * h, h, heads * h, 1}));
  if (ragged) t->set_ragged_offset(ragged);
  return t;
}

void SetBshd(const TensorPtr& t, Uid uid, int64_t b, int64_t heads,
             int64_t rows, int64_t full_rows, int64_t h,
             const TensorPtr& ragged) {
  t->set_output(true).set_uid(uid).set_dim({b, heads, rows, h}).set_stride(
      {full_rows * heads * h, h, heads * h, 1});
  if (ragged) t->set_ragged_offset(ragged);
}

// Virtual batches: B, or B * slots documents when ragged.
int64_t Batches(const SdpaKey& key) {
  return key.slots > 0 ? key.b * key.slots : key.b;
}

// A (count, 1, 1, 1) int32 graph input: sequence lengths or ragged offsets.
TensorPtr Int32Vector(fe::graph::Graph& g, const char* name, Uid uid,
                      int64_t count) {
  return g.tensor(fe::graph::Tensor_attributes()
                      .set_name(name)
                      .set_uid(uid)
                      .set_dim({count, 1, 1, 1})
                      .set_stride({1, 1, 1, 1})
                      .set_data_type(fe::DataType_t::INT32));
}

// Soft cap as a score modifier, with the band applied inside it.
template <typename Attrs>
void SetSoftcap(Attrs& attrs, const SdpaKey& key) {
  namespace mods = fe::graph::attn::score_modifiers;
  using Tensor = std::shared_ptr<fe::graph::Tensor_attributes>;
  // One Softcap (it keeps the pre-tanh scores for its backward) and one cap
  // scalar per graph: a tensor keeps its uid, so they must not be shared.
  auto softcap = std::make_shared<mods::Softcap>();
  auto cap = std::make_shared<fe::graph::Tensor_attributes>(key.softcap);
  std::optional<int64_t> left, right;
  if (key.left_bound >= 1) left = key.left_bound;
  if (key.right_bound >= 0) right = key.right_bound;
  attrs.set_score_mod(
      [=](std::shared_ptr<fe::graph::Graph> graph, Tensor scores) -> Tensor {
        scores = softcap->forward(graph, scores, cap);
        if (!left && !right) return scores;
        return mods::sliding_window_mask(
            graph, scores, fe::DiagonalAlignment_t::TOP_LEFT, left, right,
            /*s_q=*/0, /*s_kv=*/0, nullptr, nullptr, nullptr, nullptr);
      });
  if constexpr (std::is_same_v<Attrs, fe::graph::SDPA_backward_attributes>) {
    attrs.set_score_mod_bprop(
        [=](std::shared_ptr<fe::graph::Graph> graph, Tensor grad) -> Tensor {
          return softcap->backward(graph, grad, cap);
        });
  }
}

template <typename Attrs>
void SetMask(Attrs& attrs, const SdpaKey& key, fe::graph::Graph& g) {
  if (key.softcap > 0) {
    SetSoftcap(attrs, key);
    return;
  }
  if (key.right_bound >= 0 || key.left_bound >= 1) {
    attrs.set_diagonal_alignment(fe::DiagonalAlignment_t::TOP_LEFT);
  }
  if (key.right_bound >= 0) {
    attrs.set_diagonal_band_right_bound(static_cast<int>(key.right_bound));
  }
  if (key.left_bound >= 1) {
    attrs.set_diagonal_band_left_bound(static_cast<int>(key.left_bound));
  }
  if (key.padding || key.slots > 0) {
    attrs.set_padding_mask(true)
        .set_seq_len_q(Int32Vector(g, "seq_q", kSeqQ, Batches(key)))
        .set_seq_len_kv(Int32Vector(g, "seq_kv", kSeqKV, Batches(key)));
  }
}

std::string Check(fe::error_t status, const char* stage) {
  if (status.is_good()) return "";
  return std::string("cuDNN ") + stage + ": " + status.get_message();
}

std::shared_ptr<SdpaPlan> Build(const SdpaKey& key, cudnnHandle_t handle,
                                std::string* error) {
  auto g = std::make_shared<fe::graph::Graph>();
  g->set_io_data_type(key.dtype == Dtype::kBF16 ? fe::DataType_t::BFLOAT16
                                                : fe::DataType_t::HALF)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  const bool short_docs = key.slots > 0 && key.ragged_len > 0;
  const int64_t t = short_docs ? key.ragged_len : key.full_t - key.row_start;
  const int64_t s = short_docs ? key.ragged_len : key.full_s - key.col_start;
  const int64_t b = Batches(key);
  // Ragged offsets, in elements, (b + 1) each: one per buffer layout, as
  // q/k and v/out offsets differ when the head dims do.
  TensorPtr rq, rk, rv, ro;
  if (key.slots > 0) {
    rq = Int32Vector(*g, "ragged_q", kRaggedQ, b + 1);
    rk = Int32Vector(*g, "ragged_k", kRaggedK, b + 1);
    rv = Int32Vector(*g, "ragged_v", kRaggedV, b + 1);
    ro = Int32Vector(*g, "ragged_o", kRaggedO, b + 1);
  }
  auto q = Bshd(*g, "q", kQ, b, key.n, t, key.full_t, key.h, rq);
  auto k = Bshd(*g, "k", kK, b, key.k, s, key.full_s, key.h, rk);
  auto v = Bshd(*g, "v", kV, b, key.k, s, key.full_s, key.hv, rv);
  const std::vector<int64_t> stats_dim = {b, key.n, t, 1};
  // Packed (B, N, t): the only stats layout cuDNN 9.19's backward reads.
  const std::vector<int64_t> stats_stride = {key.n * t, t, 1, 1};

  if (!key.backward) {
    auto attrs = fe::graph::SDPA_attributes()
                     .set_name("jax_ring_sdpa_fwd")
                     .set_generate_stats(true)
                     .set_attn_scale(key.scale);
    SetMask(attrs, key, *g);
    auto [o, stats] = g->sdpa(q, k, v, attrs);
    SetBshd(o, kO, b, key.n, t, key.full_t, key.hv, ro);
    stats->set_output(true)
        .set_uid(kStats)
        .set_data_type(fe::DataType_t::FLOAT)
        .set_dim(stats_dim)
        .set_stride(stats_stride);
  } else {
    auto o = Bshd(*g, "o", kO, b, key.n, t, key.full_t, key.hv, ro);
    auto dout = Bshd(*g, "dout", kDO, b, key.n, t, key.full_t, key.hv, ro);
    auto stats = g->tensor(fe::graph::Tensor_attributes()
                               .set_name("stats")
                               .set_uid(kStats)
                               .set_dim(stats_dim)
                               .set_stride(stats_stride)
                               .set_data_type(fe::DataType_t::FLOAT));
    auto attrs = fe::graph::SDPA_backward_attributes()
                     .set_name("jax_ring_sdpa_bwd")
                     .set_attn_scale(key.scale);
    SetMask(attrs, key, *g);
    if (key.slots > 0) {
      // The documents of a row lie inside it: key.b * full_t rows in all,
      // not (b * slots) x each virtual batch's length. Without this bound
      // cuDNN sizes its float32 dQ accumulator for every virtual batch at
      // full length (207 GB at 786k tokens, 16 heads, 16 row-long batches).
      attrs.set_max_total_seq_len_q(key.b * key.full_t)
          .set_max_total_seq_len_kv(key.b * key.full_s);
    }
    auto [dq, dk, dv] = g->sdpa_backward(q, k, v, o, dout, stats, attrs);
    SetBshd(dq, kDQ, b, key.n, t, key.full_t, key.h, rq);
    SetBshd(dk, kDK, b, key.k, s, key.full_s, key.h, rk);
    SetBshd(dv, kDV, b, key.k, s, key.full_s, key.hv, rv);
  }

  auto plan = std::make_shared<SdpaPlan>();
  plan->graph = g;
  auto failed = [&](fe::error_t status, const char* stage) {
    *error = Check(status, stage);
    return !error->empty();
  };
  if (failed(g->validate(), "validate") ||
      failed(g->build_operation_graph(handle), "build_operation_graph") ||
      failed(g->create_execution_plans({fe::HeurMode_t::A}),
             "create_execution_plans") ||
      failed(g->check_support(handle), "check_support") ||
      failed(g->build_plans(handle), "build_plans") ||
      failed(g->get_workspace_size(plan->workspace), "get_workspace_size")) {
    return nullptr;
  }
  return plan;
}

struct DeviceHandle {
  std::mutex mu;
  cudnnHandle_t handle = nullptr;
};

std::mutex& RegistryMutex() {
  static std::mutex mu;
  return mu;
}

}  // namespace

std::shared_ptr<SdpaPlan> GetPlan(const SdpaKey& key, cudnnHandle_t handle,
                                  std::string* error) {
  // This thread's plans: every handler looks its plan up at every run of
  // the program (INITIALIZE, then EXECUTE), each device's program on a
  // thread of its own, so a plan found before takes no lock.
  thread_local std::unordered_map<SdpaKey, std::shared_ptr<SdpaPlan>,
                                  SdpaKeyHash>
      mine;
  if (auto it = mine.find(key); it != mine.end()) return it->second;
  static auto* cache =
      new std::unordered_map<SdpaKey, std::shared_ptr<SdpaPlan>, SdpaKeyHash>();
  std::lock_guard<std::mutex> lock(RegistryMutex());
  auto it = cache->find(key);
  if (it != cache->end()) return mine.emplace(key, it->second).first->second;
  std::shared_ptr<SdpaPlan> plan;
  try {
    plan = Build(key, handle, error);
  } catch (const std::exception& e) {
    *error = std::string("cuDNN graph build threw: ") + e.what();
  }
  if (plan) {
    cache->emplace(key, plan);
    mine.emplace(key, plan);
  }
  return plan;
}

int64_t WorkspaceSize(const SdpaPlan& plan) { return plan.workspace; }

bool Execute(SdpaPlan& plan, cudnnHandle_t handle, cudaStream_t stream,
             void* const* ptrs, void* workspace, std::string* error) {
  static_assert(GraphCache::kPointers == kRaggedO + 2);
  std::unordered_map<int64_t, void*> pack;
  GraphCache::Pointers key{};
  for (int64_t uid = kQ; uid <= kRaggedO; ++uid) {
    key[uid] = ptrs[uid];
    if (ptrs[uid] != nullptr) pack.emplace(uid, ptrs[uid]);
  }
  key[kRaggedO + 1] = workspace;
  auto record = [&](cudaGraph_t graph) {
    auto bindings = pack;  // populate adds the workspace's own entries
    try {
      return plan.graph->populate_cuda_graph(handle, bindings, workspace,
                                             graph).is_good();
    } catch (const std::exception&) {
      return false;
    }
  };
  switch (plan.graphs.Launch(key, stream, record, error)) {
    case GraphCache::Result::kLaunched:
      return true;
    case GraphCache::Result::kFailed:
      return false;
    case GraphCache::Result::kExecute:
      break;
  }
  try {
    *error = Check(plan.graph->execute(handle, pack, workspace), "execute");
  } catch (const std::exception& e) {
    *error = std::string("cuDNN execute threw: ") + e.what();
  }
  return error->empty();
}

namespace {
DeviceHandle& Device(int32_t device) {
  // The registry's entries never move (an unordered_map keeps its nodes),
  // so each thread keeps the ones it has looked up.
  thread_local std::unordered_map<int32_t, DeviceHandle*> mine;
  if (auto it = mine.find(device); it != mine.end()) return *it->second;
  static auto* handles = new std::unordered_map<int32_t, DeviceHandle>();
  std::lock_guard<std::mutex> lock(RegistryMutex());
  DeviceHandle* d = &(*handles)[device];
  mine.emplace(device, d);
  return *d;
}
}  // namespace

cudnnHandle_t HandleFor(int32_t device, std::string* error) {
  DeviceHandle& d = Device(device);
  std::lock_guard<std::mutex> lock(d.mu);
  if (d.handle == nullptr) {
    int previous = 0;
    cudaGetDevice(&previous);
    if (previous != device) cudaSetDevice(device);
    cudnnStatus_t status = cudnnCreate(&d.handle);
    if (previous != device) cudaSetDevice(previous);
    if (status != CUDNN_STATUS_SUCCESS) {
      *error = std::string("cudnnCreate failed: ") +
               cudnnGetErrorString(status);
      d.handle = nullptr;
    }
  }
  return d.handle;
}

std::unique_lock<std::mutex> LockHandle(int32_t device) {
  return std::unique_lock<std::mutex>(Device(device).mu);
}

}  // namespace jax_ring
