// src/runtime/snapshot_document: a pool's view as torch's snapshot layout. Each mapped
// stretch is a segment whose blocks, cut to its bounds, add up to its size (torch's tools
// assert it); evicted blocks no mapped page holds are listed apart; the trace keeps its
// order and marks evictions and fetches.
#include <gtest/gtest.h>

#include <string>

#include "runtime/snapshot_document.h"

namespace vramswap {
namespace {

using Block = pool::DevicePool::BlockView;
using pool::TraceEvent;

constexpr uintptr_t kBase = 0x10000000;
constexpr uint64_t kMiB = 1 << 20;

Block block(uintptr_t offset_mib, uint64_t mib, Block::State state, bool tagged = false, bool away = false) {
  Block b;
  b.addr = kBase + offset_mib * kMiB;
  b.size = mib * kMiB;
  b.state = state;
  b.offloadable = tagged;
  b.away = away;
  b.stream = state == Block::State::kLive ? 0x77 : 0;
  return b;
}

// Mapped: [0, 4) and [8, 10) MiB. Blocks: live tagged [0, 1), free [1, 6) (runs past the
// first stretch), evicted [6, 9) (its last MiB on a page still mapped), pending [9, 10),
// evicted [10, 12) (no page mapped), free [12, 64).
DeviceMemoryView two_stretches() {
  DeviceMemoryView d;
  d.device = 1;
  d.view.mapped = {{kBase, 4 * kMiB}, {kBase + 8 * kMiB, 2 * kMiB}};
  d.view.blocks = {block(0, 1, Block::State::kLive, true),       block(1, 5, Block::State::kFree),
                   block(6, 3, Block::State::kLive, true, true), block(9, 1, Block::State::kPendingFree),
                   block(10, 2, Block::State::kLive, true, true), block(12, 52, Block::State::kFree)};
  return d;
}

std::string segment(uintptr_t offset_mib, uint64_t mib, uint64_t allocated_mib, uint64_t active_mib) {
  return R"({"device":1,"address":)" + std::to_string(kBase + offset_mib * kMiB) +
         R"(,"total_size":)" + std::to_string(mib * kMiB) + R"(,"allocated_size":)" +
         std::to_string(allocated_mib * kMiB) + R"(,"active_size":)" + std::to_string(active_mib * kMiB) +
         R"(,"requested_size":)" + std::to_string(allocated_mib * kMiB) +
         R"(,"stream":0,"segment_type":"large","is_expandable":true,"frames":[],"blocks":[)";
}

std::string part(uintptr_t offset_mib, uint64_t mib, const char* state, const char* extra = "") {
  const std::string size = std::to_string(mib * kMiB);
  return R"({"address":)" + std::to_string(kBase + offset_mib * kMiB) + R"(,"size":)" + size +
         R"(,"requested_size":)" + size + R"(,"state":")" + state + R"(","frames":[])" + extra + "}";
}

TEST(SnapshotDocument, EachMappedStretchIsASegmentOfTheBlocksCutToIt) {
  const std::string doc = snapshot_document({two_stretches()});
  const char* live = R"(,"vramswap":{"tagged":true,"evicted":false})";
  const char* evicted = R"(,"vramswap":{"tagged":true,"evicted":true})";
  const std::string first =
      segment(0, 4, 1, 1) + part(0, 1, "active_allocated", live) + "," + part(1, 3, "inactive") + "]}";
  const std::string second = segment(8, 2, 1, 2) + part(8, 1, "active_allocated", evicted) + "," +
                             part(9, 1, "active_pending_free") + "]}";
  EXPECT_EQ(0u, doc.find(R"({"segments":[)" + first + "," + second + "],")) << doc;
}

TEST(SnapshotDocument, EvictedBlocksWithNoMappedPageAreListedApart) {
  const std::string doc = snapshot_document({two_stretches()});
  const std::string evicted = R"("vramswap":{"evicted":[{"device":1,"address":)" +
                              std::to_string(kBase + 10 * kMiB) + R"(,"size":)" + std::to_string(2 * kMiB) +
                              R"(,"stream":119}]}})";
  ASSERT_GE(doc.size(), evicted.size());
  EXPECT_EQ(evicted, doc.substr(doc.size() - evicted.size())) << doc;
}

TEST(SnapshotDocument, OneTracePerOrdinalInOrderWithEvictionsMarked) {
  DeviceMemoryView d = two_stretches();
  d.view.trace = {{TraceEvent::Action::kAlloc, TraceEvent::Cause::kNone, kBase, 100, 0x77, 5},
                  {TraceEvent::Action::kSegmentUnmap, TraceEvent::Cause::kEvict, kBase, 2 * kMiB, 0, 6},
                  {TraceEvent::Action::kSegmentMap, TraceEvent::Cause::kFetch, kBase, 2 * kMiB, 0, 7},
                  {TraceEvent::Action::kOom, TraceEvent::Cause::kNone, 0, 1 << 30, 0x77, 8, 3 * kMiB}};
  const std::string doc = snapshot_document({d});
  const std::string a = std::to_string(kBase), g = std::to_string(2 * kMiB);
  const std::string traces = R"("device_traces":[[],[{"action":"alloc","addr":)" + a +
                             R"(,"size":100,"stream":119,"time_us":5,"frames":[]},{"action":"segment_unmap","addr":)" +
                             a + R"(,"size":)" + g + R"(,"stream":0,"time_us":6,"frames":[],"vramswap":"evict"},)" +
                             R"({"action":"segment_map","addr":)" + a + R"(,"size":)" + g +
                             R"(,"stream":0,"time_us":7,"frames":[],"vramswap":"fetch"},)" +
                             R"({"action":"oom","addr":0,"size":1073741824,"stream":119,"time_us":8,"frames":[],)" +
                             R"("device_free":)" + std::to_string(3 * kMiB) + "}]],";
  EXPECT_NE(std::string::npos, doc.find(traces)) << doc;
}

TEST(SnapshotDocument, NoPoolIsAnEmptyDocument) {
  EXPECT_EQ(R"({"segments":[],"device_traces":[],"vramswap":{"evicted":[]}})", snapshot_document({}));
}

}  // namespace
}  // namespace vramswap
