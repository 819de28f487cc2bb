#include <gtest/gtest.h>

#include "dayzero/kv_manager.h"
#include "helpers.h"

namespace dz {
namespace {

TEST(ChainKey, DependsOnEveryTokenAndOnTheParent) {
  const auto a = test::seq(4);
  auto b = a;
  b[3] = 99;
  const BlockKey root{};
  EXPECT_EQ(chain_key(root, a), chain_key(root, a));
  EXPECT_NE(chain_key(root, a), chain_key(root, b));
  EXPECT_NE(chain_key(chain_key(root, a), a), chain_key(chain_key(root, b), a));
}

struct CacheFixture : ::testing::Test {
  SchedulerConfig cfg = test::paged(8, 4, 0);
  MemoryLayout layout = MemoryLayout::plan(cfg);
  KvManager kv{cfg, layout};

  // A request that computed `n` tokens and committed them.
  KvBlocks compute(ReqInfo& info, std::int32_t n) {
    auto blocks = *kv.new_kv();
    EXPECT_TRUE(kv.grow(blocks, n));
    kv.commit(blocks, info, n);
    return blocks;
  }
  static ReqInfo req(std::vector<TokenId> toks) {
    ReqInfo i;
    i.tokens = std::move(toks);
    i.prompt_len = static_cast<std::int32_t>(i.tokens.size());
    return i;
  }
};

TEST_F(CacheFixture, HitSharesBlocksAndNeverCoversTheLastToken) {
  ReqInfo a = req(test::seq(12));
  KvBlocks ka = compute(a, 12);
  ReqInfo b = req(test::seq(12));  // same 12 tokens: at most 8 cached (last token recomputed)
  auto m = kv.match(b);
  EXPECT_EQ(m.hit_tokens, 8);
  auto kb = *kv.new_kv();
  ASSERT_TRUE(kv.acquire(m, kb));
  EXPECT_EQ(kb.table(0).ids()[0], ka.table(0).ids()[0]);
  EXPECT_EQ(kv.allocator(0)->refcount(ka.table(0).ids()[0]), 3);  // a, b, cache
}

TEST_F(CacheFixture, DifferentTokensMissAfterTheCommonPrefix) {
  ReqInfo a = req(test::seq(12));
  KvBlocks ka = compute(a, 12);
  auto t = test::seq(12);
  t[5] = 1000;  // second block differs
  ReqInfo b = req(t);
  EXPECT_EQ(kv.match(b).hit_tokens, 4);
}

TEST_F(CacheFixture, AKeyCollisionIsNoHitWhenTheTokensDiffer) {
  ReqInfo a = req(test::seq(12));
  KvBlocks ka = compute(a, 12);
  ReqInfo b = req(test::seq(12, 500));
  b.keys = a.keys;  // as if every block key collided: the cached tokens still differ
  EXPECT_EQ(kv.match(b).hit_tokens, 0);
}

TEST(CacheSalt, KeysStartFromTheSalt) {
  auto cfg = test::paged(8, 4, 0);
  ReqInfo a, b;
  a.tokens = b.tokens = test::seq(8);
  a.prompt_len = b.prompt_len = 8;
  MemoryLayout layout = MemoryLayout::plan(cfg);
  KvManager plain{cfg, layout};
  cfg.cache_salt_hi = 0x1234, cfg.cache_salt_lo = 0x5678;
  KvManager salted{cfg, layout};
  plain.match(a), salted.match(b);  // both fill in their keys
  ASSERT_EQ(a.keys.size(), 2u);
  EXPECT_NE(a.keys[0], b.keys[0]);  // the same tokens, another server: another key
  EXPECT_EQ(b.keys[0], chain_key(BlockKey{0x1234, 0x5678}, std::span<const TokenId>(b.tokens).subspan(0, 4)));
}

TEST_F(CacheFixture, UnusedEntriesAreEvictedLeafFirstWhenMemoryRunsOut) {
  ReqInfo a = req(test::seq(16));
  { KvBlocks ka = compute(a, 16); }  // released: 4 cached blocks, all evictable
  EXPECT_EQ(kv.cache().evictable(), 4);
  EXPECT_EQ(kv.free_pages(), 4);
  auto big = *kv.new_kv();
  ASSERT_TRUE(kv.grow(big, 20));  // needs 5 pages: evicts one entry, the leaf
  EXPECT_EQ(kv.cache().size(), 3);
  ReqInfo again = req(test::seq(16));
  EXPECT_EQ(kv.match(again).hit_tokens, 12);  // root..third block still chained
}

TEST_F(CacheFixture, ReferencedEntriesAreNeverEvicted) {
  ReqInfo a = req(test::seq(16));
  KvBlocks ka = compute(a, 16);  // still held
  auto other = *kv.new_kv();
  EXPECT_TRUE(kv.grow(other, 16));
  EXPECT_FALSE(kv.grow(other, 20));  // nothing evictable
  EXPECT_EQ(kv.cache().size(), 4);
}

TEST(PrefixCacheHost, DemotedEntriesComeBackThroughCopies) {
  SchedulerConfig cfg = test::paged(4, 4, /*host_pages=*/8);
  MemoryLayout layout = MemoryLayout::plan(cfg);
  KvManager kv(cfg, layout);
  ReqInfo a;
  a.tokens = test::seq(9);
  a.prompt_len = 9;
  {
    auto ka = *kv.new_kv();
    ASSERT_TRUE(kv.grow(ka, 8));
    kv.commit(ka, a, 8);
  }
  kv.new_step();
  auto filler = *kv.new_kv();
  ASSERT_TRUE(kv.grow(filler, 16));  // all four pages: both entries demoted to host
  EXPECT_EQ(kv.cache().host_entries(), 2);
  EXPECT_EQ(kv.ops().to_host_src.size(), 2u);
  filler = KvBlocks{};
  kv.new_step();
  ReqInfo b;
  b.tokens = test::seq(9);
  b.prompt_len = 9;
  auto m = kv.match(b);
  EXPECT_EQ(m.hit_tokens, 8);
  EXPECT_EQ(m.host_blocks, 2);
  auto kb = *kv.new_kv();
  ASSERT_TRUE(kv.acquire(m, kb));
  EXPECT_EQ(kv.ops().to_device_dst.size(), 2u);
  EXPECT_EQ(kv.ops().to_device_dst[0], kb.table(0).ids()[0]);
  EXPECT_EQ(kv.cache().host_entries(), 0);
}

}  // namespace
}  // namespace dz
