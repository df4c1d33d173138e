// The pool's support for eviction: own-span blocks, taking their pages away and giving
// them back at the same address, spare pages, and the reclaimer (device_pool.h, "For the
// residency engine").
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include "pool_test_util.h"

namespace pool_test {
namespace {

class OwnSpan : public ::testing::Test {
 protected:
  void make_pool(uint64_t limit) { pool_ = std::make_unique<DevicePool>(PoolOptions{0, limit}); }
  DevicePool& pool() { return *pool_; }
  void* own(size_t size) {
    std::string error;
    void* p = pool_->allocate_offloadable(size, nullptr, &error);
    EXPECT_TRUE(error.empty()) << error;
    return p;
  }
  void* plain(size_t size) {
    std::string error;
    void* p = pool_->allocate(size, nullptr, &error);
    EXPECT_TRUE(error.empty()) << error;
    return p;
  }
  std::unique_ptr<DevicePool> pool_;
};

TEST_F(OwnSpan, StartsOnAGranuleAndSharesNoGranule) {
  make_pool(64 * kMiB);  // placing for eviction (Note [Placing for eviction])
  const size_t g = granularity();
  void* a = plain(1000);  // puts the next free address off a granule boundary
  void* b = own(3 * kMiB);
  void* c = plain(1000);
  ASSERT_TRUE(a && b && c);
  EXPECT_EQ(0u, address(b) % g);
  const uint64_t span = round_up(3 * kMiB, g);
  // No other block may touch [b, b + span).
  for (void* other : {a, c}) {
    EXPECT_TRUE(address(other) + 1000 <= address(b) || address(other) >= address(b) + span)
        << "a plain block shares a granule with the own-span block";
  }
  EXPECT_TRUE(pool().deallocate(a, nullptr).ok);
  EXPECT_TRUE(pool().deallocate(b, nullptr).ok);
  EXPECT_TRUE(pool().deallocate(c, nullptr).ok);
}

// With no limit and no pressure nothing is evicted: a larger offloadable block is placed
// densely, as allocate() would place it, and says so (*placed), so that tagging a model's
// activations of 6.9 MiB does not round each to 8 MiB (the residual CNN of
// test_vramswap_run peaked at 150 MiB against 132 untagged).
TEST_F(OwnSpan, WithNoPressureALargerBlockIsPlacedDensely) {
  make_pool(0);
  const size_t g = granularity();
  void* a = plain(1000);
  std::string error;
  uint64_t placed = 0;
  void* b = pool().allocate_offloadable(3 * kMiB + 1000, nullptr, &error, &placed);
  ASSERT_TRUE(a && b) << error;
  EXPECT_EQ(round_up(3 * kMiB + 1000, 512), placed) << "512-byte units, not whole granules";
  EXPECT_EQ(address(a) + 1024, address(b)) << "right after its neighbour";
  void* c = plain(1000);
  ASSERT_NE(nullptr, c);
  EXPECT_EQ(address(b) + placed, address(c));
  EXPECT_EQ(round_up(1024 + placed + 1024, g), pool().stats().mapped_bytes) << "no granule more than untagged";
  for (void* p : {a, b, c}) EXPECT_TRUE(pool().deallocate(p, nullptr).ok);
  EXPECT_EQ("", pool().check_invariants());
  uint64_t placed_under_limit = 0;
  make_pool(64 * kMiB);
  void* d = pool().allocate_offloadable(3 * kMiB + 1000, nullptr, &error, &placed_under_limit);
  ASSERT_NE(nullptr, d) << error;
  EXPECT_EQ(round_up(3 * kMiB + 1000, g), placed_under_limit) << "under a limit: whole granules of its own";
  EXPECT_EQ(pool().placed_size(3 * kMiB + 1000), placed_under_limit);
  EXPECT_TRUE(pool().deallocate(d, nullptr).ok);
  EXPECT_EQ("", pool().check_invariants());
}

TEST_F(OwnSpan, UnmapThenMapKeepsTheAddressAndTheSpare) {
  make_pool(0);
  const size_t g = granularity();
  auto* p = static_cast<unsigned char*>(own(2 * g));
  ASSERT_NE(nullptr, p);
  std::memset(p, 0x5a, 2 * g);
  const PoolStats before = pool().stats();
  ASSERT_TRUE(pool().unmap_block(p).ok);
  PoolStats s = pool().stats();
  EXPECT_EQ(before.mapped_bytes - 2 * g, s.mapped_bytes);
  EXPECT_EQ(before.spare_bytes + 2 * g, s.spare_bytes);
  EXPECT_EQ(before.reserved_bytes, s.reserved_bytes) << "unmapped pages stay owned, as spare";
  EXPECT_EQ(before.allocated_bytes, s.allocated_bytes) << "the block stays live";
  EXPECT_FALSE(pool().unmap_block(p).ok) << "a second unmap is refused";
  ASSERT_TRUE(pool().map_block(p, DevicePool::MapWait::kSynchronize).ok);
  s = pool().stats();
  EXPECT_EQ(before.mapped_bytes, s.mapped_bytes);
  EXPECT_EQ(before.reserved_bytes, s.reserved_bytes)
      << "no more than before: the spare pages were mapped again, or gave way to a run (Note [Runs])";
  EXPECT_EQ(0u, s.spare_bytes);
  p[0] = 1;  // mapped again, read-write, at the same address
  p[2 * g - 1] = 2;
  EXPECT_FALSE(pool().map_block(p, DevicePool::MapWait::kSynchronize).ok) << "mapping a mapped block is refused";
  EXPECT_TRUE(pool().deallocate(p, nullptr).ok);
}

TEST_F(OwnSpan, UnmapOfAPlainBlockIsRefused) {
  make_pool(0);
  void* p = plain(4 * kMiB);
  ASSERT_NE(nullptr, p);
  EXPECT_FALSE(pool().unmap_block(p).ok);
  EXPECT_FALSE(pool().unmap_block(offset(p, 512)).ok);
  EXPECT_TRUE(pool().deallocate(p, nullptr).ok);
}

TEST_F(OwnSpan, SparePagesServeANewAllocationWithinTheLimit) {
  const size_t g = granularity();
  make_pool(4 * g);
  void* a = own(4 * g);
  ASSERT_NE(nullptr, a);
  std::string error;
  EXPECT_EQ(nullptr, pool().allocate(g, nullptr, &error)) << "the limit is full";
  ASSERT_TRUE(pool().unmap_block(a).ok);
  void* b = plain(g);
  EXPECT_NE(nullptr, b) << "a spare page of the unmapped block serves it";
  EXPECT_EQ(4 * g, pool().stats().reserved_bytes);
  EXPECT_FALSE(pool().map_block(a, DevicePool::MapWait::kSynchronize).ok) << "only 3 spare pages are left for 4 granules";
  EXPECT_TRUE(pool().deallocate(b, nullptr).ok);
  pool().empty_cache();
  EXPECT_TRUE(pool().map_block(a, DevicePool::MapWait::kSynchronize).ok);
  EXPECT_TRUE(pool().deallocate(a, nullptr).ok);
}

// A fetch planned from the step before counts on memory the program's stream freed: blocks
// cached under that stream's tag, whose granules can be unmapped only once the stream has
// synchronized. MapWait::kStream synchronizes that stream (and no other) for it.
TEST_F(OwnSpan, MappingWithTheCallersStreamRetiresThatStreamsCachedBlocks) {
  const size_t g = granularity();
  make_pool(4 * g);
  void* a = own(2 * g);
  ASSERT_NE(nullptr, a);
  ASSERT_TRUE(pool().unmap_block(a).ok);
  cudaStream_t s = nullptr;
  ASSERT_EQ(cudaSuccess, cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  std::string error;
  void* blocks[4] = {};
  for (void*& b : blocks) {
    b = pool().allocate(g, s, &error);
    ASSERT_NE(nullptr, b) << error;
  }
  EXPECT_TRUE(pool().deallocate(blocks[0], s).ok);
  EXPECT_TRUE(pool().deallocate(blocks[2], s).ok);  // two granules cached under s, apart
  EXPECT_FALSE(pool().map_block(a, DevicePool::MapWait::kPendingFrees).ok) << "s's cached blocks are still s's";
  EXPECT_TRUE(pool().map_block(a, DevicePool::MapWait::kStream, s).ok) << "synchronizing s frees their granules";
  EXPECT_LE(pool().stats().reserved_bytes, 4 * g);
  EXPECT_TRUE(pool().deallocate(blocks[1], s).ok);
  EXPECT_TRUE(pool().deallocate(blocks[3], s).ok);
  EXPECT_TRUE(pool().deallocate(a, nullptr).ok);
  EXPECT_EQ(cudaSuccess, cudaStreamSynchronize(s));
  EXPECT_EQ(cudaSuccess, cudaStreamDestroy(s));
}

TEST_F(OwnSpan, FreeingAnUnmappedBlockLeavesUsableMemory) {
  const size_t g = granularity();
  make_pool(2 * g);
  void* a = own(2 * g);
  ASSERT_NE(nullptr, a);
  ASSERT_TRUE(pool().unmap_block(a).ok);
  EXPECT_TRUE(pool().deallocate(a, nullptr).ok);
  auto* b = static_cast<unsigned char*>(plain(2 * g));
  ASSERT_NE(nullptr, b);
  std::memset(b, 1, 2 * g);  // mapped, whatever address it got
  EXPECT_TRUE(pool().deallocate(b, nullptr).ok);
}

TEST_F(OwnSpan, TheReclaimerRunsAtTheLimitAndItsPagesAreUsed) {
  const size_t g = granularity();
  make_pool(4 * g);
  void* victim = own(4 * g);
  ASSERT_NE(nullptr, victim);
  using Mode = DevicePool::ReclaimMode;
  std::vector<Mode> modes;  // of each call
  pool().set_reclaimer([&](uint64_t bytes, Mode mode, cudaStream_t) -> uint64_t {
    modes.push_back(mode);
    EXPECT_GE(4 * g, bytes);
    return pool().unmap_block(victim).ok ? 4 * g : 0;
  });
  void* p = plain(2 * g);
  EXPECT_NE(nullptr, p) << "the reclaimer's pages serve the allocation";
  EXPECT_EQ(std::vector<Mode>{Mode::kNoWait}, modes) << "what can be freed at once is asked for first";
  std::string error;
  EXPECT_EQ(nullptr, pool().allocate(3 * g, nullptr, &error)) << "the reclaimer has nothing more";
  EXPECT_EQ((std::vector<Mode>{Mode::kNoWait, Mode::kNoWait, Mode::kFull}), modes)
      << "then once more, allowed to wait";
  EXPECT_NE(std::string::npos, error.find("out of memory")) << error;
  EXPECT_TRUE(pool().deallocate(p, nullptr).ok);
  EXPECT_TRUE(pool().deallocate(victim, nullptr).ok);
}

// set_reclaimer() is how the reclaimer's owner (the engine) detaches before it is destroyed.
// The pool runs the reclaimer with no lock held, so a call may be in progress on another
// thread: setting another reclaimer waits for it, or the owner would be destroyed under it.
TEST_F(OwnSpan, SettingTheReclaimerWaitsForACallInProgress) {
  const size_t g = granularity();
  make_pool(2 * g);
  void* full = own(2 * g);
  ASSERT_NE(nullptr, full);
  std::mutex mu;
  std::condition_variable changed;
  bool entered = false, let_go = false;
  std::atomic<bool> detached{false};
  std::atomic<bool> detached_while_running{false};
  pool().set_reclaimer([&](uint64_t, DevicePool::ReclaimMode, cudaStream_t) -> uint64_t {
    std::unique_lock lock(mu);
    entered = true;
    changed.notify_all();
    changed.wait(lock, [&] { return let_go; });
    if (detached) detached_while_running = true;
    return 0;
  });
  std::thread allocating([&] {
    std::string error;
    EXPECT_EQ(nullptr, pool().allocate(g, nullptr, &error));  // the limit is full: it asks the reclaimer
  });
  {
    std::unique_lock lock(mu);
    ASSERT_TRUE(changed.wait_for(lock, std::chrono::seconds(30), [&] { return entered; }));
  }
  std::thread detaching([&] {
    pool().set_reclaimer(nullptr);
    detached = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));  // time for a detach that does not wait
  {
    std::lock_guard lock(mu);
    let_go = true;
    changed.notify_all();
  }
  allocating.join();
  detaching.join();
  EXPECT_FALSE(detached_while_running) << "set_reclaimer returned while the old reclaimer still ran";
  EXPECT_TRUE(pool().deallocate(full, nullptr).ok);
}

// Issue 13: a small offloadable block (below half a granule) is placed as allocate() would
// place it, beside other blocks on one granule, not on a granule of its own: a 589,824-byte
// tensor took 2 MiB, and a model whose saved tensors are all small peaked at many times its
// untagged footprint.
TEST_F(OwnSpan, SmallOffloadableBlocksSharePagesAndCostNoMemory) {
  make_pool(0);
  const size_t g = granularity();
  const size_t small = 589824;  // a 768 x 192 fp32 activation
  void* blocks[3] = {};
  for (void*& b : blocks) b = own(small);
  ASSERT_TRUE(blocks[0] && blocks[1] && blocks[2]);
  EXPECT_EQ(address(blocks[0]) + small, address(blocks[1])) << "packed in allocation order, as allocate() places";
  EXPECT_EQ(address(blocks[1]) + small, address(blocks[2]));
  EXPECT_EQ(3 * small, pool().stats().allocated_bytes) << "placed in 512-byte units, not whole granules";
  EXPECT_EQ(g, pool().stats().mapped_bytes) << "the three share one granule";
  EXPECT_EQ(pool().placed_size(small), small);
  EXPECT_EQ(pool().placed_size(g / 2), g) << "from half a granule on, whole granules of its own";
  EXPECT_EQ("", pool().check_invariants());
  for (void* b : blocks) EXPECT_TRUE(pool().deallocate(b, nullptr).ok);
}

// Giving up a block that shares its granule unmaps nothing while a neighbour needs the
// page; the page goes with the last of them; map_block brings it back at the same address,
// and the neighbour's bytes are never touched.
TEST_F(OwnSpan, ASharedGranuleGoesWithTheLastOfItsBlocks) {
  make_pool(0);
  const size_t g = granularity();
  const size_t small = 256 * kKiB;
  auto* a = static_cast<unsigned char*>(own(small));
  auto* b = static_cast<unsigned char*>(own(small));
  ASSERT_TRUE(a && b);
  ASSERT_EQ(address(a) / g, address(b) / g) << "both on one granule";
  std::memset(a, 0x11, small);
  std::memset(b, 0x22, small);
  uint64_t freed = 1;
  bool partly = true;
  ASSERT_TRUE(pool().unmap_block(a, &partly, &freed).ok);
  EXPECT_EQ(0u, freed) << "b still needs the page";
  EXPECT_FALSE(partly);
  EXPECT_EQ(g, pool().stats().mapped_bytes);
  EXPECT_TRUE(holds_byte(b, small, 0x22)) << "the neighbour is untouched";
  EXPECT_FALSE(pool().unmap_block(a).ok) << "a second unmap is refused";
  EXPECT_EQ("", pool().check_invariants());
  ASSERT_TRUE(pool().unmap_block(b, nullptr, &freed).ok);
  EXPECT_EQ(g, freed) << "the last block on the granule takes the page with it";
  EXPECT_EQ(0u, pool().stats().mapped_bytes);
  EXPECT_EQ(g, pool().stats().spare_bytes);
  EXPECT_EQ("", pool().check_invariants());
  ASSERT_TRUE(pool().map_block(b, DevicePool::MapWait::kNone).ok);
  std::memset(b, 0x33, small);  // mapped again, read-write, at the same address
  EXPECT_EQ(g, pool().stats().reserved_bytes) << "the spare page was reused";
  ASSERT_TRUE(pool().map_block(a, DevicePool::MapWait::kNone).ok) << "nothing to map: the page is there";
  std::memset(a, 0x44, small);
  EXPECT_TRUE(holds_byte(b, small, 0x33));
  EXPECT_EQ("", pool().check_invariants());
  EXPECT_TRUE(pool().deallocate(a, nullptr).ok);
  EXPECT_TRUE(pool().deallocate(b, nullptr).ok);
}

// A granule an away block shares with a block that is then freed is unused: the pool's
// unused-granule unmapping takes it (empty_cache here; pressure does the same).
TEST_F(OwnSpan, FreeingTheNeighbourOfAnAwayBlockLeavesItsGranuleUnused) {
  make_pool(0);
  const size_t small = 256 * kKiB;
  void* a = own(small);
  void* b = own(small);
  ASSERT_TRUE(a && b);
  uint64_t freed = 1;
  ASSERT_TRUE(pool().unmap_block(a, nullptr, &freed).ok);
  EXPECT_EQ(0u, freed) << "b shares the granule";
  EXPECT_TRUE(pool().deallocate(b, nullptr).ok);
  pool().empty_cache();
  EXPECT_EQ(0u, pool().stats().mapped_bytes) << "only an away block is left on the granule";
  EXPECT_EQ("", pool().check_invariants());
  ASSERT_TRUE(pool().map_block(a, DevicePool::MapWait::kNone).ok);
  std::memset(a, 1, small);
  EXPECT_TRUE(pool().deallocate(a, nullptr).ok);
}

// Under a limit (Note [Placing for eviction]), small offloadable blocks and ordinary ones
// allocated in turn (a forward's saved activations between untagged tensors) never share a
// granule: an ordinary block on a granule would keep it mapped when every offloadable block
// on it is given up. Giving up all the offloadable blocks frees their granule.
TEST_F(OwnSpan, UnderALimitSmallOffloadableBlocksKeepToGranulesOfTheirOwn) {
  make_pool(64 * kMiB);
  const size_t g = granularity();
  const size_t small = g / 8;
  std::vector<void*> tagged, others;
  for (int i = 0; i < 8; ++i) {
    tagged.push_back(own(small));
    others.push_back(plain(small));
    ASSERT_TRUE(tagged.back() && others.back());
  }
  std::set<uint64_t> tagged_granules, other_granules;
  for (void* p : tagged) tagged_granules.insert(address(p) / g);
  for (void* p : others) other_granules.insert(address(p) / g);
  for (uint64_t gr : tagged_granules) EXPECT_EQ(0u, other_granules.count(gr)) << "granule " << gr << " is shared";
  EXPECT_EQ(2 * g, pool().stats().mapped_bytes) << "each kind fills one granule";
  uint64_t freed_total = 0;
  for (void* p : tagged) {
    uint64_t freed = 0;
    ASSERT_TRUE(pool().unmap_block(p, nullptr, &freed).ok);
    freed_total += freed;
  }
  EXPECT_EQ(g, freed_total) << "the offloadable blocks' granule went with the last of them";
  EXPECT_EQ(g, pool().stats().mapped_bytes);
  EXPECT_EQ("", pool().check_invariants());
  // A block freed by one kind and taken by the other from the quick lists would mix them.
  ASSERT_TRUE(pool().deallocate(others[0], nullptr).ok);
  void* again = own(small);
  ASSERT_NE(nullptr, again);
  EXPECT_EQ(0u, other_granules.count(address(again) / g)) << "an offloadable block reused an ordinary granule's block";
  EXPECT_EQ("", pool().check_invariants());
  EXPECT_TRUE(pool().deallocate(again, nullptr).ok);
  for (void* p : tagged) EXPECT_TRUE(pool().deallocate(p, nullptr).ok);
  for (size_t i = 1; i < others.size(); ++i) EXPECT_TRUE(pool().deallocate(others[i], nullptr).ok);
  EXPECT_EQ("", pool().check_invariants());
}

// Under a limit, a small offloadable block goes on the granule its stream's last one went
// on, or on a granule no live block touches: never into a hole among older blocks, where it
// would keep their granule mapped after they went cold and were given up together (a
// forward's temporaries leave such holes). Without a limit the hole is reused (density
// first: nothing is evicted).
TEST_F(OwnSpan, UnderALimitASmallOffloadableBlockFillsNoHoleAmongOlderBlocks) {
  for (const uint64_t limit : {uint64_t(64 * kMiB), uint64_t(0)}) {
    SCOPED_TRACE(limit ? "under a limit" : "no limit");
    make_pool(limit);
    const size_t g = granularity();
    const size_t small = g / 4;
    std::vector<void*> first;
    for (int i = 0; i < 4; ++i) first.push_back(own(small));  // fills one granule
    void* next = own(small);                                  // opens the next one
    ASSERT_TRUE(first[3] && next);
    ASSERT_NE(address(first[0]) / g, address(next) / g);
    ASSERT_TRUE(pool().deallocate(first[1], nullptr).ok);  // a hole among older blocks
    void* again = own(small);
    ASSERT_NE(nullptr, again);
    if (limit) {
      EXPECT_EQ(address(next) / g, address(again) / g) << "it went into the hole on the older granule";
    } else {
      EXPECT_EQ(address(first[0]) / g, address(again) / g) << "without a limit the hole is reused";
    }
    EXPECT_EQ("", pool().check_invariants());
    for (void* p : {first[0], first[2], first[3], next, again}) EXPECT_TRUE(pool().deallocate(p, nullptr).ok);
    pool_.reset();
  }
}

// Under a limit a small offloadable block lies within one granule: one that would run past
// its granule's end starts on the next one. Fetched back, it then needs one page, not two
// (a 384 KiB saved tensor over a granule boundary asked for two pages at a limit of five
// and could not come back: train_transformer.py --batch 12 at 60% of its peak). Without a
// limit, blocks are packed densely as before.
TEST_F(OwnSpan, UnderALimitASmallOffloadableBlockLiesWithinOneGranule) {
  for (const uint64_t limit : {uint64_t(64 * kMiB), uint64_t(0)}) {
    SCOPED_TRACE(limit ? "under a limit" : "no limit");
    make_pool(limit);
    const size_t g = granularity();
    const size_t size = 3 * g / 8;
    std::vector<void*> blocks;
    for (int i = 0; i < 3; ++i) blocks.push_back(own(size));  // the third would cross
    ASSERT_TRUE(blocks[0] && blocks[1] && blocks[2]);
    if (limit) {
      for (void* p : blocks) EXPECT_EQ(address(p) / g, (address(p) + size - 1) / g) << "a block crosses a granule";
      EXPECT_EQ(0u, address(blocks[2]) % g) << "it starts the next granule";
    } else {
      EXPECT_EQ(address(blocks[1]) + size, address(blocks[2])) << "densely, right after its neighbour";
    }
    EXPECT_EQ("", pool().check_invariants());
    for (void* p : blocks) EXPECT_TRUE(pool().deallocate(p, nullptr).ok);
    pool_.reset();
  }
}

// Under a limit a block goes where it occupies no granule that holds no live block, when
// such a place exists among the free blocks, before best fit: a granule cached idle (or one
// mapped anew) that a small block lands on stays mapped for as long as that block lives.
// Here best fit would take the whole idle granule 1; the block goes into the hole on
// granule 3 next to a live block instead, and an empty_cache() then unmaps granules 1 and 4.
TEST_F(OwnSpan, UnderALimitABlockGoesOnAnOccupiedGranuleBeforeAnIdleOne) {
  for (const uint64_t limit : {uint64_t(64 * kMiB), uint64_t(0)}) {
    SCOPED_TRACE(limit ? "under a limit" : "no limit");
    make_pool(limit);
    const size_t g = granularity();
    void* a = plain(g);          // granule 0
    void* b = plain(g);          // granule 1
    void* c = plain(g);          // granule 2
    void* d = plain(g / 2);      // the first half of granule 3
    void* e = plain(g + g / 2);  // the rest of granule 3, and granule 4
    void* f = plain(g / 8);      // granule 5
    ASSERT_TRUE(a && b && c && d && e && f);
    const uintptr_t base = address(a);
    ASSERT_EQ(base + 5 * g, address(f));
    ASSERT_TRUE(pool().deallocate(b, nullptr).ok);  // granule 1: idle, still mapped (cached)
    ASSERT_TRUE(pool().deallocate(e, nullptr).ok);  // a hole of 1.5 granules from granule 3 on
    void* x = plain(g / 4);
    ASSERT_NE(nullptr, x);
    if (limit) {
      EXPECT_EQ(3u, (address(x) - base) / g) << "it went on the idle granule";
      pool().empty_cache();
      EXPECT_EQ(4 * g, pool().stats().mapped_bytes) << "granules 0, 2, 3 and 5";
    } else {
      EXPECT_EQ(1u, (address(x) - base) / g) << "without a limit, best fit";
    }
    EXPECT_EQ("", pool().check_invariants());
    for (void* p : {a, c, d, f, x}) EXPECT_TRUE(pool().deallocate(p, nullptr).ok);
    pool_.reset();
  }
}

// Placing for eviction is a preference, never a reason to run out of memory: when the only
// room within the limit is a hole on a granule closed to the block (an ordinary block next to
// a live offloadable one, or an offloadable one away from its stream's open granule), the
// block goes there.
TEST_F(OwnSpan, PlacingForEvictionNeverCausesAnOutOfMemory) {
  const size_t g = granularity();
  make_pool(2 * g);
  void* tagged = own(g / 4);          // granule 0, its stream's open granule
  void* other = plain(g - g / 8);     // closed granule 0: granule 1
  ASSERT_TRUE(tagged && other);
  ASSERT_NE(address(tagged) / g, address(other) / g);
  ASSERT_EQ(2 * g, pool().stats().mapped_bytes);
  void* more = plain(g / 2);  // fits only beside the offloadable block
  ASSERT_NE(nullptr, more);
  EXPECT_EQ(address(tagged) / g, address(more) / g);
  EXPECT_EQ(2 * g, pool().stats().mapped_bytes);
  EXPECT_EQ("", pool().check_invariants());
  for (void* p : {tagged, other, more}) EXPECT_TRUE(pool().deallocate(p, nullptr).ok);
}

// A free block retired by a device synchronization (empty_cache, or pressure) is withheld
// while the pool waits with its lock released; it may lie over granules an eviction
// unmapped. check_invariants() from another thread meanwhile must not count it as a block
// in use (it reported "granule under a block in use is not mapped" for such a block, seen
// as a rare failure of the shadow-model stress test).
TEST_F(OwnSpan, ABlockBeingRetiredNeedsNoPages) {
  make_pool(64 * kMiB);
  const size_t g = granularity();
  Stream stream;
  ASSERT_CUDA_OK(stream.status());
  std::string error;
  void* x = pool().allocate_offloadable(g, stream, &error);
  ASSERT_NE(nullptr, x) << error;
  ASSERT_TRUE(pool().unmap_block(x).ok);
  ASSERT_TRUE(pool().deallocate(x, stream).ok);  // free for `stream`, over an unmapped granule
  EXPECT_EQ("", pool().check_invariants());
  StreamGate gate;
  ASSERT_CUDA_OK(gate.hold(stream));
  ASSERT_TRUE(gate.wait_entered());
  std::thread retiring([&] { pool().empty_cache(); });  // waits for the gate, lock released
  // Until the gate opens, empty_cache() is inside its synchronization: check meanwhile.
  std::string during;
  for (int i = 0; i < 20 && during.empty(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    during = pool().check_invariants();
  }
  gate.open();
  retiring.join();
  EXPECT_EQ("", during);
  EXPECT_EQ("", pool().check_invariants());
}


// Note [Placing for eviction]: with no limit and no pressure tagging costs no memory. A
// program's allocations and frees, some of them tagged, are replayed on a pool that tags
// them (allocate_offloadable; freed as the engine frees them: deallocate below a granule,
// deallocate_to_any from one on) and on one that tags nothing (allocate, deallocate): every
// block must land at the same offset from the first, and the pools map as much. A tagged
// block and an ordinary one of the same size must be reused as the program frees them,
// the last freed first, through the quick lists and the threads' caches alike.
struct Step {
  enum Kind { kPlain, kTagged, kFree } kind;
  size_t size = 0;  // kPlain, kTagged: the request
  int block = 0;    // kFree: the index of the allocation it frees
};

struct Placement {
  std::vector<int64_t> offsets;  // each allocation's address less the first's
  uint64_t peak_mapped = 0;
};

// Replays `steps` on a fresh pool with no limit; `tag`: kTagged steps are offloadable.
// `caches`: the threads' caches on (off: the pool records its history, which turns them off).
Placement replay(const std::vector<Step>& steps, bool tag, bool caches) {
  Placement out;
  DevicePool pool(PoolOptions{0, 0});
  if (!caches) pool.record_history(1000);
  const size_t g = granularity();
  std::vector<void*> blocks;
  std::vector<bool> tagged;
  for (const Step& s : steps) {
    std::string error;
    if (s.kind == Step::kFree) {
      void* p = blocks.at(s.block);
      const bool to_any = tagged.at(s.block) && pool.placed_size(s.size) >= g;
      const Result r = to_any ? pool.deallocate_to_any(p, nullptr) : pool.deallocate(p, nullptr);
      EXPECT_TRUE(r.ok) << r.message;
      continue;
    }
    const bool t = tag && s.kind == Step::kTagged;
    void* p = t ? pool.allocate_offloadable(s.size, nullptr, &error) : pool.allocate(s.size, nullptr, &error);
    EXPECT_NE(nullptr, p) << error;
    blocks.push_back(p);
    tagged.push_back(t);
    out.offsets.push_back(int64_t(address(p)) - int64_t(address(blocks.front())));
  }
  out.peak_mapped = pool.stats().peak_mapped_bytes;
  EXPECT_EQ("", pool.check_invariants());
  cudaDeviceSynchronize();
  return out;
}

// The free steps carry the size of the block they free (the engine's rule needs it).
std::vector<Step> with_free_sizes(std::vector<Step> steps) {
  std::vector<size_t> sizes;
  for (Step& s : steps) {
    if (s.kind == Step::kFree) s.size = sizes.at(s.block);
    else sizes.push_back(s.size);
  }
  return steps;
}

void expect_tagging_changes_nothing(const std::vector<Step>& script, uint64_t untagged_peak) {
  const std::vector<Step> steps = with_free_sizes(script);
  for (const bool caches : {true, false}) {
    SCOPED_TRACE(caches ? "threads' caches on" : "threads' caches off");
    const Placement plain = replay(steps, false, caches);
    const Placement tagged = replay(steps, true, caches);
    EXPECT_EQ(untagged_peak, plain.peak_mapped) << "the case's premise";
    EXPECT_EQ(plain.peak_mapped, tagged.peak_mapped) << "tagging cost memory with no limit";
    EXPECT_EQ(plain.offsets, tagged.offsets) << "tagging moved blocks with no limit";
  }
}

// A tagged block of half a granule or more, below one, freed before an ordinary block of
// its size: the next allocation of that size takes the tagged one (the last freed), and the
// ordinary one's place, beside free memory, takes a larger block later. Taken the other
// way round, the larger block needed a granule more (the residual CNN of
// test_vramswap_run with oneDNN's AVX2 kernels: 134 MiB against 130 untagged).
TEST_F(OwnSpan, WithNoPressureATaggedBlockIsReusedAsAnUntaggedOne) {
  const size_t s = 3 * kMiB / 2;
  expect_tagging_changes_nothing({{Step::kTagged, s},           // 0: [0, 1.5) MiB
                                  {Step::kPlain, s},            // 1: [1.5, 3)
                                  {Step::kPlain, kMiB / 2},     // 2: [3, 3.5)
                                  {Step::kFree, 0, 1},          // the ordinary one first,
                                  {Step::kFree, 0, 0},          // then the tagged one
                                  {Step::kPlain, s},            // 3: the tagged one's place
                                  {Step::kFree, 0, 2},
                                  {Step::kPlain, 2 * kMiB}},    // 4: [1.5, 3.5), no new granule
                                 4 * kMiB);
}

// The same with blocks of whole granules and more, which the engine frees with
// deallocate_to_any.
TEST_F(OwnSpan, WithNoPressureALargeTaggedBlockIsReusedAsAnUntaggedOne) {
  expect_tagging_changes_nothing({{Step::kTagged, 3 * kMiB},   // 0: [0, 3) MiB
                                  {Step::kPlain, 3 * kMiB},    // 1: [3, 6)
                                  {Step::kPlain, kMiB},        // 2: [6, 7)
                                  {Step::kFree, 0, 1},
                                  {Step::kFree, 0, 0},
                                  {Step::kPlain, 3 * kMiB},    // 3: the tagged one's place
                                  {Step::kFree, 0, 2},
                                  {Step::kPlain, 4 * kMiB}},   // 4: [3, 7), no new granule
                                 8 * kMiB);
}

// And the other way round: a tagged allocation takes the ordinary block freed last of its
// size, as an untagged one would (small blocks and larger).
TEST_F(OwnSpan, WithNoPressureATaggedAllocationReusesTheLastFreedBlockOfItsSize) {
  for (const size_t s : {size_t(96 * kKiB), size_t(3 * kMiB / 2), size_t(3 * kMiB)}) {
    SCOPED_TRACE(s);
    expect_tagging_changes_nothing({{Step::kPlain, s},           // 0
                                    {Step::kPlain, 4 * kKiB},    // 1: keeps 0 and 2 apart
                                    {Step::kPlain, s},           // 2
                                    {Step::kPlain, 4 * kKiB},    // 3
                                    {Step::kFree, 0, 0},
                                    {Step::kFree, 0, 2},         // freed last
                                    {Step::kTagged, s},          // 4: takes 2's place
                                    {Step::kPlain, s},           // 5: takes 0's place
                                    {Step::kFree, 0, 4},
                                    {Step::kFree, 0, 5}},
                                   round_up(2 * s + 8 * kKiB, granularity()));
  }
}

}  // namespace
}  // namespace pool_test
