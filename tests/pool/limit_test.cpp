// DevicePool at its limit: a request that would take the mapped memory past limit_bytes
// (or past the card) fails with a report naming the request and the limit, counts in
// num_ooms and changes nothing else; before failing, the pool waits for pending blocks and
// unmaps cached granules, so a request that fits once they are released succeeds.
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>

#include "pool_test_util.h"

namespace pool_test {
namespace {

// A pool limited to 8 MiB (four 2 MiB granules).
class Limit : public PoolTest {
 protected:
  static constexpr uint64_t kLimit = 8 * kMiB;
  uint64_t limit() const override { return kLimit; }

  // Requests `size` and expects an out-of-memory report that names it and the limit.
  void expect_out_of_memory(size_t size, uint64_t limit) {
    std::string error;
    void* p = pool().allocate(size, stream_, &error);
    EXPECT_EQ(nullptr, p) << "a request of " << size << " bytes was granted";
    if (p != nullptr) return;
    EXPECT_FALSE(error.empty()) << "out of memory without a report";
    EXPECT_TRUE(mentions_size(error, size)) << "the report does not name the request ("
                                            << size << " bytes): " << error;
    EXPECT_TRUE(mentions_size(error, limit)) << "the report does not name the limit (" << limit
                                             << " bytes): " << error;
  }

  // Four one-granule blocks on stream_ fill the limit; the first and the third are freed:
  // two granules cached under stream_'s tag but in two pieces, so a two-granule request
  // fits only once they are unmapped. blocks_[1] and blocks_[3] stay live until
  // free_the_rest().
  void fill_then_free_two() {
    for (void*& b : blocks_) {
      b = allocate(granularity());
      ASSERT_NE(nullptr, b);
    }
    ASSERT_EQ(kLimit, stats().reserved_bytes);
    deallocate(blocks_[0]);
    deallocate(blocks_[2]);
    ASSERT_EQ(kLimit, stats().reserved_bytes) << "freed blocks stay cached";
  }
  void free_the_rest() {
    deallocate(blocks_[1]);
    deallocate(blocks_[3]);
  }

  void* blocks_[4] = {};
};

// Ends the capture on `stream`, expecting it intact: cudaSuccess and a graph (destroyed).
void expect_capture_intact(cudaStream_t stream) {
  cudaGraph_t graph = nullptr;
  EXPECT_CUDA_OK(cudaStreamEndCapture(stream, &graph)) << "the capture was broken";
  EXPECT_NE(nullptr, graph);
  if (graph != nullptr) cudaGraphDestroy(graph);
}

TEST_F(Limit, BeyondTheLimitFailsWithAReportAndChangesNothingElse) {
  SKIP_UNLESS_CUDASIM();
  void* big = allocate(6 * kMiB);
  ASSERT_NE(nullptr, big);
  const PoolStats before = stats();
  const uint64_t mapped = sim_counters()->mapped_bytes;

  expect_out_of_memory(4 * kMiB, kLimit);

  PoolStats after = stats();
  EXPECT_EQ(before.num_ooms + 1, after.num_ooms);
  after.num_ooms = before.num_ooms;
  EXPECT_TRUE(same_stats(before, after)) << "a failed request changes only num_ooms";
  EXPECT_EQ(mapped, sim_counters()->mapped_bytes) << "a failed request maps nothing";

  // Once the big block is freed the same request fits.
  deallocate(big);
  std::string error;
  void* p = pool().allocate(4 * kMiB, stream_, &error);
  EXPECT_NE(nullptr, p) << error;
  EXPECT_EQ(before.num_ooms + 1, stats().num_ooms);
  EXPECT_LE(stats().reserved_bytes, kLimit);
  if (p != nullptr) deallocate(p);
}

// A block given up (unmap_block) is still allocated but holds no page: the report says how
// much of what is allocated is such, and counts the free part of what is mapped from the
// blocks that hold pages. (A replayed VGG-16 step's report said "5.82 GiB allocated, 4.3 GiB
// reserved (mapped), 0 B reserved but free" under a limit of 5.37 GiB, 1.53 GiB of it away.)
TEST_F(Limit, TheReportSaysWhatOfTheAllocatedBytesIsGivenUp) {
  const size_t g = granularity();
  ASSERT_EQ(2 * kMiB, g);
  std::string error;
  void* a = allocate(3 * g);
  ASSERT_NE(nullptr, a);
  void* x = pool().allocate_offloadable(g, stream_, &error);
  ASSERT_NE(nullptr, x) << error;
  ASSERT_TRUE(pool().unmap_block(x).ok);
  ASSERT_EQ(3 * g, stats().mapped_bytes);
  EXPECT_EQ(nullptr, pool().allocate(2 * g, stream_, &error));
  EXPECT_NE(std::string::npos,
            error.find("pool: 8 MiB allocated (2 MiB of it in blocks given up to offload, their pages unmapped), "
                       "6 MiB reserved (mapped), 0 B reserved but free"))
      << error;
  EXPECT_TRUE(pool().deallocate(x, stream_).ok);
  deallocate(a);
}

TEST_F(Limit, ARequestLargerThanTheLimitFailsAtOnce) {
  expect_out_of_memory(kLimit + kBlockUnit, kLimit);
  expect_out_of_memory(64 * kMiB, kLimit);
  const PoolStats s = stats();
  EXPECT_EQ(2u, s.num_ooms);
  EXPECT_EQ(0u, s.num_allocs) << "failed requests are not allocations";
  EXPECT_EQ(0u, s.reserved_bytes);
}

TEST_F(Limit, TheWholeLimitCanBeAllocated) {
  void* p = allocate(kLimit);
  ASSERT_NE(nullptr, p);
  EXPECT_EQ(kLimit, stats().reserved_bytes);
  expect_out_of_memory(kBlockUnit, kLimit);
  deallocate(p);
}

TEST_F(Limit, CachedGranulesAreUnmappedBeforeReportingOutOfMemory) {
  SKIP_UNLESS_CUDASIM();
  const size_t g = granularity();
  ASSERT_NO_FATAL_FAILURE(fill_then_free_two());

  std::string error;
  void* p = pool().allocate(2 * g, stream_, &error);
  ASSERT_NE(nullptr, p) << "the cached granules should have made room: " << error;
  const PoolStats s = stats();
  EXPECT_EQ(0u, s.num_ooms);
  EXPECT_LE(s.reserved_bytes, kLimit);
  EXPECT_LE(s.peak_reserved_bytes, kLimit) << "the limit holds at every moment";
  EXPECT_EQ(s.reserved_bytes, sim_counters()->mapped_bytes);
  LiveBlocks live;
  EXPECT_TRUE(live.insert(blocks_[1], g));
  EXPECT_TRUE(live.insert(blocks_[3], g));
  EXPECT_TRUE(live.insert(p, 2 * g));
  EXPECT_TRUE(round_trip(p, 2 * g, 5));
  deallocate(p);
  free_the_rest();
}

// Note [Taking only the pages needed]: at the limit a request takes the pages of as many
// unused cached granules as it lacks, not of every one. Eight one-granule blocks fill a
// 16 MiB limit; three non-adjacent ones are freed (cached); a two-granule request fits only
// past them and takes two granules' pages: the third cached block stays mapped, and a
// one-granule request then reuses it without mapping anything.
class LimitOfEight : public PoolTest {
 protected:
  uint64_t limit() const override { return 16 * kMiB; }

