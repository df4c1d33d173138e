// TORCH_CHECK and TORCH_CHECK_WITH, as declared for cpu_sim.cpp in torch/library.h here.
#pragma once
#include <torch/library.h>
