// Device and host memory, in logical units. Python maps them to bytes.
//
// Layout of the device byte budget:
//   [ state slots: num_slots x state_slot_bytes ][ pages: num_pages x page_bytes ]
// page_bytes = block_size x the widest paged row. A narrower paged group packs
// blocks_per_page blocks into one page (its rows padded to page_bytes /
// (blocks_per_page x block_size)), so every paged group draws from the one pool.
#pragma once

#include <cstdint>
#include <vector>

#include "dayzero/types.h"

namespace dz {

struct MemoryLayout {
  std::int64_t page_bytes = 0;
  std::int32_t num_pages = 0;
  std::int64_t state_slot_bytes = 0;  // all State groups of one request
  std::int32_t num_slots = 0;         // running requests + snapshots
  std::int32_t num_host_pages = 0;
  std::int32_t pages_per_state = 0;            // host pages one state copy needs
  std::vector<std::int32_t> blocks_per_page;   // per group; 0 for State groups
  std::vector<std::int64_t> padded_row_bytes;  // per group; 0 for State groups

  static MemoryLayout plan(const SchedulerConfig& cfg);
};

// Free list of fixed-size units (pages, state slots, host pages).
class FreeList {
 public:
  explicit FreeList(std::int32_t n, std::int32_t first = 0);  // ids [first, first + n)
  bool empty() const { return free_.empty(); }
  std::int32_t size() const { return static_cast<std::int32_t>(free_.size()); }
  std::int32_t capacity() const { return capacity_; }
  std::int32_t take();
  void give(std::int32_t id);

 private:
  std::int32_t capacity_;
  std::vector<std::int32_t> free_;
};

// Hooks the prefix cache installs to learn when a cached block gains or loses
// its last request reference (it may be evicted only while unreferenced).
class PinListener {
 public:
  virtual void pin(std::int32_t entry) = 0;
  virtual void unpin(std::int32_t entry) = 0;

 protected:
  ~PinListener() = default;
};

// Reference-counted blocks of one paged group, carved out of shared pages.
class GroupAllocator {
 public:
  GroupAllocator(FreeList& pages, std::int32_t blocks_per_page, std::int32_t num_pages);

  BlockId alloc();  // refcount 1, or kNoBlock when no page is free
  void incref(BlockId b);
  void decref(BlockId b);
  std::int32_t refcount(BlockId b) const { return refs_[b]; }
  bool allocated(BlockId b) const;  // its page belongs to this group and the block is handed out
  std::int32_t pages_owned() const { return pages_owned_; }
  std::int32_t capacity() const { return static_cast<std::int32_t>(refs_.size()); }
  std::int32_t used() const { return used_; }
  std::int32_t free_in_partial_pages() const { return partial_free_; }

  void set_owner(BlockId b, std::int32_t entry) { owner_[b] = entry; }
  std::int32_t owner(BlockId b) const { return owner_[b]; }
  void listen(PinListener* l) { listener_ = l; }

 private:
  void release(BlockId b);

  FreeList& pages_;
  std::int32_t per_page_;
  std::vector<std::int32_t> refs_;
  std::vector<std::int32_t> owner_;        // prefix-cache entry holding the block, or -1
  std::vector<std::uint64_t> page_free_;   // per page: bit i set = block i of the page free
  std::vector<PageId> partial_;            // pages of this group with some blocks free
  std::vector<std::int32_t> partial_pos_;  // page -> index in partial_, or -1
  std::vector<std::uint8_t> owned_;        // per page: this group holds it
  std::int32_t pages_owned_ = 0;
  std::int32_t used_ = 0;
  std::int32_t partial_free_ = 0;
  PinListener* listener_ = nullptr;
};

}  // namespace dz
