// report.h — how numbers are shown to people: byte counts, medians, Megatron's offload summary.
// One place, so every command and benchmark prints the same units the same way.
#pragma once

#include <iosfwd>
#include <string>
#include <vector>

namespace actmem {

/// "12.3 MiB": binary units, two decimals below 10, one above.
std::string format_bytes(double bytes);
/// "512 MiB", "3.03 GiB": binary units from MiB up, three significant digits (the paper-scale
/// numbers of `actmem estimate`).
std::string format_bytes_3sig(double bytes);

/// "42s", "3m05s", "2h07m": a duration for progress lines (ETA), rounded to the second.
std::string format_duration(double seconds);

/// The q-quantile (0 <= q <= 1) of a non-empty sample, linear between the order statistics.
double quantile(std::vector<double> values, double q);

/// Median of a non-empty sample: quantile 0.5 (the mean of the middle two for an even count).
double median(std::vector<double> values);

/// Standard error of the median of a sample of independent draws, from its interquartile range
/// as for a normal distribution: sqrt(pi / 2) * (IQR / 1.349) / sqrt(n). Infinite below three
/// values (no spread to judge by).
double median_standard_error(const std::vector<double>& values);

/// One row of Megatron's "Activation Offload Summary (MB)": bytes offloaded per group name in
/// the warmup step, after the margin rule.
struct OffloadSummaryRow {
  std::string name;
  int64_t bytes = 0;
  int64_t tensors = 0;
};
/// One rank's rows, labelled ("0"; under pipeline or tensor parallelism "pp1 tp0").
struct OffloadSummaryRank {
  std::string label;
  std::vector<OffloadSummaryRow> rows;
};
/// Megatron's post-warmup table: a row per rank, a column per group name (in the order the
/// names first appear), and the rank's total.
void print_offload_summary(std::ostream& os, const std::vector<OffloadSummaryRank>& ranks);

}  // namespace actmem
