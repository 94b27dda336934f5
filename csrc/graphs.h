// A cuDNN plan's launches replayed as CUDA graphs, one a set of pointers.
//
// cuDNN's execute spends 40-55 us of host time a call (its variant pack,
// then the workspace memsets and three to five kernel launches). Where the
// host has just waited on the stream (a packed pass reads its counts), the
// GPU idles through all of it. Recorded once into a CUDA graph (cuDNN's
// populate_cuda_graph), the same launches replay with one cudaGraphLaunch.
//
// A recorded graph's kernels hold the device pointers they were recorded
// with, so a graph serves exactly its pointers and workspace: a set's first
// run executes as usual and is noted, its second records the graph, later
// runs launch it. A plan keeps at most kGraphs graphs (the least recently
// used goes) and kGraphs noted sets; a plan whose launches cuDNN cannot
// record, or whose graph CUDA cannot build, executes from then on. Streams
// XLA is capturing into a command buffer are never served here (the
// capture records the execute).
//
// Not thread-safe: a plan belongs to one device, whose handle lock
// (LockHandle) its callers hold.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <cuda_runtime.h>

namespace jax_ring {

class GraphCache {
 public:
  // Device pointers by Uid (sdpa.h; index 0 unused), then the workspace.
  static constexpr int kPointers = 17;
  static constexpr int kGraphs = 64;
  using Pointers = std::array<void*, kPointers>;
  // Fills an empty graph with the plan's launches for the pointers; false
  // where the engine cannot be recorded.
  using Record = std::function<bool(cudaGraph_t)>;

  enum class Result { kLaunched, kExecute, kFailed };

  GraphCache() = default;
  GraphCache(const GraphCache&) = delete;
  GraphCache& operator=(const GraphCache&) = delete;
  ~GraphCache();

  // Launches the graph of `ptrs` on `stream` (recording it at the set's
  // second run), or answers kExecute: the caller runs cuDNN's execute
  // (also where the graph could not be recorded or built). kFailed sets
  // `error`: the launch failed.
  Result Launch(const Pointers& ptrs, cudaStream_t stream,
                const Record& record, std::string* error);

 private:
  struct Entry {
    Pointers ptrs;
    cudaGraphExec_t exec;
    uint64_t used;
  };
  std::vector<Entry> graphs_;
  std::vector<Pointers> noted_;
  uint64_t clock_ = 0;
  bool unsupported_ = false;
};

// Whether plans replay graphs (default on; off for A/B measurements), and
// the process's counts: graphs launched, recorded, plans found unsupported.
void SetGraphsEnabled(bool enabled);
std::array<int64_t, 3> GraphCounts();

}  // namespace jax_ring
