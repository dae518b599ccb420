// The CPU backend's workers: one persistent pool shared by every CPU kernel of the process.
#pragma once

#include <cstdint>
#include <functional>

namespace ringattn::detail {

// Calls body(i) for every i in [0, count), spread over the pool's threads and the caller.
// Returns when all calls have returned; rethrows the first exception a call threw. A call from
// inside a body runs serially, so kernels may nest without deadlock.
void parallel_for(std::int64_t count, const std::function<void(std::int64_t)>& body);

}  // namespace ringattn::detail
