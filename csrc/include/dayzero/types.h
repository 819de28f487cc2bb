// Basic vocabulary of the control plane: ids, cache-group kinds, configuration.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace dz {

using BlockId = std::int32_t;  // a block of one cache group (group-local id)
using SlotId = std::int32_t;   // a fixed-size state slot
using PageId = std::int32_t;   // a physical page of the shared device pool
using ReqId = std::int64_t;    // the caller's request id
using TokenId = std::int32_t;

inline constexpr BlockId kNoBlock = -1;
inline constexpr SlotId kNoSlot = -1;
// An input token that the device fills in itself: the token sampled by the
// previous in-flight step (overlap mode) or a draft token (speculative decode).
inline constexpr TokenId kDeviceToken = -1;

// What one cache group stores.
//   Paged:         full history, one row per token (KV, MLA latent, indexer keys).
//   SlidingWindow: like Paged, but blocks that leave the window are released.
//   State:         one fixed-size slot per request (linear-attention / conv state).
enum class GroupKind : std::uint8_t { Paged, SlidingWindow, State };

struct CacheGroupSpec {
  std::string name;
  GroupKind kind = GroupKind::Paged;
  std::int64_t bytes_per_token = 0;  // Paged / SlidingWindow: one token's row, all layers
  std::int32_t window = 0;           // SlidingWindow: tokens a query may look back
  std::int64_t state_bytes = 0;      // State: one request's state, all layers
};

struct SchedulerConfig {
  std::int32_t block_size = 64;             // tokens per block, every paged group
  std::int64_t device_bytes = 0;            // byte budget for all groups together
  std::int64_t host_bytes = 0;              // host memory for retracted requests and demoted prefixes
  std::int32_t max_batch_size = 256;        // rows (requests) per step
  std::int32_t max_tokens_per_step = 8192;  // token budget per step
  std::int32_t chunk_size = 8192;           // largest prefill chunk of one request
  std::int32_t snapshot_slots = 0;          // state snapshots kept for prefix hits
  std::int32_t spec_tokens = 0;             // draft tokens reserved per decode row
  bool overlap = false;                     // plan step N+1 before N's results arrive
  bool prefix_cache = true;
  // The prefix cache's key chain starts from this secret (a random one per server), so no
  // crafted prompt can predict a block key; a hit also compares the block's tokens.
  std::uint64_t cache_salt_hi = 0;
  std::uint64_t cache_salt_lo = 0;
  std::vector<CacheGroupSpec> groups;
};

enum class FinishReason : std::uint8_t { None, Stop, Length, Abort };

// Raised for a caller error (bad config, unknown request, illegal event).
// Every call that raises leaves the scheduler unchanged.
struct SchedulerError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

}  // namespace dz
