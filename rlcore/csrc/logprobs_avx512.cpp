// The avx512 build of the kernels in logprobs.h (its compiler flags are in rlcore/_kernel_build.py).
#include "logprobs.h"
