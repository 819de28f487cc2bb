// Claim (a): the handover used by the legal transitions is closed to other code.
#include "dayzero/transitions.h"

using namespace dz;

void attempt() {
  Decoding d(ReqInfo{}, KvBlocks{}, 0, 0);
#ifdef DZ_MUST_FAIL
  KvBlocks stolen = KvHandover::take(d);  // private: only the listed transitions may call it
#else
  Finishing f = on(std::move(d), Finish{FinishReason::Stop});  // the legal way out
  (void)f;
#endif
}
