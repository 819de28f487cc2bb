// Events and the legal transitions between phases.
//
// A transition is an overload `on(Phase&&, Event) -> NextPhase`: it consumes the
// old phase and returns the new one. There is no generic overload: a pair that is
// not listed here does not compile. apply() dispatches an event that arrives at
// run time; for an illegal pair it raises SchedulerError naming the request, the
// event and the phase, and leaves the request as it was.
//
//   Bootstrapping --BootstrapDone--> Submitted
//   Submitted     --Admit--> Prefilling | --AdmitFromHost--> Prefetching | --AdmitRemote--> RemoteFill
//   Prefetching   --PrefetchDone--> Prefilling
//   Prefilling    --LastChunk--> PrefillAwaitingResult          --Retract--> Retracted
//   PrefillAwaitingResult --FirstToken--> Decoding
//   Decoding      --Finish--> Finishing                          --Retract--> Retracted
//   Retracted     --Restore--> Restoring | --Recompute--> Prefilling
//   Restoring     --RestoreDone--> Decoding
//   Finishing     --Release--> Finished
//   RemoteFill    --RemoteFillDone--> Ready --StartDecode--> Decoding
//   any phase but Finishing/Finished --Abort--> Finishing (holds KV) or Finished (holds none)
#pragma once

#include <string>
#include <type_traits>
#include <utility>

#include "dayzero/phases.h"

namespace dz {

struct BootstrapDone {
  static constexpr const char* kName = "BootstrapDone";
};
struct Admit {
  static constexpr const char* kName = "Admit";
  KvBlocks kv;
  std::int32_t cached = 0;
};
struct AdmitFromHost {
  static constexpr const char* kName = "AdmitFromHost";
  KvBlocks kv;
  std::int32_t cached = 0;
};
struct AdmitRemote {
  static constexpr const char* kName = "AdmitRemote";
  KvBlocks kv;
};
struct PrefetchDone {
  static constexpr const char* kName = "PrefetchDone";
};
struct LastChunk {
  static constexpr const char* kName = "LastChunk";
};
struct FirstToken {
  static constexpr const char* kName = "FirstToken";
  TokenId token = 0;
};
struct Finish {
  static constexpr const char* kName = "Finish";
  FinishReason reason = FinishReason::Stop;
};
struct Retract {
  static constexpr const char* kName = "Retract";
  HostCopy host;
};
struct Restore {
  static constexpr const char* kName = "Restore";
  KvBlocks kv;
};
struct Recompute {
  static constexpr const char* kName = "Recompute";
  KvBlocks kv;
  std::int32_t cached = 0;
};
struct RestoreDone {
  static constexpr const char* kName = "RestoreDone";
};
struct Release {
  static constexpr const char* kName = "Release";
};
struct RemoteFillDone {
  static constexpr const char* kName = "RemoteFillDone";
  TokenId token = 0;
};
struct StartDecode {
  static constexpr const char* kName = "StartDecode";
};
struct Abort {
  static constexpr const char* kName = "Abort";
};

// The only way KV leaves a KvOwner phase: these transitions, and no other code.
class KvHandover {
  static KvBlocks take(KvOwner& s) { return std::move(s.kv_); }

