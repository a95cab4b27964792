"""The suite runs on the CPU (gloo) even on a GPU host: its exact-equality checks rely on
CPU determinism, and its multi-rank tests start more ranks than a host may have GPUs."""

import os

os.environ["CUDA_VISIBLE_DEVICES"] = ""
