// Claim (a): a Decoding request's KV cannot be handed over; only Finishing gives it up.
#include "dayzero/transitions.h"

using namespace dz;

KvBlocks attempt() {
#ifdef DZ_MUST_FAIL
  Decoding d(ReqInfo{}, KvBlocks{}, 0, 0);
  return std::move(d).kv();  // kv() is a const view: moving out needs the deleted copy
#else
  Finishing f(ReqInfo{}, KvBlocks{}, 0, FinishReason::Stop);
  return std::move(f).take_kv();
#endif
}
