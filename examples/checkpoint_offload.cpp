// checkpoint_offload.cpp — actmem's mechanisms in a user's own training loop: a stack of the
// user's torch::nn blocks, with the first blocks recomputed in backward (actmem::checkpoint) and
// the last ones offloaded to host memory (actmem::ActivationOffloader, one OffloadRegion per
// block). Three SGD steps with dropout on must give bitwise the same losses and gradients as the
// plain run, with fewer activation bytes held between forward and backward. Exits 1 otherwise.
#include <actmem/memory/memory_tracker.h>
#include <actmem/offload/activation_offloader.h>
#include <actmem/recompute/recompute.h>

#include <torch/torch.h>

#include <cstring>
#include <iostream>
#include <vector>

namespace {

// The user's block: a residual MLP with dropout (nothing actmem-specific).
struct BlockImpl : torch::nn::Module {
  BlockImpl(int64_t width, double p) : fc1(width, 4 * width), fc2(4 * width, width), p(p) {
    register_module("fc1", fc1);
    register_module("fc2", fc2);
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return x + torch::dropout(fc2(torch::gelu(fc1(x))), p, is_training());
  }
  torch::nn::Linear fc1, fc2;
  double p;
};
TORCH_MODULE(Block);

enum class Strategy { kPlain, kRecomputeAndOffload };

struct Run {
  std::vector<double> losses;
  std::vector<torch::Tensor> grads;  // last step's
  int64_t held_bytes = 0;            // device bytes the forward left for the backward
  int64_t offloaded_bytes = 0;       // copied to the host in the last step
};

Run train(Strategy strategy) {
  torch::manual_seed(7);  // same weights, batches and dropout masks for both strategies
  const int64_t width = 256, batch = 512;
  std::vector<Block> blocks;
  torch::nn::ModuleList stack;
  for (int i = 0; i < 4; ++i) {
    blocks.emplace_back(width, 0.1);
    stack->push_back(blocks.back());
  }
  torch::optim::SGD sgd(stack->parameters(), torch::optim::SGDOptions(0.01));
  // Tensors of at least 64 Ki elements go to the host (a CPU copy engine here; CUDA streams and
  // pinned buffers on a GPU build).
  actmem::ActivationOffloader offloader(/*min_elements=*/1 << 16, /*bytes_per_second=*/0);
  for (const auto& p : stack->parameters()) offloader.exclude(p);
  auto& memory = actmem::device_memory(torch::kCPU);
  Run run;
  for (int step = 0; step < 3; ++step) {
    const torch::Tensor x = torch::randn({batch, width});
    const torch::Tensor target = torch::randn({batch, width});
    sgd.zero_grad();
    offloader.begin_step();
    offloader.begin_forward();
    const int64_t before = memory.current_bytes();
    torch::Tensor h = x.requires_grad_(false);
    for (size_t i = 0; i < blocks.size(); ++i) {
      Block& block = blocks[i];
      if (strategy == Strategy::kPlain) {
        h = block->forward(h);
      } else if (i < 2) {
        // Recomputed in backward: only the block's input (and the random state) is kept.
        // The first block's input needs grad for the checkpoint to carry gradients.
        if (!h.requires_grad()) h = h.detach().requires_grad_(true);
        h = actmem::checkpoint(
            [&block](const actmem::TensorList& in) {
              return actmem::TensorList{block->forward(in[0])};
            },
            /*distribute_saved_activations=*/false, {h})[0];
      } else {
        // Offloaded: what the block saves goes to the host when it ends, and comes back when
        // the backward reaches it (the block before is prefetched meanwhile).
        actmem::OffloadRegion region(&offloader, "block", actmem::GroupKind::kLayer);
        h = region.commit(block->forward(region.enter(h)));
      }
    }
    const torch::Tensor loss = torch::mse_loss(h, target);
    run.held_bytes = memory.current_bytes() - before;
    loss.backward();
    sgd.step();
    run.offloaded_bytes = offloader.stats().offloaded_bytes;
    offloader.end_step();
    run.losses.push_back(loss.item<double>());
  }
  for (const auto& p : stack->parameters()) run.grads.push_back(p.grad().clone());
  offloader.wait_idle();
  return run;
}

bool bitwise_equal(const torch::Tensor& a, const torch::Tensor& b) {
  return a.sizes() == b.sizes() && std::memcmp(a.data_ptr(), b.data_ptr(), a.nbytes()) == 0;
}

}  // namespace

int main() {
  actmem::install_memory_tracker();
  torch::set_num_threads(1);
  const Run plain = train(Strategy::kPlain);
  const Run managed = train(Strategy::kRecomputeAndOffload);
  bool equal = plain.losses == managed.losses && plain.grads.size() == managed.grads.size();
  for (size_t i = 0; equal && i < plain.grads.size(); ++i) {
    equal = bitwise_equal(plain.grads[i], managed.grads[i]);
  }
  std::cout << "losses";
  for (size_t i = 0; i < plain.losses.size(); ++i) {
    std::cout << " " << plain.losses[i] << (plain.losses[i] == managed.losses[i] ? "" : "(!)");
  }
  std::cout << "\nactivations held between forward and backward: plain "
            << plain.held_bytes / 1048576.0 << " MiB, recompute + offload "
            << managed.held_bytes / 1048576.0 << " MiB (" << managed.offloaded_bytes / 1048576.0
            << " MiB offloaded to host memory)\n"
            << (equal ? "bitwise equal losses and gradients: yes" : "NOT bitwise equal") << "\n";
  return equal && managed.held_bytes < plain.held_bytes && managed.offloaded_bytes > 0 ? 0 : 1;
}
