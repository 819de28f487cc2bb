// Move-only owners of a request's memory. Destroying a handle gives its memory
// back; a handle cannot be copied, so a block is never released twice.
#pragma once

#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "dayzero/memory.h"

namespace dz {

// One reference to each block of one paged group, in token order.
// A sliding-window group holds kNoBlock for blocks that left the window.
class BlockTable {
 public:
  explicit BlockTable(GroupAllocator* a = nullptr) : alloc_(a) {}
  BlockTable(const BlockTable&) = delete;
  BlockTable& operator=(const BlockTable&) = delete;
  BlockTable(BlockTable&& o) noexcept : alloc_(o.alloc_), ids_(std::move(o.ids_)) { o.ids_.clear(); }
  BlockTable& operator=(BlockTable&& o) noexcept {
    if (this != &o) {
      clear();
      alloc_ = o.alloc_;
      ids_ = std::move(o.ids_);
      o.ids_.clear();
    }
    return *this;
  }
  ~BlockTable() { clear(); }

  std::span<const BlockId> ids() const { return ids_; }
  std::int32_t size() const { return static_cast<std::int32_t>(ids_.size()); }

  void push(BlockId counted) { ids_.push_back(counted); }  // takes over one reference
  void share(BlockId b) {                                  // adds a reference
    if (b != kNoBlock) alloc_->incref(b);
    ids_.push_back(b);
  }
  void fill(std::int32_t i, BlockId b) {  // a placeholder becomes a reference on b
    alloc_->incref(b);
    ids_[i] = b;
  }
  void drop_before(std::int32_t n) {  // window slid past blocks [0, n)
    for (std::int32_t i = 0; i < n && i < size(); ++i) put(ids_[i]);
  }
  void truncate(std::int32_t n) {  // speculative rollback
    while (size() > n) {
      put(ids_.back());
      ids_.pop_back();
    }
  }

 private:
  void put(BlockId& b) {
    if (b != kNoBlock) alloc_->decref(b);
    b = kNoBlock;
  }
  void clear() {  // last block first: a cached chain is evicted leaf first
    for (auto it = ids_.rbegin(); it != ids_.rend(); ++it) put(*it);
    ids_.clear();
  }

  GroupAllocator* alloc_;
  std::vector<BlockId> ids_;
};

// One unit (state slot or host page run) of a FreeList.
class Lease {
 public:
  Lease() = default;
  Lease(FreeList* pool, std::int32_t id) : pool_(pool), id_(id) {}
  Lease(const Lease&) = delete;
  Lease& operator=(const Lease&) = delete;
  Lease(Lease&& o) noexcept : pool_(o.pool_), id_(std::exchange(o.id_, -1)) {}
  Lease& operator=(Lease&& o) noexcept {
    if (this != &o) {
      reset();
      pool_ = o.pool_;
      id_ = std::exchange(o.id_, -1);
    }
    return *this;
  }
  ~Lease() { reset(); }

  explicit operator bool() const { return id_ >= 0; }
  std::int32_t id() const { return id_; }
  void reset() {
    if (id_ >= 0) pool_->give(id_);
    id_ = -1;
  }

 private:
  FreeList* pool_ = nullptr;
  std::int32_t id_ = -1;
};

// Host pages holding a copy of device memory (a retracted request, a demoted prefix).
struct HostCopy {
  std::vector<std::vector<Lease>> blocks;  // per group, parallel to the block table
  std::vector<Lease> state;                // pages_per_state pages, or empty
  std::int32_t tokens = 0;                 // tokens whose KV the copy holds

  bool empty() const { return tokens == 0 && state.empty(); }
};

// Everything a request holds on the device: a table per group (empty for State
// groups) and, when the model has State groups, one state slot.
class KvBlocks {
 public:
  KvBlocks() = default;
  KvBlocks(std::vector<BlockTable> tables, Lease state) : tables_(std::move(tables)), state_(std::move(state)) {}
  KvBlocks(const KvBlocks&) = delete;
  KvBlocks& operator=(const KvBlocks&) = delete;
  KvBlocks(KvBlocks&&) noexcept = default;
  KvBlocks& operator=(KvBlocks&&) noexcept = default;
  ~KvBlocks() = default;

  std::span<const BlockTable> tables() const { return tables_; }
  const BlockTable& table(std::size_t g) const { return tables_[g]; }
  SlotId state_slot() const { return state_ ? state_.id() : kNoSlot; }

  // Gives every block and the state slot back now.
  void release() && {
    tables_.clear();
    state_.reset();
  }

 private:
  friend class KvManager;  // grows and trims the tables in place
  std::vector<BlockTable> tables_;
  Lease state_;
};

}  // namespace dz