  // The limit reached, then a hole of three unmapped granules (x's, its pages spare) and
  // three cached, mapped granules (y's, of `y_size`), with w away: x on granules 0-2, w on
  // 3, y on 4-6, c on 7, d on w's page. With `step`, a step begins just before y, which is
  // its first large allocation (Note [A step's addresses]).
  struct HoleAndCache {
    void *x, *w, *y, *c, *d;
  };
  HoleAndCache hole_and_cache(size_t y_size, bool step) {
    const size_t g = granularity();
    std::string error;
    HoleAndCache l{};
    l.x = pool().allocate_offloadable(3 * g, stream_, &error);
    EXPECT_NE(nullptr, l.x) << error;
    l.w = pool().allocate_offloadable(g, stream_, &error);
    EXPECT_NE(nullptr, l.w) << error;
    if (step) pool().begin_step();
    l.y = allocate(y_size);
    l.c = allocate(g);
    EXPECT_NE(nullptr, l.y);
    EXPECT_NE(nullptr, l.c);
    EXPECT_TRUE(pool().unmap_block(l.w).ok);  // away, and stays so
    l.d = allocate(g);
    EXPECT_NE(nullptr, l.d);
    EXPECT_TRUE(pool().unmap_block(l.x).ok);
    deallocate(l.x);
    deallocate(l.y);
    return l;
  }
};

TEST_F(LimitOfEight, ARequestAtTheLimitUnmapsOnlyTheCachedGranulesItNeeds) {
  SKIP_UNLESS_CUDASIM();
  const size_t g = granularity();
  ASSERT_EQ(2 * kMiB, g);
  void* blocks[8] = {};
  for (void*& b : blocks) {
    b = allocate(g);
    ASSERT_NE(nullptr, b);
  }
  for (int i : {0, 2, 4}) deallocate(blocks[i]);
  ASSERT_EQ(16 * kMiB, sim_counters()->mapped_bytes) << "freed blocks stay cached";

  std::string error;
  void* pair = pool().allocate(2 * g, stream_, &error);
  ASSERT_NE(nullptr, pair) << error;
  EXPECT_EQ(16 * kMiB, sim_counters()->mapped_bytes)
      << "two cached granules give their pages; the third stays mapped";
  EXPECT_EQ(16 * kMiB, stats().reserved_bytes);

  const uint64_t mapped = sim_counters()->mapped_bytes;
  void* one = pool().allocate(g, stream_, &error);
  ASSERT_NE(nullptr, one) << error;
  EXPECT_EQ(mapped, sim_counters()->mapped_bytes) << "the cached block is reused as it is";
  EXPECT_EQ(0u, stats().num_ooms);
  EXPECT_TRUE(round_trip(pair, 2 * g, 7));
  EXPECT_TRUE(round_trip(one, g, 8));
  deallocate(one);
  deallocate(pair);
  for (int i : {1, 3, 5, 6, 7}) deallocate(blocks[i]);
}

// Note [Placing on mapped pages]: at the limit, a block that best fit would put into a hole
// whose pages were given up goes instead where its granules are still mapped (a larger
// cached block), so that no page changes place: on a GPU each granule mapped costs
// cuMemMap + cuMemSetAccess, and one taken from a cached granule a cuMemUnmap as well.
TEST_F(LimitOfEight, AtTheLimitABlockGoesWhereItsPagesAreStillMapped) {
  SKIP_UNLESS_CUDASIM();
  const size_t g = granularity();
  ASSERT_EQ(2 * kMiB, g);
  std::string error;
  void* x = pool().allocate_offloadable(3 * g, stream_, &error);  // granules 0-2, its own
  ASSERT_NE(nullptr, x) << error;
  void* b = allocate(g);      // granule 3: keeps the two holes apart
  void* y = allocate(3 * g);  // granules 4-6
  void* c = allocate(g);      // granule 7: the limit reached
  ASSERT_NE(nullptr, b);
  ASSERT_NE(nullptr, y);
  ASSERT_NE(nullptr, c);
  ASSERT_TRUE(pool().unmap_block(x).ok);  // given up: its three pages become spare
  deallocate(x);                          // a hole of three unmapped granules
  deallocate(y);                          // three cached granules, mapped
  const uint64_t mapped = sim_counters()->mapped_bytes;
  ASSERT_EQ(10 * kMiB, mapped);

  void* z = allocate(3 * g);  // best fit by size: the hole, whose pages would be mapped again
  ASSERT_NE(nullptr, z);
  EXPECT_EQ(y, z) << "placed on the cached granules instead of the unmapped hole";
  EXPECT_EQ(mapped, sim_counters()->mapped_bytes) << "no page mapped";
  EXPECT_EQ(16 * kMiB, stats().reserved_bytes);
  EXPECT_TRUE(round_trip(z, 3 * g, 9));
  EXPECT_EQ("", pool().check_invariants());
  deallocate(z);
  deallocate(b);
  deallocate(c);
}

// The physical pages (the handle) mapped under the byte at `p`: one per run (Note [Runs]).
CUmemGenericAllocationHandle pages_under(const void* p) {
  CUmemGenericAllocationHandle h = 0;
  if (cuMemRetainAllocationHandle(&h, const_cast<void*>(p)) != CUDA_SUCCESS) return 0;
  cuMemRelease(h);  // the retain's reference; the pool's mapping keeps the pages
  return h;
}

// Refuses one request, as the limit does under pressure: from then on the pool maps runs.
void press(vramswap::pool::DevicePool& pool, cudaStream_t stream) {
  std::string error;
  ASSERT_EQ(nullptr, pool.allocate(64 * kMiB, stream, &error)) << "above the limit";
  ASSERT_NE(std::string::npos, error.find("the limit")) << error;
}

// Note [Runs]: on a GPU each VMM call costs per call, not per granule. Once the pool is
// under pressure (a request was refused), the granules a block covers whole are mapped as
// one run (one handle, one cuMemMap, one cuMemSetAccess); a granule it covers in part,
// which a neighbour may share, is a run of its own. Before, one granule is one run.
TEST_F(LimitOfEight, UnderPressureTheGranulesABlockCoversWholeAreOneRun) {
  const size_t g = granularity();
  ASSERT_EQ(2 * kMiB, g);
  void* before = allocate(2 * g);
  ASSERT_NE(nullptr, before);
  EXPECT_NE(pages_under(before), pages_under(static_cast<char*>(before) + g)) << "no pressure yet";
  deallocate(before);
  pool().empty_cache();
  ASSERT_NO_FATAL_FAILURE(press(pool(), stream_));
  void* x = allocate(4 * g);  // granules 0-3
  ASSERT_NE(nullptr, x);
  const char* c = static_cast<const char*>(x);
  ASSERT_NE(0u, pages_under(c));
  EXPECT_EQ(pages_under(c), pages_under(c + 3 * g)) << "one handle under all four granules";
  void* y = allocate(2 * g + g / 2);  // granules 4-5 whole, 6 in part
  ASSERT_NE(nullptr, y);
  const char* d = static_cast<const char*>(y);
  EXPECT_EQ(pages_under(d), pages_under(d + g));
  EXPECT_NE(pages_under(d), pages_under(d + 2 * g)) << "the granule a neighbour may share is a run of its own";
  EXPECT_NE(pages_under(c), pages_under(d));
  EXPECT_TRUE(round_trip(x, 4 * g, 3));
  EXPECT_EQ("", pool().check_invariants());
  deallocate(x);
  deallocate(y);
}

// ... and once a block was given up, with no request refused: an engine whose plan evicts
// early enough never meets the limit, but its pages change place every step.
TEST_F(LimitOfEight, OnceABlockWasGivenUpTheGranulesABlockCoversWholeAreOneRun) {
  const size_t g = granularity();
  ASSERT_EQ(2 * kMiB, g);
  std::string error;
  void* x = pool().allocate_offloadable(2 * g, stream_, &error);
  ASSERT_NE(nullptr, x) << error;
  EXPECT_NE(pages_under(x), pages_under(static_cast<char*>(x) + g)) << "nothing has changed place yet";
  ASSERT_TRUE(pool().unmap_block(x).ok);
  void* y = allocate(3 * g);
  ASSERT_NE(nullptr, y);
  const char* c = static_cast<const char*>(y);
  EXPECT_EQ(pages_under(c), pages_under(c + 2 * g));
  EXPECT_EQ(0u, stats().num_ooms) << "no request was refused";
  ASSERT_TRUE(pool().map_block(x, DevicePool::MapWait::kSynchronize).ok);
  EXPECT_EQ(pages_under(x), pages_under(static_cast<char*>(x) + g)) << "its pages came back as one run";
  EXPECT_EQ("", pool().check_invariants());
  deallocate(y);
  EXPECT_TRUE(pool().deallocate(x, stream_).ok);
}

// A run can only be unmapped whole: a block that took part of a run the stream still uses
// (a block it freed, whose work may still run) would keep the whole run mapped while either
// lives, and its eviction would free nothing. So it goes elsewhere, and giving it up frees
// its pages. (Placed into such a run, a replayed GPT-1.3B step on its card moved 55 -> 89 GB
// and GPT-2 small at 90% ran out of memory.)
TEST_F(LimitOfEight, ABlockDoesNotCutARunItsStreamStillUses) {
  const size_t g = granularity();
  ASSERT_EQ(2 * kMiB, g);
  ASSERT_NO_FATAL_FAILURE(press(pool(), stream_));
  void* z = allocate(4 * g);  // granules 0-3, one run
  ASSERT_NE(nullptr, z);
  deallocate(z);  // cached for stream_: its work may still be queued
  std::string error;
  void* a = pool().allocate_offloadable(2 * g, stream_, &error);
  ASSERT_NE(nullptr, a) << error;
  const auto at = reinterpret_cast<uintptr_t>(a), zat = reinterpret_cast<uintptr_t>(z);
  EXPECT_FALSE(at >= zat && at < zat + 4 * g) << "placed into the stream's run";
  uint64_t freed = 0;
  ASSERT_TRUE(pool().unmap_block(a, nullptr, &freed).ok);
  EXPECT_EQ(2 * g, freed) << "its pages went";
  EXPECT_EQ("", pool().check_invariants());
  ASSERT_TRUE(pool().map_block(a, DevicePool::MapWait::kSynchronize).ok);
  EXPECT_TRUE(round_trip(a, 2 * g, 4));
  EXPECT_TRUE(pool().deallocate(a, stream_).ok);
}

// A run no block needs any more may be cut: it is unmapped first, and the block gets a run
// of its own (the rest of the old run's pages are spare, for what needs them).
TEST_F(LimitOfEight, ARunNoBlockNeedsIsUnmappedBeforeABlockCutsIt) {
  const size_t g = granularity();
  ASSERT_EQ(2 * kMiB, g);
  ASSERT_NO_FATAL_FAILURE(press(pool(), stream_));
  void* z = allocate(4 * g);  // granules 0-3, one run
  ASSERT_NE(nullptr, z);
  ASSERT_TRUE(pool().deallocate(z, vramswap::pool::any_stream()).ok);  // free for any stream: idle
  void* a = allocate(2 * g);
  ASSERT_NE(nullptr, a);
  EXPECT_EQ(z, a) << "best fit: the idle run's place";
  const char* c = static_cast<const char*>(a);
  EXPECT_EQ(pages_under(c), pages_under(c + g));
  EXPECT_EQ(0u, pages_under(c + 2 * g)) << "the rest of the old run is unmapped";
  EXPECT_EQ(4 * kMiB, stats().mapped_bytes);
  EXPECT_TRUE(round_trip(a, 2 * g, 5));
  EXPECT_EQ("", pool().check_invariants());
  deallocate(a);
}

// ... but not while a block is away: the fetches that bring it back need the pages of the
// blocks the stream freed, and best fit's places at the limit have the stream synchronized
// for them (Note [Placing on mapped pages]).
TEST_F(LimitOfEight, WhileABlockIsAwayBestFitPlacesTheBlock) {
  SKIP_UNLESS_CUDASIM();
  const size_t g = granularity();
  ASSERT_EQ(2 * kMiB, g);
  const auto [x, w, y, c, d] = hole_and_cache(3 * g, false);
  ASSERT_FALSE(HasFailure());
  const uint64_t mapped = sim_counters()->mapped_bytes;

  void* z = allocate(3 * g - 4096);  // not y's size: no quick-list hit
  ASSERT_NE(nullptr, z);
  EXPECT_EQ(x, z) << "best fit's place, the hole";
  EXPECT_EQ(mapped + 3 * g, sim_counters()->mapped_bytes) << "the spare pages mapped under it";
  EXPECT_EQ(16 * kMiB, stats().reserved_bytes);
  EXPECT_TRUE(round_trip(z, 3 * g - 4096, 3));
  EXPECT_EQ("", pool().check_invariants());
  for (void* p : {z, c, d}) deallocate(p);
  EXPECT_TRUE(pool().deallocate(w, stream_).ok);
}

// Note [A step's addresses]: the same case in a repeated step. The step before put the
// allocation of this order and size on the three granules now cached; best fit alone takes
// the unmapped hole and maps three pages there (the case above), the step's address takes
// the cached granules and maps nothing.
TEST_F(LimitOfEight, ARepeatedStepsBlockGoesWhereTheStepBeforePutIt) {
  SKIP_UNLESS_CUDASIM();
  const size_t g = granularity();
  ASSERT_EQ(2 * kMiB, g);
  const size_t size = 3 * g - 4096;  // not a cached block's size: no quick-list hit
  const auto [x, w, y, c, d] = hole_and_cache(size, true);
  ASSERT_FALSE(HasFailure());
  const uint64_t mapped = sim_counters()->mapped_bytes;

  pool().begin_step();
  void* z = allocate(size);  // the next step's first large allocation, of y's size
  ASSERT_NE(nullptr, z);
  EXPECT_EQ(y, z) << "where the step before put it, not best fit's hole";
  EXPECT_EQ(mapped, sim_counters()->mapped_bytes) << "no page mapped";
  EXPECT_TRUE(round_trip(z, size, 4));
  EXPECT_EQ("", pool().check_invariants());
  // The second allocation of the step is not y's size's: best fit, as always.
  void* e = allocate(2 * g);
  ASSERT_NE(nullptr, e);
  EXPECT_EQ(x, e) << "best fit's place, the hole";
  EXPECT_EQ("", pool().check_invariants());
  for (void* p : {z, c, d, e}) deallocate(p);
  EXPECT_TRUE(pool().deallocate(w, stream_).ok);
}

// ... but not where the step before's place has lost its pages and best fit's has them: a
// place is worth keeping for its mapped pages, and one whose pages were given up would have
// them mapped again (gpt-medium-adamw in the benchmark remapped more with the place kept).
TEST_F(LimitOfEight, ARepeatedStepsBlockGoesWhereThePagesAreIfItsPlaceLostThem) {
  SKIP_UNLESS_CUDASIM();
  const size_t g = granularity();
  ASSERT_EQ(2 * kMiB, g);
  const size_t size = 3 * g - 4096;  // not a cached block's size: no quick-list hit
  std::string error;
  pool().begin_step();
  void* x = pool().allocate_offloadable(size, stream_, &error);  // the step's first: granules 0-2
  ASSERT_NE(nullptr, x) << error;
  void* u = pool().allocate_offloadable(g, stream_, &error);  // granule 3
  ASSERT_NE(nullptr, u) << error;
  void* w = pool().allocate_offloadable(g, stream_, &error);  // granule 4
  ASSERT_NE(nullptr, w) << error;
  void* y = allocate(3 * g);  // granules 5-7: the limit reached
  ASSERT_NE(nullptr, y);
  ASSERT_TRUE(pool().unmap_block(w).ok);  // away, and stays so
  for (void* p : {x, u}) {
    ASSERT_TRUE(pool().unmap_block(p).ok);
    deallocate(p);  // a hole of four unmapped granules, x's place at its start
  }
  deallocate(y);  // three cached granules, mapped: best fit's place
  const uint64_t mapped = sim_counters()->mapped_bytes;

  pool().begin_step();
  void* z = allocate(size);  // the next step's first large allocation, of x's size
  ASSERT_NE(nullptr, z);
  EXPECT_EQ(y, z) << "best fit's mapped place, not the step before's unmapped one";
  EXPECT_EQ(mapped, sim_counters()->mapped_bytes) << "no page mapped";
  EXPECT_TRUE(round_trip(z, size, 6));
  EXPECT_EQ("", pool().check_invariants());
  deallocate(z);
  EXPECT_TRUE(pool().deallocate(w, stream_).ok);
}

// Note [A step's addresses] is for a pool at its limit: with pages to spare the step before's
// place is no cheaper than best fit's, and taking it splits a larger free block for nothing
// (gpt-small-lora with its limit above its peak reserved 18.1 GiB with the place kept, 16.5
// without).
class LimitOfSixtyFour : public PoolTest {
 protected:
  uint64_t limit() const override { return 128 * kMiB; }
};

TEST_F(LimitOfSixtyFour, WithPagesToSpareARepeatedStepsBlockGoesWhereBestFitPutsIt) {
  SKIP_UNLESS_CUDASIM();
  const size_t g = granularity();
  ASSERT_EQ(2 * kMiB, g);
  const size_t size = 3 * g - 4096;  // not a cached block's size: no quick-list hit
  pool().begin_step();
  void* a = allocate(size);   // the step's first large allocation
  void* b = allocate(2 * g);  // after it: a and b free make five granules
  void* w = allocate(g);      // stays
  void* c = allocate(3 * g);  // three granules, best fit's place for `size` once free
  void* z = allocate(g);      // stays
  for (void* p : {a, b, w, c, z}) ASSERT_NE(nullptr, p);
  for (void* p : {a, b, c}) deallocate(p);
  void* q = allocate(7 * g);  // a miss: the quick lists merge into the free index
  ASSERT_NE(nullptr, q);
  deallocate(q);
  const uint64_t mapped = sim_counters()->mapped_bytes;

  pool().begin_step();
  void* n = allocate(size);  // the next step's first large allocation, of a's size
  ASSERT_NE(nullptr, n);
  EXPECT_EQ(c, n) << "best fit's place: pages are not scarce";
  EXPECT_EQ(mapped, sim_counters()->mapped_bytes);
  EXPECT_TRUE(round_trip(n, size, 9));
  EXPECT_EQ("", pool().check_invariants());
  for (void* p : {n, w, z}) deallocate(p);
}

// Note [A step without pressure]: a whole step that neither gave up a block nor was refused
// memory shows the limit is above what a step needs, so the next places densely, as with no
// limit (gpt-small-v10k with its limit above its peak reserved 318 MiB more than with no
// offload while every step placed for eviction).
class StepWithoutPressure : public LimitOfSixtyFour {
 protected:
  // Two offloadable blocks of three quarters of a granule each, on stream_, freed again:
  // how far apart they were placed (a granule apart: placed for eviction).
  uintptr_t two_blocks_apart() {
    const size_t size = granularity() / 4 * 3;
    std::string error;
    void* a = pool().allocate_offloadable(size, stream_, &error);
    void* b = pool().allocate_offloadable(size, stream_, &error);
    EXPECT_NE(nullptr, a) << error;
    EXPECT_NE(nullptr, b) << error;
    if (!a || !b) return 0;
    EXPECT_TRUE(round_trip(a, size, 3));
    EXPECT_TRUE(round_trip(b, size, 5));
    EXPECT_EQ("", pool().check_invariants());
    const uintptr_t apart = reinterpret_cast<uintptr_t>(b) > reinterpret_cast<uintptr_t>(a)
                                ? reinterpret_cast<uintptr_t>(b) - reinterpret_cast<uintptr_t>(a)
                                : reinterpret_cast<uintptr_t>(a) - reinterpret_cast<uintptr_t>(b);
    EXPECT_TRUE(pool().deallocate(a, stream_).ok);
    EXPECT_TRUE(pool().deallocate(b, stream_).ok);
    return apart;
  }
  // The limit reached: a block of all but one granule, then one of two granules refused.
  void refused_once() {
    std::string error;
    void* big = pool().allocate(limit() - granularity(), stream_, &error);
    ASSERT_NE(nullptr, big) << error;
    EXPECT_EQ(nullptr, pool().allocate(2 * granularity(), stream_, &error)) << "beyond the limit";
    EXPECT_TRUE(pool().deallocate(big, stream_).ok);
  }
};

TEST_F(StepWithoutPressure, TheNextStepPlacesDensely) {
  SKIP_UNLESS_CUDASIM();
  const size_t g = granularity();
  ASSERT_EQ(2 * kMiB, g);
  pool().begin_step();
  EXPECT_EQ(g, two_blocks_apart()) << "the first step places for eviction: the limit is below the card";
  EXPECT_EQ(g, two_blocks_apart());
  pool().begin_step();
  EXPECT_EQ(g / 4 * 3, two_blocks_apart()) << "a step without pressure before: placed densely";
  const uint64_t reserved = stats().reserved_bytes;
  pool().begin_step();
  EXPECT_EQ(g / 4 * 3, two_blocks_apart());
  EXPECT_EQ(reserved, stats().reserved_bytes);
}

TEST_F(StepWithoutPressure, AStepThatGaveUpABlockKeepsTheNextPlacingForEviction) {
  SKIP_UNLESS_CUDASIM();
  const size_t g = granularity();
  pool().begin_step();
  std::string error;
  void* v = pool().allocate_offloadable(g, stream_, &error);
  ASSERT_NE(nullptr, v) << error;
  ASSERT_TRUE(pool().unmap_block(v).ok);  // an eviction
  ASSERT_TRUE(pool().deallocate(v, stream_).ok);
  pool().begin_step();
  EXPECT_EQ(g, two_blocks_apart()) << "blocks were given up in the step before";
  pool().begin_step();
  EXPECT_EQ(g, two_blocks_apart());
}

TEST_F(StepWithoutPressure, AStepRefusedMemoryKeepsTheNextPlacingForEviction) {
  SKIP_UNLESS_CUDASIM();
  const size_t g = granularity();
  pool().begin_step();
  refused_once();
  pool().begin_step();
  EXPECT_EQ(g, two_blocks_apart()) << "the pool was refused memory in the step before";
}

// A step that places densely and then reaches the limit places for eviction from there on.
TEST_F(StepWithoutPressure, PressureInADenseStepTurnsPlacingForEvictionBackOn) {
  SKIP_UNLESS_CUDASIM();
  const size_t g = granularity();
  pool().begin_step();
  pool().begin_step();
  ASSERT_EQ(g / 4 * 3, two_blocks_apart());
  refused_once();
  EXPECT_EQ(g, two_blocks_apart()) << "refused memory: placing for eviction again";
}

// The allocating stream is alive, so the blocks it freed itself can be made usable by
// synchronizing just that stream: at the limit their granules are unmapped for the request
// without waiting for another stream's work (a device synchronization would wait for it:
// for an eviction engine's copy queue, for instance).
TEST_F(Limit, OwnCachedBlocksAreRetiredWithoutWaitingForOtherStreams) {
  const size_t g = granularity();
  ASSERT_NO_FATAL_FAILURE(fill_then_free_two());
  Stream other;
  ASSERT_CUDA_OK(other.status());
  void* p = nullptr;
  {
    StreamGate gate;
    LetGoLater watchdog(gate, kHangTimeout);
    ASSERT_CUDA_OK(gate.hold(other));  // busy until the gate opens
    std::string error;
    p = pool().allocate(2 * g, stream_, &error);
    EXPECT_NE(nullptr, p) << error;
    watchdog.finish();
    EXPECT_FALSE(watchdog.fired()) << "the allocation waited for the other stream";
  }
  EXPECT_EQ(0u, stats().num_ooms);
  EXPECT_LE(stats().reserved_bytes, kLimit);
  if (p != nullptr) {
    EXPECT_TRUE(round_trip(p, 2 * g, 9));
    deallocate(p);
  }
  free_the_rest();
}

// The same request while the stream is capturing a CUDA graph: synchronizing it, or the
// device, would invalidate the capture (the device in every capture mode), so the pool does
// neither; the capture ends with a graph.
TEST_F(Limit, OwnCachedBlocksAreNotRetiredBySynchronizingACapturingStream) {
  const size_t g = granularity();
  ASSERT_NO_FATAL_FAILURE(fill_then_free_two());
  ASSERT_CUDA_OK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeGlobal));
  std::string error;
  void* p = pool().allocate(2 * g, stream_, &error);
  expect_capture_intact(stream_);
  if (p != nullptr) deallocate(p);
  free_the_rest();
}

