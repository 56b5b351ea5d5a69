"""Launch detection: MPI launchers, env-style launchers (torchrun), and the error a CPU world
gives inside a torchrun-style launch instead of silently training one model per process."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from axondist._environment import (
    check_env_launch,
    default_backend,
    env_launch_size,
    launched_by_mpi,
    torch_installed,
)
from axondist.errors import AxondistError, LaunchError

ROOT = Path(__file__).resolve().parents[2]
_LAUNCH_PREFIXES = ("PMI_", "PMIX_", "OMPI_", "HYDI_", "HYDRA_", "MPI_LOCAL", "SLURM_")
_ENV_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID",
             "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")
TORCHRUN = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
            "TORCHELASTIC_RUN_ID": "none", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without any launcher's variables, plus ``extra``."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(_LAUNCH_PREFIXES) and k not in _ENV_VARS}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


# --- pure checks -------------------------------------------------------------------------

@pytest.mark.parametrize("env, expected", [
    ({}, False),
    ({"PMI_RANK": "0", "PMI_SIZE": "2"}, True),
    ({"OMPI_COMM_WORLD_SIZE": "2"}, True),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}, False),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "4"}, True),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "many"}, False),
    (TORCHRUN, False),
    # torchrun under srun or mpiexec: its children are not MPI ranks, whatever they inherit
    ({**TORCHRUN, "SLURM_PROCID": "1", "SLURM_NTASKS": "2"}, False),
    ({**TORCHRUN, "PMI_RANK": "1", "PMI_SIZE": "2"}, False),
    # srun without PMI, with torch's variables given from Slurm's
    ({"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "RANK": "1", "WORLD_SIZE": "2"}, False),
    ({"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "RANK": "0", "WORLD_SIZE": "1"}, True),
    ({"PMI_RANK": "1", "PMI_SIZE": "2", "RANK": "1", "WORLD_SIZE": "2"}, True),
])
def test_launched_by_mpi_reads_the_mpi_launchers_variables(env, expected):
    assert launched_by_mpi(env) is expected


@pytest.mark.parametrize("env, expected", [
    ({}, None),
    ({"RANK": "0", "WORLD_SIZE": "1"}, None),
    ({"TORCHELASTIC_RUN_ID": "abc"}, None),
    ({"LOCAL_RANK": "0"}, None),
    ({"RANK": "1", "WORLD_SIZE": "2"}, (1, 2)),
    ({"RANK": "0", "WORLD_SIZE": "4"}, (0, 4)),
    ({"LOCAL_RANK": "2"}, (2, 3)),
    ({"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}, (0, 2)),
    ({"RANK": "x", "WORLD_SIZE": "y"}, None),
])
def test_env_launch_size(env, expected):
    assert env_launch_size(env) == expected


sizes = st.one_of(st.none(), st.integers(0, 9).map(str), st.sampled_from(["", "x", "-1"]))


@given(rank=sizes, world=sizes, local_rank=sizes, local_world=sizes,
       backend=st.sampled_from(["mock", "mpi", "MPI", "nccl", "NCCL"]), under_mpi=st.booleans())
def test_check_env_launch_refuses_exactly_multi_process_env_launches(
        rank, world, local_rank, local_world, backend, under_mpi):
    env = {k: v for k, v in [("RANK", rank), ("WORLD_SIZE", world), ("LOCAL_RANK", local_rank),
                             ("LOCAL_WORLD_SIZE", local_world)] if v is not None}
    if under_mpi:
        env["PMI_RANK"] = "0"
    found = env_launch_size(env)
    must_raise = found is not None and backend.lower() != "nccl" and not under_mpi
    if must_raise:
        with pytest.raises(LaunchError) as info:
            check_env_launch(backend, env)
        text = str(info.value)
        assert text.startswith("init: ") and f"{backend!r} backend" in text
        assert "axondist run -n" in text and "mpiexec -n" in text and "nccl" in text
        assert f"rank {found[0]} of" in text
    else:
        check_env_launch(backend, env)


def test_the_error_names_the_launch_and_the_command_to_run():
    with pytest.raises(LaunchError) as info:
        check_env_launch("mpi", TORCHRUN)
    text = str(info.value)
    assert "rank 1 of 2 started by torchrun" in text
    assert "RANK=1, WORLD_SIZE=2" in text
    assert "`axondist run -n 2 script.py`" in text
    assert "`mpiexec -n 2 python script.py`" in text
    assert isinstance(info.value, AxondistError) and isinstance(info.value, RuntimeError)


def test_an_unknown_size_says_at_least_and_n():
    with pytest.raises(LaunchError, match=r"rank 2 of at least 3 .*`axondist run -n N"):
        check_env_launch("mock", {"RANK": "2"})


def test_torchrun_inside_an_mpi_launch_is_not_an_mpi_world():
    env = {**TORCHRUN, "PMI_RANK": "0", "PMI_SIZE": "2", "SLURM_PROCID": "0", "SLURM_NTASKS": "2"}
    with pytest.raises(LaunchError, match=r"rank 1 of 2 started by torchrun .* the 'mpi' backend"):
        check_env_launch("mpi", env)


def test_srun_with_torchs_variables_defaults_to_torch_where_installed():
    env = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "RANK": "1", "WORLD_SIZE": "2"}
    assert default_backend(env) == ("torch" if torch_installed() else "mock")
    assert default_backend({**TORCHRUN, "SLURM_PROCID": "1", "SLURM_NTASKS": "2"}) == (
        "torch" if torch_installed() else "mock")
    assert default_backend({"SLURM_PROCID": "1", "SLURM_NTASKS": "2"}) == "mpi"


def test_nccl_and_mpi_launches_pass():
    check_env_launch("nccl", TORCHRUN)
    check_env_launch("mpi", {"RANK": "1", "WORLD_SIZE": "2", "PMI_RANK": "1", "PMI_SIZE": "2"})
    check_env_launch("mock", {"RANK": "0", "WORLD_SIZE": "1"})


# --- a real process with torchrun's variables and no MPI ---------------------------------

_CHECK_SCRIPT = textwrap.dedent("""
    from axondist._environment import check_env_launch
    check_env_launch("mpi")
    print("no error")
