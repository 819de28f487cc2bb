// The scheduler: admission, chunked prefill, mixed batches, overlap,
// retraction and restore, speculative slots, disaggregated fill.
//
// Policy (docs/scheduler.md has the long form):
//  - Rows per step: decodes first (arrival order), then prefill chunks of running
//    requests, then admissions: retracted requests before new ones, strictly in
//    arrival order (the head of the queue is never overtaken).
//  - Memory pressure: when a running request cannot grow, the running request
//    with the latest arrival and no result in flight is retracted (its KV copied
//    to host memory, or dropped for recompute when host memory is short).
//    Retracted requests come back before any new admission, so the earliest
//    request always progresses and no request starves.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "dayzero/kv_manager.h"
#include "dayzero/phases.h"
#include "dayzero/plan.h"

namespace dz {

struct SubmitArgs {
  std::int32_t max_new_tokens = 16;
  std::vector<TokenId> stop_ids;
  bool ignore_eos = false;
  bool remote = false;  // decode-side of disaggregation: KV comes from a remote prefill
};

struct PhaseCounts {
  std::int32_t counts[std::variant_size_v<Phase>] = {};
};

class Scheduler {
 public:
  explicit Scheduler(SchedulerConfig cfg);

  // Requests. Each raises SchedulerError (and changes nothing) on a bad call.
  void submit(ReqId id, std::span<const TokenId> prompt, const SubmitArgs& args);
  void bootstrap_done(ReqId id);                   // remote: handshake done, may be admitted
  void remote_fill_done(ReqId id, TokenId first);  // remote: KV written, first token known
  void abort(ReqId id);
  void finish(ReqId id);  // stop condition found by the caller (e.g. a stop string)
  // Drops every prefix-cache entry no request uses (e.g. after a weight update).
  std::int32_t flush_prefix_cache() { return kv_.cache().flush(); }
  // The device could not run the plans in flight (a failed step): every request with a row in
  // one of them is aborted without committing the KV those plans were to write (reported as
  // aborted by the next plan), the plans are forgotten, and the prefix cache drops every entry
  // no request uses, the blocks those plans committed at planning time among them. Returns the
  // aborted requests' ids.
  std::vector<ReqId> discard_inflight();

  // One step. The plan stays valid while the caller holds it.
  std::shared_ptr<const Plan> step();
  // Results of the oldest plan not yet answered: for each of its rows, in order,
  // counts[i] tokens (0 for a prefill chunk that does not sample).
  void feed(std::span<const ReqId> ids, std::span<const std::int32_t> counts, std::span<const TokenId> tokens);

  // Introspection.
  const SchedulerConfig& config() const { return cfg_; }
  const MemoryLayout& layout() const { return layout_; }
  const KvManager& memory() const { return kv_; }
  std::int32_t live() const { return static_cast<std::int32_t>(by_id_.size()); }
  std::int32_t waiting() const;
  std::int32_t running() const { return static_cast<std::int32_t>(running_.size()); }
  std::int32_t plans_in_flight() const { return static_cast<std::int32_t>(inflight_.size()); }
  PhaseCounts phase_counts() const;
  std::string phase_of(ReqId id) const;
  std::vector<BlockId> block_table(ReqId id, std::size_t group = 0) const;
  std::vector<TokenId> tokens_of(ReqId id) const;
  std::int32_t cached_tokens_of(ReqId id) const;  // prompt tokens the prefix cache held at admission
  std::int32_t capacity() const { return static_cast<std::int32_t>(slots_.size()); }
  // Throws SchedulerError describing the first broken invariant.
  void check_invariants() const;

 private:
  struct Slot {
    std::optional<Phase> phase;
    std::uint32_t gen = 0;
  };
  struct RowRef {
    std::int32_t slot;
    std::uint32_t gen;
  };
  struct InFlight {
    std::vector<ReqId> ids;
    std::vector<RowRef> rows;
    std::vector<std::uint8_t> sample;
  };
  struct Budget {
    std::int32_t tokens;
    std::int32_t rows;
  };

  std::int32_t slot_of(ReqId id) const;
  Phase& phase(std::int32_t slot) { return *slots_[static_cast<std::size_t>(slot)].phase; }
  void add_row(Plan& p, std::int32_t slot, const ReqInfo& info, const KvBlocks& kv, std::int32_t start, std::int32_t n,
               bool prefill, bool sample);
  void schedule_decodes(Plan& p, Budget& b);
  void schedule_prefills(Plan& p, Budget& b);
  void admit(Plan& p, Budget& b);
  bool admit_one(Plan& p, Budget& b, std::int32_t slot);  // false: it must wait, and so do later ones
  void enter_running(std::int32_t slot);                  // keeps running_ in arrival order
  PrefixCache::Match acquire_prefix(ReqInfo& info, KvBlocks& kv, bool device_only);
  std::int32_t chunk_end(const ReqInfo& info, std::int32_t start, const Budget& b) const;
  bool chunk(Plan& p, Budget& b, std::int32_t slot);
  bool make_room(std::int32_t for_slot);  // retracts one victim later than for_slot
  void retract(std::int32_t slot);
  void finish_request(std::int32_t slot);                        // Finishing -> Finished, reported and freed
  bool after_token(std::int32_t slot, std::int32_t new_tokens);  // Decoding: finishes it if a stop condition holds
  void remove(std::int32_t slot);
  void build_tables(Plan& p);

  SchedulerConfig cfg_;
  MemoryLayout layout_;
  KvManager kv_;
  std::vector<Slot> slots_;
  std::vector<std::int32_t> free_slots_;
  std::unordered_map<ReqId, std::int32_t> by_id_;
  std::deque<RowRef> waiting_;         // Submitted (and Bootstrapping until done), arrival order
  std::vector<RowRef> retracted_;      // arrival order
  std::vector<std::int32_t> running_;  // phases holding KV, arrival order
  std::deque<InFlight> inflight_;
  std::uint64_t next_arrival_ = 0;
  std::int64_t step_ = 0;
  std::vector<std::int32_t> commit_rows_;  // slots whose new full blocks are committed at step end
  struct PendingSnapshot {
    std::int32_t slot;
    std::int32_t end;  // tokens the snapshot covers
    Lease lease;
  };
  std::vector<PendingSnapshot> snapshots_;
  Plan pending_;  // finished / retracted / remote-fill reports for the next plan
};

}  // namespace dz
