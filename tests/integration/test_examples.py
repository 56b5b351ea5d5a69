"""Every example runs, passes its own check against single-process training, and exits 0.

Examples needing JAX, PyTorch or scikit-learn are skipped when it is not
installed; their own "not installed" path is tested by hiding the module.
The char LM's hand-written gradients are checked against finite differences,
and its loss curves against one process at several world sizes.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from harness import UNDER_MPI, mock_only

import axondist as ad

ROOT = Path(__file__).resolve().parents[2]
# Variables an MPI launcher sets: a child started without them is not part of a launch.
_LAUNCH_PREFIXES = ("PMI_", "PMIX_", "OMPI_", "HYDI_", "HYDRA_", "MPI_LOCAL", "SLURM_")
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
# Examples that print "... is not installed; skipping" and exit 0 without their module.
FRAMEWORK = {"jax_grad.py": "jax", "torch_autograd.py": "torch", "digits_ddp_fsdp.py": "sklearn",
             "jax_tp_mlp_jit.py": "jax", "torch_tp_autograd.py": "torch"}
NEEDS = {**FRAMEWORK, "resume.py": "sklearn"}
# Shorter runs than the defaults: the check against one process is the same.
QUICK = {"digits_ddp_fsdp.py": ["--epochs", "2"], "char_lm.py": ["--steps", "3"],
         "pipeline_schedules.py": ["-p", "2", "-m", "3", "--repeats", "1", "--no-pictures",
                                   "--tolerance", "1"],
         "moe_expert_data_parallel.py": ["--steps", "3"],
         "context_parallel_char_lm.py": ["--steps", "3"],
         "jax_tp_mlp_jit.py": ["--steps", "6"], "torch_tp_autograd.py": ["--steps", "6"]}

# The examples start their own worlds: running them once per MPI rank would only repeat them.
pytestmark = mock_only


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCH_PREFIXES)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def run(args: list[str], timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=timeout, check=False)


def test_the_examples_are_there():
    names = {p.name for p in EXAMPLES}
    assert {"numpy_mlp.py", "jax_grad.py", "torch_autograd.py"} <= names


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_runs_and_checks_itself(path):
    if path.name in NEEDS:
        pytest.importorskip(NEEDS[path.name])
    proc = run([sys.executable, str(path), *QUICK.get(path.name, [])])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "FAILED" not in proc.stdout


@pytest.mark.parametrize("name", sorted(FRAMEWORK))
def test_framework_examples_skip_cleanly_without_the_framework(name):
    module = FRAMEWORK[name]
    code = (f"import sys, runpy; sys.modules[{module!r}] = None; sys.argv = [{name!r}]; "
            f"runpy.run_path({str(ROOT / 'examples' / name)!r}, run_name='__main__')")
    proc = run([sys.executable, "-c", code], timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "is not installed; skipping" in proc.stdout


def _example(name: str):
    """The example module ``examples/NAME.py``, imported (its main does not run)."""
    sys.path.insert(0, str(ROOT / "examples"))
    environ = dict(os.environ)
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(ROOT / "examples"))
        os.environ.clear()  # char_lm.py sets BLAS thread counts for its own processes
        os.environ.update(environ)


def test_numpy_example_detects_a_wrong_result(monkeypatch):
    numpy_mlp = _example("numpy_mlp")
    real = numpy_mlp.train_single_process
    monkeypatch.setattr(numpy_mlp, "train_single_process",
                        lambda n, e: [p + 1e-3 for p in real(n, e)])
    assert numpy_mlp.main(["--world-size", "2", "--epochs", "1"]) == 1


def _mpiexec() -> str | None:
    local = Path(sys.executable).parent / "mpiexec"
    return str(local) if local.exists() else shutil.which("mpiexec")


@pytest.mark.mpi
@pytest.mark.skipif(UNDER_MPI, reason="launches its own mpiexec")
@pytest.mark.skipif(importlib.util.find_spec("mpi4py") is None or _mpiexec() is None,
                    reason="needs mpi4py and mpiexec")
def test_numpy_example_under_mpiexec():
    proc = run([_mpiexec(), "-n", "2", sys.executable, str(ROOT / "examples" / "numpy_mlp.py"),
                "--epochs", "1"], timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("2 ranks") and "(OK)" in proc.stdout


@pytest.mark.mpi
@pytest.mark.skipif(UNDER_MPI, reason="launches its own mpiexec")
@pytest.mark.skipif(importlib.util.find_spec("mpi4py") is None or _mpiexec() is None,
                    reason="needs mpi4py and mpiexec")
@pytest.mark.parametrize("name, n, args", [
    ("digits_ddp_fsdp.py", 2, ["--epochs", "2"]),
    ("digits_ddp_fsdp.py", 3, ["--epochs", "1"]),
    ("char_lm.py", 2, ["--steps", "3"]),
    ("char_lm.py", 3, ["--steps", "2"]),
    ("moe_expert_data_parallel.py", 2, ["--ep", "2", "--steps", "2"]),
    ("jax_tp_mlp_jit.py", 2, ["--steps", "6"]),
    ("torch_tp_autograd.py", 2, ["--steps", "6"]),
])
def test_real_data_examples_under_mpiexec(name, n, args):
    if name in NEEDS:
        pytest.importorskip(NEEDS[name])
    proc = run([_mpiexec(), "-n", str(n), sys.executable, str(ROOT / "examples" / name), *args],
               timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"on {n} ranks" in proc.stdout or proc.stdout.startswith(f"{n} ranks"), proc.stdout
    assert "single-process training" in proc.stdout and ": yes" in proc.stdout, proc.stdout
    assert "FAILED" not in proc.stdout


def test_moe_example_detects_a_wrong_result(monkeypatch, capsys):
    moe = _example("moe_expert_data_parallel")
    real = moe.Model.dense

    def nudged(self):  # the one-process model's weights, off by 1e-6
        return [a + 1e-6 for a in real(self)] if self.moe.group.world_size == 1 else real(self)

    monkeypatch.setattr(moe.Model, "dense", nudged)
    assert moe.main(["--world-size", "2", "--ep", "2", "--steps", "1"]) == 1
    assert "NO (FAILED)" in capsys.readouterr().out


# --- digits ------------------------------------------------------------------------------

def test_digits_example_detects_a_wrong_result(monkeypatch, capsys):
    pytest.importorskip("sklearn")
    digits = _example("digits_ddp_fsdp")
    real = digits.train_single_process

    def nudged(args):
        ref = real(args)
        ref["weights"][2] = ref["weights"][2] + 1e-6
        return ref

    monkeypatch.setattr(digits, "train_single_process", nudged)
    assert digits.main(["--world-size", "2", "--epochs", "1", "--strategies", "ddp"]) == 1
    assert "DIFFERS" in capsys.readouterr().out


def test_digits_example_learns_and_matches_one_process(capsys):
    pytest.importorskip("sklearn")
    digits = _example("digits_ddp_fsdp")
    assert digits.main(["--world-size", "2", "--epochs", "3"]) == 0
    out = capsys.readouterr().out
    for strategy in ("ddp", "zero1", "fsdp"):
        line = next(ln for ln in out.splitlines() if ln.startswith(strategy))
        assert line.endswith("OK") and float(line.split()[2].rstrip("%")) > 90, out


def test_digits_example_refuses_a_batch_that_does_not_split():
    pytest.importorskip("sklearn")
    digits = _example("digits_ddp_fsdp")
    with pytest.raises(SystemExit, match=r"--batch 60 does not split over 7 ranks"):
        digits.main(["--world-size", "7", "--epochs", "1"])


# --- the char LM -------------------------------------------------------------------------

TINY = dict(context=5, width=8, heads=2, hidden=6, blocks=1, batch=3)


def test_char_lm_gradients_match_finite_differences():
    lm = _example("char_lm")
    cfg = lm.Config(**TINY)
    rng = np.random.default_rng(0)
    arrays = [a + 0.1 * rng.standard_normal(a.shape)  # away from the zero biases / unit gains
              for piece in lm.init_model(cfg) for a in piece]
    corpus = lm.load_corpus(2_000)
    x, y = lm.batch_at(corpus, 0, cfg)
    loss_and_grads = lm.model_loss_and_grads(cfg)
    loss, grads = loss_and_grads(arrays, x, y)
    assert len(grads) == len(arrays) and np.isfinite(loss)
    eps = 1e-6
    for i, (a, g) in enumerate(zip(arrays, grads)):
        direction = rng.standard_normal(a.shape)
        plus = [b + eps * direction if j == i else b for j, b in enumerate(arrays)]
        minus = [b - eps * direction if j == i else b for j, b in enumerate(arrays)]
        numeric = (loss_and_grads(plus, x, y)[0] - loss_and_grads(minus, x, y)[0]) / (2 * eps)
        assert np.isclose(np.sum(g * direction), numeric, rtol=1e-5, atol=1e-8), i


def test_char_lm_corpus_is_the_stdlib_read_deterministically():
    lm = _example("char_lm")
    corpus = lm.load_corpus(5_000)
    assert corpus.shape == (5_000,) and corpus.min() >= 0 and corpus.max() < lm.VOCAB
    np.testing.assert_array_equal(corpus, lm.load_corpus(5_000))
    x, y = lm.batch_at(corpus, 3, lm.Config())
    np.testing.assert_array_equal(x[:, 1:], y[:, :-1])  # targets are the next characters


@pytest.mark.parametrize("n", [1, 3, 4])
def test_char_lm_loss_curves_are_equal_across_strategies(n):
    """FSDP, both pipelines and TP x DP trace the single-process loss curve, step by step."""
    lm = _example("char_lm")
    cfg = lm.Config(batch=12)
    steps = 3
    results = ad.spawn(lm.train, n, cfg, steps, list(lm.STRATEGIES))
    ref, _ = lm.train_single_process(cfg, steps)
    assert ref[-1] < ref[0], "the model learns"
    for rank_results in results:
        assert set(rank_results) == set(lm.STRATEGIES)
        for name, ((losses, seconds), layout) in rank_results.items():
            np.testing.assert_allclose(losses, ref, rtol=0, atol=lm.TOLERANCE, err_msg=name)
            assert seconds > 0 and layout
    layouts = {name: layout for name, (_, layout) in results[0].items()}
    if n == 4:
        assert layouts["pipeline-1f1b"].startswith("1f1b: 4 ranks x 1 chunk")
        assert layouts["pipeline-interleaved"].startswith("interleaved_1f1b: 4 ranks x 2 chunk")
        assert layouts["tp-dp"] == "tp 2 x dp 2"
    if n == 1:
        assert "in each process" in layouts["pipeline-1f1b"]


def test_char_lm_detects_a_wrong_result(monkeypatch, capsys):
    lm = _example("char_lm")
    real = lm.train_single_process

    def nudged(cfg, steps):
        losses, seconds = real(cfg, steps)
        return [losses[0]] + [v + 1e-6 for v in losses[1:]], seconds

    monkeypatch.setattr(lm, "train_single_process", nudged)
    assert lm.main(["--world-size", "2", "--steps", "2", "--strategies", "fsdp"]) == 1
    assert "FAILED" in capsys.readouterr().out


def test_char_lm_refuses_bad_arguments(capsys):
    lm = _example("char_lm")
    with pytest.raises(SystemExit, match="2"):
        lm.main(["--steps", "1"])
    assert "--steps 1: pass at least 2" in capsys.readouterr().err
    with pytest.raises(SystemExit, match=r"--batch 10 does not split over 4 data-parallel"):
        lm.main(["--world-size", "4", "--batch", "10", "--strategies", "fsdp"])


def test_char_lm_jax_gradients_give_the_hand_written_curve():
    """Each piece's backward from jax.vjp: the same loss curve as the hand-written NumPy one."""
    pytest.importorskip("jax")
    lm = _example("char_lm")
    cfg = lm.Config(batch=4, grads="jax")  # one shape per piece: few compilations
    results = ad.spawn(lm.train, 1, cfg, 2, ["fsdp", "tp-dp"])
    ref, _ = lm.train_single_process(lm.Config(batch=4), 2)  # hand-written gradients
    for name, ((losses, _), _) in results[0].items():
        np.testing.assert_allclose(losses, ref, rtol=0, atol=lm.TOLERANCE, err_msg=name)


