// One step's work, as flat arrays (the Python boundary exposes them as numpy views).
//
// The executor runs, in order: copies.to_host*, copies.to_device*, copies.restore*,
// the forward pass over the rows, then copies.snapshot*. A row is one request:
// num_tokens[i] tokens at positions [kv_lens[i] - num_tokens[i], kv_lens[i]),
// input_ids[query_start[i] : query_start[i + 1]]. An input id of -1 is filled on
// the device (overlap: last step's sampled token; speculative: a draft token).
// A prefill row that starts at position 0 starts from a zero state.
#pragma once

#include <cstdint>
#include <vector>

#include "dayzero/prefix_cache.h"
#include "dayzero/types.h"

namespace dz {

struct Plan {
  std::int64_t step = 0;
  // rows
  std::vector<ReqId> req_ids;
  std::vector<std::int32_t> req_slots;  // stable per-request index in [0, capacity)
  std::vector<std::int32_t> num_tokens;
  std::vector<std::int32_t> query_start;  // size rows + 1
  std::vector<std::int32_t> kv_lens;      // KV length once this step has run
  std::vector<std::uint8_t> is_prefill;
  std::vector<std::uint8_t> sample;       // the row yields tokens this step
  std::vector<std::int32_t> state_slots;  // -1 without State groups
  std::vector<TokenId> input_ids;
  std::vector<std::int32_t> positions;
  // per paged group: [rows, width] row-major, padded with -1 (State groups: width 0)
  std::vector<std::vector<std::int32_t>> block_tables;
  std::vector<std::int32_t> block_table_width;
  CopyOps copies;
  // what happened since the last plan
  std::vector<ReqId> finished_ids;
  std::vector<std::int32_t> finished_reasons;  // FinishReason
  std::vector<ReqId> retracted_ids;
  std::vector<ReqId> remote_fill_ids;  // blocks allocated; the remote node may write them now

  std::int32_t rows() const { return static_cast<std::int32_t>(req_ids.size()); }
  std::int32_t tokens() const { return static_cast<std::int32_t>(input_ids.size()); }
};

}  // namespace dz
