// All device and host memory of the control plane: the shared page pool, one
// allocator per paged group, state and snapshot slots, host pages and the
// prefix cache. Every operation that implies a copy logs it in ops().
#pragma once

#include <limits>
#include <memory>
#include <optional>
#include <vector>

#include "dayzero/handles.h"
#include "dayzero/memory.h"
#include "dayzero/phases.h"
#include "dayzero/prefix_cache.h"

namespace dz {

// max_tokens_per_request() of a model whose every group is a sliding window (its memory does
// not grow with the length): the most positions a request may have.
inline constexpr std::int64_t kUnboundedTokens = std::numeric_limits<std::int32_t>::max();

class KvManager {
 public:
  KvManager(const SchedulerConfig& cfg, const MemoryLayout& layout);
  KvManager(const KvManager&) = delete;
  KvManager& operator=(const KvManager&) = delete;

  void new_step();
  CopyOps& ops() { return ops_; }

  bool has_state() const { return slots_.capacity() > 0; }
  std::int32_t block_size() const { return block_size_; }
  std::size_t num_groups() const { return groups_.size(); }
  const CacheGroupSpec& group(std::size_t g) const { return groups_[g]; }

  // Empty tables and, for models with State groups, a state slot (nullopt if none is free).
  std::optional<KvBlocks> new_kv();
  // Blocks for the first `tokens` tokens in every paged group, for queries at positions
  // `first_query` and on; false if memory ran out (blocks already added stay with the request).
  // A sliding-window group first drops the blocks no such query sees and allocates none for
  // them (placeholders), so it holds at most window_blocks() blocks, whatever the length.
  bool grow(KvBlocks& kv, std::int32_t tokens, std::int32_t first_query = 0);
  void rollback(KvBlocks& kv, std::int32_t tokens);  // keep blocks for `tokens` tokens

  // Prefix cache.
  void extend_keys(ReqInfo& info) const;
  PrefixCache::Match match(ReqInfo& info, bool device_only = false);
  bool acquire(const PrefixCache::Match& m, KvBlocks& kv) {
    return cache_.acquire(m, tables_of(kv), kv.state_slot(), ops_);
  }
  // Registers the full blocks among the first `tokens` tokens; `snapshot`, if
  // given, holds the state after block `tokens / block_size - 1`.
  void commit(const KvBlocks& kv, ReqInfo& info, std::int32_t tokens, Lease snapshot = {});
  Lease snapshot_slot() { return cache_.take_snapshot_slot(); }
  PrefixCache& cache() { return cache_; }
  const PrefixCache& cache() const { return cache_; }

  // Retraction to host memory and back.
  std::optional<HostCopy> copy_to_host(const KvBlocks& kv, std::int32_t tokens);
  bool copy_to_device(KvBlocks& kv, const HostCopy& host);

  // Introspection.
  std::int32_t free_pages() const { return pages_.size(); }
  std::int32_t total_pages() const { return pages_.capacity(); }
  std::int32_t free_blocks(std::size_t g) const;  // in free and partial pages
  std::int32_t total_blocks(std::size_t g) const;
  std::int32_t free_host_pages() const { return host_.size(); }
  // The most tokens one request can hold with the whole device to itself: unbounded
  // (kUnboundedTokens) when every group is a sliding window that fits, 0 when one does not.
  std::int64_t max_tokens_per_request() const { return max_tokens_per_request_; }
  // The most blocks one request holds in sliding-window group g: its window and the tokens one
  // step adds (a prefill chunk, or a decode row and its drafts), plus a partial block.
  std::int32_t window_blocks(std::size_t g) const;
  std::int32_t free_slots() const { return slots_.size(); }
  const GroupAllocator* allocator(std::size_t g) const { return allocs_[g].get(); }

 private:
  std::vector<BlockTable>& tables_of(KvBlocks& kv);
  BlockId alloc(std::size_t g);                        // evicts from the prefix cache when needed
  void slide(KvBlocks& kv, std::int32_t first_query);  // sliding-window groups drop old blocks
  std::int64_t compute_max_tokens_per_request() const;

  std::int32_t block_size_;
  std::int32_t step_tokens_;  // the most tokens one step adds to one request
  BlockKey salt_;             // the key chain's root (SchedulerConfig::cache_salt_*)
  std::vector<CacheGroupSpec> groups_;
  MemoryLayout layout_;
  FreeList pages_;
  FreeList slots_;
  FreeList snapshots_;
  FreeList host_;
  std::vector<std::unique_ptr<GroupAllocator>> allocs_;  // nullptr for State groups
  PrefixCache cache_;
  std::int64_t max_tokens_per_request_;
  CopyOps ops_;
};

}  // namespace dz
