"""The delta-rule kernels' tests (tests/test_gated_deltanet_triton.py, which the CPU runs under Triton's
interpreter) compiled and run on a GPU, by bench/device_check.sh; skipped elsewhere. tests/gpu/test_cuda.py runs the
tiny Qwen3.5 models through the engine, on these kernels, against transformers; bench/gpu_hybrid.py checks them at
Qwen3.5-4B's shapes and times them."""

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

from tests.test_gated_deltanet_triton import (  # noqa: E402, F401
    test_a_decode_step_of_one_token_a_sequence,
    test_a_prefill_step_longer_than_a_chunk,
    test_head_dims_wider_than_a_value_block_and_not_powers_of_two,
    test_the_recurrent_form_over_several_tokens_keeps_snapshots_between_them,
)
