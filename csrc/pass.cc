// One handler a packed block pass: every length class's cuDNN calls, their
// number read from the device once (the tables are built by
// ../jax_ring/_src/backends/cudnn/passes.py, `tables`).
//
// Class c's documents are virtual batches of L_c rows and keys. A row's
// table holds P_c entries of class c (its documents by rank, empty ones at
// the row's end) inside tables laid out as
//   lens  (2, B, P)      s32  query and key counts, P = sum of P_c; class c
//                             from `base_c = sum_{c' < c} P_c'`
//   offs  (4, B, W)      s32  ragged element offsets of q, k, v, out (dq,
//                             dk, dv, dout alike) from the row's start;
//                             class c's in P_c / M_c chunks of M_c + 4
//                             entries, each chunk's entry M_c the row's
//                             end (M_c = batches[c]; class 0's, its menu's
//                             largest)
//   stats (B, R)         f32  R = sum_c P_c * N * L_c: class c's (P_c, N,
//                             L_c) stats of a row, from sum_{c'<c}
//                             P_c' * N * L_c'
// and `counts (C,)` s32, the most documents of each class in a row. The
// execute stage copies the counts to the host (one stream synchronisation)
// and runs, for each class with documents and each row, calls of M virtual
// batches over ranks [first, first + M): M = `batches[c]` (M_c) while more
// than M_c remain, then the smallest entry of the class's menu (`menu`
// from `menu_ends[c - 1]` to `menu_ends[c]`, ascending, ending at M_c)
// that holds the rest. A call reads a contiguous slice of lens and stats
// and the chunk of offs its first rank is in (whose entry M is the row's
// end, as in a call's own table: entries past the row's documents hold
// the end; all 16-byte aligned: every call starts at a multiple of M_c,
// and every M_c and P_c is a multiple of 4), so the row's graph (B = 1,
// slots M, ragged_len L_c) runs on pointers into them: no copies. The
// handlers read the counts when they run, so they are not recorded into
// command buffers.
#include <cstdint>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include "checks.h"
#include "run.h"
#include "sdpa.h"
#include "xla/ffi/api/ffi.h"

namespace jax_ring {
namespace {

using Longs = ffi::Span<const int64_t>;

// The length classes' static layout (the attributes) and shapes.
struct Layout {
  Longs lengths, slots, batches, menu, menu_ends;
  int64_t b, t, s, n, kh, h, hv;

