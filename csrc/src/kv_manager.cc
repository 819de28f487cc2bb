#include "dayzero/kv_manager.h"

#include <algorithm>
#include <cmath>

namespace dz {

namespace {

std::vector<std::unique_ptr<GroupAllocator>> make_allocators(const SchedulerConfig& cfg, const MemoryLayout& m,
                                                             FreeList& pages) {
  std::vector<std::unique_ptr<GroupAllocator>> out;
  for (std::size_t g = 0; g < cfg.groups.size(); ++g) {
    if (cfg.groups[g].kind == GroupKind::State)
      out.emplace_back(nullptr);
    else
      out.push_back(std::make_unique<GroupAllocator>(pages, m.blocks_per_page[g], m.num_pages));
  }
  return out;
}

std::vector<GroupInfo> group_infos(const SchedulerConfig& cfg,
                                   const std::vector<std::unique_ptr<GroupAllocator>>& allocs) {
  std::vector<GroupInfo> out;
  for (std::size_t g = 0; g < cfg.groups.size(); ++g)
    out.push_back({cfg.groups[g].kind, allocs[g].get(), cfg.groups[g].window});
  return out;
}

std::int32_t ceil_div(std::int32_t a, std::int32_t b) { return (a + b - 1) / b; }

// The first block a query at `first_query` or later reads in group g: a query at q reads keys
// (q - window, q] of a sliding-window group, every key of another.
std::int32_t first_seen_block(const CacheGroupSpec& g, std::int32_t first_query, std::int32_t block_size) {
  if (g.kind != GroupKind::SlidingWindow) return 0;
  return std::max(0, first_query - g.window) / block_size;
}

}  // namespace

KvManager::KvManager(const SchedulerConfig& cfg, const MemoryLayout& layout)
    : block_size_(cfg.block_size),
      step_tokens_(std::max(std::min(cfg.chunk_size, cfg.max_tokens_per_step), 1 + cfg.spec_tokens)),
      salt_{cfg.cache_salt_hi, cfg.cache_salt_lo},
      groups_(cfg.groups),
      layout_(layout),
      pages_(layout.num_pages),
      slots_(layout.num_slots > 0 ? cfg.max_batch_size : 0),
      snapshots_(layout.num_slots > 0 ? cfg.snapshot_slots : 0, cfg.max_batch_size),
      host_(layout.num_host_pages),
      allocs_(make_allocators(cfg, layout, pages_)),
      cache_(group_infos(cfg, allocs_), cfg.block_size, layout.num_host_pages > 0 ? &host_ : nullptr, &snapshots_,
             cfg.prefix_cache),
      max_tokens_per_request_(compute_max_tokens_per_request()) {}

void KvManager::new_step() {
  ops_.clear();
  cache_.new_step();
}

std::vector<BlockTable>& KvManager::tables_of(KvBlocks& kv) { return kv.tables_; }

std::optional<KvBlocks> KvManager::new_kv() {
  Lease slot;
  if (has_state()) {
    if (slots_.empty()) return std::nullopt;
    slot = Lease(&slots_, slots_.take());
  }
  std::vector<BlockTable> tables;
  tables.reserve(groups_.size());
  for (auto& a : allocs_) tables.emplace_back(a.get());
  return KvBlocks(std::move(tables), std::move(slot));
}

BlockId KvManager::alloc(std::size_t g) {
  BlockId b = allocs_[g]->alloc();
  while (b == kNoBlock && cache_.evict_one(ops_)) b = allocs_[g]->alloc();
  return b;
}

bool KvManager::grow(KvBlocks& kv, std::int32_t tokens, std::int32_t first_query) {
  slide(kv, first_query);  // before allocating: the blocks it frees may be the ones handed out
  const std::int32_t want = ceil_div(tokens, block_size_);
  for (std::size_t g = 0; g < groups_.size(); ++g) {
    if (!allocs_[g]) continue;
    BlockTable& t = kv.tables_[g];
    const std::int32_t seen = first_seen_block(groups_[g], first_query, block_size_);
    while (t.size() < want) {
      if (t.size() < seen) {  // out of every later query's window: a placeholder
        t.push(kNoBlock);
        continue;
      }
      const BlockId b = alloc(g);
      if (b == kNoBlock) return false;
      t.push(b);
    }
  }
  return true;
}

void KvManager::slide(KvBlocks& kv, std::int32_t first_query) {
  for (std::size_t g = 0; g < groups_.size(); ++g)
    if (allocs_[g]) kv.tables_[g].drop_before(first_seen_block(groups_[g], first_query, block_size_));
}

void KvManager::rollback(KvBlocks& kv, std::int32_t tokens) {
  const std::int32_t keep = ceil_div(tokens, block_size_);
  for (std::size_t g = 0; g < groups_.size(); ++g)
    if (allocs_[g]) kv.tables_[g].truncate(keep);
}

void KvManager::extend_keys(ReqInfo& info) const {
  const auto full = static_cast<std::size_t>(info.len() / block_size_);
  const auto bs = static_cast<std::size_t>(block_size_);
  while (info.keys.size() < full) {
    const std::size_t i = info.keys.size();
    const BlockKey parent = i == 0 ? salt_ : info.keys[i - 1];
    info.keys.push_back(chain_key(parent, std::span<const TokenId>(info.tokens).subspan(i * bs, bs)));
  }
}

PrefixCache::Match KvManager::match(ReqInfo& info, bool device_only) {
  if (!cache_.enabled()) return {};
  extend_keys(info);
  return cache_.match(info.tokens, info.keys, device_only);
}

void KvManager::commit(const KvBlocks& kv, ReqInfo& info, std::int32_t tokens, Lease snapshot) {
  if (!cache_.enabled()) return;
  tokens = std::min(tokens, info.len());
  const std::int32_t full = tokens / block_size_;
  if (full <= 0) return;
  extend_keys(info);
  std::vector<BlockId> blocks(groups_.size(), kNoBlock);
  for (std::int32_t i = info.committed; i < full; ++i) {
    for (std::size_t g = 0; g < groups_.size(); ++g) {
      const auto& t = kv.table(g);
      blocks[g] = allocs_[g] && i < t.size() ? t.ids()[static_cast<std::size_t>(i)] : kNoBlock;
    }
    cache_.insert(info.keys[static_cast<std::size_t>(i)],
                  std::span<const TokenId>(info.tokens)
                      .subspan(static_cast<std::size_t>(i) * static_cast<std::size_t>(block_size_),
                               static_cast<std::size_t>(block_size_)),
                  blocks);
  }
  info.committed = std::max(info.committed, full);
  // The block may have been committed before (a recomputed request): the snapshot still attaches.
  if (snapshot) cache_.attach_snapshot(info.keys[static_cast<std::size_t>(full - 1)], std::move(snapshot));
}

std::optional<HostCopy> KvManager::copy_to_host(const KvBlocks& kv, std::int32_t tokens) {
  const std::int32_t nblocks = ceil_div(tokens, block_size_);
  std::int32_t need = has_state() ? layout_.pages_per_state : 0;
  for (std::size_t g = 0; g < groups_.size(); ++g) {
    if (!allocs_[g]) continue;
    const auto ids = kv.table(g).ids();
    for (std::int32_t i = 0; i < nblocks && i < static_cast<std::int32_t>(ids.size()); ++i)
      need += ids[static_cast<std::size_t>(i)] != kNoBlock ? 1 : 0;
  }
  while (host_.size() < need && cache_.drop_host_one()) {
  }
  if (host_.size() < need) return std::nullopt;
  HostCopy h;
  h.tokens = tokens;
  h.blocks.resize(groups_.size());
  for (std::size_t g = 0; g < groups_.size(); ++g) {
    if (!allocs_[g]) continue;
    const auto ids = kv.table(g).ids();
    for (std::int32_t i = 0; i < nblocks && i < static_cast<std::int32_t>(ids.size()); ++i) {
      const BlockId b = ids[static_cast<std::size_t>(i)];
      if (b == kNoBlock) {
        h.blocks[g].emplace_back();
        continue;
      }
      h.blocks[g].emplace_back(&host_, host_.take());
      ops_.to_host_group.push_back(static_cast<std::int32_t>(g));
      ops_.to_host_src.push_back(b);
      ops_.to_host_dst.push_back(h.blocks[g].back().id());
    }
  }
  if (has_state()) {
    ops_.state_to_host_slot.push_back(kv.state_slot());
    for (std::int32_t i = 0; i < layout_.pages_per_state; ++i) {
      h.state.emplace_back(&host_, host_.take());
      ops_.state_to_host_pages.push_back(h.state.back().id());
    }
  }
  return h;
}

bool KvManager::copy_to_device(KvBlocks& kv, const HostCopy& host) {
  // The next query is at host.tokens: blocks out of its window are neither allocated nor restored.
  if (!grow(kv, host.tokens, host.tokens)) return false;
  for (std::size_t g = 0; g < groups_.size(); ++g) {
    if (!allocs_[g]) continue;
    const auto ids = kv.tables_[g].ids();
    for (std::size_t i = 0; i < host.blocks[g].size(); ++i) {
      if (host.blocks[g][i] && ids[i] != kNoBlock) {
        ops_.to_device_group.push_back(static_cast<std::int32_t>(g));
        ops_.to_device_src.push_back(host.blocks[g][i].id());
        ops_.to_device_dst.push_back(ids[i]);
      }
    }
  }
  if (has_state()) {
    ops_.state_to_device_slot.push_back(kv.state_slot());
    for (const auto& p : host.state) ops_.state_to_device_pages.push_back(p.id());
  }
  return true;
}

std::int32_t KvManager::free_blocks(std::size_t g) const {
  if (!allocs_[g]) return free_slots();
  return pages_.size() * layout_.blocks_per_page[g] + allocs_[g]->free_in_partial_pages();
}

std::int32_t KvManager::total_blocks(std::size_t g) const {
  return allocs_[g] ? allocs_[g]->capacity() : slots_.capacity();
}

std::int32_t KvManager::window_blocks(std::size_t g) const {
  // A step's queries [s, e) read keys from s - window + 1 on: blocks floor((s - window) / block)
  // to ceil(e / block) - 1, with e - s <= step_tokens_.
  return ceil_div(groups_[g].window + step_tokens_, block_size_) + 1;
}

std::int64_t KvManager::compute_max_tokens_per_request() const {
  // Per block of tokens a request takes 1/k pages in each full-history group (k blocks per
  // page); a sliding-window group holds window_blocks() at most, on pages of their own (and
  // one page more, partly freed, when a page holds several blocks).
  double pages = layout_.num_pages, per_block = 0;
  for (std::size_t g = 0; g < groups_.size(); ++g) {
    const std::int32_t k = layout_.blocks_per_page[g];
    if (groups_[g].kind == GroupKind::Paged) per_block += 1.0 / k;
    if (groups_[g].kind == GroupKind::SlidingWindow) pages -= ceil_div(window_blocks(g), k) + (k > 1 ? 1 : 0);
  }
  if (pages < 0) return 0;                      // not even one request's windows fit
  if (per_block == 0) return kUnboundedTokens;  // windows only: memory does not grow with the length
  return std::min(kUnboundedTokens, static_cast<std::int64_t>(pages / per_block) * block_size_);
}

bool KvOwner::grow(KvManager& m, std::int32_t tokens, std::int32_t first_query) {
  return m.grow(kv_, tokens, first_query);
}
void KvOwner::rollback(KvManager& m, std::int32_t tokens) { m.rollback(kv_, tokens); }

}  // namespace dz
