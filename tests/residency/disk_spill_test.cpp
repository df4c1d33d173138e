// The engine with a disk tier (EngineOptions::disk_dir, Note [The disk tier]): when the
// pinned host tier is full, evicted blocks needed furthest away move on to the disk, and
// come back from it byte for byte.
#include <cstdlib>
#include <string>

#include "cuda/cufile.h"
#include "cuda/host_time.h"
#include "cuda/vmm.h"
#include "engine_test_util.h"
#include "temp_dir.h"

namespace engine_test {
namespace {

using residency_test::TempDir;
using vramswap::residency::DiskIo;

// VRAMSWAP_TEST_DISK_IO=cufile (a CTest variant of its own): the tier's I/O on streams
// through cuFile (cudasim's libcufile), else on threads.
DiskIo disk_io_under_test() {
  const char* v = std::getenv("VRAMSWAP_TEST_DISK_IO");
  return v && std::string(v) == "cufile" ? DiskIo::kCuFile : DiskIo::kThreads;
}

class DiskSpill : public EngineFixture {
 protected:
  // A card of `card` bytes whose engine has `host` bytes of pinned memory and a disk tier in
  // a directory of the test's own; the graph begun.
  void start_with_disk(uint64_t card, uint64_t host, int horizon, bool verify = false) {
    ASSERT_FALSE(dir_.path().empty());
    EngineOptions options;
    options.horizon = horizon;
    options.verify = verify;
    options.host_limit_bytes = host;
    options.disk_dir = dir_.path();
    options.disk_io = disk_io_under_test();
    if (options.disk_io == DiskIo::kCuFile) {
      // Else the engine would warn and fall back to threads, and the variant test nothing new.
      std::string error;
      ASSERT_NE(nullptr, vramswap::cuda::CuFileApi::load(&error)) << error;
    }
    start(card, options);
    engine_->graph_begin();
  }
  // Backward over save_cold(n, seed)'s block i: unpacked, checked, released and freed, with
  // the invariants checked after it.
  void backward_one(const Saved& saved, size_t i, uint8_t seed) {
    const auto unpacked = engine_->unpack(saved.handles[i], stream_);
    ASSERT_TRUE(unpacked.ok) << i << ": " << unpacked.message;
    EXPECT_TRUE(holds(saved.blocks[i], uint8_t(seed + i))) << "block " << i;
    ASSERT_TRUE(engine_->release(saved.handles[i]).ok) << i;
    ASSERT_TRUE(engine_->free_tagged(saved.blocks[i], stream_).ok) << i;
    EXPECT_EQ("", engine_->check_invariants()) << i;
  }
  void backward(const Saved& saved, uint8_t seed) {
    for (size_t i = saved.blocks.size(); i-- > 0;) backward_one(saved, i, seed);
  }

