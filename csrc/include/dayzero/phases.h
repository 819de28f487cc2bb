// The twelve phases of a request's life, each its own type.
//
// A phase owns exactly the resources that exist in that phase. Device KV
// (KvBlocks) lives in the KvOwner phases as a private member: it can be read
// (kv() const) and grown in place, never moved out or released, except by the
// transitions listed as friends of KvHandover in transitions.h. A phase that owns
// no KV has no kv() at all.
#pragma once

#include <concepts>
#include <cstdint>
#include <variant>
#include <vector>

#include "dayzero/handles.h"
#include "dayzero/prefix_cache.h"
#include "dayzero/types.h"

namespace dz {

class KvManager;

// Identity and token history; travels with the request through every phase.
struct ReqInfo {
  ReqId id = 0;
  std::uint64_t arrival = 0;    // admission order; a retracted request keeps its place
  std::vector<TokenId> tokens;  // prompt, then generated tokens
  std::int32_t prompt_len = 0;
  std::int32_t max_new_tokens = 0;
  std::vector<TokenId> stop_ids;  // finish when one is generated (unless ignore_eos)
  bool ignore_eos = false;
  bool remote = false;         // KV filled by a remote prefill node
  std::vector<BlockKey> keys;  // chained keys of full blocks, extended lazily
  std::int32_t committed = 0;  // blocks registered in the prefix cache
  std::int32_t cached = 0;     // prompt tokens found in the prefix cache at first admission

  std::int32_t generated() const { return static_cast<std::int32_t>(tokens.size()) - prompt_len; }
  std::int32_t len() const { return static_cast<std::int32_t>(tokens.size()); }
};

class KvOwner {
 public:
  const KvBlocks& kv() const& { return kv_; }
  // Grows or trims the blocks in place; the request keeps them.
  bool grow(KvManager& m, std::int32_t tokens, std::int32_t first_query);  // see KvManager::grow
  void rollback(KvManager& m, std::int32_t tokens);

 protected:
  explicit KvOwner(KvBlocks kv) : kv_(std::move(kv)) {}
  KvBlocks kv_;

 private:
  friend class KvHandover;
};

struct Bootstrapping {
  static constexpr const char* kName = "Bootstrapping";
  ReqInfo info;
};

struct Submitted {
  static constexpr const char* kName = "Submitted";
  ReqInfo info;
};

// Prefix blocks are coming back from host memory (copies in this step's plan).
struct Prefetching : KvOwner {
  static constexpr const char* kName = "Prefetching";
  Prefetching(ReqInfo i, KvBlocks kv, std::int32_t cached)
      : KvOwner(std::move(kv)), info(std::move(i)), kv_len(cached) {}
  ReqInfo info;
  std::int32_t kv_len;
};

struct Prefilling : KvOwner {
  static constexpr const char* kName = "Prefilling";
  Prefilling(ReqInfo i, KvBlocks kv, std::int32_t cached)
      : KvOwner(std::move(kv)), info(std::move(i)), kv_len(cached) {}
  ReqInfo info;
  std::int32_t kv_len;        // tokens whose KV is computed or dispatched
  std::int32_t inflight = 0;  // chunks whose (empty) results are outstanding
};

// The last chunk is dispatched; its token is not back yet.
struct PrefillAwaitingResult : KvOwner {
  static constexpr const char* kName = "PrefillAwaitingResult";
  PrefillAwaitingResult(ReqInfo i, KvBlocks kv, std::int32_t n, std::int32_t in)
      : KvOwner(std::move(kv)), info(std::move(i)), kv_len(n), inflight(in) {}
  ReqInfo info;
  std::int32_t kv_len;
  std::int32_t inflight;  // chunks dispatched, results outstanding (the last one samples)
};

struct Decoding : KvOwner {
  static constexpr const char* kName = "Decoding";
  Decoding(ReqInfo i, KvBlocks kv, std::int32_t n, std::int32_t in)
      : KvOwner(std::move(kv)), info(std::move(i)), kv_len(n), inflight(in) {}
  ReqInfo info;
  std::int32_t kv_len;
  std::int32_t inflight;  // decode steps dispatched, results outstanding
};

// Device KV given up: a host copy of it, or nothing (recompute on return).
struct Retracted {
  static constexpr const char* kName = "Retracted";
  ReqInfo info;
  HostCopy host;
};

// Host copy being brought back (copies in this step's plan).
struct Restoring : KvOwner {
  static constexpr const char* kName = "Restoring";
  Restoring(ReqInfo i, KvBlocks kv, HostCopy h, std::int32_t n)
      : KvOwner(std::move(kv)), info(std::move(i)), host(std::move(h)), kv_len(n) {}
  ReqInfo info;
  HostCopy host;  // read by this step's copies; released when the restore is done
  std::int32_t kv_len;
};

// Blocks are being committed to the prefix cache, then released.
struct Finishing : KvOwner {
  static constexpr const char* kName = "Finishing";
  Finishing(ReqInfo i, KvBlocks kv, std::int32_t n, FinishReason r)
      : KvOwner(std::move(kv)), info(std::move(i)), kv_len(n), reason(r) {}
  ReqInfo info;
  std::int32_t kv_len;
  FinishReason reason;
  KvBlocks take_kv() && { return std::move(kv_); }
};

struct Finished {
  static constexpr const char* kName = "Finished";
  ReqInfo info;
  FinishReason reason = FinishReason::None;
};

// KV being written by a remote prefill node (disaggregation).
struct RemoteFill : KvOwner {
  static constexpr const char* kName = "RemoteFill";
  RemoteFill(ReqInfo i, KvBlocks kv) : KvOwner(std::move(kv)), info(std::move(i)) {}
  ReqInfo info;
};

// Remote fill done, first token known; decodes from the next step.
struct Ready : KvOwner {
  static constexpr const char* kName = "Ready";
  Ready(ReqInfo i, KvBlocks kv, std::int32_t n) : KvOwner(std::move(kv)), info(std::move(i)), kv_len(n) {}
  ReqInfo info;
  std::int32_t kv_len;
};

using Phase = std::variant<Bootstrapping, Submitted, Prefetching, Prefilling, PrefillAwaitingResult, Decoding,
                           Retracted, Restoring, Finishing, Finished, RemoteFill, Ready>;

inline const ReqInfo& info_of(const Phase& s) {
  return std::visit([](const auto& x) -> const ReqInfo& { return x.info; }, s);
}
inline ReqInfo& info_of(Phase& s) {
  return std::visit([](auto& x) -> ReqInfo& { return x.info; }, s);
}
// The KV of a phase that holds some, or nullptr.
inline const KvBlocks* kv_of(const Phase& s) {
  return std::visit(
      [](const auto& x) -> const KvBlocks* {
        if constexpr (std::derived_from<std::decay_t<decltype(x)>, KvOwner>)
          return &x.kv();
        else
          return nullptr;
      },
      s);
}
inline const char* name_of(const Phase& s) {
  return std::visit([](const auto& x) { return std::decay_t<decltype(x)>::kName; }, s);
}

}  // namespace dz
