// Whole-state consistency checks, used by the property tests after every step.
#include <algorithm>
#include <set>

#include "dayzero/scheduler.h"

namespace dz {

namespace {

[[noreturn]] void broken(const std::string& what) { throw SchedulerError("invariant broken: " + what); }

}  // namespace

void Scheduler::check_invariants() const {
  const std::size_t ng = kv_.num_groups();
  // 1. Every block's reference count equals its references from tables and the cache.
  std::vector<std::vector<std::int32_t>> refs(ng);
  for (std::size_t g = 0; g < ng; ++g)
    if (kv_.allocator(g)) refs[g].assign(static_cast<std::size_t>(kv_.allocator(g)->capacity()), 0);
  std::set<SlotId> state_slots;
  std::int32_t holders = 0;
  for (const auto& s : slots_) {
    if (!s.phase) continue;
    const KvBlocks* kv = kv_of(*s.phase);
    if (!kv) continue;
    ++holders;
    for (std::size_t g = 0; g < ng; ++g)
      for (BlockId b : kv->table(g).ids())
        if (b != kNoBlock) ++refs[g][static_cast<std::size_t>(b)];
    if (kv_.has_state() && !state_slots.insert(kv->state_slot()).second)
      broken("state slot " + std::to_string(kv->state_slot()) + " held twice");
  }
  kv_.cache().count_refs(refs);
  std::int32_t pages_owned = 0;
  for (std::size_t g = 0; g < ng; ++g) {
    const GroupAllocator* a = kv_.allocator(g);
    if (!a) continue;
    pages_owned += a->pages_owned();
    for (BlockId b = 0; b < a->capacity(); ++b) {
      const std::int32_t want = refs[g][static_cast<std::size_t>(b)];
      if (a->refcount(b) != want)
        broken("group " + kv_.group(g).name + " block " + std::to_string(b) + ": refcount " +
               std::to_string(a->refcount(b)) + ", referenced " + std::to_string(want) + " times");
      // 2. No block is both free and referenced.
      if ((want > 0) != a->allocated(b))
        broken("group " + kv_.group(g).name + " block " + std::to_string(b) +
               (want > 0 ? " is referenced but free" : " is allocated but unreferenced"));
    }
  }
  // 3. Pages: owned by exactly one group or free.
  if (pages_owned + kv_.free_pages() != kv_.total_pages())
    broken(std::to_string(pages_owned) + " pages owned + " + std::to_string(kv_.free_pages()) +
           " free != " + std::to_string(kv_.total_pages()));
  if (kv_.has_state() && kv_.free_slots() + static_cast<std::int32_t>(state_slots.size()) != cfg_.max_batch_size)
    broken("state slots: " + std::to_string(kv_.free_slots()) + " free + " + std::to_string(state_slots.size()) +
           " held != " + std::to_string(cfg_.max_batch_size));
  // 4. Queues agree with phases.
  if (holders != static_cast<std::int32_t>(running_.size()))
    broken(std::to_string(holders) + " requests hold KV but " + std::to_string(running_.size()) + " are running");
  if (static_cast<std::int32_t>(running_.size()) > cfg_.max_batch_size)
    broken("more running requests than max_batch_size");
  for (std::size_t i = 1; i < running_.size(); ++i)
    if (info_of(*slots_[static_cast<std::size_t>(running_[i - 1])].phase).arrival >=
        info_of(*slots_[static_cast<std::size_t>(running_[i])].phase).arrival)
      broken("running requests out of arrival order");
  for (const auto& r : retracted_)
    if (!slots_[static_cast<std::size_t>(r.slot)].phase ||
        !std::holds_alternative<Retracted>(*slots_[static_cast<std::size_t>(r.slot)].phase))
      broken("retracted queue holds a request that is not Retracted");
  // 5. Host pages: held by retracted or restoring requests, the cache, or free.
  std::int32_t host_held = kv_.cache().host_pages_held();
  for (const auto& s : slots_) {
    if (!s.phase) continue;
    const HostCopy* h = nullptr;
    if (auto* r = std::get_if<Retracted>(&*s.phase)) h = &r->host;
    if (auto* r = std::get_if<Restoring>(&*s.phase)) h = &r->host;
    if (!h) continue;
    for (const auto& g : h->blocks)
      host_held += static_cast<std::int32_t>(
          std::count_if(g.begin(), g.end(), [](const Lease& l) { return static_cast<bool>(l); }));
    host_held += static_cast<std::int32_t>(h->state.size());
  }
  if (host_held + kv_.free_host_pages() != layout_.num_host_pages)
    broken("host pages: " + std::to_string(host_held) + " held + " + std::to_string(kv_.free_host_pages()) +
           " free != " + std::to_string(layout_.num_host_pages));
}

}  // namespace dz
