// plot.h — an SVG memory-timeline plot: device bytes through forward and backward, one line per
// strategy, layer boundaries marked. Plain SVG 1.1, no scripts; opens in any browser.
#pragma once

#include "actmem/memory_tracker.h"

#include <string>
#include <vector>

namespace actmem {

struct TimelineSeries {
  std::string name;
  std::vector<MemoryTimeline::Entry> entries;  // marks of one step (first = "fwd start")
  int64_t peak_bytes = 0;                      // activation peak of the step, for the legend
};

/// Bytes are drawn relative to each series' first entry (what the step added). Every <g> of a
/// series carries data-name and data-peak-bytes attributes so tools and tests can read the plot.
std::string memory_timeline_svg(const std::vector<TimelineSeries>& series, const std::string& title);

}  // namespace actmem