  TempDir dir_{"vramswap-spill-test"};
};

TEST_F(DiskSpill, BlocksPastAFullHostTierGoToDiskAndComeBackWhole) {
  start_with_disk(16 * kMiB, 8 * kMiB, 1);  // pinned memory for two blocks
  // 32 MiB saved on a 16 MiB card with 8 MiB of pinned memory: at least 8 MiB must go on
  // to the disk.
  Saved saved = save_cold(8, 10);
  EXPECT_EQ("", engine_->check_invariants());
  const EngineStats mid = stats();
  EXPECT_GT(mid.disk_bytes_written, 0u);
  EXPECT_GT(mid.disk_bytes, 0u);
  EXPECT_LE(mid.host_bytes, 8 * kMiB);
  // Backward: each block unpacked (last saved first), checked, released and freed.
  backward(saved, 10);
  const EngineStats after = stats();
  EXPECT_EQ(after.disk_bytes_written, after.disk_bytes_read) << "what went to the disk came back";
  EXPECT_EQ(0u, after.disk_bytes) << "every extent given back";
  EXPECT_EQ("", engine_->check_invariants());
}

TEST_F(DiskSpill, ChecksumsHoldThroughTheDisk) {
  // Checksummed at eviction, checked when each block is restored.
  start_with_disk(8 * kMiB, 4 * kMiB, 0, true);
  Saved saved = save_cold(4, 40);
  ASSERT_GT(stats().disk_bytes, 0u);
  backward(saved, 40);
  const EngineStats s = stats();
  EXPECT_GT(s.disk_bytes_read, 0u);
  EXPECT_EQ(0u, s.num_verify_failures);
  EXPECT_EQ("", engine_->check_invariants());
}

// Note [Blocks larger than the pinned tier]: with pinned memory for half a block, every
// eviction goes to the disk through a bounce buffer, chunk by chunk, and every block comes
// back the same way. Before, a block larger than VRAMSWAP_HOST_LIMIT could never be evicted,
// and saving 32 MiB on a 16 MiB card ran out of memory.
TEST_F(DiskSpill, BlocksLargerThanThePinnedTierGoToTheDiskInChunks) {
  start_with_disk(16 * kMiB, 2 * kMiB, 0, true);  // checksummed through the chunks too
  Saved saved = save_cold(8, 110);
  EXPECT_EQ("", engine_->check_invariants());
  const EngineStats mid = stats();
  EXPECT_GE(mid.disk_bytes, 4 * kBlock);
  EXPECT_EQ(mid.disk_bytes, mid.disk_bytes_written);
  EXPECT_LE(mid.peak_host_bytes, 2 * kMiB) << "more pinned memory than VRAMSWAP_HOST_LIMIT";
  backward(saved, 110);
  const EngineStats after = stats();
  EXPECT_EQ(after.disk_bytes_written, after.disk_bytes_read) << "what went to the disk came back";
  EXPECT_EQ(0u, after.disk_bytes);
  EXPECT_EQ(0u, after.host_bytes) << "the bounce buffer went back";
  EXPECT_EQ(after.disk_bytes_bounced, after.disk_bytes_written + after.disk_bytes_read);
  EXPECT_EQ(0u, after.num_verify_failures);
}

// The pinned tier held by what cannot move to the disk (a frozen weight's host copy, read
// by the weight's fetch): a saved block evicted for the weight goes to the disk through the
// bounce buffer. Before, the eviction found no pinned memory and the weight's use ran out of
// memory. Needed again, the saved block takes the pinned memory of the weight's host copy
// (the weight is on the device: its copy is given up, and made again when it must leave).
// An unpack in that state failed with "no pinned memory to read it into".
// Where the driver has host VMM the weight's host copy is host memory of its own, outside the
// tier (Note [Kept blocks stay addressable]): CTest runs this case with CUDASIM_HOST_VMM=0.
TEST_F(DiskSpill, ABlockComesBackFromTheDiskWhenThePinnedTierCannotHoldIt) {
  if (vramswap::cuda::host_vmm_supported(0)) GTEST_SKIP() << "a kept block's host copy is not the tier's here";
  start_with_disk(8 * kMiB, 6 * kMiB, 0);  // a card of two blocks; pinned memory for one and a half
  void* weight = tagged(1);
  const uint64_t kept = engine_->keep(weight, true);
  ASSERT_NE(0u, kept);
  ASSERT_TRUE(engine_->mark_cold(kept, stream_).ok);
  Saved saved = save_cold(2, 130);  // the weight leaves for the second block: 4 MiB pinned
  ASSERT_EQ(kBlock, stats().evicted_bytes);
  ASSERT_EQ(0u, stats().disk_bytes);
  const auto used = engine_->use(kept, stream_, Engine::UseLane::kForward);
  ASSERT_TRUE(used.ok) << used.message;
  EXPECT_TRUE(holds(weight, 1));
  ASSERT_TRUE(engine_->mark_cold(kept, stream_).ok);
  EXPECT_EQ("", engine_->check_invariants());
  const EngineStats mid = stats();
  EXPECT_EQ(kBlock, mid.disk_bytes) << "a saved block went to the disk for the weight";
  EXPECT_EQ(kBlock, mid.disk_bytes_bounced);
  backward(saved, 130);
  const EngineStats after = stats();
  EXPECT_EQ(after.disk_bytes_written, after.disk_bytes_read);
  EXPECT_EQ(0u, after.disk_bytes);
  EXPECT_EQ(kBlock, after.disk_bytes_bounced) << "it came back through pinned memory";
  const auto again = engine_->use(kept, stream_, Engine::UseLane::kForward);
  ASSERT_TRUE(again.ok) << again.message;
  EXPECT_TRUE(holds(weight, 1));
  ASSERT_TRUE(engine_->mark_cold(kept, stream_).ok);
  ASSERT_TRUE(engine_->unkeep(kept).ok);
  ASSERT_TRUE(engine_->free_tagged(weight, stream_).ok);
  EXPECT_EQ("", engine_->check_invariants());
}

TEST_F(DiskSpill, AFreedBlockOnDiskGivesItsSpaceBack) {
  start_with_disk(8 * kMiB, 4 * kMiB, 0);
  Saved saved = save_cold(4, 1);
  ASSERT_GT(stats().disk_bytes, 0u);
  for (size_t i = saved.blocks.size(); i-- > 0;) {
    // Freed without an unpack (the program dropped the graph): nothing is read back.
    ASSERT_TRUE(engine_->free_tagged(saved.blocks[i], stream_).ok) << i;
  }
  EXPECT_EQ(0u, stats().disk_bytes);
  EXPECT_EQ(0u, stats().disk_bytes_read);
  EXPECT_EQ("", engine_->check_invariants());
}

// Note [Reading ahead from the disk]: the window's blocks on the disk are read back by the
// tier's threads while backward goes on; only a block needed before its read is done waits.
TEST_F(DiskSpill, TheWindowReadsBlocksOnTheDiskAheadOfUse) {
  start_with_disk(16 * kMiB, 8 * kMiB, 2);
  Saved saved = save_cold(8, 90);
  ASSERT_GT(stats().disk_bytes, 0u);
  backward(saved, 90);
  const EngineStats s = stats();
  EXPECT_GT(s.disk_bytes_read_ahead, 0u) << "the window's reads did not wait for their turn";
  EXPECT_LE(s.disk_bytes_read_ahead, s.disk_bytes_read);
  EXPECT_EQ(s.disk_bytes_written, s.disk_bytes_read) << "everything on the disk came back once";
  EXPECT_EQ(0u, s.disk_bytes);
  EXPECT_EQ(0u, s.host_bytes) << "every staging buffer went back";
}

// Note [Writing ahead to the disk]: with the pinned tier nearly full, the blocks needed
// furthest away go to the disk in the background, so that evictions find pinned room.
TEST_F(DiskSpill, BlocksNeededLastAreWrittenToTheDiskAheadOfNeed) {
  start_with_disk(8 * kMiB, 16 * kMiB, 1);
  Saved saved = save_cold(10, 30);
  const EngineStats mid = stats();
  EXPECT_GT(mid.disk_bytes_written_ahead, 0u) << "no write waited for its turn";
  EXPECT_LE(mid.disk_bytes_written_ahead, mid.disk_bytes_written);
  EXPECT_EQ("", engine_->check_invariants());
  // A block whose write may still run is fetched: its host copy comes back.
  backward(saved, 30);
  const EngineStats s = stats();
  EXPECT_EQ(0u, s.disk_bytes);
  EXPECT_EQ(0u, s.host_bytes);
  EXPECT_EQ(s.disk_bytes_written, s.disk_bytes_read) << "what went to the disk came back once";
}

TEST_F(DiskSpill, BlocksFreedWhileTheirWritesAheadMayRunGiveEverythingBack) {
  start_with_disk(8 * kMiB, 16 * kMiB, 0);
  Saved saved = save_cold(8, 1);
  for (size_t i = 0; i < saved.blocks.size(); ++i) {  // the first ones, furthest away, first
    ASSERT_TRUE(engine_->free_tagged(saved.blocks[i], stream_).ok) << i;
    EXPECT_EQ("", engine_->check_invariants()) << i;
  }
  EXPECT_EQ(0u, stats().disk_bytes);
  EXPECT_EQ(0u, stats().host_bytes);
}

TEST_F(DiskSpill, ABlockFreedOrUnpackedWhileItsReadAheadRunsWaitsForIt) {
  start_with_disk(8 * kMiB, 8 * kMiB, 0);  // room to evict one more while one is fetched
  Saved saved = save_cold(6, 60);  // two on the device, two on the host, the first two on the disk
  ASSERT_GE(stats().disk_bytes, 2 * kBlock);
  // A hint reads a block ahead only into device room it can have now: none yet.
  EXPECT_FALSE(engine_->prefetch(saved.handles[0]).ok);
  EXPECT_EQ(0u, stats().disk_bytes_read) << "no room on the device, nothing read";
  backward_one(saved, 5, 60);
  backward_one(saved, 4, 60);
  // A read ahead takes only free pinned memory (Note [Reading ahead from the disk]): block 3
  // comes back from the host, and its buffer with it.
  backward_one(saved, 3, 60);
  ASSERT_TRUE(engine_->prefetch(saved.handles[0]).ok);  // its pages, then its read: nothing waits
  ASSERT_TRUE(engine_->free_tagged(saved.blocks[0], stream_).ok);
  EXPECT_EQ("", engine_->check_invariants());
  ASSERT_TRUE(engine_->prefetch(saved.handles[1]).ok);
  for (size_t i : {1, 2}) backward_one(saved, i, 60);  // 1's read may still run
  EXPECT_EQ(0u, stats().disk_bytes);
  EXPECT_EQ(0u, stats().host_bytes);
  EXPECT_EQ("", engine_->check_invariants());
}

// A block freed while its read ahead runs has its pages mapped for the read (Slot::pages_kept).
// The next block in its slot kept that mark: resident with it (what check_invariants now
// refuses), and, once evicted, fetched into pages it took to be mapped ("cudaMemcpyAsync
// failed: invalid argument" in the stress test with the disk tier behind a 2 MiB pinned tier).
TEST_F(DiskSpill, TheNextBlockInAFreedSlotStartsAnew) {
  start_with_disk(8 * kMiB, 8 * kMiB, 0);
  Saved saved = save_cold(6, 60);  // two on the device, two on the host, the first two on the disk
  for (size_t i : {5, 4, 3}) backward_one(saved, i, 60);
  ASSERT_TRUE(engine_->prefetch(saved.handles[0]).ok);  // its pages mapped, its read under way
  ASSERT_TRUE(engine_->free_tagged(saved.blocks[0], stream_).ok);
  Saved next = save_cold(3, 150);  // the first takes block 0's slot
  EXPECT_EQ("", engine_->check_invariants());
  backward(next, 150);
  for (size_t i : {2, 1}) backward_one(saved, i, 60);
  EXPECT_EQ(0u, stats().disk_bytes);
}

// A read ahead that finds no free pinned memory is refused before the block's pages are
// mapped: it used to map them, fail to start the read and unmap them again, and the plan
// tries its fetches again at every point, so that on the benchmark's disk step at 75% of its
// peak a step made 7,339 maps and 7,346 unmaps (each tens of microseconds of host time on a
// GPU) for 84 evictions.
TEST_F(DiskSpill, AReadAheadWithNoPinnedRoomMapsNothing) {
  // Pinned memory for one block and half of another: with one block in it more than a
  // quarter stays free, so nothing is written ahead, and there is no room for a second.
  start_with_disk(8 * kMiB, 6 * kMiB, 0);
  Saved saved = save_cold(6, 70);  // 4 and 5 on the device, 3 on the host, 0 to 2 on the disk
  ASSERT_EQ(3 * kBlock, stats().disk_bytes);
  backward_one(saved, 5, 70);  // room on the device for one block; none in pinned memory
  const vramswap::cuda::HostTimes before = vramswap::cuda::host_times();
  for (int i = 0; i < 3; ++i) EXPECT_FALSE(engine_->prefetch(saved.handles[0]).ok) << "no pinned memory to read into";
  const vramswap::cuda::HostTimes after = vramswap::cuda::host_times();
  EXPECT_EQ(before.vmm_map_calls, after.vmm_map_calls) << "pages mapped for a read that could not start";
  EXPECT_EQ(before.vmm_unmap_calls, after.vmm_unmap_calls);
  EXPECT_EQ(0u, stats().disk_bytes_read);
  EXPECT_EQ("", engine_->check_invariants());
  for (size_t i : {4, 3, 2, 1, 0}) backward_one(saved, i, 70);
  EXPECT_EQ(0u, stats().disk_bytes);
  EXPECT_EQ(0u, stats().host_bytes);
}

// Unpacking a block on the disk with the card full: read back into pinned memory, then room
// is made on the card by evicting a block, whose copy needs pinned memory too, so a block
// goes to the disk. It used to be the very block being fetched (the evicted block needed
// furthest away): its copy to the device then read a null buffer.
TEST_F(DiskSpill, MakingRoomForABlockReadBackNeverSendsItBackToTheDisk) {
  start_with_disk(8 * kMiB, 8 * kMiB, 0);
  Saved saved = save_cold(6, 20);  // 4 and 5 on the device, 2 and 3 on the host, 0 and 1 on the disk
  ASSERT_GE(stats().disk_bytes, 2 * kBlock);
  for (size_t i : {1, 5, 4, 3, 2, 0}) backward_one(saved, i, 20);  // block 1 first
}

TEST_F(DiskSpill, AnUnusableDirectoryLeavesTheEngineWithoutADiskAndSaysWhy) {
  EngineOptions options;
  options.horizon = 0;
  options.host_limit_bytes = 4 * kMiB;
  options.disk_dir = "/nonexistent/vramswap-spill";
  start(8 * kMiB, options);
  engine_->graph_begin();
  Saved saved = save_cold(2, 1);
  std::string error;
  void* third = engine_->allocate_tagged(kBlock, stream_, &error);  // one block to the host
  ASSERT_NE(nullptr, third) << error;
  void* fourth = engine_->allocate_tagged(kBlock, stream_, &error);  // the host is full
  EXPECT_EQ(nullptr, fourth);
  EXPECT_NE(std::string::npos, error.find("VRAMSWAP_DISK_DIR='/nonexistent/vramswap-spill'")) << error;
  ASSERT_TRUE(engine_->free_tagged(third, stream_).ok);
  release_all(saved);
}

// A block on the disk needed now while the pinned tier is held by copies in flight: here
// the host buffers of two blocks brought back ahead (one fetched, one read from the disk
// and fetched), used and freed before the host saw their fetches land (their buffers go
// back behind the fetches' events). Those buffers are free
// as soon as the fetches land, so the read back waits for them instead of failing. It ran
// out of pinned memory ("no pinned memory to read it into") where the host had not seen
// them land (in virtual time, where nothing lands before the host waits: the CTest
// variants .cufile_virtual_time and .virtual_time), and the benchmark's disk step
// (gpt-small-disk at 75%) stopped with an out-of-memory.
TEST_F(DiskSpill, ABlockNeededFromTheDiskWaitsForCopiesHoldingThePinnedTier) {
  start_with_disk(16 * kMiB, 8 * kMiB, 0);  // pinned memory for two blocks
  Saved saved = save_cold(8, 70);
  ASSERT_GE(stats().disk_bytes, 2 * kBlock);
  backward_one(saved, 7, 70);
  backward_one(saved, 6, 70);
  // Block 3 on the host, 0-2 on the disk: 3 fetched ahead, 2 read ahead into the pinned tier.
  for (size_t i : {3, 2}) ASSERT_TRUE(engine_->prefetch(saved.handles[i]).ok) << i;
  ASSERT_GE(stats().host_bytes, kBlock) << "pinned memory held by what comes back ahead";
  for (size_t i : {5, 4, 3, 2}) {  // used and freed with no host wait: 3's and 2's buffers wait for their fetches
    ASSERT_TRUE(engine_->unpack(saved.handles[i], stream_).ok) << i;
    ASSERT_TRUE(engine_->release(saved.handles[i]).ok) << i;
    ASSERT_TRUE(engine_->free_tagged(saved.blocks[i], stream_).ok) << i;
  }
  // Blocks 1 and 0 are on the disk (needed last, so sent there first) and needed now.
  backward_one(saved, 1, 70);
  backward_one(saved, 0, 70);
  EXPECT_EQ(0u, stats().disk_bytes);
  EXPECT_EQ(0u, stats().host_bytes);
  EXPECT_EQ("", engine_->check_invariants());
}

}  // namespace
}  // namespace engine_test