// With every stream's destruction reported (PoolOptions::streams_reported: the preload,
// which interposes cudaStreamDestroy), every stream the cache names is alive, so the blocks
// other streams freed are retired by synchronizing those streams, never the device: a
// device synchronization while any stream of the device captures invalidates the capture,
// in every mode (CUDA C++ Programming Guide, stream capture).
class LimitStreamsReported : public Limit {
 protected:
  bool streams_reported() const override { return true; }
};

// An allocation on a stream capturing in the global mode (as torch.cuda.graph captures)
// needs the pages of blocks another stream freed: that stream is synchronized, the capture
// stays valid, and the allocation is served.
TEST_F(LimitStreamsReported, AnAllocationInAGlobalCaptureRetiresOtherStreamsBlocksWithoutBreakingIt) {
  const size_t g = granularity();
  ASSERT_NO_FATAL_FAILURE(fill_then_free_two());  // blocks 0 and 2 cached for stream_
  Stream capturing;
  ASSERT_CUDA_OK(capturing.status());
  ASSERT_CUDA_OK(cudaStreamBeginCapture(capturing, cudaStreamCaptureModeGlobal));
  std::string error;
  void* p = pool().allocate(2 * g, capturing, &error);
  EXPECT_NE(nullptr, p) << error;
  if (p != nullptr) {
    EXPECT_CUDA_OK(cudaMemsetAsync(p, 1, 2 * g, capturing));
  }
  expect_capture_intact(capturing);
  if (p != nullptr) {
    EXPECT_TRUE(pool().deallocate(p, capturing).ok);
  }
  free_the_rest();
}

