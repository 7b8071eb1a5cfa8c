// process.h — process-level set-up for actmem's programs (call first in main).
#pragma once

namespace actmem {

/// Note [OpenMP wait policy]
/// libtorch's intra-op pool is OpenMP; OpenBLAS runs its own threads. With libgomp's default
/// (active) wait policy, idle OpenMP workers spin after every parallel region and steal the cores
/// that OpenBLAS's threads need: on 2 cores the 4-layer hidden-512 step took 2.5 s instead of
/// 1.9 s. libgomp reads OMP_WAIT_POLICY once, when it is loaded, before main runs; so when the
/// variable is unset prepare_process() sets it to PASSIVE. A value the user set is respected.
///
/// prepare_process() also decides OpenBLAS's kernel family (Note [BLAS kernel choice] in
/// blas_kernels.h), which OpenBLAS likewise reads when it is loaded. When either variable has to
/// change, the program re-executes itself once (same argv) with the environment set; it returns
/// normally in the process that goes on. In a BLAS probe child it runs the probe and exits.
void prepare_process(char** argv);

}  // namespace actmem
