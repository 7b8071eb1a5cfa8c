// parallel_layout.cpp — Megatron's rank groups (Note [Megatron's rank order]).
#include "actmem/parallel/parallel_layout.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <sstream>

namespace actmem {

namespace {
std::vector<int> prefix_product(const std::vector<int>& a) {
  std::vector<int> r{1};
  for (int v : a) r.push_back(r.back() * v);
  return r;
}

int inner_product(const std::vector<int>& a, const std::vector<int>& b) {
  int s = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) s += a[i] * b[i];
  return s;
}

// index = sum(idx[i] * stride[i]) with stride the prefix product of shape: the idx.
std::vector<int> decompose(int index, const std::vector<int>& shape) {
  const std::vector<int> stride = prefix_product(shape);
  std::vector<int> idx;
  for (size_t i = 0; i < shape.size(); ++i) idx.push_back((index / stride[i]) % shape[i]);
  return idx;
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, sep)) out.push_back(item);
  return out;
}
}  // namespace

std::vector<std::vector<int>> masked_orthogonal_rank_groups(int world_size,
                                                            const std::vector<int>& sizes,
                                                            const std::vector<bool>& mask) {
  TORCH_CHECK(sizes.size() == mask.size(), "actmem::masked_orthogonal_rank_groups: ", sizes.size(),
              " sizes but ", mask.size(), " mask entries");
  std::vector<int> masked_shape, unmasked_shape, masked_stride, unmasked_stride;
  const std::vector<int> global_stride = prefix_product(sizes);
  for (size_t i = 0; i < sizes.size(); ++i) {
    (mask[i] ? masked_shape : unmasked_shape).push_back(sizes[i]);
    (mask[i] ? masked_stride : unmasked_stride).push_back(global_stride[i]);
  }
  const int group_size = prefix_product(masked_shape).back();
  TORCH_CHECK(group_size > 0 && world_size % group_size == 0,
              "actmem::masked_orthogonal_rank_groups: world size ", world_size,
              " is not a multiple of the group size ", group_size);
  std::vector<std::vector<int>> groups;
  for (int g = 0; g < world_size / group_size; ++g) {
    const std::vector<int> group_idx = decompose(g, unmasked_shape);
    std::vector<int> ranks;
    for (int r = 0; r < group_size; ++r) {
      ranks.push_back(inner_product(decompose(r, masked_shape), masked_stride) +
                      inner_product(group_idx, unmasked_stride));
    }
    groups.push_back(std::move(ranks));
  }
  return groups;
}

RankGenerator::RankGenerator(int tp, int ep, int dp, int pp, int cp, const std::string& order)
    : world_size_(tp * ep * dp * pp * cp) {
  TORCH_CHECK(tp >= 1 && ep >= 1 && dp >= 1 && pp >= 1 && cp >= 1,
              "actmem::RankGenerator: every parallel size must be at least 1");
  TORCH_CHECK(ep == 1 || cp == 1,
              "actmem::RankGenerator: Both EP and CP > 1 in not allow in one "
              "rank generator. CP is only included in default RankGenerator, and EP only in "
              "expert RankGenerator.");
  const std::vector<std::pair<std::string, int>> known = {
      {"tp", tp}, {"pp", pp}, {"dp", dp}, {"ep", ep}, {"cp", cp}};
  std::string full = order;
  std::transform(full.begin(), full.end(), full.begin(), ::tolower);
  std::vector<std::string> names = split(full, '-');
  for (const auto& name : names) {
    TORCH_CHECK(
        std::any_of(known.begin(), known.end(), [&](const auto& k) { return k.first == name; }),
        "actmem::RankGenerator: unknown parallelism '", name, "' in order '", order,
        "' (tp, cp, ep, dp, pp)");
  }
  for (const auto& [name, size] : known) {
    if (std::find(names.begin(), names.end(), name) != names.end()) continue;
    TORCH_CHECK(size == 1, "actmem::RankGenerator: The size of (", name, ") is (", size,
                "), but you haven't specified the order (", order, ").");
    full += "-" + name;
    names.push_back(name);
  }
  order_ = full;
  names_ = names;
  for (const auto& n : names_) {
    sizes_.push_back(std::find_if(known.begin(), known.end(), [&](const auto& k) {
                       return k.first == n;
                     })->second);
  }
}

