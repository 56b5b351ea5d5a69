"""Every wrapper on the NCCL backend of one GPU, against the same training on NumPy.

The bodies of ``test_cupy_wrappers.py`` run here on a one-rank NCCL world
(CuPy arrays, the real ``cupy.cuda.nccl``) and on a one-rank mock world with
NumPy arrays; the two must agree. One GPU cannot show NCCL moving data
between ranks, but every call a wrapper makes still goes through the NCCL
backend, which takes device memory only: a wrapper that hands it a host
array (a loss, row counts, a norm) fails here. Skipped, at collection,
without CuPy, NCCL or a CUDA device.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import test_cupy_wrappers as cw
from test_nccl_gpu import REASON

import axondist as ad
from axondist import GradSyncStrategy
from axondist.fsdp import CPUOffload, ShardingStrategy
from axondist.pipeline import PipelineSchedule

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(REASON is not None, reason=str(REASON))]


def on_nccl_and_numpy(world, body, *args):
    """``body`` on the NCCL world with CuPy, and on a mock world of one rank with NumPy."""
    import cupy

    return body(world, cupy, *args), ad.spawn(body, 1, np, *args)[0]


@pytest.mark.parametrize("strategy", list(GradSyncStrategy))
@pytest.mark.parametrize("weighted", [False, True])
def test_ddp(world, strategy, weighted):
    got, want = on_nccl_and_numpy(world, cw.ddp_body, 3, "float64", strategy, False, weighted)
    cw.assert_runs_agree(got, want, "float64")
    cw.assert_runs_agree(want[1], cw.reference(3, 1, 3, "float64", weighted), "float64")


@pytest.mark.parametrize("offload", [CPUOffload.PARAMS, CPUOffload.FULL])
@pytest.mark.parametrize("micro", [1, 2])
def test_fsdp_full_shard_with_cpu_offload(world, offload, micro):
    got, want = on_nccl_and_numpy(world, cw.fsdp_offload_body, 4, "float32", None, offload,
                                  micro)
    cw.assert_runs_agree(got, want, "float32")


@pytest.mark.parametrize("strategy", [ShardingStrategy.FULL_SHARD, ShardingStrategy.NO_SHARD])
def test_fsdp_bfloat16(world, strategy):
    if not cw.device_has_bfloat16():
        pytest.skip("this CuPy has no bfloat16 arrays")
    got, want = on_nccl_and_numpy(world, cw.fsdp_bf16_body, 5, "float32", strategy)
    cw.assert_runs_agree(got, want, ad._array.bfloat16)


@pytest.mark.parametrize("kind", [PipelineSchedule.ONE_F_ONE_B, PipelineSchedule.GPIPE,
                                  PipelineSchedule.INTERLEAVED_ONE_F_ONE_B])
def test_pipeline(world, kind):
    got, want = on_nccl_and_numpy(world, cw.pipeline_body, 6, kind, 2)
    cw.assert_runs_agree(got, want, np.float64)


@pytest.mark.parametrize("layout", ["mlp", "gathered"])
def test_tensor_parallel(world, layout):
    got, want = on_nccl_and_numpy(world, cw.tp_body, 7, layout, "float32")
    cw.assert_runs_agree(got, want, "float32")


def test_checkpoint_round_trip(world, tmp_path: Path):
    got, want = on_nccl_and_numpy(world, cw.checkpoint_body, str(tmp_path), 8,
                                  CPUOffload.PARAMS)
    cw.assert_runs_agree(got, want, np.float32)
