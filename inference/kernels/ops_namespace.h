// The namespace of slimlm's CPU ops in torch.ops: SLIMLM_OPS, which inference/cpu_kernels.py
// defines as slimlm_ and the digest of the kernels' sources, so that torch.compile never reuses
// a graph it cached for another build of them. TORCH_LIBRARY pastes its argument into names
// unexpanded: these macros expand SLIMLM_OPS first.
#pragma once
#include <torch/library.h>

#ifndef SLIMLM_OPS
#error "SLIMLM_OPS is not defined: build the kernels through inference/cpu_kernels.py"
#endif

#define SLIMLM_LIBRARY_EXPANDED(ns, m) TORCH_LIBRARY(ns, m)
#define SLIMLM_LIBRARY(m) SLIMLM_LIBRARY_EXPANDED(SLIMLM_OPS, m)
#define SLIMLM_LIBRARY_FRAGMENT_EXPANDED(ns, m) TORCH_LIBRARY_FRAGMENT(ns, m)
#define SLIMLM_LIBRARY_FRAGMENT(m) SLIMLM_LIBRARY_FRAGMENT_EXPANDED(SLIMLM_OPS, m)
#define SLIMLM_LIBRARY_IMPL_EXPANDED(ns, key, m) TORCH_LIBRARY_IMPL(ns, key, m)
#define SLIMLM_LIBRARY_IMPL(key, m) SLIMLM_LIBRARY_IMPL_EXPANDED(SLIMLM_OPS, key, m)