  friend PrefillAwaitingResult on(Prefilling&&, LastChunk);
  friend Retracted on(Prefilling&&, Retract);
  friend Prefilling on(Prefetching&&, PrefetchDone);
  friend Decoding on(PrefillAwaitingResult&&, FirstToken);
  friend Finishing on(Decoding&&, Finish);
  friend Retracted on(Decoding&&, Retract);
  friend Decoding on(Restoring&&, RestoreDone);
  friend Ready on(RemoteFill&&, RemoteFillDone);
  friend Decoding on(Ready&&, StartDecode);
  friend Finishing on(Prefetching&&, Abort);
  friend Finishing on(Prefilling&&, Abort);
  friend Finishing on(PrefillAwaitingResult&&, Abort);
  friend Finishing on(Decoding&&, Abort);
  friend Finishing on(Restoring&&, Abort);
  friend Finishing on(RemoteFill&&, Abort);
  friend Finishing on(Ready&&, Abort);
};

inline Submitted on(Bootstrapping&& s, BootstrapDone) { return {std::move(s.info)}; }
inline Prefilling on(Submitted&& s, Admit e) {
  s.info.cached = e.cached;
  return {std::move(s.info), std::move(e.kv), e.cached};
}
inline Prefetching on(Submitted&& s, AdmitFromHost e) {
  s.info.cached = e.cached;
  return {std::move(s.info), std::move(e.kv), e.cached};
}
inline RemoteFill on(Submitted&& s, AdmitRemote e) { return {std::move(s.info), std::move(e.kv)}; }
inline Prefilling on(Prefetching&& s, PrefetchDone) { return {std::move(s.info), KvHandover::take(s), s.kv_len}; }
inline PrefillAwaitingResult on(Prefilling&& s, LastChunk) {
  return {std::move(s.info), KvHandover::take(s), s.kv_len, s.inflight};
}
inline Retracted on(Prefilling&& s, Retract e) {
  KvHandover::take(s);  // released here: the host copy (if any) was logged from kv()
  return {std::move(s.info), std::move(e.host)};
}
inline Decoding on(PrefillAwaitingResult&& s, FirstToken e) {
  s.info.tokens.push_back(e.token);
  return {std::move(s.info), KvHandover::take(s), s.kv_len, s.inflight - 1};
}
inline Finishing on(Decoding&& s, Finish e) { return {std::move(s.info), KvHandover::take(s), s.kv_len, e.reason}; }
inline Retracted on(Decoding&& s, Retract e) {
  KvHandover::take(s);
  return {std::move(s.info), std::move(e.host)};
}
inline Restoring on(Retracted&& s, Restore e) {
  const std::int32_t n = s.host.tokens;
  return {std::move(s.info), std::move(e.kv), std::move(s.host), n};
}
inline Prefilling on(Retracted&& s, Recompute e) { return {std::move(s.info), std::move(e.kv), e.cached}; }
inline Decoding on(Restoring&& s, RestoreDone) { return {std::move(s.info), KvHandover::take(s), s.kv_len, 0}; }
inline Finished on(Finishing&& s, Release) {
  std::move(s).take_kv().release();
  return {std::move(s.info), s.reason};
}
inline Ready on(RemoteFill&& s, RemoteFillDone e) {
  const std::int32_t n = s.info.len();
  s.info.tokens.push_back(e.token);
  return {std::move(s.info), KvHandover::take(s), n};
}
inline Decoding on(Ready&& s, StartDecode) { return {std::move(s.info), KvHandover::take(s), s.kv_len, 0}; }

// Abort: phases without KV finish at once; phases with KV go through Finishing.
inline Finished on(Bootstrapping&& s, Abort) { return {std::move(s.info), FinishReason::Abort}; }
inline Finished on(Submitted&& s, Abort) { return {std::move(s.info), FinishReason::Abort}; }
inline Finished on(Retracted&& s, Abort) { return {std::move(s.info), FinishReason::Abort}; }
inline Finishing on(Prefetching&& s, Abort) {
  return {std::move(s.info), KvHandover::take(s), s.kv_len, FinishReason::Abort};
}
inline Finishing on(Prefilling&& s, Abort) {
  return {std::move(s.info), KvHandover::take(s), s.kv_len, FinishReason::Abort};
}
inline Finishing on(PrefillAwaitingResult&& s, Abort) {
  return {std::move(s.info), KvHandover::take(s), s.kv_len, FinishReason::Abort};
}
inline Finishing on(Decoding&& s, Abort) {
  return {std::move(s.info), KvHandover::take(s), s.kv_len, FinishReason::Abort};
}
inline Finishing on(Restoring&& s, Abort) {
  return {std::move(s.info), KvHandover::take(s), s.kv_len, FinishReason::Abort};
}
inline Finishing on(RemoteFill&& s, Abort) { return {std::move(s.info), KvHandover::take(s), 0, FinishReason::Abort}; }
inline Finishing on(Ready&& s, Abort) {
  return {std::move(s.info), KvHandover::take(s), s.kv_len, FinishReason::Abort};
}

template <class S, class E>
concept LegalTransition = requires(S&& s, E&& e) {
  on(std::move(s), std::move(e));
};

// Applies a run-time event to whatever phase `phase` is in.
template <class E>
void apply(ReqId id, Phase& phase, E&& event) {
  std::visit(
      [&]<class S>(S& s) {
        if constexpr (LegalTransition<S, std::decay_t<E>>) {
          phase = on(std::move(s), std::forward<E>(event));
        } else {
          throw SchedulerError("request " + std::to_string(id) + ": event " + std::decay_t<E>::kName +
                               " is not legal in phase " + S::kName);
        }
      },
      phase);
}

}  // namespace dz
