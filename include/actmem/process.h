// process.h — process-level set-up for actmem's programs (call first in main).
#pragma once

namespace actmem {

/// Note [OpenMP wait policy]
/// libtorch's intra-op pool is OpenMP; OpenBLAS runs its own threads. With libgomp's default
/// (active) wait policy, idle OpenMP workers spin after every parallel region and steal the cores
/// that OpenBLAS's threads need: on 2 cores the 4-layer hidden-512 step took 2.5 s instead of
/// 1.9 s. libgomp reads OMP_WAIT_POLICY once, when it is loaded, before main runs; so when the
/// variable is unset this sets it to PASSIVE and re-executes the program once (same argv).
/// A value the user set is respected. Returns normally in the (re-executed) process.
void ensure_passive_openmp_wait(char** argv);

}  // namespace actmem
