// See graphs.h.
#include "graphs.h"

#include <algorithm>
#include <atomic>

namespace jax_ring {
namespace {

std::atomic<bool> enabled{true};
std::atomic<int64_t> launched{0}, recorded{0}, unsupported{0};

std::string CudaError(const char* call, cudaError_t err) {
  return std::string(call) + ": " + cudaGetErrorString(err);
}

// The executable graph of `record`'s launches, or null where cuDNN cannot
// record them (its engine) or CUDA cannot build the graph.
cudaGraphExec_t Instantiate(const GraphCache::Record& record) {
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  if (cudaGraphCreate(&graph, 0) == cudaSuccess && record(graph) &&
      cudaGraphInstantiate(&exec, graph, 0) != cudaSuccess) {
    exec = nullptr;
  }
  if (graph != nullptr) cudaGraphDestroy(graph);  // exec keeps what it needs
  cudaGetLastError();  // a failure here leaves no error behind
  return exec;
}

}  // namespace

void SetGraphsEnabled(bool on) { enabled = on; }

std::array<int64_t, 3> GraphCounts() {
  return {launched.load(), recorded.load(), unsupported.load()};
}

GraphCache::~GraphCache() {
  for (Entry& e : graphs_) cudaGraphExecDestroy(e.exec);
}

GraphCache::Result GraphCache::Launch(const Pointers& ptrs,
                                      cudaStream_t stream,
                                      const Record& record,
                                      std::string* error) {
  if (unsupported_ || !enabled) return Result::kExecute;
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &capturing) != cudaSuccess ||
      capturing != cudaStreamCaptureStatusNone) {
    cudaGetLastError();  // a failed query leaves no error behind
    return Result::kExecute;
  }
  ++clock_;
  auto found = std::find_if(graphs_.begin(), graphs_.end(),
                            [&](const Entry& e) { return e.ptrs == ptrs; });
  if (found == graphs_.end()) {
    auto seen = std::find(noted_.begin(), noted_.end(), ptrs);
    if (seen == noted_.end()) {  // a first run: note it, execute
      if (noted_.size() >= kGraphs) noted_.erase(noted_.begin());
      noted_.push_back(ptrs);
      return Result::kExecute;
    }
    noted_.erase(seen);
    cudaGraphExec_t exec = Instantiate(record);
    if (exec == nullptr) {  // not recordable: execute, now and from now on
      unsupported_ = true;
      ++unsupported;
      return Result::kExecute;
    }
    if (graphs_.size() >= kGraphs) {
      auto oldest = std::min_element(
          graphs_.begin(), graphs_.end(),
          [](const Entry& a, const Entry& b) { return a.used < b.used; });
      cudaGraphExecDestroy(oldest->exec);  // freed after any launch ends
      graphs_.erase(oldest);
    }
    graphs_.push_back({ptrs, exec, clock_});
    found = graphs_.end() - 1;
    ++recorded;
  }
  found->used = clock_;
  if (cudaError_t err = cudaGraphLaunch(found->exec, stream);
      err != cudaSuccess) {
    *error = CudaError("cudaGraphLaunch", err);
    return Result::kFailed;
  }
  ++launched;
  return Result::kLaunched;
}

}  // namespace jax_ring
