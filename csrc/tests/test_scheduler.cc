#include <gtest/gtest.h>

#include "helpers.h"

namespace dz {
namespace {

using test::answer;
using test::seq;

TEST(Scheduler, PrefillThenDecodeUntilLength) {
  Scheduler s(test::paged(16));
  s.submit(1, seq(10), {.max_new_tokens = 3});
  auto p = s.step();
  ASSERT_EQ(p->rows(), 1);
  EXPECT_EQ(p->num_tokens[0], 10);
  EXPECT_EQ(p->positions.front(), 0);
  EXPECT_EQ(p->positions.back(), 9);
  EXPECT_TRUE(p->is_prefill[0] && p->sample[0]);
  EXPECT_EQ(p->block_table_width[0], 3);
  answer(s, *p, 50);
  EXPECT_EQ(s.phase_of(1), "Decoding");
  p = s.step();
  ASSERT_EQ(p->rows(), 1);
  EXPECT_EQ(p->input_ids, std::vector<TokenId>{50});
  EXPECT_EQ(p->positions, std::vector<std::int32_t>{10});
  EXPECT_EQ(p->kv_lens[0], 11);
  answer(s, *p, 51);
  p = s.step();
  answer(s, *p, 52);
  EXPECT_EQ(s.live(), 0);  // three tokens: finished by length
  p = s.step();
  EXPECT_EQ(p->rows(), 0);
  ASSERT_EQ(p->finished_ids, std::vector<ReqId>{1});
  EXPECT_EQ(p->finished_reasons[0], static_cast<int>(FinishReason::Length));
  s.check_invariants();
}

TEST(Scheduler, StopTokenFinishesAndIgnoreEosDoesNot) {
  Scheduler s(test::paged(16));
  s.submit(1, seq(5), {.max_new_tokens = 10, .stop_ids = {7}});
  s.submit(2, seq(5), {.max_new_tokens = 2, .stop_ids = {7}, .ignore_eos = true});
  auto p = s.step();
  answer(s, *p, 7);
  EXPECT_EQ(s.live(), 1);
  EXPECT_EQ(s.phase_of(2), "Decoding");
  p = s.step();
  EXPECT_EQ(p->finished_reasons, std::vector<std::int32_t>{static_cast<int>(FinishReason::Stop)});
}

TEST(Scheduler, ChunkedPrefillSamplesOnlyOnTheLastChunk) {
  auto cfg = test::paged(16);
  cfg.chunk_size = 4;
  Scheduler s(cfg);
  s.submit(1, seq(10), {.max_new_tokens = 1});
  std::vector<std::int32_t> sizes;
  for (int i = 0; i < 3; ++i) {
    auto p = s.step();
    ASSERT_EQ(p->rows(), 1);
    sizes.push_back(p->num_tokens[0]);
    EXPECT_EQ(p->sample[0], i == 2 ? 1 : 0);
    answer(s, *p);
    s.check_invariants();
  }
  EXPECT_EQ(sizes, (std::vector<std::int32_t>{4, 4, 2}));
  EXPECT_EQ(s.live(), 0);
}

TEST(Scheduler, MixedBatchHoldsDecodesAndPrefillChunks) {
  Scheduler s(test::paged(32));
  s.submit(1, seq(6), {.max_new_tokens = 5});
  answer(s, *s.step());
  s.submit(2, seq(9, 100), {.max_new_tokens = 5});
  auto p = s.step();
  ASSERT_EQ(p->rows(), 2);
  EXPECT_EQ(p->req_ids, (std::vector<ReqId>{1, 2}));
  EXPECT_EQ(p->is_prefill, (std::vector<std::uint8_t>{0, 1}));
  EXPECT_EQ(p->query_start, (std::vector<std::int32_t>{0, 1, 10}));
  EXPECT_EQ(p->block_table_width[0], 3);  // request 2 needs 3 blocks; request 1 is padded
  EXPECT_EQ(p->block_tables[0][2], kNoBlock);
  answer(s, *p);
  s.check_invariants();
}

TEST(Scheduler, NextTurnReusesPromptAndGeneratedTokens) {
  Scheduler s(test::paged(32));
  s.submit(1, seq(8), {.max_new_tokens = 4});
  std::vector<TokenId> out = {21, 22, 23, 24};
  for (TokenId t : out) answer(s, *s.step(), t);
  ASSERT_EQ(s.live(), 0);
  auto turn2 = seq(8);
  turn2.insert(turn2.end(), out.begin(), out.end());
  turn2.insert(turn2.end(), {30, 31, 32});
  s.submit(2, turn2, {.max_new_tokens = 1});
  auto p = s.step();
  ASSERT_EQ(p->rows(), 1);
  // 8 prompt + 3 generated tokens have KV (the last generated token was never input): 8 cached.
  EXPECT_EQ(p->kv_lens[0] - p->num_tokens[0], 8);
  EXPECT_EQ(p->positions[0], 8);
  EXPECT_EQ(s.cached_tokens_of(2), 8);  // reported per request (the server's usage)
  answer(s, *p);
  s.check_invariants();
}

TEST(Scheduler, DiscardInflightAbortsItsRequestsAndCachesNothingOfThem) {
  auto cfg = test::paged(32);
  cfg.overlap = true;
  Scheduler s(cfg);
  const std::int32_t free0 = s.memory().free_blocks(0);
  s.submit(1, seq(8), {.max_new_tokens = 4});
  answer(s, *s.step(), 21);  // decoding, its prompt's blocks in the cache
  s.submit(2, seq(12, 100), {.max_new_tokens = 4});
  auto p = s.step();  // 1 decodes, 2 prefills (its full blocks committed at planning)
  ASSERT_EQ(p->rows(), 2);
  auto q = s.step();  // overlap: a second plan in flight
  EXPECT_EQ(s.plans_in_flight(), 2);
  const auto gone = s.discard_inflight();
  EXPECT_EQ(gone, (std::vector<ReqId>{1, 2}));
  EXPECT_EQ(s.plans_in_flight(), 0);
  EXPECT_EQ(s.live(), 0);
  EXPECT_EQ(s.memory().free_blocks(0), free0);  // every block back, none held by the cache
  p = s.step();
  EXPECT_EQ(p->rows(), 0);
  EXPECT_EQ(p->finished_ids, (std::vector<ReqId>{1, 2}));
  EXPECT_EQ(p->finished_reasons[1], static_cast<int>(FinishReason::Abort));
  s.submit(3, seq(12, 100), {.max_new_tokens = 1});  // the same prompt: no hit on unwritten KV
  p = s.step();
  EXPECT_EQ(s.cached_tokens_of(3), 0);
  answer(s, *p);
  s.check_invariants();
}

TEST(Scheduler, BatchCapAdmitsInArrivalOrder) {
  auto cfg = test::paged(64);
  cfg.max_batch_size = 2;
  Scheduler s(cfg);
  for (ReqId id = 1; id <= 3; ++id) s.submit(id, seq(4), {.max_new_tokens = 2});
  auto p = s.step();
  EXPECT_EQ(p->req_ids, (std::vector<ReqId>{1, 2}));
  EXPECT_EQ(s.phase_of(3), "Submitted");
  answer(s, *p);
  answer(s, *s.step());  // 1 and 2 finish
  p = s.step();
  EXPECT_EQ(p->req_ids, std::vector<ReqId>{3});
}

TEST(Scheduler, BadFeedIsRejectedAndChangesNothing) {
  Scheduler s(test::paged(16));
  s.submit(1, seq(4), {.max_new_tokens = 2});
  auto p = s.step();
  const std::vector<std::int32_t> one = {1};
  const std::vector<TokenId> tok = {5};
  EXPECT_THROW(s.feed(std::vector<ReqId>{2}, one, tok), SchedulerError);                // wrong request
  EXPECT_THROW(s.feed(p->req_ids, std::vector<std::int32_t>{2}, tok), SchedulerError);  // too many tokens
  EXPECT_THROW(s.feed(p->req_ids, one, std::vector<TokenId>{-3}), SchedulerError);      // bad token
  EXPECT_EQ(s.phase_of(1), "PrefillAwaitingResult");
  s.feed(p->req_ids, one, tok);
  EXPECT_EQ(s.tokens_of(1).back(), 5);
  EXPECT_THROW(s.feed(p->req_ids, one, tok), SchedulerError);  // nothing in flight
}

TEST(Scheduler, BadSubmitIsRejected) {
  Scheduler s(test::paged(16));
  EXPECT_THROW(s.submit(1, {}, {}), SchedulerError);
  EXPECT_THROW(s.submit(1, seq(3), {.max_new_tokens = 0}), SchedulerError);
  EXPECT_THROW(s.submit(1, std::vector<TokenId>{1, -1}, {}), SchedulerError);
  s.submit(1, seq(3), {});
  EXPECT_THROW(s.submit(1, seq(3), {}), SchedulerError);
  EXPECT_THROW(s.abort(99), SchedulerError);
  EXPECT_THROW(s.submit(2, seq(60), {.max_new_tokens = 5}), SchedulerError);  // 16 pages of 4 = 64 tokens
  s.submit(3, seq(60), {.max_new_tokens = 4});                                // exactly fits
  EXPECT_EQ(s.live(), 2);
}

TEST(Scheduler, AbortFromEveryPhaseFreesEverything) {
  auto cfg = test::paged(32);
  cfg.chunk_size = 4;
  Scheduler s(cfg);
  const std::int32_t total = s.memory().free_pages();
  s.submit(1, seq(12), {.max_new_tokens = 8});                 // will be Prefilling (chunked)
  s.submit(2, seq(3), {.max_new_tokens = 8});                  // will be Decoding
  s.submit(3, seq(3), {.max_new_tokens = 8, .remote = true});  // Bootstrapping
  auto p = s.step();
  answer(s, *p);
  p = s.step();
  EXPECT_EQ(s.phase_of(1), "Prefilling");
  EXPECT_EQ(s.phase_of(2), "Decoding");
  EXPECT_EQ(s.phase_of(3), "Bootstrapping");
  s.abort(1);
  s.abort(2);
  s.abort(3);
  answer(s, *p);  // results for aborted rows are dropped
  EXPECT_EQ(s.live(), 0);
  s.check_invariants();
  p = s.step();
  EXPECT_EQ(p->finished_ids.size(), 3u);
  for (auto r : p->finished_reasons) EXPECT_EQ(r, static_cast<int>(FinishReason::Abort));
  // Nothing is referenced any more: every cached block is evictable and memory is whole.
  EXPECT_EQ(s.memory().free_pages() + s.memory().cache().evictable(), total);
}

}  // namespace
}  // namespace dz

namespace dz {
namespace {

TEST(Invariants, ACorruptedCountIsCaught) {
  // The property tests lean on check_invariants: it must see a leak and a double free.
  Scheduler s(test::paged(16));
  s.submit(1, test::seq(9), {.max_new_tokens = 4});
  test::answer(s, *s.step());
  s.check_invariants();
  auto* alloc = const_cast<GroupAllocator*>(s.memory().allocator(0));
  const BlockId b = s.block_table(1)[0];
  alloc->incref(b);  // a reference nobody holds
  EXPECT_THROW(s.check_invariants(), SchedulerError);
  alloc->decref(b);
  s.check_invariants();
  const BlockId spare = alloc->alloc();  // allocated but in no table
  EXPECT_THROW(s.check_invariants(), SchedulerError);
  alloc->decref(spare);
  s.check_invariants();
}

}  // namespace
}  // namespace dz