  int64_t Classes() const { return static_cast<int64_t>(lengths.size()); }
  // Class c's menu: [MenuBegin(c), menu_ends[c]) of `menu`.
  int64_t MenuBegin(int64_t c) const { return c == 0 ? 0 : menu_ends[c - 1]; }
  int64_t Entries() const {  // P
    int64_t p = 0;
    for (int64_t x : slots) p += x;
    return p;
  }
  int64_t Base(int64_t c) const {
    int64_t p = 0;
    for (int64_t i = 0; i < c; ++i) p += slots[i];
    return p;
  }
  int64_t OffsBase(int64_t c) const {  // class c's first chunk in offs
    int64_t w = 0;
    for (int64_t i = 0; i < c; ++i) {
      w += slots[i] / batches[i] * (batches[i] + 4);
    }
    return w;
  }
  int64_t StatsBase(int64_t c) const {
    int64_t r = 0;
    for (int64_t i = 0; i < c; ++i) r += slots[i] * n * lengths[i];
    return r;
  }
};

// One call: class c, M virtual batches over ranks [first, first + M).
struct Call {
  int64_t c, m, first;
};

// The calls `counts` need, or every graph the pass may run (counts null:
// the INITIALIZE stage builds them all, each with first = 0).
std::vector<Call> Calls(const Layout& l, const int32_t* counts) {
  std::vector<Call> calls;
  for (int64_t c = 0; c < l.Classes(); ++c) {
    const int64_t begin = l.MenuBegin(c), end = l.menu_ends[c];
    if (counts == nullptr) {
      for (int64_t i = begin; i < end; ++i) calls.push_back({c, l.menu[i], 0});
      continue;
    }
    const int64_t top = l.batches[c];
    for (int64_t first = 0; first < counts[c]; first += top) {
      const int64_t rest = counts[c] - first;
      int64_t m = top;
      for (int64_t i = begin; i < end && rest <= top; ++i) {
        if (l.menu[i] >= rest) { m = l.menu[i]; break; }
      }
      calls.push_back({c, m, first});
    }
  }
  return calls;
}

// The buffers of a pass; those a direction lacks stay null.
struct Buffers {
  const ffi::AnyBuffer *q, *k, *v, *out, *dout;
  void *o, *dq, *dk, *dv;
  const int32_t* lens;
  const int32_t* offs;
  float* stats;
};

ffi::Error Check(const Layout& l, const ffi::AnyBuffer& counts,
                 const ffi::AnyBuffer& lens, const ffi::AnyBuffer& offs,
                 const ffi::AnyBuffer& stats) {
  const int64_t c = l.Classes(), p = l.Entries();
  if (c == 0 || static_cast<int64_t>(l.slots.size()) != c ||
      static_cast<int64_t>(l.batches.size()) != c ||
      static_cast<int64_t>(l.menu_ends.size()) != c ||
      l.menu_ends[c - 1] != static_cast<int64_t>(l.menu.size())) {
    return Invalid("a packed pass needs lengths, slots, batches and "
                   "menu_ends of one size (a class each), the last menu "
                   "end the menu's size");
  }
  for (int64_t i = 0; i < c; ++i) {
    const int64_t m = l.batches[i];
    if (m < 1 || m % 4 != 0 || l.slots[i] % m != 0) {
      return Invalid("class " + std::to_string(i) + "'s " +
                     std::to_string(l.slots[i]) +
                     " entries are not a multiple of its calls' " +
                     std::to_string(m) + " virtual batches (a multiple "
                     "of 4)");
    }
    const int64_t begin = l.MenuBegin(i), end = l.menu_ends[i];
    bool ascending = begin < end && l.menu[begin] >= 1 && l.menu[end - 1] == m;
    for (int64_t j = begin + 1; j < end && ascending; ++j) {
      ascending = l.menu[j] > l.menu[j - 1];
    }
    if (!ascending) {
      return Invalid("class " + std::to_string(i) + "'s menu must ascend "
                     "from at least 1 to its calls' " + std::to_string(m) +
                     " virtual batches");
    }
  }
  int64_t r = l.StatsBase(c);
  return FirstFailure(
      {Expect("counts", counts, {c}, "(C,)", ffi::S32),
       Expect("lens", lens, {2, l.b, p}, "(2, B, P)", ffi::S32),
       Expect("offs", offs, {4, l.b, l.OffsBase(c)}, "(4, B, W)", ffi::S32),
       Expect("stats", stats, {l.b, r}, "(B, R)", ffi::F32)});
}

// Runs (kRun) or builds the graphs of `calls`, one a call and row.
template <bool kRun>
ffi::Error RunCalls(const Layout& l, const std::vector<Call>& calls,
                    const Buffers& x, bool backward, ffi::DataType dtype,
                    int32_t device, float scale, int64_t right_bound,
                    int64_t left_bound, cudaStream_t stream,
                    const ffi::AnyBuffer* workspace) {
  const int64_t p = l.Entries(), c_all = l.Classes();
  const int64_t r = l.StatsBase(c_all), w = l.OffsBase(c_all);
  for (const Call& call : calls) {
    SdpaKey key{backward,
                dtype == ffi::BF16 ? Dtype::kBF16 : Dtype::kF16,
                device, 1, l.t, l.s, l.n, l.kh, l.h, l.hv, call.m,
                l.lengths[call.c], 0, 0, right_bound, left_bound,
                /*padding=*/false, scale, /*softcap=*/0.0f};
    const int64_t rows = kRun ? l.b : 1;
    for (int64_t b = 0; b < rows; ++b) {
      void* ptrs[kRaggedO + 1] = {};
      auto at = [](const void* base, int64_t elements) {
        return static_cast<void*>(const_cast<char*>(
            static_cast<const char*>(base)) + elements * 2);  // 16-bit
      };
      if (kRun) {
        const int64_t qr = b * l.t * l.n, kr = b * l.s * l.kh;
        ptrs[kQ] = at(x.q->untyped_data(), qr * l.h);
        ptrs[kK] = at(x.k->untyped_data(), kr * l.h);
        ptrs[kV] = at(x.v->untyped_data(), kr * l.hv);
        if (backward) {
          ptrs[kO] = at(x.out->untyped_data(), qr * l.hv);
          ptrs[kDO] = at(x.dout->untyped_data(), qr * l.hv);
          ptrs[kDQ] = at(x.dq, qr * l.h);
          ptrs[kDK] = at(x.dk, kr * l.h);
          ptrs[kDV] = at(x.dv, kr * l.hv);
        } else {
          ptrs[kO] = at(x.o, qr * l.hv);
        }
        const int64_t e = l.Base(call.c) + call.first;
        ptrs[kSeqQ] = const_cast<int32_t*>(x.lens + b * p + e);
        ptrs[kSeqKV] = const_cast<int32_t*>(x.lens + (l.b + b) * p + e);
        const Uid ragged[] = {kRaggedQ, kRaggedK, kRaggedV, kRaggedO};
        const int64_t m = l.batches[call.c];
        const int64_t chunk = l.OffsBase(call.c) + call.first / m * (m + 4);
        for (int j = 0; j < 4; ++j) {
          ptrs[ragged[j]] =
              const_cast<int32_t*>(x.offs + (j * l.b + b) * w + chunk);
        }
        ptrs[kStats] = x.stats + b * r + l.StatsBase(call.c) +
                       call.first * l.n * l.lengths[call.c];
      }
      if (auto e = Run(key, stream, kRun ? workspace : nullptr, ptrs);
          e.failure()) {
        return e;
      }
    }
  }
  return ffi::Error::Success();
}

// The counts on the host: one copy and one wait for the stream. A count
// past its class's entries (which the Python side's bound rules out) is an
// error, not a read into the next class's tables.
ffi::Error ReadCounts(const ffi::AnyBuffer& counts, cudaStream_t stream,
                      std::vector<int32_t>* host, const Layout& l) {
  host->resize(counts.element_count());
  cudaError_t err = cudaMemcpyAsync(host->data(), counts.untyped_data(),
                                    host->size() * sizeof(int32_t),
                                    cudaMemcpyDeviceToHost, stream);
  if (err == cudaSuccess) err = cudaStreamSynchronize(stream);
  if (err != cudaSuccess) {
    return ffi::Error::Internal(std::string("jax_ring packed pass: reading "
                                            "the class counts: ") +
                                cudaGetErrorString(err));
  }
  for (int64_t c = 0; c < l.Classes(); ++c) {
    if ((*host)[c] < 0 || (*host)[c] > l.slots[c]) {
      return ffi::Error::Internal(
          "jax_ring packed pass: " + std::to_string((*host)[c]) +
          " documents of class " + std::to_string(c) + " in a row, past its " +
          std::to_string(l.slots[c]) + " entries");
    }
  }
  return ffi::Error::Success();
}

Layout MakeLayout(const ffi::AnyBuffer& q, const ffi::AnyBuffer& k,
                  const ffi::AnyBuffer& v, Longs lengths, Longs slots,
                  Longs batches, Longs menu, Longs menu_ends) {
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  return Layout{lengths, slots, batches, menu,  menu_ends, qd[0],
                qd[1],   kd[1], qd[2],   kd[2], qd[3],     vd[3]};
}

ffi::Error CheckQkv(const ffi::AnyBuffer& q, const ffi::AnyBuffer& k,
                    const ffi::AnyBuffer& v) {
  if (q.dimensions().size() != 4 || k.dimensions().size() != 4 ||
      v.dimensions().size() != 4 || q.element_type() != k.element_type() ||
      q.element_type() != v.element_type() ||
      (q.element_type() != ffi::BF16 && q.element_type() != ffi::F16)) {
    return Invalid("a packed pass needs q, k, v of rank 4, all bfloat16 or "
                   "float16; got q " + Shape(q) + ", k " + Shape(k) +
                   ", v " + Shape(v));
  }
  return ffi::Error::Success();
}

// The rows no call writes keep what the out operand held (an `_into`
// call: XLA aliases it to the result), else they are undefined.
template <bool kRun>
ffi::Error Forward(cudaStream_t stream, int32_t device, ffi::AnyBuffer q,
                   ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer counts,
                   ffi::AnyBuffer lens, ffi::AnyBuffer offs,
                   ffi::RemainingArgs, ffi::Result<ffi::AnyBuffer> out,
                   ffi::Result<ffi::AnyBuffer> stats,
                   ffi::Result<ffi::AnyBuffer> workspace, float scale,
                   int64_t right_bound, int64_t left_bound, Longs lengths,
                   Longs slots, Longs batches, Longs menu, Longs menu_ends) {
  if (auto e = CheckQkv(q, k, v); e.failure()) return e;
  const Layout l =
      MakeLayout(q, k, v, lengths, slots, batches, menu, menu_ends);
  if (auto e = FirstFailure(
          {Check(l, counts, lens, offs, *stats),
           Expect("out", *out, {l.b, l.t, l.n, l.hv}, "(B, T, N, Hv)",
                  q.element_type())});
      e.failure()) {
    return e;
  }
  std::vector<int32_t> host;
  if (kRun) {
    if (auto e = ReadCounts(counts, stream, &host, l); e.failure()) return e;
  }
  Buffers x{&q, &k, &v, nullptr, nullptr, out->untyped_data(), nullptr,
            nullptr, nullptr, static_cast<const int32_t*>(lens.untyped_data()),
            static_cast<const int32_t*>(offs.untyped_data()),
            static_cast<float*>(stats->untyped_data())};
  return RunCalls<kRun>(l, Calls(l, kRun ? host.data() : nullptr), x, false,
                        q.element_type(), device, scale, right_bound,
                        left_bound, stream, &*workspace);
}

template <bool kRun>
ffi::Error Backward(cudaStream_t stream, int32_t device, ffi::AnyBuffer q,
                    ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer out,
                    ffi::AnyBuffer stats, ffi::AnyBuffer dout,
                    ffi::AnyBuffer counts, ffi::AnyBuffer lens,
                    ffi::AnyBuffer offs, ffi::RemainingArgs,
                    ffi::Result<ffi::AnyBuffer> dq,
                    ffi::Result<ffi::AnyBuffer> dk,
                    ffi::Result<ffi::AnyBuffer> dv,
                    ffi::Result<ffi::AnyBuffer> workspace, float scale,
                    int64_t right_bound, int64_t left_bound, Longs lengths,
                    Longs slots, Longs batches, Longs menu, Longs menu_ends) {
  if (auto e = CheckQkv(q, k, v); e.failure()) return e;
  const Layout l =
      MakeLayout(q, k, v, lengths, slots, batches, menu, menu_ends);
  const ffi::DataType dtype = q.element_type();
  if (auto e = FirstFailure(
          {Check(l, counts, lens, offs, stats),
           Expect("out", out, {l.b, l.t, l.n, l.hv}, "(B, T, N, Hv)", dtype),
           Expect("dout", dout, {l.b, l.t, l.n, l.hv}, "(B, T, N, Hv)",
                  dtype),
           Expect("dq", *dq, DimsOf(q), "(q's shape)", dtype),
           Expect("dk", *dk, DimsOf(k), "(k's shape)", dtype),
           Expect("dv", *dv, DimsOf(v), "(v's shape)", dtype)});
      e.failure()) {
    return e;
  }
  std::vector<int32_t> host;
  if (kRun) {
    if (auto e = ReadCounts(counts, stream, &host, l); e.failure()) return e;
  }
  Buffers x{&q,
            &k,
            &v,
            &out,
            &dout,
            nullptr,
            dq->untyped_data(),
            dk->untyped_data(),
            dv->untyped_data(),
            static_cast<const int32_t*>(lens.untyped_data()),
            static_cast<const int32_t*>(offs.untyped_data()),
            static_cast<float*>(stats.untyped_data())};
  return RunCalls<kRun>(l, Calls(l, kRun ? host.data() : nullptr), x, true,
                        dtype, device, scale, right_bound, left_bound, stream,
                        &*workspace);
}

template <typename Binding>
auto PassAttrs(Binding&& binding) {
  return std::move(binding)
      .template Attr<float>("scale")
      .template Attr<int64_t>("right_bound")
      .template Attr<int64_t>("left_bound")
      .template Attr<Longs>("lengths")
      .template Attr<Longs>("slots")
      .template Attr<Longs>("batches")
      .template Attr<Longs>("menu")
      .template Attr<Longs>("menu_ends");
}

// Buffers to write into may follow the tables (the remaining operands,
// aliased to the results by XLA); without them the results are fresh, and
// every row the caller reads must be some call's.
template <ffi::ExecutionStage kStage>
auto ForwardBinding() {
  return PassAttrs(ffi::Ffi::Bind<kStage>()
                       .template Ctx<ffi::PlatformStream<cudaStream_t>>()
                       .template Ctx<ffi::DeviceOrdinal>()
                       .template Arg<ffi::AnyBuffer>()  // q (B, T, N, H)
                       .template Arg<ffi::AnyBuffer>()  // k (B, S, K, H)
                       .template Arg<ffi::AnyBuffer>()  // v (B, S, K, Hv)
                       .template Arg<ffi::AnyBuffer>()  // counts (C,)
                       .template Arg<ffi::AnyBuffer>()  // lens (2, B, P)
                       .template Arg<ffi::AnyBuffer>()  // offs (4, B, W)
                       .RemainingArgs()                 // out, if _into
                       .template Ret<ffi::AnyBuffer>()  // out (B, T, N, Hv)
                       .template Ret<ffi::AnyBuffer>()  // stats (B, R) f32
                       .template Ret<ffi::AnyBuffer>());  // workspace
}

template <ffi::ExecutionStage kStage>
auto BackwardBinding() {
  return PassAttrs(ffi::Ffi::Bind<kStage>()
                       .template Ctx<ffi::PlatformStream<cudaStream_t>>()
                       .template Ctx<ffi::DeviceOrdinal>()
                       .template Arg<ffi::AnyBuffer>()  // q
                       .template Arg<ffi::AnyBuffer>()  // k
                       .template Arg<ffi::AnyBuffer>()  // v
                       .template Arg<ffi::AnyBuffer>()  // out
                       .template Arg<ffi::AnyBuffer>()  // stats (B, R) f32
                       .template Arg<ffi::AnyBuffer>()  // dout
                       .template Arg<ffi::AnyBuffer>()  // counts (C,)
                       .template Arg<ffi::AnyBuffer>()  // lens (2, B, P)
                       .template Arg<ffi::AnyBuffer>()  // offs (4, B, W)
                       .RemainingArgs()                 // dq, dk, dv if _into
                       .template Ret<ffi::AnyBuffer>()  // dq
                       .template Ret<ffi::AnyBuffer>()  // dk
                       .template Ret<ffi::AnyBuffer>()  // dv
                       .template Ret<ffi::AnyBuffer>());  // workspace
}

// A result XLA allocates and no kernel writes: the backward's stats, which
// a scatter fills only at the rows cuDNN reads (each document's; the
// rows past a document's end, in its virtual batch, are never read).
ffi::Error Uninitialized(ffi::Result<ffi::AnyBuffer>) {
  return ffi::Error::Success();
}

auto UninitializedBinding() { return ffi::Ffi::Bind().Ret<ffi::AnyBuffer>(); }

constexpr auto kInit = ffi::ExecutionStage::kInitialize;
constexpr auto kExec = ffi::ExecutionStage::kExecute;

}  // namespace
}  // namespace jax_ring

// Not command-buffer compatible: the execute stage reads the counts.
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxRingPassForwardInit,
                              (jax_ring::Forward<false>),
                              jax_ring::ForwardBinding<jax_ring::kInit>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxRingPassForward,
                              (jax_ring::Forward<true>),
                              jax_ring::ForwardBinding<jax_ring::kExec>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxRingPassBackwardInit,
                              (jax_ring::Backward<false>),
                              jax_ring::BackwardBinding<jax_ring::kInit>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxRingPassBackward,
                              (jax_ring::Backward<true>),
                              jax_ring::BackwardBinding<jax_ring::kExec>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxRingUninitialized, jax_ring::Uninitialized,
                              jax_ring::UninitializedBinding(),
                              {xla::ffi::Traits::kCmdBufferCompatible});
