"""Suite-wide settings: the models under test are tiny, so one intra-op thread is both fastest and steadiest
(with two threads on a busy 2-core machine, tiny matmuls slow down by orders of magnitude). The MTP drafter's
compiled CPU step (runtime/drafters/mtp_compiled.py) is off, so that a setup in a test does not spend 15 s
compiling it; tests/runtime/drafters/test_mtp_compiled.py turns it on."""

import os

import torch

torch.set_num_threads(1)
os.environ["STRATA_COMPILE"] = "0"
