// Claim (c): KV handles cannot be copied (only moved).
#include "dayzero/transitions.h"

using namespace dz;

void attempt() {
#if DZ_HANDLE == 1
  BlockTable a, b;
#elif DZ_HANDLE == 2
  Lease a, b;
#else
  KvBlocks a, b;
#endif
#ifdef DZ_MUST_FAIL
  b = a;
#else
  b = std::move(a);
#endif
}
