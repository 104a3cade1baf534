// The torch headers every source includes, parsed once per build into a precompiled
// header (build.py) instead of once per source: they were most of each file's compile
// time (~14 s of the 15-42 s a file took on 2 Zen 3 cores).
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/library.h>
