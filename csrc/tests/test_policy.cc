#include <gtest/gtest.h>

#include <algorithm>
#include <string>

#include "helpers.h"

namespace dz {
namespace {

using test::answer;
using test::seq;

// Two requests that together outgrow 6 pages of 4 tokens.
SchedulerConfig tight(std::int32_t host_pages) {
  auto cfg = test::paged(6, 4, host_pages);
  cfg.prefix_cache = false;  // keep the arithmetic about retraction only
  return cfg;
}

TEST(Pressure, LaterRequestIsRetractedToHostAndRestored) {
  Scheduler s(tight(16));
  s.submit(1, seq(8), {.max_new_tokens = 8});
  s.submit(2, seq(8, 50), {.max_new_tokens = 8});
  bool saw_retract = false, saw_restore = false;
  std::map<ReqId, std::vector<TokenId>> out;
  for (int step = 0; step < 100 && s.live() > 0; ++step) {
    auto p = s.step();
    if (!p->retracted_ids.empty()) {
      EXPECT_EQ(p->retracted_ids, std::vector<ReqId>{2});  // the later arrival
      saw_retract = true;
    }
    if (!p->copies.to_device_src.empty()) saw_restore = true;
    for (std::size_t i = 0; i < p->req_ids.size(); ++i)
      if (p->sample[i]) out[p->req_ids[i]].push_back(static_cast<TokenId>(100 + step));
    if (p->rows() > 0) answer(s, *p, static_cast<TokenId>(100 + step));
    s.check_invariants();
  }
  EXPECT_TRUE(saw_retract);
  EXPECT_TRUE(saw_restore);
  EXPECT_EQ(s.live(), 0);
  EXPECT_EQ(out[1].size(), 8u);
  EXPECT_EQ(out[2].size(), 8u);
  EXPECT_EQ(s.memory().free_pages(), 6);
  EXPECT_EQ(s.memory().free_host_pages(), 16);
}

TEST(Pressure, WithoutHostMemoryTheVictimIsRecomputed) {
  Scheduler s(tight(0));
  s.submit(1, seq(8), {.max_new_tokens = 8});
  s.submit(2, seq(8, 50), {.max_new_tokens = 8});
  bool recomputed = false;
  for (int step = 0; step < 100 && s.live() > 0; ++step) {
    auto p = s.step();
    for (std::size_t i = 0; i < p->req_ids.size(); ++i)
      if (p->req_ids[i] == 2 && p->is_prefill[i] && p->num_tokens[i] > 8) recomputed = true;  // prompt + generated
    if (p->rows() > 0) answer(s, *p);
    s.check_invariants();
  }
  EXPECT_TRUE(recomputed);
  EXPECT_EQ(s.live(), 0);
  EXPECT_EQ(s.memory().free_pages(), 6);
}

TEST(Overlap, NextStepIsPlannedBeforeResultsArrive) {
  auto cfg = test::paged(16);
  cfg.overlap = true;
  Scheduler s(cfg);
  s.submit(1, seq(5), {.max_new_tokens = 4});
  auto p0 = s.step();
  answer(s, *p0, 60);  // first token
  auto p1 = s.step();  // decode of token 60 at position 5
  auto p2 = s.step();  // planned before p1's result: input filled on the device
  ASSERT_EQ(p2->rows(), 1);
  EXPECT_EQ(p1->input_ids, std::vector<TokenId>{60});
  EXPECT_EQ(p2->input_ids, std::vector<TokenId>{kDeviceToken});
  EXPECT_EQ(p2->positions, std::vector<std::int32_t>{6});
  EXPECT_EQ(s.plans_in_flight(), 2);
  answer(s, *p1, 61);
  answer(s, *p2, 62);
  EXPECT_EQ(s.tokens_of(1), (std::vector<TokenId>{1, 2, 3, 4, 5, 60, 61, 62}));
  auto p3 = s.step();
  EXPECT_EQ(p3->input_ids, std::vector<TokenId>{62});
  auto p4 = s.step();
  answer(s, *p3, 63);  // fourth token: finished; p4's row is dropped
  answer(s, *p4, 64);
  EXPECT_EQ(s.live(), 0);
  s.check_invariants();
}

TEST(Speculative, ReservesDraftSlotsAndRollsBackRejectedOnes) {
  auto cfg = test::paged(16);
  cfg.spec_tokens = 3;
  Scheduler s(cfg);
  s.submit(1, seq(7), {.max_new_tokens = 20});
  answer(s, *s.step(), 40);
  auto p = s.step();
  ASSERT_EQ(p->num_tokens[0], 4);  // last token + 3 drafts
  EXPECT_EQ(p->input_ids, (std::vector<TokenId>{40, kDeviceToken, kDeviceToken, kDeviceToken}));
  EXPECT_EQ(p->kv_lens[0], 11);
  EXPECT_EQ(s.block_table(1).size(), 3u);                                      // 11 tokens
  s.feed(p->req_ids, std::vector<std::int32_t>{1}, std::vector<TokenId>{41});  // no draft accepted
  EXPECT_EQ(s.block_table(1).size(), 2u);  // KV for 8 tokens: the third block is rolled back
  p = s.step();
  EXPECT_EQ(p->positions.front(), 8);
  s.feed(p->req_ids, std::vector<std::int32_t>{4}, std::vector<TokenId>{42, 43, 44, 45});  // all accepted + bonus
  EXPECT_EQ(s.tokens_of(1).size(), 13u);
  p = s.step();
  EXPECT_EQ(p->positions.front(), 12);
  s.check_invariants();
}

TEST(Speculative, WithOverlapTheNextRowIsPlannedAsIfEveryDraftWereAccepted) {
  auto cfg = test::paged(16);
  cfg.spec_tokens = 2;
  cfg.overlap = true;
  Scheduler s(cfg);
  s.submit(1, seq(7), {.max_new_tokens = 20});
  answer(s, *s.step(), 40);
  auto p1 = s.step();  // x_p = 40 at position 7, drafts at 8, 9
  auto p2 = s.step();  // before p1's result: from position 10 (both drafts accepted)
  ASSERT_EQ(p2->rows(), 1);
  EXPECT_EQ(p1->positions, (std::vector<std::int32_t>{7, 8, 9}));
  EXPECT_EQ(p2->positions, (std::vector<std::int32_t>{10, 11, 12}));
  EXPECT_EQ(p2->input_ids, (std::vector<TokenId>{kDeviceToken, kDeviceToken, kDeviceToken}));
  EXPECT_EQ(p2->kv_lens[0], 13);
  EXPECT_EQ(s.block_table(1).size(), 4u);  // 13 tokens
  // p1 keeps 1 token: p2's row (moved back by 2 on the device) runs at 8..10, its KV ends at 11
  s.feed(p1->req_ids, std::vector<std::int32_t>{1}, std::vector<TokenId>{41});
  EXPECT_EQ(s.block_table(1).size(), 3u);
  auto p3 = s.step();  // behind p2 in flight: from 11, as if p2 kept all 3
  EXPECT_EQ(p3->positions.front(), 11);
  s.feed(p2->req_ids, std::vector<std::int32_t>{3}, std::vector<TokenId>{42, 43, 44});
  EXPECT_EQ(s.tokens_of(1).size(), 12u);  // 7 + 40, 41 + 42, 43, 44
  s.feed(p3->req_ids, std::vector<std::int32_t>{2}, std::vector<TokenId>{45, 46});
  auto p4 = s.step();  // nothing in flight: exact again, x_p = 46 at position 13
  EXPECT_EQ(p4->positions.front(), 13);
  EXPECT_EQ(p4->input_ids.front(), 46);
  EXPECT_EQ(s.block_table(1).size(), 4u);  // 16 tokens
  s.check_invariants();
}

TEST(Disaggregation, RemoteFillThenDecode) {
  Scheduler s(test::paged(16));
  s.submit(1, seq(9), {.max_new_tokens = 3, .remote = true});
  auto p = s.step();
  EXPECT_EQ(p->rows(), 0);
  EXPECT_EQ(s.phase_of(1), "Bootstrapping");
  s.bootstrap_done(1);
  p = s.step();
  EXPECT_EQ(p->rows(), 0);  // blocks allocated, the remote node writes them
  EXPECT_EQ(s.phase_of(1), "RemoteFill");
  EXPECT_EQ(s.block_table(1).size(), 3u);
  EXPECT_THROW(s.feed(std::vector<ReqId>{1}, std::vector<std::int32_t>{1}, std::vector<TokenId>{1}), SchedulerError);
  s.remote_fill_done(1, 77);
  EXPECT_EQ(s.phase_of(1), "Ready");
  EXPECT_THROW(s.remote_fill_done(1, 78), SchedulerError);  // not legal twice
  p = s.step();
  ASSERT_EQ(p->rows(), 1);
  EXPECT_EQ(p->input_ids, std::vector<TokenId>{77});
  EXPECT_EQ(p->positions, std::vector<std::int32_t>{9});
  answer(s, *p);
  answer(s, *s.step());
  EXPECT_EQ(s.live(), 0);
  s.check_invariants();
}

TEST(SlidingWindow, BlocksLeavingTheWindowAreFreed) {
  auto cfg = test::paged(64);
  cfg.groups = {{"full", GroupKind::Paged, 1, 0, 0}, {"swa", GroupKind::SlidingWindow, 1, 8, 0}};
  cfg.device_bytes = 64 * 4;
  cfg.prefix_cache = false;
  Scheduler s(cfg);
  s.submit(1, seq(4), {.max_new_tokens = 30});
  for (int i = 0; i < 25; ++i) answer(s, *s.step());
  const auto full = s.block_table(1, 0), swa = s.block_table(1, 1);
  EXPECT_EQ(full.size(), swa.size());
  const auto live_swa = std::count_if(swa.begin(), swa.end(), [](BlockId b) { return b != kNoBlock; });
  EXPECT_LE(live_swa, 4);  // window 8 + the block being written
  EXPECT_EQ(std::count(full.begin(), full.end(), kNoBlock), 0);
  s.check_invariants();
}

// Every group a sliding window (Mistral 7B v0.1): blocks of 4 tokens, chunks of 8, 1 byte a
// token. With window 8 a request holds window_blocks() = ceil((8 + 8) / 4) + 1 = 5 blocks at most.
SchedulerConfig windows_only(std::int32_t pages, std::int32_t host_pages = 0, std::int32_t window = 8) {
  auto cfg = test::paged(pages, 4, host_pages);
  cfg.groups = {{"swa", GroupKind::SlidingWindow, 1, window, 0}};
  cfg.chunk_size = 8;
  cfg.max_tokens_per_step = 16;
  cfg.prefix_cache = false;
  return cfg;
}

std::int32_t live_blocks(const Scheduler& s, ReqId id) {
  const auto t = s.block_table(id);
  return static_cast<std::int32_t>(std::count_if(t.begin(), t.end(), [](BlockId b) { return b != kNoBlock; }));
}

TEST(WindowsOnly, RequestLongerThanTheMemoryHoldsOnlyItsWindow) {
  Scheduler s(windows_only(8));  // 32 tokens of KV; the request reaches 70
  EXPECT_EQ(s.memory().window_blocks(0), 5);
  EXPECT_EQ(s.memory().max_tokens_per_request(), kUnboundedTokens);
  s.submit(1, seq(40), {.max_new_tokens = 30});
  std::int32_t peak = 0, sampled = 0, pos = 0;
  for (int step = 0; step < 200 && s.live() > 0; ++step) {
    auto p = s.step();
    ASSERT_EQ(p->rows(), 1);
    EXPECT_EQ(p->positions.front(), pos);  // no position skipped or repeated
    pos += p->num_tokens[0];
    // Every block a query of this step reads is there: (first query - window, last key].
    const auto t = s.block_table(1);
    for (std::int32_t b = std::max(0, p->positions.front() - 8 + 1) / 4; b < (p->kv_lens[0] + 3) / 4; ++b)
      EXPECT_NE(t[static_cast<std::size_t>(b)], kNoBlock) << "step " << step << " block " << b;
    peak = std::max(peak, live_blocks(s, 1));
    sampled += p->sample[0];
    answer(s, *p);
    s.check_invariants();
  }
  EXPECT_EQ(s.live(), 0);
  EXPECT_EQ(sampled, 30);
  EXPECT_LE(peak, 5);
  EXPECT_EQ(s.memory().free_pages(), 8);
}

TEST(WindowsOnly, RetractedRequestRestoresOnlyItsWindow) {
  // Window 6: a decoding request holds 2 or 3 blocks, as its window straddles block edges; two
  // requests decoding side by side outgrow 5 pages, and the later one goes to host memory.
  Scheduler s(windows_only(5, 32, 6));
  s.submit(1, seq(4), {.max_new_tokens = 20});
  s.submit(2, seq(4, 50), {.max_new_tokens = 20});
  bool retracted = false, restored = false;
  std::map<ReqId, std::int32_t> sampled;
  for (int step = 0; step < 300 && s.live() > 0; ++step) {
    auto p = s.step();
    retracted = retracted || !p->retracted_ids.empty();
    if (!p->copies.to_device_src.empty()) {
      restored = true;
      EXPECT_LE(p->copies.to_device_src.size(), 3u);  // the next query's window, not every block
    }
    for (std::size_t i = 0; i < p->req_ids.size(); ++i) sampled[p->req_ids[i]] += p->sample[i];
    if (p->rows() > 0) answer(s, *p);
    s.check_invariants();
  }
  EXPECT_TRUE(retracted);
  EXPECT_TRUE(restored);
  EXPECT_EQ(s.live(), 0);
  EXPECT_EQ(sampled[1], 20);
  EXPECT_EQ(sampled[2], 20);
  EXPECT_EQ(s.memory().free_pages(), 5);
  EXPECT_EQ(s.memory().free_host_pages(), 32);
}

TEST(WindowsOnly, MemoryBelowOneWindowIsRefusedAtSubmit) {
  Scheduler s(windows_only(4));  // 5 blocks needed
  EXPECT_EQ(s.memory().max_tokens_per_request(), 0);
  try {
    s.submit(1, seq(3), {.max_new_tokens = 1});
    FAIL() << "submit should throw";
  } catch (const SchedulerError& e) {
    EXPECT_NE(std::string(e.what()).find("4 pages cannot hold one request's sliding-window blocks"), std::string::npos)
        << e.what();
  }
  EXPECT_EQ(s.live(), 0);
}

TEST(HybridState, SnapshotsAtBlockBoundariesGivePrefixHits) {
  auto cfg = test::paged(64);
  cfg.groups = {{"attn", GroupKind::Paged, 1, 0, 0}, {"ssm", GroupKind::State, 0, 0, 16}};
  cfg.max_batch_size = 4;
  cfg.snapshot_slots = 4;
  cfg.device_bytes = 64 * 4 + 8 * 16;
  Scheduler s(cfg);
  s.submit(1, seq(14), {.max_new_tokens = 1});
  auto p = s.step();
  // The prefill stops at the last usable boundary (12) and snapshots the state there.
  EXPECT_EQ(p->num_tokens[0], 12);
  ASSERT_EQ(p->copies.snapshot_src.size(), 1u);
  EXPECT_EQ(p->copies.snapshot_src[0], p->state_slots[0]);
  answer(s, *p);
  answer(s, *s.step());
  ASSERT_EQ(s.live(), 0);
  s.submit(2, seq(14), {.max_new_tokens = 1});
  p = s.step();
  ASSERT_EQ(p->rows(), 1);
  EXPECT_EQ(p->kv_lens[0] - p->num_tokens[0], 12);  // hit up to the snapshot
  ASSERT_EQ(p->copies.restore_dst.size(), 1u);
  EXPECT_EQ(p->copies.restore_dst[0], p->state_slots[0]);
  EXPECT_GE(p->copies.restore_src[0], cfg.max_batch_size);  // snapshot slots follow request slots
  answer(s, *p);
  s.check_invariants();
}

TEST(HostPrefix, DemotedPrefixComesBackThroughPrefetching) {
  auto cfg = test::paged(6, 4, 16);
  Scheduler s(cfg);
  s.submit(1, seq(9), {.max_new_tokens = 1});
  answer(s, *s.step());
  ASSERT_EQ(s.live(), 0);                            // blocks 0..1 cached on the device
  s.submit(2, seq(23, 500), {.max_new_tokens = 1});  // needs every page: the cached prefix goes to host
  auto p = s.step();
  EXPECT_EQ(p->copies.to_host_src.size(), 2u);
  answer(s, *p);
  s.submit(3, seq(9), {.max_new_tokens = 1});
  p = s.step();
  EXPECT_EQ(s.phase_of(3), "Prefetching");
  EXPECT_EQ(p->copies.to_device_src.size(), 2u);
  EXPECT_EQ(p->rows(), 0);
  p = s.step();
  ASSERT_EQ(p->rows(), 1);
  EXPECT_EQ(p->kv_lens[0] - p->num_tokens[0], 8);
  answer(s, *p);
  s.check_invariants();
}

}  // namespace
}  // namespace dz

namespace dz {
namespace {

TEST(Admission, ARequestWithoutRoomForItsFirstChunkWaitsUnadmitted) {
  auto cfg = test::paged(6);
  cfg.prefix_cache = false;
  Scheduler s(cfg);
  s.submit(1, test::seq(16), {.max_new_tokens = 4});       // 4 pages, a fifth while decoding
  s.submit(2, test::seq(12, 100), {.max_new_tokens = 1});  // 3 pages: does not fit beside it
  bool waited = false;
  for (int step = 0; step < 20 && s.live() > 0; ++step) {
    auto p = s.step();
    EXPECT_TRUE(p->retracted_ids.empty());  // waiting is not retraction
    if (s.live() == 2) {
      EXPECT_EQ(s.phase_of(2), "Submitted");
      waited = true;
    }
    if (p->rows() > 0) test::answer(s, *p);
    s.check_invariants();
  }
  EXPECT_TRUE(waited);
  EXPECT_EQ(s.live(), 0);
}

}  // namespace
}  // namespace dz
