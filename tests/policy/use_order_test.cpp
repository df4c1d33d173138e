// The predicted order of use (src/policy/use_order.h): a graph's three lanes (its forward's
// uses of kept blocks, its backward, the uses after its backward), and graphs oldest first.
#include "policy/use_order.h"

#include <gtest/gtest.h>

namespace vramswap::policy {
namespace {

UseKey forward_use(uint64_t graph, uint64_t pos) { return {graph, pos, kForwardLane}; }
UseKey saved(uint64_t graph, uint64_t seq) { return {graph, seq}; }
UseKey after_backward(uint64_t graph, uint64_t pos) { return {graph, pos, kAfterBackwardLane}; }

TEST(UseOrder, AGraphsForwardUsesComeFirstThenItsBackwardThenWhatFollowsIt) {
  // Inserted out of order; the order of use is the expected one.
  const std::vector<std::pair<UseKey, uint32_t>> keys = {
      {after_backward(1, 0), 6}, {saved(1, 1), 5}, {forward_use(2, 0), 7}, {saved(1, 2), 4},
      {forward_use(1, 1), 2},    {after_backward(1, 1), 8}, {forward_use(1, 0), 1}, {saved(1, 3), 3},
  };
  UseOrder order;
  for (const auto& [key, slot] : keys) order.insert(key, slot);
  std::vector<uint32_t> used;
  order.each_after_cursor([&](uint32_t slot) {
    used.push_back(slot);
    return true;
  });
  // Graph 1: forward uses 0, 1; backward last saved first (3, 2, 1); after it 0, 1; then graph 2.
  EXPECT_EQ(used, (std::vector<uint32_t>{1, 2, 3, 4, 5, 6, 8, 7}));
}

TEST(UseOrder, TheCursorAtAForwardUseMakesTheWindowTheNextUses) {
  UseOrder order;
  for (uint32_t p = 0; p < 4; ++p) order.insert(forward_use(2, p), p);
  order.insert(saved(2, 1), 10);
  order.set_cursor(forward_use(2, 1));
  EXPECT_EQ(order.window(2), (std::vector<uint32_t>{2, 3}));
  order.set_cursor(forward_use(2, 3));
  EXPECT_EQ(order.window(2), (std::vector<uint32_t>{10}));
}

TEST(UseOrder, NeededBeforeIsAStrictOrderAcrossLanes) {
  const UseKey keys[] = {forward_use(1, 0), forward_use(1, 5), saved(1, 9), saved(1, 2),
                         after_backward(1, 0), after_backward(1, 3), forward_use(2, 0), saved(2, 7)};
  for (size_t i = 0; i < std::size(keys); ++i)
    for (size_t j = 0; j < std::size(keys); ++j) {
      SCOPED_TRACE(std::to_string(i) + " before " + std::to_string(j));
      EXPECT_EQ(needed_before(keys[i], keys[j]), i < j);
    }
}

}  // namespace
}  // namespace vramswap::policy
