#include "dayzero/memory.h"

#include <algorithm>
#include <bit>
#include <set>
#include <string>

namespace dz {

namespace {

[[noreturn]] void bad_config(const std::string& what) { throw SchedulerError("scheduler config: " + what); }

void validate(const SchedulerConfig& cfg) {
  if (cfg.block_size <= 0) bad_config("block_size must be > 0");
  if (cfg.max_batch_size <= 0) bad_config("max_batch_size must be > 0");
  if (cfg.max_tokens_per_step <= 0) bad_config("max_tokens_per_step must be > 0");
  if (cfg.chunk_size <= 0) bad_config("chunk_size must be > 0");
  if (cfg.spec_tokens < 0) bad_config("spec_tokens must be >= 0");
  if (cfg.snapshot_slots < 0) bad_config("snapshot_slots must be >= 0");
  if (cfg.host_bytes < 0) bad_config("host_bytes must be >= 0");
  std::set<std::string> names;
  bool paged = false;
  for (const auto& g : cfg.groups) {
    if (g.name.empty()) bad_config("a cache group has an empty name");
    if (!names.insert(g.name).second) bad_config("cache group '" + g.name + "' appears twice");
    if (g.kind == GroupKind::State) {
      if (g.state_bytes <= 0) bad_config("state group '" + g.name + "' needs state_bytes > 0");
    } else {
      paged = true;
      if (g.bytes_per_token <= 0) bad_config("group '" + g.name + "' needs bytes_per_token > 0");
      if (g.kind == GroupKind::SlidingWindow && g.window <= 0)
        bad_config("sliding-window group '" + g.name + "' needs window > 0");
    }
  }
  if (!paged) bad_config("at least one paged (or sliding-window) cache group is required");
}

}  // namespace

MemoryLayout MemoryLayout::plan(const SchedulerConfig& cfg) {
  validate(cfg);
  MemoryLayout m;
  std::int64_t widest = 0;
  for (const auto& g : cfg.groups) {
    if (g.kind == GroupKind::State) {
      m.state_slot_bytes += g.state_bytes;
    } else {
      widest = std::max(widest, g.bytes_per_token);
    }
  }
  m.page_bytes = widest * cfg.block_size;
  for (const auto& g : cfg.groups) {
    if (g.kind == GroupKind::State) {
      m.blocks_per_page.push_back(0);
      m.padded_row_bytes.push_back(0);
      continue;
    }
    // Largest k <= 64 with k rows of `widest / k` bytes, each at least this group's row.
    std::int32_t k = static_cast<std::int32_t>(std::min<std::int64_t>(64, widest / g.bytes_per_token));
    while (k > 1 && widest % k != 0) --k;
    m.blocks_per_page.push_back(k);
    m.padded_row_bytes.push_back(widest / k);
  }
  if (m.state_slot_bytes > 0) m.num_slots = cfg.max_batch_size + cfg.snapshot_slots;
  const std::int64_t state_region = m.state_slot_bytes * m.num_slots;
  const std::int64_t pages = (cfg.device_bytes - state_region) / m.page_bytes;
  if (pages < 2)
    bad_config("device_bytes " + std::to_string(cfg.device_bytes) + " leaves " +
               std::to_string(std::max<std::int64_t>(pages, 0)) + " pages of " + std::to_string(m.page_bytes) +
               " bytes after " + std::to_string(state_region) + " bytes of state slots; need at least 2");
  if (pages > (1LL << 24)) bad_config("more than 2^24 pages; use a larger block_size");
  m.num_pages = static_cast<std::int32_t>(pages);
  m.num_host_pages = static_cast<std::int32_t>(std::min<std::int64_t>(cfg.host_bytes / m.page_bytes, 1LL << 24));
  m.pages_per_state = static_cast<std::int32_t>((m.state_slot_bytes + m.page_bytes - 1) / m.page_bytes);
  return m;
}

FreeList::FreeList(std::int32_t n, std::int32_t first) : capacity_(n) {
  free_.reserve(static_cast<std::size_t>(n));
  for (std::int32_t i = n - 1; i >= 0; --i) free_.push_back(first + i);  // low ids first
}

std::int32_t FreeList::take() {
  const std::int32_t id = free_.back();
  free_.pop_back();
  return id;
}

void FreeList::give(std::int32_t id) { free_.push_back(id); }

GroupAllocator::GroupAllocator(FreeList& pages, std::int32_t blocks_per_page, std::int32_t num_pages)
    : pages_(pages),
      per_page_(blocks_per_page),
      refs_(static_cast<std::size_t>(num_pages) * static_cast<std::size_t>(blocks_per_page), 0),
      owner_(refs_.size(), -1),
      page_free_(static_cast<std::size_t>(num_pages), 0),
      partial_pos_(static_cast<std::size_t>(num_pages), -1),
      owned_(static_cast<std::size_t>(num_pages), 0) {}

BlockId GroupAllocator::alloc() {
  PageId p;
  if (!partial_.empty()) {
    p = partial_.back();
  } else {
    if (pages_.empty()) return kNoBlock;
    p = pages_.take();
    owned_[p] = 1;
    ++pages_owned_;
    page_free_[p] = per_page_ == 64 ? ~0ULL : ((1ULL << per_page_) - 1);
    partial_pos_[p] = static_cast<std::int32_t>(partial_.size());
    partial_.push_back(p);
    partial_free_ += per_page_;
  }
  const int bit = std::countr_zero(page_free_[p]);
  page_free_[p] &= ~(1ULL << bit);
  --partial_free_;
  if (page_free_[p] == 0) {  // page now full: leaves the partial list
    partial_.pop_back();
    partial_pos_[p] = -1;
  }
  const BlockId b = p * per_page_ + bit;
  refs_[b] = 1;
  ++used_;
  return b;
}

bool GroupAllocator::allocated(BlockId b) const {
  const PageId p = b / per_page_;
  return owned_[p] && !(page_free_[p] & (1ULL << (b % per_page_)));
}

void GroupAllocator::incref(BlockId b) {
  if (++refs_[b] == 2 && owner_[b] >= 0 && listener_) listener_->pin(owner_[b]);
}

void GroupAllocator::decref(BlockId b) {
  const std::int32_t r = --refs_[b];
  if (r == 1 && owner_[b] >= 0 && listener_) listener_->unpin(owner_[b]);
  if (r == 0) release(b);
}

void GroupAllocator::release(BlockId b) {
  owner_[b] = -1;
  --used_;
  const PageId p = b / per_page_;
  const bool was_full = page_free_[p] == 0;
  page_free_[p] |= 1ULL << (b % per_page_);
  ++partial_free_;
  const std::uint64_t all = per_page_ == 64 ? ~0ULL : ((1ULL << per_page_) - 1);
  if (page_free_[p] == all) {  // whole page free: back to the shared pool
    if (!was_full) {
      const std::int32_t pos = partial_pos_[p];
      partial_[pos] = partial_.back();
      partial_pos_[partial_[pos]] = pos;
      partial_.pop_back();
    }
    partial_pos_[p] = -1;
    partial_free_ -= per_page_;
    owned_[p] = 0;
    --pages_owned_;
    pages_.give(p);
  } else if (was_full) {
    partial_pos_[p] = static_cast<std::int32_t>(partial_.size());
    partial_.push_back(p);
  }
}

}  // namespace dz
