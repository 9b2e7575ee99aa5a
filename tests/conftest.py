"""Suite-wide settings: the models under test are tiny, so one intra-op thread is both fastest and steadiest
(with two threads on a busy 2-core machine, tiny matmuls slow down by orders of magnitude)."""

import torch

torch.set_num_threads(1)
