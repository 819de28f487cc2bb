// Prefix cache over chained hashes of full blocks.
//
//   key_0 = H(salt, tokens[0:B)),  key_i = H(key_{i-1}, tokens[iB:(i+1)B))
//
// Keys are 128-bit and fixed-size whatever the block size; the salt is a per-server secret,
// and an entry keeps its block's tokens: a hit needs the key and the tokens to agree. An entry holds one
// reference on its block in every paged group (kNoBlock where a sliding window
// had already dropped it) and, for models with State groups, optionally a
// snapshot slot with the state after the block. An entry no request uses is
// evictable, least recently used first; with host memory it is demoted to host
// pages (a later hit brings it back: the request goes through Prefetching),
// without it it is dropped.
#pragma once

#include <cstdint>
#include <deque>
#include <span>
#include <unordered_map>
#include <vector>

#include "dayzero/handles.h"
#include "dayzero/memory.h"

namespace dz {

struct BlockKey {
  std::uint64_t hi = 0;
  std::uint64_t lo = 0;
  bool operator==(const BlockKey&) const = default;
};

struct BlockKeyHash {
  std::size_t operator()(const BlockKey& k) const {
    return static_cast<std::size_t>(k.lo ^ (k.hi * 0x9E3779B97F4A7C15ULL));
  }
};

BlockKey chain_key(const BlockKey& parent, std::span<const TokenId> block);

// Device<->host and slot copies the executor must perform this step.
// Order: to_host, to_device, slot_restore, forward, slot_snapshot.
struct CopyOps {
  std::vector<std::int32_t> to_host_group, to_host_src, to_host_dst;        // device block -> host page
  std::vector<std::int32_t> to_device_group, to_device_src, to_device_dst;  // host page -> device block
  std::vector<std::int32_t> state_to_host_slot, state_to_host_pages;        // slot -> pages_per_state pages
  std::vector<std::int32_t> state_to_device_slot, state_to_device_pages;
  std::vector<std::int32_t> restore_src, restore_dst;    // snapshot slot -> request slot, before forward
  std::vector<std::int32_t> snapshot_src, snapshot_dst;  // request slot -> snapshot slot, after forward
  void clear();
};

struct GroupInfo {
  GroupKind kind;
  GroupAllocator* alloc;  // nullptr for State groups
  std::int32_t window_blocks_needed(std::int32_t hit_tokens, std::int32_t block_size) const;
  std::int32_t window = 0;
};

class PrefixCache final : public PinListener {
 public:
  // snapshots: the slots reserved for state snapshots (disjoint from request slots).
  PrefixCache(std::vector<GroupInfo> groups, std::int32_t block_size, FreeList* host_pages, FreeList* snapshots,
              bool enabled);
  PrefixCache(const PrefixCache&) = delete;
  PrefixCache& operator=(const PrefixCache&) = delete;

  struct Match {
    std::vector<std::int32_t> entries;  // one per matched block
    std::int32_t hit_tokens = 0;
    std::int32_t host_blocks = 0;  // entries that must come back from host
  };
  // Longest usable cached prefix of `tokens`, never the whole sequence (the last
  // token must be computed to produce logits).
  // device_only: stop at the first entry that lives on the host.
  Match match(std::span<const TokenId> tokens, const std::vector<BlockKey>& keys, bool device_only) const;
  // Takes references for a match into new (empty) tables; brings host entries back
  // (device blocks allocated, copies logged). Returns false, having taken
  // nothing, when device blocks for host entries cannot be found.
  bool acquire(const Match& m, std::vector<BlockTable>& tables, SlotId state_slot, CopyOps& ops);

  // Registers block i of a request (key, its tokens, its block in every group). The
  // entry takes its own references.
  void insert(const BlockKey& key, std::span<const TokenId> tokens, std::span<const BlockId> blocks);
  // Gives a device entry without one the state snapshot taken after its block.
  void attach_snapshot(const BlockKey& key, Lease snapshot);
  bool contains(const BlockKey& key) const { return index_.contains(key); }

  // Frees device memory: demotes or drops the least recently used unused entry.
  bool evict_one(CopyOps& ops);
  // Frees host pages: drops the least recently used host entry.
  bool drop_host_one();
  // Drops every entry no request uses (device and host); returns how many.
  std::int32_t flush();
  Lease take_snapshot_slot();  // may drop the oldest snapshot; empty if none allowed
  bool enabled() const { return enabled_; }

  void pin(std::int32_t e) override;
  void unpin(std::int32_t e) override;

  // Introspection and invariant checks.
  std::int32_t size() const { return static_cast<std::int32_t>(index_.size()); }
  std::int32_t device_entries() const;
  std::int32_t evictable() const { return lru_size_; }
  std::int32_t host_entries() const { return host_size_; }
  // Adds this cache's references to per-group counts.
  void count_refs(std::vector<std::vector<std::int32_t>>& refs) const;
  std::int32_t snapshots_held() const { return snapshots_ ? snapshots_->capacity() - snapshots_->size() : 0; }
  std::int32_t host_pages_held() const;

  // Hit rate, counted once per admitted request.
  void record(std::int64_t lookup, std::int64_t hit) {
    lookup_tokens_ += lookup;
    hit_tokens_ += hit;
  }
  std::int64_t lookup_tokens() const { return lookup_tokens_; }
  std::int64_t hit_tokens() const { return hit_tokens_; }

 private:
  struct Entry {
    BlockKey key;
    std::vector<TokenId> tokens;  // the block's tokens (checked on a hit)
    std::vector<BlockId> blocks;  // per group; device ids, or host pages when demoted
    Lease snapshot;
    std::vector<Lease> host;  // per group, when demoted: the host page holding the block
    bool on_device = true;
    bool live = false;
    enum class In : std::uint8_t { None, DeviceLru, HostLru } in = In::None;
    std::int32_t pinned = 0;  // blocks some request also references
    std::int32_t prev = -1, next = -1;
    std::uint32_t gen = 0;
  };
  struct List {
    std::int32_t head = -1, tail = -1;
  };
  void link_front(Entry::In where, std::int32_t e);
  void unlink(std::int32_t e);
  List& list(Entry::In where) { return where == Entry::In::DeviceLru ? lru_ : host_lru_; }
  void drop(std::int32_t e);

  std::vector<GroupInfo> groups_;
  std::int32_t block_size_;
  FreeList* host_pages_;
  FreeList* snapshots_;
  bool enabled_;
  std::vector<Entry> entries_;
  std::vector<std::int32_t> free_entries_;
  std::unordered_map<BlockKey, std::int32_t, BlockKeyHash> index_;
  List lru_, host_lru_;
  std::int32_t lru_size_ = 0, host_size_ = 0;
  std::deque<std::pair<std::int32_t, std::uint32_t>> snapshot_fifo_;
  std::vector<Lease> deferred_host_;  // host pages read by the last plan's copies
  std::int64_t lookup_tokens_ = 0, hit_tokens_ = 0;

 public:
  // Called when planning a new step: copies of earlier plans run before it.
  void new_step() { deferred_host_.clear(); }
};

}  // namespace dz
