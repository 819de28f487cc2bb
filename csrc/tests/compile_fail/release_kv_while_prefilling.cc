// Claim (a): a Prefilling request's KV cannot be released; only Finishing gives it up.
#include "dayzero/transitions.h"

using namespace dz;

void attempt() {
#ifdef DZ_MUST_FAIL
  Prefilling p(ReqInfo{}, KvBlocks{}, 0);
  std::move(p.kv()).release();  // release() needs a mutable KvBlocks; kv() is const
#else
  Finishing f(ReqInfo{}, KvBlocks{}, 0, FinishReason::Stop);
  std::move(f).take_kv().release();
#endif
}
