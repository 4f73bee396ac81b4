// The host's wait for a word the device writes into mapped host memory (a dispatch's received count).
#pragma once

#include <chrono>
#include <thread>

namespace ep_plugin {

// The wait's end is on the GPU's critical path (the dispatch launches after the count arrives), and a
// sleep overshoots by the kernel's timer slack (tens of us on Linux). So a wait spins for as long as a
// GPU queue ahead of it plausibly lasts, and yields its core between polls only after that (a late peer).
constexpr std::chrono::milliseconds kHostSpinOnly{50};

// Between two polls of a wait that began at `start`; `now` is the caller's clock reading.
inline void yield_if_waiting_long(std::chrono::steady_clock::time_point start,
                                  std::chrono::steady_clock::time_point now) {
  if (now - start > kHostSpinOnly) std::this_thread::sleep_for(std::chrono::microseconds(20));
}

}  // namespace ep_plugin
