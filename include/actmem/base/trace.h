// trace.h — a Chrome-trace recorder (opens in Perfetto or chrome://tracing): spans on named
// tracks (compute, the d2h and h2d copy streams) for the iteration being traced.
#pragma once

#include <chrono>
#include <mutex>
#include <string>
#include <vector>

namespace actmem {

/// Seconds of the steady clock since `t0`.
inline double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

class TraceRecorder {
 public:
  TraceRecorder();
  /// Records a complete span on `track` (e.g. "compute", "d2h", "h2d").
  void span(const std::string& track, const std::string& name,
            std::chrono::steady_clock::time_point t0, std::chrono::steady_clock::time_point t1,
            const std::string& args_json = "{}");
  /// The trace as Chrome's JSON: {"traceEvents": [...]} and a newline.
  std::string json() const;
  /// Writes json() to `path`; throws when the file cannot be written completely.
  void write(const std::string& path) const;
  size_t size() const;

 private:
  struct Event {
    std::string track, name, args;
    double ts_us, dur_us;
  };
  std::chrono::steady_clock::time_point origin_;
  mutable std::mutex mutex_;
  std::vector<Event> events_;
};

/// The recorder spans go to while a TraceScope is alive (process-wide; nullptr otherwise).
TraceRecorder* active_trace();
class TraceScope {
 public:
  explicit TraceScope(TraceRecorder& recorder);
  ~TraceScope();
  TraceScope(const TraceScope&) = delete;
  TraceScope& operator=(const TraceScope&) = delete;

 private:
  TraceRecorder* previous_;
};

}  // namespace actmem
