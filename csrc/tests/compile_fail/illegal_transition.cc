// Claim (d): an event has no overload for a phase it is not legal in.
#include "dayzero/transitions.h"

using namespace dz;

void attempt() {
#ifdef DZ_MUST_FAIL
#if DZ_CASE == 1
  Submitted s{ReqInfo{}};
  auto next = on(std::move(s), FirstToken{7});  // a waiting request has produced nothing
#elif DZ_CASE == 2
  Finished s{ReqInfo{}, FinishReason::Stop};
  auto next = on(std::move(s), Abort{});  // nothing left to abort
#else
  Prefilling s(ReqInfo{}, KvBlocks{}, 0);
  auto next = on(std::move(s), Release{});  // releasing skips Finishing
#endif
#else
  Decoding s(ReqInfo{}, KvBlocks{}, 0, 0);
  auto next = on(std::move(s), Finish{FinishReason::Stop});
#endif
  (void)next;
}
static_assert(!LegalTransition<Submitted, FirstToken>);
static_assert(LegalTransition<Decoding, Finish>);
