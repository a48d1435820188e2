// The avx512 build of the kernels in logprobs.h (its compiler flags are in setup.py).
#include "logprobs.h"
