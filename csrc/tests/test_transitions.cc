#include <gtest/gtest.h>

#include "dayzero/kv_manager.h"
#include "dayzero/transitions.h"
#include "helpers.h"

namespace dz {
namespace {

TEST(Transitions, IllegalRuntimeEventIsRejectedAndChangesNothing) {
  ReqInfo info;
  info.id = 42;
  info.tokens = {1, 2, 3};
  Phase s = Submitted{info};
  try {
    apply(42, s, FirstToken{9});
    FAIL() << "FirstToken accepted while Submitted";
  } catch (const SchedulerError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("request 42"), std::string::npos);
    EXPECT_NE(msg.find("FirstToken"), std::string::npos);
    EXPECT_NE(msg.find("Submitted"), std::string::npos);
  }
  ASSERT_TRUE(std::holds_alternative<Submitted>(s));
  EXPECT_EQ(std::get<Submitted>(s).info.tokens, info.tokens);
}

TEST(Transitions, AbortFromAStopWithKvGoesThroughFinishingAndReleases) {
  SchedulerConfig cfg = test::paged(4);
  MemoryLayout layout = MemoryLayout::plan(cfg);
  KvManager kv(cfg, layout);
  auto blocks = *kv.new_kv();
  ASSERT_TRUE(kv.grow(blocks, 8));
  EXPECT_EQ(kv.free_pages(), 2);
  Phase s = Decoding(ReqInfo{}, std::move(blocks), 8, 0);
  apply(1, s, Abort{});
  ASSERT_TRUE(std::holds_alternative<Finishing>(s));
  EXPECT_EQ(std::get<Finishing>(s).reason, FinishReason::Abort);
  EXPECT_EQ(kv.free_pages(), 2);  // Finishing still owns them
  apply(1, s, Release{});
  EXPECT_TRUE(std::holds_alternative<Finished>(s));
  EXPECT_EQ(kv.free_pages(), 4);
}

// Every live phase can be aborted; nothing can be aborted twice; a few pairs that must not exist.
static_assert(LegalTransition<Bootstrapping, Abort> && LegalTransition<Submitted, Abort> &&
              LegalTransition<Prefetching, Abort> && LegalTransition<Prefilling, Abort> &&
              LegalTransition<PrefillAwaitingResult, Abort> && LegalTransition<Decoding, Abort> &&
              LegalTransition<Retracted, Abort> && LegalTransition<Restoring, Abort> &&
              LegalTransition<RemoteFill, Abort> && LegalTransition<Ready, Abort>);
static_assert(!LegalTransition<Finishing, Abort> && !LegalTransition<Finished, Abort>);
static_assert(!LegalTransition<Retracted, FirstToken> && !LegalTransition<Submitted, Release>);

}  // namespace
}  // namespace dz
