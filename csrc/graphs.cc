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
    cudaGraph_t graph = nullptr;
    if (cudaError_t err = cudaGraphCreate(&graph, 0); err != cudaSuccess) {
      *error = CudaError("cudaGraphCreate", err);
      return Result::kFailed;
    }
    std::string why;
    if (!record(graph, &why)) {
      // The engine records no graph: execute, now and from now on.
      cudaGraphDestroy(graph);
      cudaGetLastError();
      unsupported_ = true;
      ++unsupported;
      return Result::kExecute;
    }
    cudaGraphExec_t exec = nullptr;
    cudaError_t err = cudaGraphInstantiate(&exec, graph, 0);
    cudaGraphDestroy(graph);  // the executable keeps what it needs
    if (err != cudaSuccess) {
      *error = CudaError("cudaGraphInstantiate", err);
      return Result::kFailed;
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
