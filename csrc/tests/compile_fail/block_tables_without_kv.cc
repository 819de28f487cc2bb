// Claim (b): phases that own no KV have no accessor for block tables.
#include "dayzero/transitions.h"

using namespace dz;

std::size_t attempt() {
#ifdef DZ_MUST_FAIL
#if DZ_PHASE == 1
  Submitted s{ReqInfo{}};
#elif DZ_PHASE == 2
  Retracted s{ReqInfo{}, HostCopy{}};
#else
  Finished s{ReqInfo{}, FinishReason::Stop};
#endif
  return s.kv().tables().size();
#else
  Decoding s(ReqInfo{}, KvBlocks{}, 0, 0);
  return s.kv().tables().size();
#endif
}
