// DevicePool refusals: a pointer the pool did not hand out, one inside a block, and one
// freed already are refused with a message and change nothing (the statistics included);
// record_stream refuses what is not a live block.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <string>

#include "pool_test_util.h"

namespace pool_test {
namespace {

using Refusals = PoolTest;

// Expects `r` to be a refusal with a message.
::testing::AssertionResult refused(const Result& r) {
  if (r.ok) return ::testing::AssertionFailure() << "accepted (message: \"" << r.message << "\")";
  if (r.message.empty()) return ::testing::AssertionFailure() << "refused without a message";
  return ::testing::AssertionSuccess() << r.message;
}

TEST_F(Refusals, HostPointerIsRefusedAndChangesNothing) {
  void* live = allocate(8 * kKiB);
  ASSERT_NE(nullptr, live);
  const PoolStats before = stats();
  int on_stack = 0;
  EXPECT_TRUE(refused(pool().deallocate(&on_stack, stream_)));
  EXPECT_TRUE(same_stats(before, stats()));
  deallocate(live);
}

TEST_F(Refusals, CudaMallocPointerIsRefusedAndStaysUsable) {
  void* foreign = nullptr;
  ASSERT_CUDA_OK(cudaMalloc(&foreign, 64 * kKiB));
  const PoolStats before = stats();
  EXPECT_TRUE(refused(pool().deallocate(foreign, stream_)));
  EXPECT_TRUE(same_stats(before, stats()));
  EXPECT_TRUE(round_trip(foreign, 64 * kKiB, 4));
  EXPECT_CUDA_OK(cudaFree(foreign));
}

TEST_F(Refusals, AddressInTheReservationThatIsNoBlockIsRefused) {
  void* p = allocate(4 * kKiB);
  ASSERT_NE(nullptr, p);
  // 64 MiB past the only block: inside the VA reservation (a few times the 1 GiB card),
  // never handed out.
  void* never = offset(p, 64 * kMiB);
  ASSERT_TRUE(pool().owns(never)) << "the case needs an address inside the reservation";
  const PoolStats before = stats();
  EXPECT_TRUE(refused(pool().deallocate(never, stream_)));
  EXPECT_TRUE(same_stats(before, stats()));
  deallocate(p);
}

TEST_F(Refusals, InteriorPointerIsRefusedAndTheBlockStaysLive) {
  const size_t size = 3 * kMiB;
  void* p = allocate(size);
  ASSERT_NE(nullptr, p);
  ASSERT_CUDA_OK(cudaMemset(p, 0x21, size));
  const PoolStats before = stats();
  for (size_t inside : {kBlockUnit, size / 2, size - kBlockUnit}) {
    EXPECT_TRUE(refused(pool().deallocate(offset(p, inside), stream_))) << "offset " << inside;
  }
  EXPECT_TRUE(same_stats(before, stats()));
  // The block was not split or freed: nothing else is handed out inside it.
  void* q = allocate(kBlockUnit);
  ASSERT_NE(nullptr, q);
  EXPECT_TRUE(address(q) + kBlockUnit <= address(p) || address(p) + size <= address(q))
      << q << " lies inside the live block " << p;
  EXPECT_TRUE(holds_byte(p, size, 0x21));
  deallocate(q);
  deallocate(p);
  EXPECT_EQ(0u, stats().allocated_bytes);
}

TEST_F(Refusals, DoubleFreeIsRefusedAndTheBlockIsCachedOnce) {
  const size_t size = 96 * kKiB;
  void* p = allocate(size);
  ASSERT_NE(nullptr, p);
  deallocate(p);
  const PoolStats before = stats();
  EXPECT_TRUE(refused(pool().deallocate(p, stream_)));
  EXPECT_TRUE(same_stats(before, stats()));
  // Had the second free been taken, the block would be in the cache twice and handed out
  // twice.
  void* a = allocate(size);
  void* b = allocate(size);
  ASSERT_NE(nullptr, a);
  ASSERT_NE(nullptr, b);
  EXPECT_NE(a, b);
  LiveBlocks live;
  EXPECT_TRUE(live.insert(a, size));
  EXPECT_TRUE(live.insert(b, size));
  deallocate(a);
  deallocate(b);
}

TEST_F(Refusals, DoubleFreeOnAnotherStreamIsRefused) {
  Stream other;
  ASSERT_CUDA_OK(other.status());
  void* p = allocate(kMiB);
  ASSERT_NE(nullptr, p);
  deallocate(p);
  const PoolStats before = stats();
  EXPECT_TRUE(refused(pool().deallocate(p, other)));
  EXPECT_TRUE(same_stats(before, stats()));
}

TEST_F(Refusals, RecordStreamRefusesWhatIsNotALiveBlock) {
  Stream other;
  ASSERT_CUDA_OK(other.status());
  void* p = allocate(kMiB);
  ASSERT_NE(nullptr, p);
  int on_stack = 0;
  EXPECT_TRUE(refused(pool().record_stream(&on_stack, other))) << "host pointer";
  EXPECT_TRUE(refused(pool().record_stream(offset(p, kBlockUnit), other))) << "interior pointer";
  deallocate(p);
  const PoolStats before = stats();
  EXPECT_TRUE(refused(pool().record_stream(p, other))) << "freed block";
  EXPECT_TRUE(same_stats(before, stats()));
  // The refused calls left no claim behind: the block is reused at once on its stream.
  void* q = allocate(kMiB);
  EXPECT_EQ(p, q);
  deallocate(q);
}

// A free that would order reuse after a stream the program has destroyed since (its
// allocation stream, or one record_stream named) must not name it to CUDA: a destroyed
// handle is undefined behaviour on a GPU (cudasim stops the program there; the pool used to
// record an event on it and fall back to a device synchronization when that failed). Told
// before the stream goes (stream_destroyed, which the preload's cudaStreamDestroy calls),
// the pool frees the block exactly once, and a second free is a double free that changes
// nothing.
TEST_F(Refusals, AFreeAfterTheAllocationStreamWasDestroyedCountsOnce) {
  auto* gone = new Stream();
  ASSERT_CUDA_OK(gone->status());
  void* p = allocate(kMiB, *gone);
  ASSERT_NE(nullptr, p);
  ASSERT_TRUE(pool().stream_destroyed(*gone).ok);
  delete gone;
  const Result first = pool().deallocate(p, stream_);
  EXPECT_TRUE(first.ok) << first.message;
  EXPECT_EQ(0u, stats().allocated_bytes);
  EXPECT_EQ(1u, stats().num_frees);
  const PoolStats before = stats();
  EXPECT_TRUE(refused(pool().deallocate(p, stream_)));
  EXPECT_TRUE(same_stats(before, stats()));
  EXPECT_EQ(0u, stats().allocated_bytes);
}

TEST_F(Refusals, AFreeAfterARecordedStreamWasDestroyedCountsOnce) {
  void* p = allocate(kMiB);
  ASSERT_NE(nullptr, p);
  {
    Stream gone;
    ASSERT_CUDA_OK(gone.status());
    ASSERT_TRUE(pool().record_stream(p, gone).ok);
    ASSERT_TRUE(pool().stream_destroyed(gone).ok);
  }
  const Result first = pool().deallocate(p, stream_);
  EXPECT_TRUE(first.ok) << first.message;
  EXPECT_EQ(0u, stats().allocated_bytes);
  const PoolStats before = stats();
  EXPECT_TRUE(refused(pool().deallocate(p, stream_)));
  EXPECT_TRUE(same_stats(before, stats()));
  // The block is usable again: it was freed, not lost.
  void* q = allocate(kMiB);
  EXPECT_EQ(p, q);
  deallocate(q);
}

// Blocks a destroyed stream freed and the pool kept for it are not stranded: once told, the
// pool makes them free for every stream (its queued work, what their reuse waited for, is
// done).
TEST_F(Refusals, BlocksCachedForADestroyedStreamGoToEveryStream) {
  auto* gone = new Stream();
  ASSERT_CUDA_OK(gone->status());
  void* p = allocate(kMiB, *gone);
  ASSERT_NE(nullptr, p);
  ASSERT_TRUE(pool().deallocate(p, *gone).ok);  // cached for `gone`
  ASSERT_TRUE(pool().stream_destroyed(*gone).ok);
  delete gone;
  void* q = allocate(kMiB);  // on the fixture's stream
  EXPECT_EQ(p, q) << "the block the destroyed stream freed is reused by another stream";
  deallocate(q);
  // A stream the pool never saw costs nothing.
  Stream unknown;
  ASSERT_CUDA_OK(unknown.status());
  EXPECT_TRUE(pool().stream_destroyed(unknown).ok);
}

}  // namespace
}  // namespace pool_test