def test_char_lm_says_when_jax_is_missing():
    code = (f"import sys, runpy; sys.modules['jax'] = None; "
            f"sys.argv = ['char_lm.py', '--grads', 'jax']; "
            f"runpy.run_path({str(ROOT / 'examples' / 'char_lm.py')!r}, run_name='__main__')")
    proc = run([sys.executable, "-c", code], timeout=60)
    assert proc.returncode == 1 and "--grads jax needs JAX (pip install jax)" in proc.stderr


# --- pipeline schedules ------------------------------------------------------------------

# --tolerance 1 passes any bubble: the tests check no timing (the check itself is tested below).
SMALL = ["-p", "2", "-m", "3", "--repeats", "1", "--tolerance", "1"]


def test_pipeline_schedules_example_draws_every_schedule(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    example = _example("pipeline_schedules")
    assert example.main([*SMALL, "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    names = ad.pipeline.schedule_names()
    expected = {f"pipeline_{n}{suffix}.png" for n in names for suffix in ("", "_measured")}
    assert {p.name for p in tmp_path.iterdir()} == expected
    assert all(p.read_bytes().startswith(b"\x89PNG") for p in tmp_path.iterdir())
    # Times in ms: the width follows the number of actions, not the unit (at most 24 in, 100 dpi).
    assert all(int.from_bytes(p.read_bytes()[16:20], "big") <= 2400 for p in tmp_path.iterdir())
    for name in names:  # one table row each, with its verdict
        row = next(ln for ln in out.splitlines() if ln.startswith(name + " "))
        assert row.endswith("OK"), out
    assert f"{len(expected)} pictures in {tmp_path}" in out and out.rstrip().endswith("yes")


def test_pipeline_schedules_example_runs_without_matplotlib(tmp_path):
    pictures = tmp_path / "pictures"
    code = (f"import sys, runpy; sys.modules['matplotlib'] = None; "
            f"sys.argv = ['pipeline_schedules.py', *{SMALL!r}, '--out', {str(pictures)!r}]; "
            f"runpy.run_path({str(ROOT / 'examples' / 'pipeline_schedules.py')!r}, "
            f"run_name='__main__')")
    proc = run([sys.executable, "-c", code], timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "matplotlib is not installed; skipping the pictures" in proc.stdout
    assert "pip install matplotlib" in proc.stdout and not pictures.exists()
    assert proc.stdout.rstrip().endswith("yes")


def test_pipeline_schedules_example_fails_on_an_invalid_schedule(monkeypatch, capsys):
    example = _example("pipeline_schedules")
    real = example.build_schedule

    def broken(kind, p, m, chunks):  # GPipe's rank 0 runs a backward before its forward
        if kind is ad.pipeline.PipelineSchedule.GPIPE:
            return ad.pipeline.parse_schedule(["B0 F0", "F0 B0"], kind=kind)
        return real(kind, p, m, chunks)

    monkeypatch.setattr(example, "build_schedule", broken)
    assert example.main(["-p", "2", "-m", "1", "--repeats", "1", "--no-pictures",
                         "--tolerance", "1"]) == 1
    out = capsys.readouterr().out
    assert next(ln for ln in out.splitlines() if ln.startswith("gpipe ")).endswith(
        "FAILED validation")
    assert "gpipe: rank 0, step 0" in out and "expected F0 of stage 0 first" in out
    assert next(ln for ln in out.splitlines() if ln.startswith("1f1b ")).endswith("OK")
    assert out.rstrip().endswith("no (FAILED)")


def test_pipeline_schedules_example_checks_bubble_and_activations():
    """A step whose ranks waited longer than the schedule explains, or held other activations."""
    example = _example("pipeline_schedules")
    planned = example.plan(ad.pipeline.PipelineSchedule.ONE_F_ONE_B, 3, 4, 1, 10.0, 20.0)
    exact = planned.simulated
    assert example.gap(exact) == pytest.approx(0, abs=1e-12)  # a run exactly as simulated
    assert example.verdict(planned, [exact], 0.15) == "OK"
    shift = [0.0, 0.0, 100.0]  # rank 2 starts 100 ms late: the others wait for it
    late = [tuple(ad.pipeline.TimedAction(t.action, t.start + shift[r], t.end + shift[r])
                  for t in row) for r, row in enumerate(exact.timeline)]
    waited = example.SimulationResult(
        schedule=exact.schedule, comm=0.0, timeline=tuple(late),
        makespan=max(row[-1].end for row in late), busy=exact.busy,
        peak_activations=exact.peak_activations)
    assert example.gap(waited) > 0.15
    late_text = f"bubble off by {example.gap(waited):+.3f} (timing)"
    assert example.verdict(planned, [waited], 0.15) == late_text
    held = dataclasses.replace(exact, peak_activations=(4, 4, 4))
    assert example.verdict(planned, [held], 0.15) == "peak activations DIFFER"
    assert example.verdict(planned, [exact, waited, waited], 0.15) == late_text
    assert example.verdict(planned, [exact, exact, waited], 0.15) == "OK"  # the median step
    # timing alone passes unless asked to be strict; activations never do
    assert example.passes(late_text) and not example.passes(late_text, strict_timing=True)
    both = example.verdict(planned, [dataclasses.replace(waited, peak_activations=(4, 4, 4))],
                           0.15)
    assert both == f"{late_text}; peak activations DIFFER" and not example.passes(both)


def test_pipeline_schedules_example_reports_a_late_bubble_and_passes(monkeypatch, capsys):
    """A busy machine stretches the measured bubble: the example says so and exits 0."""
    example = _example("pipeline_schedules")
    monkeypatch.setattr(example, "gap", lambda measured: 0.5)
    args = ["-p", "2", "-m", "2", "--repeats", "1", "--no-pictures"]
    assert example.main(args) == 0
    out = capsys.readouterr().out
    rows = [ln for ln in out.splitlines() if ln.split(" ")[0] in ad.pipeline.schedule_names()]
    assert rows and all(ln.endswith("bubble off by +0.500 (timing)") for ln in rows), out
    assert "is reported, not failed" in out and out.rstrip().endswith("yes")
    assert example.main([*args, "--strict-timing"]) == 1
    assert capsys.readouterr().out.rstrip().endswith("no (FAILED)")


def test_pipeline_schedules_example_refuses_bad_arguments(capsys):
    example = _example("pipeline_schedules")
    for args, message in [(["-m", "0"], "--microbatches 0: pass at least 1"),
                          (["--tolerance", "nan"], "--tolerance nan: pass a positive number"),
                          (["--forward-ms", "-1"], "--forward-ms -1.0: pass a positive number")]:
        with pytest.raises(SystemExit, match="2"):
            example.main(args)
        assert message in capsys.readouterr().err


@pytest.mark.mpi
@pytest.mark.skipif(UNDER_MPI, reason="launches its own mpiexec")
@pytest.mark.skipif(importlib.util.find_spec("mpi4py") is None or _mpiexec() is None,
                    reason="needs mpi4py and mpiexec")
@pytest.mark.parametrize("n", [2, 3])
def test_pipeline_schedules_example_under_mpiexec(n, tmp_path):
    proc = run([_mpiexec(), "-n", str(n), sys.executable,
                str(ROOT / "examples" / "pipeline_schedules.py"), "-m", "3", "--repeats", "1",
                "--tolerance", "1", "--out", str(tmp_path)], timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith(f"pipeline schedules on MPI, {n} processes"), proc.stdout
    names = ad.pipeline.schedule_names()
    rows = [ln for ln in proc.stdout.splitlines() if ln.split(" ")[0] in names]
    assert len(rows) == len(names) and all(ln.endswith("OK") for ln in rows), proc.stdout
    if importlib.util.find_spec("matplotlib") is not None:
        assert len(list(tmp_path.glob("pipeline_*.png"))) == 2 * len(names)
    else:
        assert "matplotlib is not installed; skipping the pictures" in proc.stdout
    assert proc.stdout.rstrip().endswith("yes"), proc.stdout


# --- tensor parallelism through autodiff ---------------------------------------------------

@pytest.mark.parametrize("name, module", [("jax_tp_mlp_jit", "jax"),
                                          ("torch_tp_autograd", "torch")])
def test_autodiff_tp_examples_detect_a_wrong_result(monkeypatch, capsys, name, module):
    pytest.importorskip(module)
    example = _example(name)
    real = example.train_single_process

    def nudged(steps):
        losses, weights = real(steps)
        if isinstance(weights, dict):
            return losses, {k: v + 1e-4 for k, v in weights.items()}
        return losses, [w + 1e-4 for w in weights]

    monkeypatch.setattr(example, "train_single_process", nudged)
    assert example.main(["--world-size", "2", "--steps", "2"]) == 1
    assert "NO (FAILED)" in capsys.readouterr().out
