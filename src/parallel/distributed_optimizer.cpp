// distributed_optimizer.cpp — OptimizerShards: Megatron's buffer layout with the distributed
// optimizer and the all-gather of the updated pieces (Note [Distributed optimizer]).
#include "actmem/parallel/distributed_optimizer.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <numeric>

namespace actmem {

namespace {
int64_t round_up(int64_t value, int64_t divisor) {
  return (value + divisor - 1) / divisor * divisor;
}
}  // namespace

OptimizerShards::OptimizerShards(const std::vector<at::Tensor>& params, std::vector<Group> groups,
                                 std::optional<int64_t> bucket_size, int64_t own_bucket)
    : ranges_(params.size(), {0, 0}), numel_(params.size(), 0) {
  TORCH_CHECK(!bucket_size || *bucket_size > 0,
              "actmem::OptimizerShards: bucket_size must be "
              "positive, got ",
              bucket_size.value_or(0));
  std::vector<bool> seen(params.size(), false);
  for (const auto& g : groups) {
    TORCH_CHECK(g.group != nullptr && g.group->size >= 1,
                "actmem::OptimizerShards: each group "
                "needs a process group");
    const int64_t d = g.group->size;
    // Megatron's pad_bucket_end: a multiple of lcm(d, 128), so d pieces of equal size.
    const int64_t divisor = std::lcm(d, int64_t{128});
    int64_t bucket_start = 0, param_start = 0, param_end = 0;
    Bucket bucket;
    bucket.group = g.group;
    auto finalize = [&](int64_t end) {
      bucket.size = round_up(end, divisor) - bucket_start;
      for (auto& m : bucket.members) m.offset -= bucket_start;
      buckets_.push_back(std::move(bucket));
      bucket = Bucket{};
      bucket.group = g.group;
      bucket_start += buckets_.back().size;
      return bucket_start;
    };
    for (size_t k = g.params.size(); k-- > 0;) {
      const size_t i = g.params[k];
      TORCH_CHECK(i < params.size() && !seen[i], "actmem::OptimizerShards: parameter index ", i,
                  " is out of range or in two groups");
      seen[i] = true;
      TORCH_CHECK(params[i].is_contiguous(), "actmem::OptimizerShards: parameter ", i,
                  " is not contiguous");
      const bool alone = static_cast<int64_t>(i) == own_bucket;
      param_start = round_up(param_start, 64);  // Megatron's pad_param_start
      if (alone && !bucket.members.empty()) param_start = finalize(param_start);
      param_end = param_start + params[i].numel();
      bucket.members.push_back({i, param_start});
      numel_[i] = params[i].numel();
      if ((bucket_size && param_end - bucket_start >= *bucket_size) || alone) {
        param_start = finalize(param_end);
      } else {
        param_start = param_end;
      }
    }
    if (!bucket.members.empty()) finalize(param_end);
  }
  // This rank's piece of each bucket, cut into its parameters' ranges.
  for (const auto& b : buckets_) {
    const int64_t piece = b.size / b.group->size;
    const int64_t lo = b.group->rank * piece, hi = lo + piece;
    for (const auto& m : b.members) {
      const int64_t first = std::max(lo, m.offset), last = std::min(hi, m.offset + numel_[m.param]);
      if (first < last) ranges_[m.param] = {first - m.offset, last - m.offset};
      owned_ += std::max<int64_t>(0, last - first);
      total_ += numel_[m.param];
    }
  }
  for (size_t i = 0; i < params.size(); ++i) {
    TORCH_CHECK(seen[i], "actmem::OptimizerShards: parameter ", i, " is in no group");
  }
}

at::Tensor OptimizerShards::shard(const at::Tensor& full, size_t i) const {
  TORCH_CHECK(i < ranges_.size() && full.numel() == numel_[i] && full.is_contiguous(),
              "actmem::OptimizerShards::shard: expected a contiguous tensor of parameter ", i,
              "'s ", i < numel_.size() ? numel_[i] : 0, " elements, got ", full.sizes());
  return full.view({-1}).narrow(0, ranges_[i].first, ranges_[i].second - ranges_[i].first);
}

void OptimizerShards::all_gather(const std::vector<at::Tensor>& tensors) const {
  TORCH_CHECK(tensors.size() == ranges_.size(), "actmem::OptimizerShards::all_gather: expected ",
              ranges_.size(), " tensors (one per parameter), got ", tensors.size());
  at::NoGradGuard no_grad;
  for (const auto& b : buckets_) {
    if (b.group->size == 1) continue;  // this rank owns everything
    const at::Tensor& first = tensors[b.members.front().param];
    const int64_t piece = b.size / b.group->size;
    const int64_t lo = b.group->rank * piece;
    at::Tensor mine = at::zeros({piece}, first.options());
    for (const auto& m : b.members) {
      const at::Tensor& t = tensors[m.param];
      TORCH_CHECK(t.numel() == numel_[m.param] && t.is_contiguous() &&
                      t.scalar_type() == first.scalar_type(),
                  "actmem::OptimizerShards::all_gather: tensor ", m.param,
                  " should be a "
                  "contiguous ",
                  first.scalar_type(), " tensor of ", numel_[m.param], " elements, got ",
                  t.scalar_type(), " ", t.sizes());
      const auto [begin, end] = ranges_[m.param];
      if (begin < end) mine.narrow(0, m.offset + begin - lo, end - begin).copy_(shard(t, m.param));
    }
    const at::Tensor whole = group_all_gather_dim0(*b.group, mine);
    for (const auto& m : b.members) {
      tensors[m.param].view({-1}).copy_(whole.narrow(0, m.offset, numel_[m.param]));
    }
  }
}

}  // namespace actmem