std::vector<std::vector<int>> RankGenerator::ranks(const std::string& token) const {
  std::vector<bool> mask(names_.size(), false);
  for (const auto& t : split(token, '-')) {
    const auto it = std::find(names_.begin(), names_.end(), t);
    TORCH_CHECK(it != names_.end(), "actmem::RankGenerator: unknown parallelism '", t, "' in '",
                token, "'");
    mask[static_cast<size_t>(it - names_.begin())] = true;
  }
  return masked_orthogonal_rank_groups(world_size_, sizes_, mask);
}

ParallelLayout ParallelLayout::make(int world, int tp, int pp, int ep, int etp, int cp,
                                    const std::string& order) {
  TORCH_CHECK(world >= 1 && tp >= 1 && pp >= 1 && ep >= 1 && etp >= 0 && cp >= 1,
              "actmem::ParallelLayout: sizes must be at least 1 (expert tensor size 0 = tp)");
  if (etp == 0) etp = tp;
  const int model = tp * pp * cp;
  // initialize_model_parallel's checks (megatron/core/parallel_state.py), its messages.
  TORCH_CHECK(world % model == 0, "actmem::ParallelLayout: world_size (", world,
              ") is not divisible by ", model, " (tensor ", tp, " x pipeline ", pp, " x context ",
              cp, ")");
  const int expert_model = etp * ep * pp;
  TORCH_CHECK(world % expert_model == 0, "actmem::ParallelLayout: world_size (", world,
              ") is not divisible by expert_tensor_model_pipeline_parallel size (", expert_model,
              ")");
  ParallelLayout l;
  l.world = world, l.tp = tp, l.pp = pp, l.cp = cp, l.dp = world / model;
  l.ep = ep, l.etp = etp, l.edp = world / expert_model;
  l.order = order;
  const RankGenerator dense(tp, 1, l.dp, pp, cp, order);
  const RankGenerator expert(etp, ep, l.edp, pp, 1, order);
  l.order = dense.order();
  TORCH_CHECK(dense.ranks("pp") == expert.ranks("pp"),
              "actmem::ParallelLayout: Pipeline parallel "
              "groups are expected to be the same for Non-Expert and Expert part");
  l.tp_groups = dense.ranks("tp");
  l.pp_groups = dense.ranks("pp");
  l.dp_groups = dense.ranks("dp");
  l.cp_groups = dense.ranks("cp");
  l.mp_groups = dense.ranks("tp-pp");
  l.ep_groups = expert.ranks("ep");
  l.etp_groups = expert.ranks("tp");
  l.edp_groups = expert.ranks("dp");
  l.tp_ep_groups = expert.ranks("tp-ep");
  for (const auto& g : l.pp_groups) {
    l.embedding_groups.push_back(g.size() == 1 ? g : std::vector<int>{g.front(), g.back()});
  }
  return l;
}

const std::vector<int>& ParallelLayout::group_of(const std::vector<std::vector<int>>& groups,
                                                 int rank) {
  for (const auto& g : groups) {
    if (std::find(g.begin(), g.end(), rank) != g.end()) return g;
  }
  TORCH_CHECK(false, "actmem::ParallelLayout: rank ", rank, " is in none of the groups");
}

int ParallelLayout::index_in(const std::vector<std::vector<int>>& groups, int rank) {
  const auto& g = group_of(groups, rank);
  return static_cast<int>(std::find(g.begin(), g.end(), rank) - g.begin());
}

int ParallelLayout::group_index(const std::vector<std::vector<int>>& groups, int rank) {
  const auto& g = group_of(groups, rank);
  return static_cast<int>(&g - groups.data());
}

std::string ParallelLayout::describe() const {
  std::ostringstream os;
  auto groups = [&os](const char* name, const std::vector<std::vector<int>>& gs) {
    os << "  " << name << " [";
    for (size_t i = 0; i < gs.size(); ++i) {
      os << (i ? ", " : "") << "[";
      for (size_t j = 0; j < gs[i].size(); ++j) os << (j ? ", " : "") << gs[i][j];
      os << "]";
    }
    os << "]\n";
  };
  os << "world " << world << " = tp " << tp << " x cp " << cp << " x dp " << dp << " x pp " << pp
     << " (experts: etp " << etp << " x ep " << ep << " x edp " << edp << " x pp " << pp
     << "), order " << order << "\n";
  groups("tp       ", tp_groups);
  groups("cp       ", cp_groups);
  groups("dp       ", dp_groups);
  groups("pp       ", pp_groups);
  groups("tp-pp    ", mp_groups);
  groups("embedding", embedding_groups);
  groups("ep       ", ep_groups);
  groups("expert tp", etp_groups);
  groups("expert dp", edp_groups);
  return os.str();
}

}  // namespace actmem
