#include "dayzero/prefix_cache.h"

#include <algorithm>
#include <cstring>

namespace dz {

namespace {

std::uint64_t fmix(std::uint64_t h) {  // murmur3 finaliser
  h ^= h >> 33;
  h *= 0xff51afd7ed558ccdULL;
  h ^= h >> 33;
  h *= 0xc4ceb9fe1a85ec53ULL;
  h ^= h >> 33;
  return h;
}

std::uint64_t mix_word(std::uint64_t h, std::uint64_t w, std::uint64_t mul) {
  h ^= fmix(w + mul);
  h = (h << 27) | (h >> 37);
  return h * mul + 0x52dce729ULL;
}

}  // namespace

BlockKey chain_key(const BlockKey& parent, std::span<const TokenId> block) {
  constexpr std::uint64_t kA = 0x87c37b91114253d5ULL, kB = 0x4cf5ad432745937fULL;
  std::uint64_t a = mix_word(parent.hi, parent.lo, kA), b = mix_word(parent.lo, parent.hi, kB);
  for (std::size_t i = 0; i < block.size(); i += 2) {
    std::uint64_t w = static_cast<std::uint32_t>(block[i]);
    if (i + 1 < block.size()) w |= static_cast<std::uint64_t>(static_cast<std::uint32_t>(block[i + 1])) << 32;
    a = mix_word(a, w, kA);
    b = mix_word(b, w ^ 0x9E3779B97F4A7C15ULL, kB);
  }
  return {fmix(a ^ block.size()), fmix(b + block.size())};
}

void CopyOps::clear() {
  for (auto* v : {&to_host_group, &to_host_src, &to_host_dst, &to_device_group, &to_device_src, &to_device_dst,
                  &state_to_host_slot, &state_to_host_pages, &state_to_device_slot, &state_to_device_pages,
                  &restore_src, &restore_dst, &snapshot_src, &snapshot_dst})
    v->clear();
}

std::int32_t GroupInfo::window_blocks_needed(std::int32_t hit_tokens, std::int32_t block_size) const {
  // First block a query at position `hit_tokens` may attend to.
  if (kind != GroupKind::SlidingWindow) return 0;
  return std::max(0, hit_tokens - window) / block_size;
}

PrefixCache::PrefixCache(std::vector<GroupInfo> groups, std::int32_t block_size, FreeList* host_pages,
                         FreeList* snapshots, bool enabled)
    : groups_(std::move(groups)),
      block_size_(block_size),
      host_pages_(host_pages),
      snapshots_(snapshots),
      enabled_(enabled) {
  for (auto& g : groups_)
    if (g.alloc) g.alloc->listen(this);
}

PrefixCache::Match PrefixCache::match(std::span<const TokenId> tokens, const std::vector<BlockKey>& keys,
                                      bool device_only) const {
  Match m;
  if (!enabled_ || tokens.empty()) return m;
  const std::size_t most =
      std::min<std::size_t>((tokens.size() - 1) / static_cast<std::size_t>(block_size_), keys.size());
  std::vector<std::int32_t> chain;
  const auto bs = static_cast<std::size_t>(block_size_);
  for (std::size_t i = 0; i < most; ++i) {
    auto it = index_.find(keys[i]);
    if (it == index_.end() || (device_only && !entries_[it->second].on_device)) break;
    const auto block = tokens.subspan(i * bs, bs);
    const Entry& e = entries_[it->second];
    if (!std::equal(block.begin(), block.end(), e.tokens.begin(), e.tokens.end())) break;  // a collision
    chain.push_back(it->second);
  }
  for (auto h = static_cast<std::int32_t>(chain.size()); h > 0; --h) {
    bool ok = true;
    for (std::size_t g = 0; g < groups_.size() && ok; ++g) {
      const GroupInfo& gi = groups_[g];
      if (gi.kind == GroupKind::State) {
        const Entry& last = entries_[chain[h - 1]];
        ok = last.on_device && static_cast<bool>(last.snapshot);
      } else if (gi.kind == GroupKind::SlidingWindow) {
        for (std::int32_t j = gi.window_blocks_needed(h * block_size_, block_size_); j < h && ok; ++j) {
          const Entry& e = entries_[chain[j]];
          ok = e.on_device ? e.blocks[g] != kNoBlock : static_cast<bool>(e.host[g]);
        }
      }
    }
    if (!ok) continue;
    m.entries.assign(chain.begin(), chain.begin() + h);
    m.hit_tokens = h * block_size_;
    for (auto e : m.entries) m.host_blocks += entries_[e].on_device ? 0 : 1;
    return m;
  }
  return m;
}

bool PrefixCache::acquire(const Match& m, std::vector<BlockTable>& tables, SlotId state_slot, CopyOps& ops) {
  const auto n = static_cast<std::int32_t>(m.entries.size());
  auto wanted = [&](std::size_t g, std::int32_t i) {
    return i >= groups_[g].window_blocks_needed(m.hit_tokens, block_size_);
  };
  // References on device entries first: pinned, they cannot be evicted below.
  // Host entries leave the host LRU so that nothing below drops them.
  for (std::size_t g = 0; g < groups_.size(); ++g) {
    if (groups_[g].kind == GroupKind::State) continue;
    for (std::int32_t i = 0; i < n; ++i) {
      const Entry& e = entries_[m.entries[i]];
      tables[g].share(e.on_device && wanted(g, i) ? e.blocks[g] : kNoBlock);
    }
  }
  for (auto e : m.entries)
    if (!entries_[e].on_device) unlink(e);
  // Device blocks for host entries.
  std::vector<BlockId> promoted;  // entry-major, group-minor
  bool ok = true;
  for (std::int32_t i = 0; i < n && ok; ++i) {
    const Entry& e = entries_[m.entries[i]];
    if (e.on_device) continue;
    for (std::size_t g = 0; g < groups_.size() && ok; ++g) {
      if (!e.host[g] || !wanted(g, i)) continue;
      BlockId b = groups_[g].alloc->alloc();
      while (b == kNoBlock && evict_one(ops)) b = groups_[g].alloc->alloc();
      if (b == kNoBlock)
        ok = false;
      else
        promoted.push_back(b);
    }
  }
  if (!ok) {  // give back everything taken above
    std::size_t k = 0;
    for (std::int32_t i = 0; i < n; ++i) {
      const Entry& e = entries_[m.entries[i]];
      if (e.on_device) continue;
      for (std::size_t g = 0; g < groups_.size() && k < promoted.size(); ++g)
        if (e.host[g] && wanted(g, i)) groups_[g].alloc->decref(promoted[k++]);
    }
    for (auto e : m.entries)
      if (!entries_[e].on_device) link_front(Entry::In::HostLru, e);
    for (auto& t : tables) t.truncate(0);
    return false;
  }
  // Promote host entries: a new device block is the entry's reference; the table shares it.
  std::size_t k = 0;
  for (std::int32_t i = 0; i < n; ++i) {
    const std::int32_t idx = m.entries[i];
    Entry& e = entries_[idx];
    if (e.on_device) continue;
    for (std::size_t g = 0; g < groups_.size(); ++g) {
      if (!e.host[g]) continue;
      if (wanted(g, i)) {
        const BlockId b = promoted[k++];
        e.blocks[g] = b;
        groups_[g].alloc->set_owner(b, idx);
        tables[g].fill(i, b);  // refcount 2: pins the entry
        ops.to_device_group.push_back(static_cast<std::int32_t>(g));
        ops.to_device_src.push_back(e.host[g].id());
        ops.to_device_dst.push_back(b);
        deferred_host_.push_back(std::move(e.host[g]));
      } else {
        e.host[g].reset();  // outside every window from here on
      }
    }
    e.on_device = true;
    if (e.pinned == 0) link_front(Entry::In::DeviceLru, idx);
  }
  if (state_slot != kNoSlot && n > 0) {
    const Entry& last = entries_[m.entries[n - 1]];
    if (last.snapshot) {
      ops.restore_src.push_back(last.snapshot.id());
      ops.restore_dst.push_back(state_slot);
    }
  }
  return true;
}

void PrefixCache::attach_snapshot(const BlockKey& key, Lease snapshot) {
  auto it = index_.find(key);
  if (it == index_.end()) return;
  Entry& e = entries_[it->second];
  if (!e.on_device || e.snapshot) return;
  e.snapshot = std::move(snapshot);
  snapshot_fifo_.emplace_back(it->second, e.gen);
}

void PrefixCache::insert(const BlockKey& key, std::span<const TokenId> tokens, std::span<const BlockId> blocks) {
  if (!enabled_ || index_.contains(key)) return;  // another request computed the same block
  std::int32_t idx;
  if (!free_entries_.empty()) {
    idx = free_entries_.back();
    free_entries_.pop_back();
  } else {
    idx = static_cast<std::int32_t>(entries_.size());
    entries_.emplace_back();
  }
  Entry& e = entries_[idx];
  e.key = key;
  e.tokens.assign(tokens.begin(), tokens.end());
  e.blocks.assign(blocks.begin(), blocks.end());
  e.host.clear();
  e.host.resize(groups_.size());
  e.on_device = true;
  e.live = true;
  e.pinned = 0;
  for (std::size_t g = 0; g < groups_.size(); ++g) {
    const BlockId b = e.blocks[g];
    if (b == kNoBlock) continue;
    groups_[g].alloc->incref(b);
    groups_[g].alloc->set_owner(b, idx);
    if (groups_[g].alloc->refcount(b) > 1) ++e.pinned;
  }
  if (e.pinned == 0) link_front(Entry::In::DeviceLru, idx);
  index_.emplace(key, idx);
}

Lease PrefixCache::take_snapshot_slot() {
  if (!enabled_ || !snapshots_ || snapshots_->capacity() == 0) return {};
  while (snapshots_->empty() && !snapshot_fifo_.empty()) {  // drop the oldest snapshot
    auto [idx, gen] = snapshot_fifo_.front();
    snapshot_fifo_.pop_front();
    if (entries_[idx].live && entries_[idx].gen == gen) entries_[idx].snapshot.reset();
  }
  if (snapshots_->empty()) return {};
  return Lease(snapshots_, snapshots_->take());
}

bool PrefixCache::evict_one(CopyOps& ops) {
  const std::int32_t idx = lru_.tail;
  if (idx < 0) return false;
  Entry& e = entries_[idx];
  std::int32_t need = 0;
  for (auto b : e.blocks) need += b != kNoBlock ? 1 : 0;
  if (host_pages_)
    while (host_pages_->size() < need && drop_host_one()) {
    }
  if (!host_pages_ || host_pages_->size() < need) {
    drop(idx);
    return true;
  }
  unlink(idx);
  for (std::size_t g = 0; g < groups_.size(); ++g) {
    const BlockId b = e.blocks[g];
    if (b == kNoBlock) continue;
    e.host[g] = Lease(host_pages_, host_pages_->take());
    ops.to_host_group.push_back(static_cast<std::int32_t>(g));
    ops.to_host_src.push_back(b);
    ops.to_host_dst.push_back(e.host[g].id());
    groups_[g].alloc->set_owner(b, -1);
    groups_[g].alloc->decref(b);
    e.blocks[g] = kNoBlock;
  }
  e.snapshot.reset();
  e.on_device = false;
  link_front(Entry::In::HostLru, idx);
  return true;
}

bool PrefixCache::drop_host_one() {
  if (host_lru_.tail < 0) return false;
  drop(host_lru_.tail);
  return true;
}

std::int32_t PrefixCache::flush() {
  std::int32_t n = 0;
  for (; lru_.tail >= 0; ++n) drop(lru_.tail);
  for (; host_lru_.tail >= 0; ++n) drop(host_lru_.tail);
  return n;
}

void PrefixCache::drop(std::int32_t idx) {
  Entry& e = entries_[idx];
  unlink(idx);
  for (std::size_t g = 0; g < groups_.size(); ++g) {
    const BlockId b = e.blocks[g];
    if (b == kNoBlock) continue;
    groups_[g].alloc->set_owner(b, -1);
    groups_[g].alloc->decref(b);
  }
  e.blocks.clear();
  e.host.clear();
  e.snapshot.reset();
  e.live = false;
  ++e.gen;
  index_.erase(e.key);
  free_entries_.push_back(idx);
}

void PrefixCache::pin(std::int32_t e) {
  if (++entries_[e].pinned == 1 && entries_[e].in == Entry::In::DeviceLru) unlink(e);
}

void PrefixCache::unpin(std::int32_t e) {
  if (--entries_[e].pinned == 0 && entries_[e].on_device) link_front(Entry::In::DeviceLru, e);
}

void PrefixCache::link_front(Entry::In where, std::int32_t idx) {
  Entry& e = entries_[idx];
  List& l = list(where);
  e.in = where;
  e.prev = -1;
  e.next = l.head;
  if (l.head >= 0) entries_[l.head].prev = idx;
  l.head = idx;
  if (l.tail < 0) l.tail = idx;
  (where == Entry::In::DeviceLru ? lru_size_ : host_size_)++;
}

void PrefixCache::unlink(std::int32_t idx) {
  Entry& e = entries_[idx];
  if (e.in == Entry::In::None) return;
  List& l = list(e.in);
  if (e.prev >= 0)
    entries_[e.prev].next = e.next;
  else
    l.head = e.next;
  if (e.next >= 0)
    entries_[e.next].prev = e.prev;
  else
    l.tail = e.prev;
  (e.in == Entry::In::DeviceLru ? lru_size_ : host_size_)--;
  e.in = Entry::In::None;
  e.prev = e.next = -1;
}

std::int32_t PrefixCache::device_entries() const {
  std::int32_t n = 0;
  for (const auto& e : entries_) n += e.live && e.on_device ? 1 : 0;
  return n;
}

std::int32_t PrefixCache::host_pages_held() const {
  std::int32_t n = static_cast<std::int32_t>(deferred_host_.size());
  for (const auto& e : entries_)
    for (const auto& h : e.host) n += h ? 1 : 0;
  return n;
}

void PrefixCache::count_refs(std::vector<std::vector<std::int32_t>>& refs) const {
  for (const auto& e : entries_) {
    if (!e.live || !e.on_device) continue;
    for (std::size_t g = 0; g < e.blocks.size(); ++g)
      if (e.blocks[g] != kNoBlock) ++refs[g][e.blocks[g]];
  }
}

}  // namespace dz
