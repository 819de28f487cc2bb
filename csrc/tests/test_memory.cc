#include <gtest/gtest.h>

#include "dayzero/handles.h"
#include "dayzero/memory.h"
#include "helpers.h"

namespace dz {
namespace {

TEST(Layout, PacksNarrowGroupsIntoSharedPages) {
  SchedulerConfig c = test::paged(10);
  c.groups = {{"latent", GroupKind::Paged, 1152, 0, 0}, {"index", GroupKind::Paged, 132, 0, 0}};
  c.device_bytes = 100 * 1152 * 4;
  const auto m = MemoryLayout::plan(c);
  EXPECT_EQ(m.page_bytes, 1152 * 4);
  EXPECT_EQ(m.num_pages, 100);
  EXPECT_EQ(m.blocks_per_page[0], 1);
  EXPECT_EQ(m.blocks_per_page[1], 8);  // 8 rows of 144 >= 132 bytes
  EXPECT_EQ(m.padded_row_bytes[1], 144);
}

TEST(Layout, StateSlotsComeOutOfTheSameBudget) {
  SchedulerConfig c = test::paged(10);
  c.groups.push_back({"ssm", GroupKind::State, 0, 0, 1000});
  c.max_batch_size = 4;
  c.snapshot_slots = 2;
  c.device_bytes = 6 * 1000 + 10 * 4;
  const auto m = MemoryLayout::plan(c);
  EXPECT_EQ(m.num_slots, 6);
  EXPECT_EQ(m.num_pages, 10);
  EXPECT_EQ(m.pages_per_state, 250);
}

TEST(Layout, RejectsBadConfigsWithAReason) {
  auto expect_error = [](SchedulerConfig c, const std::string& what) {
    try {
      MemoryLayout::plan(c);
      FAIL() << "accepted: " << what;
    } catch (const SchedulerError& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  SchedulerConfig c = test::paged(10);
  c.block_size = 0;
  expect_error(c, "block_size");
  c = test::paged(10);
  c.groups.push_back({"kv", GroupKind::Paged, 1, 0, 0});
  expect_error(c, "appears twice");
  c = test::paged(10);
  c.groups = {{"w", GroupKind::SlidingWindow, 1, 0, 0}};
  expect_error(c, "window");
  c = test::paged(1);
  expect_error(c, "need at least 2");
  c = test::paged(10);
  c.groups = {{"s", GroupKind::State, 0, 0, 8}};
  expect_error(c, "paged");
}

TEST(GroupAllocator, SubBlocksShareAPageAndReturnItWhole) {
  FreeList pages(3);
  GroupAllocator a(pages, 4, 3);
  std::vector<BlockId> got;
  for (int i = 0; i < 5; ++i) got.push_back(a.alloc());
  EXPECT_EQ(pages.size(), 1);  // two pages: 4 + 1 blocks
  EXPECT_EQ(got[0] / 4, got[3] / 4);
  for (int i = 0; i < 4; ++i) a.decref(got[static_cast<std::size_t>(i)]);
  EXPECT_EQ(pages.size(), 2);  // the first page came back whole
  a.decref(got[4]);
  EXPECT_EQ(pages.size(), 3);
  EXPECT_EQ(a.used(), 0);
}

TEST(GroupAllocator, RefcountsKeepSharedBlocksAlive) {
  FreeList pages(2);
  GroupAllocator a(pages, 1, 2);
  const BlockId b = a.alloc();
  a.incref(b);
  a.decref(b);
  EXPECT_TRUE(a.allocated(b));
  a.decref(b);
  EXPECT_FALSE(a.allocated(b));
  EXPECT_EQ(a.alloc(), b);  // reused
  EXPECT_NE(a.alloc(), kNoBlock);
  EXPECT_EQ(a.alloc(), kNoBlock);  // exhausted
}

TEST(Handles, DestroyingATableReleasesItsBlocks) {
  FreeList pages(4);
  GroupAllocator a(pages, 1, 4);
  {
    BlockTable t(&a);
    t.push(a.alloc());
    t.push(a.alloc());
    BlockTable moved = std::move(t);
    EXPECT_EQ(moved.size(), 2);
    EXPECT_EQ(t.size(), 0);  // NOLINT: moved-from is empty by contract
    EXPECT_EQ(pages.size(), 2);
  }
  EXPECT_EQ(pages.size(), 4);
}

TEST(Handles, SlidingWindowDropAndTruncate) {
  FreeList pages(4);
  GroupAllocator a(pages, 1, 4);
  BlockTable t(&a);
  for (int i = 0; i < 4; ++i) t.push(a.alloc());
  t.drop_before(2);
  EXPECT_EQ(t.ids()[0], kNoBlock);
  EXPECT_EQ(t.ids()[1], kNoBlock);
  EXPECT_EQ(pages.size(), 2);
  t.truncate(3);
  EXPECT_EQ(t.size(), 3);
  EXPECT_EQ(pages.size(), 3);
}

}  // namespace
}  // namespace dz
