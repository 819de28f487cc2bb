#include "dayzero/scheduler.h"

#include <algorithm>
#include <concepts>

#include "dayzero/transitions.h"

namespace dz {

namespace {

std::int32_t kv_len_of(const Phase& s) {
  return std::visit(
      [](const auto& x) -> std::int32_t {
        if constexpr (requires { x.kv_len; })
          return x.kv_len;
        else
          return 0;
      },
      s);
}

}  // namespace

Scheduler::Scheduler(SchedulerConfig cfg)
    : cfg_(std::move(cfg)), layout_(MemoryLayout::plan(cfg_)), kv_(cfg_, layout_) {}

std::int32_t Scheduler::slot_of(ReqId id) const {
  auto it = by_id_.find(id);
  if (it == by_id_.end()) throw SchedulerError("request " + std::to_string(id) + " is not live");
  return it->second;
}

// ---------------------------------------------------------------- requests

void Scheduler::submit(ReqId id, std::span<const TokenId> prompt, const SubmitArgs& args) {
  const auto fail = [id](const std::string& why) {
    throw SchedulerError("request " + std::to_string(id) + ": " + why);
  };
  if (by_id_.contains(id)) fail("id is already live");
  if (prompt.empty()) fail("empty prompt");
  if (args.max_new_tokens < 1) fail("max_new_tokens must be >= 1");
  for (TokenId t : prompt)
    if (t < 0) fail("negative token id " + std::to_string(t));
  const std::int64_t need = static_cast<std::int64_t>(prompt.size()) + args.max_new_tokens;
  if (kv_.max_tokens_per_request() == 0)
    fail("the KV memory's " + std::to_string(kv_.total_pages()) +
         " pages cannot hold one request's sliding-window blocks (a window and a step's tokens per group)");
  if (need > kv_.max_tokens_per_request())
    fail("prompt (" + std::to_string(prompt.size()) + ") + max_new_tokens (" + std::to_string(args.max_new_tokens) +
         ") exceeds the " + std::to_string(kv_.max_tokens_per_request()) + " tokens of KV memory one request can hold");
  std::int32_t slot;
  if (!free_slots_.empty()) {
    slot = free_slots_.back();
    free_slots_.pop_back();
  } else {
    slot = static_cast<std::int32_t>(slots_.size());
    slots_.emplace_back();
  }
  ReqInfo info;
  info.id = id;
  info.tokens.assign(prompt.begin(), prompt.end());
  info.prompt_len = static_cast<std::int32_t>(prompt.size());
  info.max_new_tokens = args.max_new_tokens;
  info.stop_ids = args.stop_ids;
  info.ignore_eos = args.ignore_eos;
  info.remote = args.remote;
  slots_[static_cast<std::size_t>(slot)].phase.emplace(Bootstrapping{std::move(info)});
  by_id_.emplace(id, slot);
  if (!args.remote) bootstrap_done(id);
}

void Scheduler::bootstrap_done(ReqId id) {
  const std::int32_t slot = slot_of(id);
  apply(id, phase(slot), BootstrapDone{});
  info_of(phase(slot)).arrival = next_arrival_++;
  waiting_.push_back({slot, slots_[static_cast<std::size_t>(slot)].gen});
}

void Scheduler::remote_fill_done(ReqId id, TokenId first) {
  if (first < 0) throw SchedulerError("request " + std::to_string(id) + ": negative token id");
  apply(id, phase(slot_of(id)), RemoteFillDone{first});
}

void Scheduler::abort(ReqId id) {
  const std::int32_t slot = slot_of(id);
  apply(id, phase(slot), Abort{});
  if (std::holds_alternative<Finishing>(phase(slot))) {
    finish_request(slot);
  } else {
    pending_.finished_ids.push_back(id);
    pending_.finished_reasons.push_back(static_cast<std::int32_t>(FinishReason::Abort));
    remove(slot);
  }
}

std::vector<ReqId> Scheduler::discard_inflight() {
  std::vector<ReqId> out;
  for (const InFlight& rec : inflight_) {
    for (std::size_t i = 0; i < rec.rows.size(); ++i) {
      const RowRef r = rec.rows[i];
      const Slot& sl = slots_[static_cast<std::size_t>(r.slot)];
      if (sl.gen != r.gen || !sl.phase) continue;  // finished, aborted, or a second row of one request
      out.push_back(rec.ids[i]);
      pending_.finished_ids.push_back(rec.ids[i]);
      pending_.finished_reasons.push_back(static_cast<std::int32_t>(FinishReason::Abort));
      remove(r.slot);  // its blocks go back with the phase; nothing is committed
    }
  }
  inflight_.clear();
  kv_.cache().flush();
  return out;
}

void Scheduler::finish(ReqId id) {
  const std::int32_t slot = slot_of(id);
  apply(id, phase(slot), Finish{FinishReason::Stop});
  finish_request(slot);
}

void Scheduler::finish_request(std::int32_t slot) {
  auto& f = std::get<Finishing>(phase(slot));
  kv_.commit(f.kv(), f.info, f.kv_len);  // the conversation's next turn reuses it
  const ReqId id = f.info.id;
  apply(id, phase(slot), Release{});
  pending_.finished_ids.push_back(id);
  pending_.finished_reasons.push_back(static_cast<std::int32_t>(std::get<Finished>(phase(slot)).reason));
  remove(slot);
}

void Scheduler::remove(std::int32_t slot) {
  Slot& s = slots_[static_cast<std::size_t>(slot)];
  by_id_.erase(info_of(*s.phase).id);
  s.phase.reset();
  ++s.gen;
  free_slots_.push_back(slot);
  if (auto it = std::find(running_.begin(), running_.end(), slot); it != running_.end()) running_.erase(it);
  std::erase_if(retracted_, [&](const RowRef& r) { return r.slot == slot; });
}

// ---------------------------------------------------------------- planning

std::shared_ptr<const Plan> Scheduler::step() {
  auto p = std::make_shared<Plan>();
  p->step = step_++;
  kv_.new_step();
  std::swap(p->finished_ids, pending_.finished_ids);
  std::swap(p->finished_reasons, pending_.finished_reasons);
  std::swap(p->retracted_ids, pending_.retracted_ids);
  std::swap(p->remote_fill_ids, pending_.remote_fill_ids);
  p->query_start.push_back(0);

  // Copies logged by earlier plans run before this one: those waits are over.
  std::vector<std::int32_t> ready;
  for (std::int32_t slot : running_) {
    Phase& s = phase(slot);
    const ReqId id = info_of(s).id;
    if (std::holds_alternative<Prefetching>(s))
      apply(id, s, PrefetchDone{});
    else if (std::holds_alternative<Restoring>(s))
      apply(id, s, RestoreDone{});
    else if (std::holds_alternative<Ready>(s))
      ready.push_back(slot);
  }
  for (std::int32_t slot : ready) {
    apply(info_of(phase(slot)).id, phase(slot), StartDecode{});
    after_token(slot, 1);  // the remote node's first token may already finish it
  }

  Budget b{cfg_.max_tokens_per_step, cfg_.max_batch_size};
  schedule_decodes(*p, b);
  schedule_prefills(*p, b);
  admit(*p, b);

  // Blocks whose KV this and earlier plans compute become visible to later admissions.
  for (auto& [slot, end, lease] : snapshots_) {
    const Slot& s = slots_[static_cast<std::size_t>(slot)];
    if (const KvBlocks* kv = s.phase ? kv_of(*s.phase) : nullptr)
      kv_.commit(*kv, info_of(phase(slot)), end, std::move(lease));
  }
  snapshots_.clear();
  for (std::int32_t slot : commit_rows_) {
    const Slot& s = slots_[static_cast<std::size_t>(slot)];
    if (!s.phase) continue;
    if (const KvBlocks* kv = kv_of(*s.phase)) kv_.commit(*kv, info_of(phase(slot)), kv_len_of(*s.phase));
  }
  commit_rows_.clear();

  build_tables(*p);
  p->copies = std::move(kv_.ops());
  if (p->rows() > 0) {
    InFlight rec;
    rec.ids = p->req_ids;
    rec.sample = p->sample;
    rec.rows.reserve(p->req_slots.size());
    for (std::int32_t slot : p->req_slots) rec.rows.push_back({slot, slots_[static_cast<std::size_t>(slot)].gen});
    inflight_.push_back(std::move(rec));
  }
  return p;
}

void Scheduler::add_row(Plan& p, std::int32_t slot, const ReqInfo& info, const KvBlocks& kv, std::int32_t start,
                        std::int32_t n, bool prefill, bool sample) {
  p.req_ids.push_back(info.id);
  p.req_slots.push_back(slot);
  p.num_tokens.push_back(n);
  p.kv_lens.push_back(start + n);
  p.is_prefill.push_back(prefill ? 1 : 0);
  p.sample.push_back(sample ? 1 : 0);
  p.state_slots.push_back(kv.state_slot());
  const std::int32_t known = info.len();
  for (std::int32_t pos = start; pos < start + n; ++pos) {
    p.input_ids.push_back(pos < known ? info.tokens[static_cast<std::size_t>(pos)] : kDeviceToken);
    p.positions.push_back(pos);
  }
  p.query_start.push_back(p.tokens());
}

void Scheduler::schedule_decodes(Plan& p, Budget& b) {
  const std::int32_t need = 1 + cfg_.spec_tokens;
  const std::int32_t max_inflight = cfg_.overlap ? 2 : 1;
  for (std::size_t i = 0; i < running_.size(); ++i) {
    const std::int32_t slot = running_[i];
    auto* d = std::get_if<Decoding>(&phase(slot));
    if (!d || d->inflight >= max_inflight) continue;
    if (b.rows == 0 || b.tokens < need) break;
    // Behind a speculative row in flight the start is optimistic: that row's drafts all
    // accepted. The engine moves the row back by the drafts rejected, on the device, so its
    // first query may lie up to spec_tokens earlier (a window's oldest block stays).
    const std::int32_t start = d->kv_len;
    const std::int32_t first_query = start - (d->inflight > 0 ? cfg_.spec_tokens : 0);
    bool grown = d->grow(kv_, start + need, first_query);
    while (!grown && make_room(slot)) grown = d->grow(kv_, start + need, first_query);
    if (!grown) continue;
    add_row(p, slot, d->info, d->kv(), start, need, false, true);
    d->kv_len = start + need;
    ++d->inflight;
    --b.rows;
    b.tokens -= need;
    commit_rows_.push_back(slot);
  }
}

void Scheduler::schedule_prefills(Plan& p, Budget& b) {
  for (std::size_t i = 0; i < running_.size() && b.rows > 0 && b.tokens > 0; ++i)
    if (std::holds_alternative<Prefilling>(phase(running_[i])) && !chunk(p, b, running_[i])) break;
}

std::int32_t Scheduler::chunk_end(const ReqInfo& info, std::int32_t start, const Budget& b) const {
  const std::int32_t bs = kv_.block_size(), len = info.len();
  std::int32_t end = start + std::min({len - start, cfg_.chunk_size, b.tokens});
  if (kv_.has_state()) {
    // Chunks end on block boundaries where possible: the state there is snapshotted
    // for prefix hits, up to the last boundary a later hit can use.
    const std::int32_t last_boundary = ((len - 1) / bs) * bs;
    if (start < last_boundary) end = std::min(end, last_boundary);
    if (end < len && end % bs != 0 && end - end % bs > start) end -= end % bs;
  }
  return end;
}

bool Scheduler::chunk(Plan& p, Budget& b, std::int32_t slot) {
  auto& f = std::get<Prefilling>(phase(slot));
  if (b.rows == 0 || b.tokens == 0) return false;
  const std::int32_t bs = kv_.block_size(), len = f.info.len(), start = f.kv_len;
  const std::int32_t end = chunk_end(f.info, start, b);
  bool grown = f.grow(kv_, end, start);
  while (!grown && make_room(slot)) grown = f.grow(kv_, end, start);
  if (!grown) return false;
  const bool last = end == len;
  add_row(p, slot, f.info, f.kv(), start, end - start, true, last);
  f.kv_len = end;
  ++f.inflight;
  --b.rows;
  b.tokens -= end - start;
  commit_rows_.push_back(slot);
  if (kv_.has_state() && end % bs == 0) {
    if (Lease lease = kv_.snapshot_slot()) {
      kv_.ops().snapshot_src.push_back(f.kv().state_slot());
      kv_.ops().snapshot_dst.push_back(lease.id());
      snapshots_.push_back({slot, end, std::move(lease)});
    }
  }
  if (last) apply(f.info.id, phase(slot), LastChunk{});
  return true;
}

// ---------------------------------------------------------------- admission

void Scheduler::admit(Plan& p, Budget& b) {
  const auto full = [&] { return static_cast<std::int32_t>(running_.size()) >= cfg_.max_batch_size; };
  while (!retracted_.empty() && !full()) {
    const std::int32_t slot = retracted_.front().slot;
    auto& r = std::get<Retracted>(phase(slot));
    const bool recompute = r.host.empty();
    if (recompute && (b.rows == 0 || b.tokens == 0)) return;
    auto kv = kv_.new_kv();
    if (!kv) return;
    if (!recompute) {
      if (!kv_.copy_to_device(*kv, r.host)) return;
      apply(r.info.id, phase(slot), Restore{std::move(*kv)});
    } else {
      const auto m = acquire_prefix(r.info, *kv, /*device_only=*/true);
      if (!kv_.grow(*kv, chunk_end(r.info, m.hit_tokens, b), m.hit_tokens))
        return;  // kv goes back; still first in line
      kv_.cache().record(r.info.len(), m.hit_tokens);
      apply(r.info.id, phase(slot), Recompute{std::move(*kv), m.hit_tokens});
    }
    retracted_.erase(retracted_.begin());
    enter_running(slot);
    if (recompute) chunk(p, b, slot);  // its first chunk's blocks are already there
  }
  while (!waiting_.empty() && !full() && b.rows > 0 && b.tokens > 0) {
    const RowRef r = waiting_.front();
    const Slot& s = slots_[static_cast<std::size_t>(r.slot)];
    if (s.gen != r.gen || !s.phase || !std::holds_alternative<Submitted>(*s.phase)) {
      waiting_.pop_front();  // aborted while waiting
      continue;
    }
    if (!admit_one(p, b, r.slot)) return;
    waiting_.pop_front();
  }
}

bool Scheduler::admit_one(Plan& p, Budget& b, std::int32_t slot) {
  auto& sub = std::get<Submitted>(phase(slot));
  const ReqId id = sub.info.id;
  auto kv = kv_.new_kv();
  if (!kv) return false;
  if (sub.info.remote) {
    // The first query run here is at prompt_len: a window's older blocks are not filled.
    if (!kv_.grow(*kv, sub.info.prompt_len, sub.info.prompt_len)) return false;
    apply(id, phase(slot), AdmitRemote{std::move(*kv)});
    enter_running(slot);
    pending_.remote_fill_ids.push_back(id);
    return true;
  }
  const auto m = acquire_prefix(sub.info, *kv, /*device_only=*/false);
  // Blocks for the first chunk, or no admission at all (kv and its prefix go back).
  // With part of the prefix on the host, the first chunk waits for it (Prefetching).
  if (m.host_blocks == 0 && !kv_.grow(*kv, chunk_end(sub.info, m.hit_tokens, b), m.hit_tokens)) return false;
  kv_.cache().record(sub.info.len(), m.hit_tokens);
  if (m.host_blocks > 0) {
    apply(id, phase(slot), AdmitFromHost{std::move(*kv), m.hit_tokens});
  } else {
    apply(id, phase(slot), Admit{std::move(*kv), m.hit_tokens});
  }
  enter_running(slot);
  if (m.host_blocks == 0) chunk(p, b, slot);
  return true;
}

void Scheduler::enter_running(std::int32_t slot) {
  const auto arrival = info_of(phase(slot)).arrival;
  running_.insert(std::upper_bound(running_.begin(), running_.end(), arrival,
                                   [&](std::uint64_t a, std::int32_t s) { return a < info_of(phase(s)).arrival; }),
                  slot);
}

PrefixCache::Match Scheduler::acquire_prefix(ReqInfo& info, KvBlocks& kv, bool device_only) {
  auto m = kv_.match(info, device_only);
  if (!kv_.acquire(m, kv)) m = {};
  return m;
}

// ---------------------------------------------------------------- pressure

bool Scheduler::make_room(std::int32_t for_slot) {
  const std::uint64_t arrival = info_of(phase(for_slot)).arrival;
  for (auto j = static_cast<std::ptrdiff_t>(running_.size()) - 1; j >= 0; --j) {
    const std::int32_t v = running_[static_cast<std::size_t>(j)];
    const Phase& s = phase(v);
    if (info_of(s).arrival <= arrival) return false;
    const auto* d = std::get_if<Decoding>(&s);
    const auto* f = std::get_if<Prefilling>(&s);
    if ((d && d->inflight == 0) || (f && f->inflight == 0)) {
      retract(v);
      return true;
    }
  }
  return false;
}

void Scheduler::retract(std::int32_t slot) {
  Phase& s = phase(slot);
  ReqInfo& info = info_of(s);
  const ReqId id = info.id;
  if (auto* d = std::get_if<Decoding>(&s)) {
    kv_.commit(d->kv(), info, d->kv_len);
    auto host = kv_.copy_to_host(d->kv(), d->kv_len);
    apply(id, s, Retract{host ? std::move(*host) : HostCopy{}});
  } else {
    auto& f = std::get<Prefilling>(s);  // recomputed later; its full blocks stay cached
    kv_.commit(f.kv(), info, f.kv_len);
    apply(id, s, Retract{});
  }
  running_.erase(std::find(running_.begin(), running_.end(), slot));
  const RowRef ref{slot, slots_[static_cast<std::size_t>(slot)].gen};
  const auto arrival = info_of(phase(slot)).arrival;
  retracted_.insert(
      std::upper_bound(retracted_.begin(), retracted_.end(), arrival,
                       [&](std::uint64_t a, const RowRef& r) { return a < info_of(phase(r.slot)).arrival; }),
      ref);
  pending_.retracted_ids.push_back(id);
}

// ---------------------------------------------------------------- results

void Scheduler::feed(std::span<const ReqId> ids, std::span<const std::int32_t> counts,
                     std::span<const TokenId> tokens) {
  if (inflight_.empty()) throw SchedulerError("feed: no plan is waiting for results");
  const InFlight& rec = inflight_.front();
  static const std::string where = "feed (oldest plan in flight): ";
  if (ids.size() != rec.ids.size() || counts.size() != ids.size())
    throw SchedulerError(where + "the plan has " + std::to_string(rec.ids.size()) + " rows, got " +
                         std::to_string(ids.size()) + " ids and " + std::to_string(counts.size()) + " counts");
  std::size_t total = 0;
  for (std::size_t i = 0; i < ids.size(); ++i) {
    const auto bad_row = [&](const std::string& why) {
      throw SchedulerError(where + "row " + std::to_string(i) + " " + why);
    };
    if (ids[i] != rec.ids[i]) bad_row("is request " + std::to_string(rec.ids[i]) + ", got " + std::to_string(ids[i]));
    if (!rec.sample[i] && counts[i] != 0) bad_row("is a prefill chunk that samples nothing");
    if (rec.sample[i] && (counts[i] < 1 || counts[i] > 1 + cfg_.spec_tokens))
      bad_row("needs 1.." + std::to_string(1 + cfg_.spec_tokens) + " tokens, got " + std::to_string(counts[i]));
    total += static_cast<std::size_t>(counts[i]);
  }
  if (total != tokens.size())
    throw SchedulerError(where + "counts add up to " + std::to_string(total) + " but " + std::to_string(tokens.size()) +
                         " tokens were given");
  for (TokenId t : tokens)
    if (t < 0) throw SchedulerError(where + "negative token id " + std::to_string(t));

  // Validated: from here on nothing throws.
  std::size_t off = 0;
  for (std::size_t i = 0; i < ids.size(); ++i) {
    const auto got = tokens.subspan(off, static_cast<std::size_t>(counts[i]));
    off += got.size();
    const RowRef r = rec.rows[i];
    Slot& sl = slots_[static_cast<std::size_t>(r.slot)];
    if (sl.gen != r.gen || !sl.phase) continue;  // finished or aborted meanwhile
    Phase& s = *sl.phase;
    if (auto* f = std::get_if<Prefilling>(&s)) {
      --f->inflight;
    } else if (auto* a = std::get_if<PrefillAwaitingResult>(&s)) {
      if (!rec.sample[i]) {
        --a->inflight;
      } else {
        apply(ids[i], s, FirstToken{got[0]});
        after_token(r.slot, 1);
      }
    } else if (auto* d = std::get_if<Decoding>(&s)) {
      --d->inflight;
      d->info.tokens.insert(d->info.tokens.end(), got.begin(), got.end());
      if (cfg_.spec_tokens > 0) {  // drafts past the accepted ones are rolled back
        // (a row still in flight, planned behind this one: its KV ends 1 + k further on)
        d->kv_len = d->info.len() - 1 + d->inflight * (1 + cfg_.spec_tokens);
        d->rollback(kv_, d->kv_len);
      }
      after_token(r.slot, static_cast<std::int32_t>(got.size()));
    }
  }
  inflight_.pop_front();
}

bool Scheduler::after_token(std::int32_t slot, std::int32_t new_tokens) {
  auto& d = std::get<Decoding>(phase(slot));
  ReqInfo& info = d.info;
  FinishReason why = FinishReason::None;
  std::int32_t keep = info.len();
  if (!info.ignore_eos) {
    for (std::int32_t k = info.len() - new_tokens; k < info.len(); ++k) {
      if (std::find(info.stop_ids.begin(), info.stop_ids.end(), info.tokens[static_cast<std::size_t>(k)]) !=
          info.stop_ids.end()) {
        why = FinishReason::Stop;
        keep = k + 1;
        break;
      }
    }
  }
  // A stop token within the limit is a stop, also when it is the last allowed token.
  const std::int32_t limit = info.prompt_len + info.max_new_tokens;
  if (limit < keep || (why == FinishReason::None && limit <= keep)) {
    why = FinishReason::Length;
    keep = limit;
  }
  if (why == FinishReason::None) return false;
  info.tokens.resize(static_cast<std::size_t>(keep));
  apply(info.id, phase(slot), Finish{why});
  finish_request(slot);
  return true;
}

// ---------------------------------------------------------------- tables

void Scheduler::build_tables(Plan& p) {
  const std::size_t ng = kv_.num_groups();
  p.block_tables.assign(ng, {});
  p.block_table_width.assign(ng, 0);
  std::vector<const KvBlocks*> kvs;
  kvs.reserve(p.req_slots.size());
  for (std::int32_t slot : p.req_slots) kvs.push_back(kv_of(phase(slot)));
  for (std::size_t g = 0; g < ng; ++g) {
    if (kv_.group(g).kind == GroupKind::State) continue;
    std::int32_t width = 0;
    for (const KvBlocks* kv : kvs) width = std::max(width, kv->table(g).size());
    auto& out = p.block_tables[g];
    out.assign(kvs.size() * static_cast<std::size_t>(width), kNoBlock);
    for (std::size_t r = 0; r < kvs.size(); ++r) {
      const auto ids = kvs[r]->table(g).ids();
      std::copy(ids.begin(), ids.end(), out.begin() + static_cast<std::ptrdiff_t>(r * static_cast<std::size_t>(width)));
    }
    p.block_table_width[g] = width;
  }
}

// ---------------------------------------------------------------- introspection

std::int32_t Scheduler::waiting() const {
  std::int32_t n = static_cast<std::int32_t>(retracted_.size());
  for (const auto& r : waiting_) {
    const Slot& s = slots_[static_cast<std::size_t>(r.slot)];
    n += s.gen == r.gen && s.phase && std::holds_alternative<Submitted>(*s.phase) ? 1 : 0;
  }
  return n;
}

PhaseCounts Scheduler::phase_counts() const {
  PhaseCounts c;
  for (const auto& s : slots_)
    if (s.phase) ++c.counts[s.phase->index()];
  return c;
}

std::string Scheduler::phase_of(ReqId id) const {
  return name_of(*slots_[static_cast<std::size_t>(slot_of(id))].phase);
}

std::vector<BlockId> Scheduler::block_table(ReqId id, std::size_t group) const {
  if (group >= kv_.num_groups()) throw SchedulerError("no cache group " + std::to_string(group));
  const KvBlocks* kv = kv_of(*slots_[static_cast<std::size_t>(slot_of(id))].phase);
  if (!kv) return {};
  const auto ids = kv->table(group).ids();
  return {ids.begin(), ids.end()};
}

std::vector<TokenId> Scheduler::tokens_of(ReqId id) const {
  return info_of(*slots_[static_cast<std::size_t>(slot_of(id))].phase).tokens;
}

std::int32_t Scheduler::cached_tokens_of(ReqId id) const {
  return info_of(*slots_[static_cast<std::size_t>(slot_of(id))].phase).cached;
}

}  // namespace dz
