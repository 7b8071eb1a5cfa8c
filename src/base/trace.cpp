// trace.cpp — TraceRecorder.
#include "actmem/base/trace.h"

#include "actmem/base/output_file.h"

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <atomic>
#include <map>

namespace actmem {

namespace {
std::atomic<TraceRecorder*> g_active{nullptr};
}

TraceRecorder::TraceRecorder() : origin_(std::chrono::steady_clock::now()) {}

void TraceRecorder::span(const std::string& track, const std::string& name,
                         std::chrono::steady_clock::time_point t0,
                         std::chrono::steady_clock::time_point t1, const std::string& args_json) {
  const double ts = std::chrono::duration<double, std::micro>(t0 - origin_).count();
  const double dur = std::chrono::duration<double, std::micro>(t1 - t0).count();
  std::lock_guard<std::mutex> lock(mutex_);
  events_.push_back({track, name, args_json, ts, dur});
}

size_t TraceRecorder::size() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return events_.size();
}

std::string TraceRecorder::json() const {
  nlohmann::json events = nlohmann::json::array();
  std::map<std::string, int> tids;
  std::lock_guard<std::mutex> lock(mutex_);
  for (const auto& e : events_) {
    const auto it = tids.emplace(e.track, static_cast<int>(tids.size()) + 1).first;
    events.push_back({{"name", e.name},
                      {"cat", e.track},
                      {"ph", "X"},
                      {"ts", e.ts_us},
                      {"dur", e.dur_us},
                      {"pid", 1},
                      {"tid", it->second},
                      {"args", nlohmann::json::parse(e.args)}});
  }
  for (const auto& [track, tid] : tids) {
    events.push_back({{"name", "thread_name"},
                      {"ph", "M"},
                      {"pid", 1},
                      {"tid", tid},
                      {"args", {{"name", track}}}});
  }
  return nlohmann::json{{"traceEvents", events}, {"displayTimeUnit", "ms"}}.dump() + "\n";
}

void TraceRecorder::write(const std::string& path) const {
  OutputFile file({"--trace", path});
  file.write(json());
  file.close();
}

TraceRecorder* active_trace() {
  return g_active.load();
}

TraceScope::TraceScope(TraceRecorder& recorder) : previous_(g_active.exchange(&recorder)) {}
TraceScope::~TraceScope() {
  g_active.store(previous_);
}

}  // namespace actmem