""")


def test_a_torchrun_style_process_without_mpi_gets_the_error():
    proc = subprocess.run([sys.executable, "-c", _CHECK_SCRIPT], env=clean_env(**TORCHRUN),
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "LaunchError: init: this process looks like rank 1 of 2 started by torchrun" in \
        proc.stderr
    assert "axondist run -n 2 script.py" in proc.stderr
    plain = subprocess.run([sys.executable, "-c", _CHECK_SCRIPT], env=clean_env(),
                           capture_output=True, text=True, timeout=60, check=False)
    assert plain.returncode == 0 and "no error" in plain.stdout, plain.stderr


def test_init_in_a_torchrun_style_process_without_torch_raises_instead_of_one_rank():
    script = ("import sys; sys.modules['torch'] = None  # as if torch were not installed\n"
              "import axondist as ad; w = ad.init(); print('rank', w.rank, 'of', w.world_size)")
    proc = subprocess.run([sys.executable, "-c", script], env=clean_env(**TORCHRUN),
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "LaunchError" in proc.stderr and "axondist run -n 2" in proc.stderr, proc.stderr
    assert "Use the 'torch' backend" in proc.stderr, proc.stderr
    assert "pip install '.[torch]'" in proc.stderr, proc.stderr


def test_init_in_a_torchrun_style_process_joins_through_torch_and_names_a_missing_rank_0():
    """With torch installed, ``ad.init()`` under torchrun's variables joins that world
    through the torch backend: rank 1 alone waits for rank 0, then says where it looked."""
    pytest.importorskip("torch")
    script = "import axondist as ad; w = ad.init(); print('rank', w.rank, 'of', w.world_size)"
    env = clean_env(**{**TORCHRUN, "AXONDIST_TIMEOUT": "2", "MASTER_PORT": str(_free_port())})
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=90, check=False)
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert time.monotonic() - start < 60
    assert "CollectiveTimeoutError: init: rank 1 of 2 could not join the torch.distributed " \
           "world at MASTER_ADDR:MASTER_PORT=127.0.0.1:" in proc.stderr, proc.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