// The same with blocks whose reuse waits on another stream's event (record_stream), while
// this thread captures in the global mode on a third stream: the pool's event queries and
// stream synchronizations are made in the relaxed mode, where CUDA allows them, and the
// capture ends with a graph.
TEST_F(LimitStreamsReported, EventsAndStreamsAskedAtTheLimitLeaveAGlobalCaptureValid) {
  const size_t g = granularity();
  for (void*& b : blocks_) {
    b = allocate(g);
    ASSERT_NE(nullptr, b);
  }
  Stream other, capturing;
  ASSERT_CUDA_OK(other.status());
  ASSERT_CUDA_OK(capturing.status());
  ASSERT_TRUE(pool().record_stream(blocks_[0], other).ok);
  ASSERT_TRUE(pool().record_stream(blocks_[2], other).ok);
  deallocate(blocks_[0]);  // each waits for an event on `other`
  deallocate(blocks_[2]);
  ASSERT_CUDA_OK(cudaStreamBeginCapture(capturing, cudaStreamCaptureModeGlobal));
  std::string error;
  void* p = pool().allocate(2 * g, stream_, &error);
  EXPECT_NE(nullptr, p) << error;
  expect_capture_intact(capturing);
  if (p != nullptr) deallocate(p);
  free_the_rest();
}

