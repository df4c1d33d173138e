// cycle: the host cost of the tracker protocol when nothing has to move, in ns per
// pack + mark_cold + unpack + release of one resident tagged block (what autograd's
// saved-tensor hooks pay per saved activation with no memory pressure), beside the pool's
// cached malloc+free pair of the same size on the same stream in the same run.
//
//   BM_pack_cold_unpack_release/others:<n>  the cycle, with <n> other packed cold blocks in
//                                           the predicted order (a backward in progress);
//                                           counter bytes_copied must stay 0 ("with no
//                                           pressure, offloading costs nothing")
//   BM_pool_pair                            DevicePool::allocate + deallocate, 4 MiB, warm
//   BM_event_record                         cudaEventRecord on the same kind of stream: the
//                                           one CUDA call the cycle cannot avoid (mark_cold
//                                           records the cold event), its floor
//
// The figure to quote is BM_pack_cold_unpack_release / BM_pool_pair, with the machine.
// On cudasim an event record is an operation queued to the stream's worker thread; on a
// GPU it is a driver call, so the floor differs between the two.
#include <cstdio>

#include "residency_bench.h"

namespace residency_bench {
namespace {

constexpr uint64_t kCycleBytes = 4 * kMiB;  // two granules, an activation-sized block

void BM_pack_cold_unpack_release(benchmark::State& state) {
  const int others = static_cast<int>(state.range(0));
  std::string error;
  auto rig = Rig::make(0, EngineOptions{}, &error);  // no limit: nothing is ever evicted
  if (!rig) {
    state.SkipWithError(("no engine: " + error).c_str());
    return;
  }
  Engine& engine = *rig->engine;
  const cudaStream_t stream = rig->stream;

  // The others are saved first, so the cycled block (saved last) is needed first and the
  // window after its unpack is the next `horizon` of them: unpack looks at each of them.
  engine.graph_begin();
  for (int i = 0; i < others; ++i) {
    void* p = engine.allocate_tagged(kCycleBytes, stream, &error);
    if (!p) {
      state.SkipWithError(("allocate_tagged: " + error).c_str());
      return;
    }
    const uint64_t h = engine.pack(p, stream);
    if (!engine.mark_cold(h, stream).ok) {
      state.SkipWithError("mark_cold of a background block failed");
      return;
    }
  }
  void* block = engine.allocate_tagged(kCycleBytes, stream, &error);
  if (!block) {
    state.SkipWithError(("allocate_tagged: " + error).c_str());
    return;
  }

  auto cycle = [&]() -> Status {
    const uint64_t h = engine.pack(block, stream);
    if (h == 0) return {false, "pack returned 0 for a tagged block"};
    Status s = engine.mark_cold(h, stream);
    if (s.ok) s = engine.unpack(h, stream);
    if (s.ok) s = engine.release(h);
    return s;
  };
  if (Status s = cycle(); !s.ok) {  // warm-up: the event pool holds an event from here on
    state.SkipWithError(s.message.c_str());
    return;
  }

  const EngineStats before = engine.stats();
  for (auto _ : state) {
    Status s = cycle();
    if (!s.ok) {
      state.SkipWithError(s.message.c_str());
      break;
    }
  }
  const EngineStats after = engine.stats();
  state.counters["bytes_copied"] =
      double((after.bytes_evicted_total - before.bytes_evicted_total) +
             (after.bytes_prefetched_total - before.bytes_prefetched_total));
  state.SetItemsProcessed(state.iterations());
}

void BM_pool_pair(benchmark::State& state) {
  std::string error;
  auto rig = Rig::make(0, EngineOptions{}, &error);  // the same setup as the cycle's
  if (!rig) {
    state.SkipWithError(("no engine: " + error).c_str());
    return;
  }
  DevicePool& pool = *rig->pool;
  const cudaStream_t stream = rig->stream;
  void* warm = pool.allocate(kCycleBytes, stream, &error);  // maps; later pairs are cache hits
  if (!warm) {
    state.SkipWithError(("allocate: " + error).c_str());
    return;
  }
  pool.deallocate(warm, stream);
  for (auto _ : state) {
    void* p = pool.allocate(kCycleBytes, stream, &error);
    benchmark::DoNotOptimize(p);
    pool.deallocate(p, stream);
  }
  state.SetItemsProcessed(state.iterations());
}

void BM_event_record(benchmark::State& state) {
  std::string error;
  auto rig = Rig::make(0, EngineOptions{}, &error);  // the same kind of stream as the cycle's
  if (!rig) {
    state.SkipWithError(("no engine: " + error).c_str());
    return;
  }
  cudaEvent_t event = nullptr;
  if (cudaEventCreateWithFlags(&event, cudaEventDisableTiming) != cudaSuccess) {
    state.SkipWithError("cudaEventCreateWithFlags failed");
    return;
  }
  for (auto _ : state) {
    if (cudaEventRecord(event, rig->stream) != cudaSuccess) {
      state.SkipWithError("cudaEventRecord failed");
      break;
    }
  }
  cudaStreamSynchronize(rig->stream);
  cudaEventDestroy(event);
  state.SetItemsProcessed(state.iterations());
}

BENCHMARK(BM_pack_cold_unpack_release)->ArgName("others")->Arg(0)->Arg(256)->UseRealTime();
BENCHMARK(BM_pool_pair)->UseRealTime();
BENCHMARK(BM_event_record)->UseRealTime();

}  // namespace
}  // namespace residency_bench
