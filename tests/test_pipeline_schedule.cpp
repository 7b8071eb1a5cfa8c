// test_pipeline_schedule.cpp — the interleaved 1F1B schedule as data (pipeline.h), without
// processes: Megatron's documented schedule tables, its warmup and orders, every rank's steps run
// together against a rendezvous model of the point-to-point messages (no deadlock, every tensor
// reaches the step that consumes it), and the memory count against Korthikanti's first stage.
#include "actmem/parallel/pipeline.h"

#include "test_util.h"

#include <gtest/gtest.h>

#include <deque>
#include <map>
#include <optional>
#include <set>
#include <tuple>
#include <vector>

namespace {

using actmem::PipelineStep;
using Kind = PipelineStep::Kind;

TEST(InterleavedSchedule, TableMatchesMegatronsDocumentedExamples) {
  // The examples in Megatron's ModelParallelConfig.microbatch_group_size_per_vp_stage docstring
  // and in forward_backward_pipelining_with_interleaving's comment (PP2 N3 M5 with VP2).
  auto row = [](const std::vector<std::pair<int64_t, int64_t>>& t, bool chunk) {
    std::vector<int64_t> out;
    for (const auto& [m, c] : t) out.push_back(chunk ? c : m);
    return out;
  };
  const auto n3 = actmem::interleaved_schedule_table(5, 2, 3);
  EXPECT_EQ(row(n3, false), (std::vector<int64_t>{0, 1, 2, 0, 1, 2, 3, 4, 3, 4}));
  EXPECT_EQ(row(n3, true), (std::vector<int64_t>{0, 0, 0, 1, 1, 1, 0, 0, 1, 1}));
  const auto n2 = actmem::interleaved_schedule_table(4, 2, 2);
  EXPECT_EQ(row(n2, false), (std::vector<int64_t>{0, 1, 0, 1, 2, 3, 2, 3}));
}

TEST(InterleavedSchedule, MicroBatchRulesFollowMegatron) {
  actmem::testing::expect_error_containing([] { actmem::check_interleaved_microbatches(4, 2, 4); },
                                           "should range in [PP=4 , M=2]");
  actmem::testing::expect_error_containing([] { actmem::check_interleaved_microbatches(4, 8, 3); },
                                           "should range in [PP=4 , M=8]");
  // 6 micro-batches in groups of 4: a last group of 2 < p.
  actmem::testing::expect_error_containing(
      [] { actmem::check_interleaved_microbatches(4, 6, 4); },
      "should be 0, or larger than or equal to the pipeline-parallel size, but it is 2");
  actmem::check_interleaved_microbatches(4, 8, 4);
  actmem::check_interleaved_microbatches(2, 5, 3);  // a last group of 2 = p
  actmem::check_interleaved_microbatches(3, 7, 4);  // a last group of 3 = p
}

struct ScheduleCase {
  int64_t p, v, m, n;
};

std::vector<ScheduleCase> sweep() {
  std::vector<ScheduleCase> out;
  for (int64_t p : {2, 3, 4}) {
    for (int64_t v : {2, 3}) {
      for (int64_t m : {p, 2 * p, 2 * p + p / 2 + 1, 3 * p}) {
        for (int64_t n : {p, p + 1}) {
          if (n > m) continue;
          const int64_t last = m % n;
          if (last > 0 && last < p) continue;
          out.push_back({p, v, m, n});
        }
      }
    }
  }
  return out;
}

std::string describe(const ScheduleCase& k) {
  return "p " + std::to_string(k.p) + " v " + std::to_string(k.v) + " M " + std::to_string(k.m) +
         " N " + std::to_string(k.n);
}

TEST(InterleavedSchedule, WarmupAndOrdersFollowMegatron) {
  // Rank r runs W = min(2 (p - r - 1) + (v - 1) N, M v) warmup forwards, and the steady state
  // begins with a forward, so min(W + 1, M v) forwards come before its first backward; its
  // forwards follow the table, its backwards the table with the chunks mirrored, each
  // (micro-batch, chunk) once.
  for (const ScheduleCase& k : sweep()) {
    const auto table = actmem::interleaved_schedule_table(k.m, k.v, k.n);
    for (int64_t r = 0; r < k.p; ++r) {
      const auto steps = actmem::interleaved_schedule(r, k.p, k.v, k.m, k.n);
      std::vector<std::pair<int64_t, int64_t>> fwd, bwd;
      int64_t before_first_backward = -1;
      for (const auto& s : steps) {
        if (s.kind == Kind::kForward) fwd.emplace_back(s.microbatch, s.chunk);
        if (s.kind == Kind::kBackward) {
          if (before_first_backward < 0) before_first_backward = static_cast<int64_t>(fwd.size());
          bwd.emplace_back(s.microbatch, k.v - 1 - s.chunk);
        }
      }
      const std::string what = describe(k) + " rank " + std::to_string(r);
      EXPECT_EQ(fwd, table) << what;
      EXPECT_EQ(bwd, table) << what;
      EXPECT_EQ(before_first_backward, std::min(2 * (k.p - r - 1) + (k.v - 1) * k.n + 1, k.m * k.v))
          << what;
    }
  }
}

// Every rank's steps run together. A message is a rendezvous (Gloo's unbound-buffer send
// completes once the receiver posted the matching receive, and a receive once the send was
// posted); messages on one link and direction match in the order they were posted. An exchange
// completes when all of its messages can; a rank blocks on its exchange until then.
struct Payload {
  int64_t rank, microbatch, chunk;
  bool operator==(const Payload& o) const {
    return std::tie(rank, microbatch, chunk) == std::tie(o.rank, o.microbatch, o.chunk);
  }
};

void run_all_ranks(const ScheduleCase& k, bool forward_only) {
  const std::string what = describe(k) + (forward_only ? " forward only" : "");
  const int64_t p = k.p;
  std::vector<std::vector<PipelineStep>> steps;
  for (int64_t r = 0; r < p; ++r) {
    steps.push_back(actmem::interleaved_schedule(r, p, k.v, k.m, k.n, forward_only));
  }
  // link (src, dst, forward?) -> posted sends' payloads; posted receives' count.
  std::map<std::tuple<int64_t, int64_t, bool>, std::vector<Payload>> sent;
  std::map<std::tuple<int64_t, int64_t, bool>, int64_t> received;
  struct Posted {
    std::vector<std::pair<std::tuple<int64_t, int64_t, bool>, size_t>> sends, recvs;
    std::vector<int64_t> recv_chunks;
  };
  std::vector<size_t> at(static_cast<size_t>(p), 0);
  std::vector<std::optional<Posted>> posted(static_cast<size_t>(p));
  std::vector<std::optional<Payload>> output(static_cast<size_t>(p)), grad(static_cast<size_t>(p));
  std::vector<std::vector<std::deque<Payload>>> inputs(
      static_cast<size_t>(p), std::vector<std::deque<Payload>>(static_cast<size_t>(k.v)));
  auto grads = inputs;
  std::set<std::tuple<int64_t, int64_t, int64_t>> forwarded;  // (rank, m, chunk)
  bool progress = true;
  while (progress) {
    progress = false;
    for (int64_t r = 0; r < p; ++r) {
      const auto ri = static_cast<size_t>(r);
      if (at[ri] == steps[ri].size()) continue;
      const PipelineStep& s = steps[ri][at[ri]];
      const auto c = static_cast<size_t>(std::max<int64_t>(s.chunk, 0));
      if (s.kind == Kind::kForward) {
        if (!(r == 0 && s.chunk == 0)) {
          ASSERT_FALSE(inputs[ri][c].empty())
              << what << " rank " << r << ": no input for chunk " << c;
          const Payload in = inputs[ri][c].front();
          inputs[ri][c].pop_front();
          const Payload expected = r > 0 ? Payload{r - 1, s.microbatch, s.chunk}
                                         : Payload{p - 1, s.microbatch, s.chunk - 1};
          EXPECT_EQ(in, expected) << what << " rank " << r << " forward of micro-batch "
                                  << s.microbatch << " chunk " << s.chunk;
        }
        forwarded.insert({r, s.microbatch, s.chunk});
        output[ri] = Payload{r, s.microbatch, s.chunk};
      } else if (s.kind == Kind::kBackward) {
        EXPECT_TRUE(forwarded.count({r, s.microbatch, s.chunk})) << what << ": backward first";
        if (!(r == p - 1 && s.chunk == k.v - 1)) {
          ASSERT_FALSE(grads[ri][c].empty())
              << what << " rank " << r << ": no gradient for chunk " << c;
          const Payload g = grads[ri][c].front();
          grads[ri][c].pop_front();
          const Payload expected = r < p - 1 ? Payload{r + 1, s.microbatch, s.chunk}
                                             : Payload{0, s.microbatch, s.chunk + 1};
          EXPECT_EQ(g, expected) << what << " rank " << r << " backward of micro-batch "
                                 << s.microbatch << " chunk " << s.chunk;
        }
        grad[ri] = Payload{r, s.microbatch, s.chunk};
      } else {
        const int64_t next = (r + 1) % p, prev = (r + p - 1) % p;
        if (!posted[ri]) {
          Posted post;
          auto send = [&](int64_t dst, bool fwd, const std::optional<Payload>& x) {
            ASSERT_TRUE(x.has_value()) << what << " rank " << r << ": sends nothing it produced";
            auto& log = sent[{r, dst, fwd}];
            post.sends.emplace_back(std::make_tuple(r, dst, fwd), log.size());
            log.push_back(*x);
          };
          if (s.send_next) send(next, true, output[ri]);
          if (s.send_prev) send(prev, false, grad[ri]);
          if (s.recv_prev_chunk >= 0) {
            auto& n = received[{prev, r, true}];
            post.recvs.emplace_back(std::make_tuple(prev, r, true), static_cast<size_t>(n++));
            post.recv_chunks.push_back(s.recv_prev_chunk);
          }
          if (s.recv_next_chunk >= 0) {
            auto& n = received[{next, r, false}];
            post.recvs.emplace_back(std::make_tuple(next, r, false), static_cast<size_t>(n++));
            post.recv_chunks.push_back(s.recv_next_chunk);
          }
          posted[ri] = post;
          progress = true;
        }
        const Posted& post = *posted[ri];
        bool done = true;
        for (const auto& [link, i] : post.sends)
          done = done && static_cast<size_t>(received[link]) > i;
        for (const auto& [link, i] : post.recvs) done = done && sent[link].size() > i;
        if (!done) continue;
        for (size_t j = 0; j < post.recvs.size(); ++j) {
          const auto& [link, i] = post.recvs[j];
          const auto chunk = static_cast<size_t>(post.recv_chunks[j]);
          (std::get<2>(link) ? inputs : grads)[ri][chunk].push_back(sent[link][i]);
        }
        output[ri].reset();
        grad[ri].reset();
        posted[ri].reset();
      }
      ++at[ri];
      progress = true;
    }
  }
  for (int64_t r = 0; r < p; ++r) {
    const auto ri = static_cast<size_t>(r);
    EXPECT_EQ(at[ri], steps[ri].size()) << what << ": rank " << r << " blocked at step " << at[ri]
                                        << " of " << steps[ri].size() << " (a deadlock)";
    for (int64_t c = 0; c < k.v; ++c) {
      EXPECT_TRUE(inputs[ri][static_cast<size_t>(c)].empty()) << what << ": input left over";
      EXPECT_TRUE(grads[ri][static_cast<size_t>(c)].empty()) << what << ": gradient left over";
    }
  }
  for (const auto& [link, log] : sent) {
    EXPECT_EQ(static_cast<int64_t>(log.size()), received[link]) << what << ": unmatched messages";
  }
  EXPECT_EQ(forwarded.size(), static_cast<size_t>(p * k.m * k.v)) << what;
}

TEST(InterleavedSchedule, EveryRankFinishesAndEveryTensorReachesItsConsumer) {
  int cases = 0;
  for (const ScheduleCase& k : sweep()) {
    run_all_ranks(k, false);
    run_all_ranks(k, true);
    ++cases;
  }
  EXPECT_GE(cases, 25);
}

TEST(InterleavedSchedule, FirstStageHoldsKorthikantisMicroBatches) {
  // With one byte per chunk's micro-batch and nothing crossing boundaries, the peak is the
  // micro-batches in flight: rank r's warmup plus the forward that starts the steady state,
  // min(2 (p - r - 1) + (v - 1) N + 1, M v) chunk-micro-batches. With N = p the first rank's is
  // (p - 1) 2 + (v - 1) p + 1 = v p (1 + (p - 1) / (p v)) chunk-micro-batches: Korthikanti et al.'s
  // p (1 + (p - 1) / (p v)) micro-batches of a whole stage.
  for (const ScheduleCase& k : sweep()) {
    for (int64_t r = 0; r < k.p; ++r) {
      const auto steps = actmem::interleaved_schedule(r, k.p, k.v, k.m, k.n);
      const actmem::PipelineMemory mem = actmem::pipeline_memory(
          steps, r, k.p, std::vector<int64_t>(static_cast<size_t>(k.v), 1), 0);
      EXPECT_EQ(mem.peak_at_forward_end,
                std::min(2 * (k.p - r - 1) + (k.v - 1) * k.n + 1, k.m * k.v))
          << describe(k) << " rank " << r;
      if (r == 0 && k.n == k.p && k.m * k.v > mem.peak_at_forward_end) {
        const double korthikanti =
            static_cast<double>(k.p) *
            (1.0 + static_cast<double>(k.p - 1) / static_cast<double>(k.p * k.v));
        EXPECT_DOUBLE_EQ(static_cast<double>(mem.peak_at_forward_end) / static_cast<double>(k.v),
                         korthikanti)
            << describe(k);
      }
      // Boundary tensors are counted too: a stage holds at least the output it is about to send.
      const actmem::PipelineMemory with_boundaries = actmem::pipeline_memory(
          steps, r, k.p, std::vector<int64_t>(static_cast<size_t>(k.v), 0), 1);
      EXPECT_GE(with_boundaries.peak_at_forward_end, 1) << describe(k) << " rank " << r;
      EXPECT_GE(with_boundaries.max_boundary_tensors, with_boundaries.peak_at_forward_end);
    }
  }
}

TEST(PipelineComputeOrder, OneFOneBAndInterleavedOrdersEachMicroBatchOnce) {
  // 1F1B by hand for 3 stages and 4 micro-batches (warmup p - r - 1 forwards, then forward W + i
  // and backward i, then the rest), and under both schedules: every (micro-batch, chunk) forward
  // once and before its backward, backwards of a chunk in micro-batch order, and the interleaved
  // order the schedule's own steps without the exchanges.
  auto text = [](const std::vector<PipelineStep>& order) {
    std::string out;
    for (const auto& s : order) {
      out += (s.kind == Kind::kForward ? "F" : "B") + std::to_string(s.microbatch);
      if (s.chunk > 0) out += "c" + std::to_string(s.chunk);
      out += " ";
    }
    return out;
  };
  EXPECT_EQ(text(actmem::pipeline_compute_order(0, 3, 1, 4, 3)), "F0 F1 F2 B0 F3 B1 B2 B3 ");
  EXPECT_EQ(text(actmem::pipeline_compute_order(1, 3, 1, 4, 3)), "F0 F1 B0 F2 B1 F3 B2 B3 ");
  EXPECT_EQ(text(actmem::pipeline_compute_order(2, 3, 1, 4, 3)), "F0 B0 F1 B1 F2 B2 F3 B3 ");
  EXPECT_EQ(text(actmem::pipeline_compute_order(0, 4, 1, 2, 4)), "F0 F1 B0 B1 ");
  for (const auto& [p, v, M, N] : std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t>>{
           {2, 1, 4, 2}, {4, 1, 3, 4}, {2, 2, 4, 2}, {3, 2, 6, 3}, {4, 3, 8, 4}, {2, 2, 5, 3}}) {
    for (int64_t r = 0; r < p; ++r) {
      const auto order = actmem::pipeline_compute_order(r, p, v, M, N);
      std::set<std::pair<int64_t, int64_t>> forwarded;
      std::map<int64_t, int64_t> next_backward;  // per chunk
      for (const auto& s : order) {
        const auto key = std::make_pair(s.microbatch, s.chunk);
        if (s.kind == Kind::kForward) {
          EXPECT_TRUE(forwarded.insert(key).second) << "p " << p << " r " << r;
        } else {
          ASSERT_EQ(s.kind, Kind::kBackward);
          EXPECT_TRUE(forwarded.count(key)) << "backward before its forward";
          EXPECT_EQ(s.microbatch, next_backward[s.chunk]++) << "p " << p << " r " << r;
        }
      }
      EXPECT_EQ(order.size(), static_cast<size_t>(2 * M * v));
      if (v > 1) {
        std::vector<PipelineStep> computes;
        for (const auto& s : actmem::interleaved_schedule(r, p, v, M, N)) {
          if (s.kind != Kind::kCommunicate) computes.push_back(s);
        }
        EXPECT_EQ(text(order), text(computes));
      }
    }
  }
  actmem::testing::expect_error_containing([] { actmem::pipeline_compute_order(2, 2, 1, 4, 2); },
                                           "needs a stage in [0, 2)");
}

}  // namespace