// The program may destroy a stream while another thread's allocation, with the pool's lock
// released, is synchronizing that stream to retire the blocks it freed: the pool has
// promised never to name a destroyed stream, so stream_destroyed waits for that
// synchronization to end before the program destroys the stream.
TEST_F(LimitStreamsReported, AStreamIsNotDestroyedWhileAnAllocationSynchronizesIt) {
  const size_t g = granularity();
  Stream other;
  ASSERT_CUDA_OK(other.status());
  for (void*& b : blocks_) {
    b = allocate(g, other);
    ASSERT_NE(nullptr, b);
  }
  for (void* b : blocks_) deallocate(b, other);  // all cached for `other`, none live on it
  StreamGate gate;
  LetGoLater watchdog(gate, kHangTimeout);
  ASSERT_CUDA_OK(gate.hold(other));  // `other` stays busy until the gate opens
  void* p = nullptr;
  std::thread allocating([&] {
    std::string error;
    p = pool().allocate(2 * g, stream_, &error);  // retires other's blocks: waits for the gate
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));  // into its synchronization
  std::atomic<bool> destroyed{false};
  std::thread destroying([&] {
    EXPECT_TRUE(pool().stream_destroyed(other).ok);
    destroyed = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_FALSE(destroyed) << "stream_destroyed returned while the stream was being synchronized";
  watchdog.finish();  // opens the gate
  allocating.join();
  destroying.join();
  EXPECT_NE(nullptr, p);
  if (p != nullptr) deallocate(p);
}

// Without stream reports the pool retires other streams' blocks by synchronizing the
// device, which would invalidate a capture on any stream of it. The program says when
// captures are underway (PoolOptions::captures: torch's begin/end-allocate-to-pool hooks,
// vramswap_capture_begin/end): the device is not synchronized meanwhile, and an allocation
// that needed it is refused instead; once the capture has ended it is served.
class LimitCapturesReported : public Limit {
 protected:
  const std::atomic<int>* captures() const override { return &captures_; }
  std::atomic<int> captures_{0};
};

TEST_F(LimitCapturesReported, NoDeviceSynchronizationWhileACaptureIsUnderway) {
  const size_t g = granularity();
  ASSERT_NO_FATAL_FAILURE(fill_then_free_two());  // blocks 0 and 2 cached for stream_
  Stream other, capturing;
  ASSERT_CUDA_OK(other.status());
  ASSERT_CUDA_OK(capturing.status());
  captures_ = 1;
  ASSERT_CUDA_OK(cudaStreamBeginCapture(capturing, cudaStreamCaptureModeGlobal));
  std::string error;
  void* p = pool().allocate(2 * g, other, &error);  // would need stream_'s blocks
  EXPECT_EQ(nullptr, p) << "served by synchronizing the device during a capture";
  expect_capture_intact(capturing);
  if (p != nullptr) deallocate(p, other);
  captures_ = 0;
  p = pool().allocate(2 * g, other, &error);
  EXPECT_NE(nullptr, p) << error;
  if (p != nullptr) deallocate(p, other);
  free_the_rest();
}

TEST_F(Limit, AFailedRequestLeavesTheCacheUsable) {
  void* a = allocate(4 * kMiB);
  ASSERT_NE(nullptr, a);
  deallocate(a);
  void* live = allocate(2 * kMiB);
  ASSERT_NE(nullptr, live);
  expect_out_of_memory(7 * kMiB, kLimit);
  // What is left fits a smaller request.
  void* p = allocate(kMiB);
  EXPECT_NE(nullptr, p);
  if (p != nullptr) deallocate(p);
  deallocate(live);
}

// Without a limit, the card is the limit: more than the card fails the same way.
using CardLimit = PoolTest;

TEST_F(CardLimit, MoreThanTheCardFailsWithAReport) {
  SKIP_UNLESS_CUDASIM();
  std::string error;
  EXPECT_EQ(nullptr, pool().allocate(2 * kGiB, stream_, &error));
  EXPECT_TRUE(mentions_size(error, 2 * kGiB)) << error;
  EXPECT_TRUE(mentions_size(error, kCardBytes)) << error;
  EXPECT_EQ(1u, stats().num_ooms);
  EXPECT_EQ(0u, stats().reserved_bytes);
  EXPECT_EQ(0u, sim_counters()->physical_bytes) << "nothing of the failed request stays";
  // The pool is still fine.
  void* p = allocate(kMiB);
  EXPECT_NE(nullptr, p);
  if (p != nullptr) deallocate(p);
}

TEST_F(CardLimit, AFullDeviceIsOutOfMemoryNotAnException) {
  SKIP_UNLESS_CUDASIM();
  // Another user of the card holds 700 MiB, so the pool's mapping fails inside its limit.
  void* foreign = nullptr;
  ASSERT_CUDA_OK(cudaMalloc(&foreign, 700 * kMiB));
  const uint64_t physical = sim_counters()->physical_bytes;
  std::string error;
  void* p = nullptr;
  EXPECT_NO_THROW(p = pool().allocate(512 * kMiB, stream_, &error));
  EXPECT_EQ(nullptr, p);
  EXPECT_TRUE(mentions_size(error, 512 * kMiB)) << error;
  EXPECT_EQ(1u, stats().num_ooms);
  EXPECT_EQ(0u, stats().reserved_bytes);
  EXPECT_EQ(physical, sim_counters()->physical_bytes) << "the failed request left pages behind";
  ASSERT_CUDA_OK(cudaFree(foreign));
  p = pool().allocate(512 * kMiB, stream_, &error);
  EXPECT_NE(nullptr, p) << error;
  if (p != nullptr) deallocate(p);
}

}  // namespace
}  // namespace pool_test
