// plot.h — SVG plots, plain SVG 1.1 without scripts (any browser opens them): the memory timeline
// (device bytes through forward and backward, one line per strategy, layer boundaries marked)
// and the pipeline schedule (each stage's forwards and backwards on one time axis).
#pragma once

#include "actmem/base/pipeline_event.h"
#include "actmem/memory/memory_tracker.h"

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
std::string memory_timeline_svg(const std::vector<TimelineSeries>& series,
                                const std::string& title);

/// One strategy of a plan (planner.h) as plan_front_svg draws it.
struct PlanPoint {
  std::string name;
  double peak_bytes = 0;
  double step_ratio = 1;
  bool on_front = false;
  bool standard = false;  // one of Megatron's standard settings: labelled
  bool chosen = false;
};

/// Every strategy as a dot (predicted step ratio across, device peak up), the Pareto front as a
/// line, the standard settings labelled, the budget (when > 0) as a horizontal line and the
/// chosen strategy ringed. Every dot is a <circle> with data-name, data-peak-bytes,
/// data-step-ratio and data-front attributes, so tools and tests can read the plot.
std::string plan_front_svg(const std::vector<PlanPoint>& points, double budget_bytes,
                           const std::string& title);

/// One row per stage (stage order), one box per forward (F) or backward (B), the micro-batch's
/// number inside; each row's caption gives the stage's busy share of the step and the most
/// micro-batches it held at once. Every box is a <rect> with data-stage, data-op and
/// data-microbatch attributes, so tools and tests can read the plot.
std::string pipeline_schedule_svg(const std::vector<std::vector<PipelineEvent>>& stages,
                                  const std::string& title);

/// One curve of line_chart_svg: points (x[i], y[i]).
struct CurveSeries {
  std::string name;
  std::vector<double> x, y;
};
/// Curves on shared linear axes (from 0 across; up from just below the smallest y), one colour
/// each with a legend: loss curves (bench_precision). Every curve is a <polyline> with a
/// data-name attribute, so tools and tests can read the plot.
std::string line_chart_svg(const std::vector<CurveSeries>& series, const std::string& title,
                           const std::string& x_label, const std::string& y_label);
}  // namespace actmem
