// Small builders shared by the C++ tests.
#pragma once

#include <map>
#include <numeric>
#include <vector>

#include "dayzero/scheduler.h"

namespace dz::test {

// One paged group of 1 byte per token: device_bytes counts tokens.
inline SchedulerConfig paged(std::int32_t pages, std::int32_t block = 4, std::int32_t host_pages = 0) {
  SchedulerConfig c;
  c.block_size = block;
  c.groups = {{"kv", GroupKind::Paged, 1, 0, 0}};
  c.device_bytes = static_cast<std::int64_t>(pages) * block;
  c.host_bytes = static_cast<std::int64_t>(host_pages) * block;
  c.max_batch_size = 8;
  c.max_tokens_per_step = 64;
  c.chunk_size = 64;
  return c;
}

inline std::vector<TokenId> seq(std::int32_t n, TokenId first = 1) {
  std::vector<TokenId> v(static_cast<std::size_t>(n));
  std::iota(v.begin(), v.end(), first);
  return v;
}

// Answers every sampling row of the oldest plan with `token`.
inline void answer(Scheduler& s, const Plan& p, TokenId token = 7) {
  std::vector<std::int32_t> counts(p.sample.begin(), p.sample.end());
  std::vector<TokenId> toks(static_cast<std::size_t>(std::accumulate(counts.begin(), counts.end(), 0)), token);
  s.feed(p.req_ids, counts, toks);
}

// Runs step + answer until no request is live (or the step limit is hit).
inline int drain(Scheduler& s, int limit = 10000) {
  int steps = 0;
  while (s.live() > 0 && steps < limit) {
    auto p = s.step();
    if (p->rows() > 0) answer(s, *p);
    s.check_invariants();
    ++steps;
  }
  return steps;
}

}  // namespace dz::test
