// bench_common.h — what the benchmark programs share: the reference model they compare on and
// how they report an error.
#pragma once

#include "actmem/blas_kernels.h"
#include "actmem/config.h"

#include <c10/util/Exception.h>

#include <iostream>

namespace actmem::bench {

/// The 4-layer model the benchmarks compare strategies on: hidden 512, 8 heads, ffn 2048,
/// sequence 512, micro-batch 4 (the other fields keep their defaults).
inline void use_reference_model(TransformerConfig& c) {
  c.num_layers = 4;
  c.hidden_size = 512;
  c.num_attention_heads = 8;
  c.ffn_hidden_size = 2048;
  c.seq_length = 512;
  c.micro_batch_size = 4;
}

/// The kernels the BLAS runs (Note [BLAS kernel choice]): a line on stderr at start-up, so every
/// benchmark's numbers say which kernels produced them.
inline void print_blas() { std::cerr << blas_report().summary() << std::endl; }

/// One line on stderr and exit status 1, as `actmem` does.
inline int report(const c10::Error& e) {
  std::cerr << "error: " << e.msg().substr(0, e.msg().find('\n')) << std::endl;
  return 1;
}

}  // namespace actmem::bench
