"""The job's ``[cluster] use_gpu`` seams that need no GPU: the launcher refuses a cluster without enough GPUs
before anything starts, and the int8 comparison says it is a CPU measurement when the trainers used GPUs.

(The trainers' GPU path itself, DDP over nccl with rows fetched from CPU servers, is the library's:
tests/scheduling/test_ps_device.py runs it where CUDA is available.)
"""

from __future__ import annotations

import pytest

from jobs.config import ConfigError, JobConfig
from jobs.launcher.inference import compare
from jobs.launcher.launch import check_gpus
from jobs.launcher.report import table
from recsys.criteo_synth import write_synthetic_criteo
from tests.jobs.test_launcher_inference import CONFIG, _trained_state


def _gpu_config(trainers: int) -> JobConfig:
    return JobConfig().replace(cluster={"use_gpu": True, "trainers": trainers})


@pytest.mark.parametrize("resources", [{"CPU": 2.0}, {"CPU": 16.0, "GPU": 1.0}])
def test_use_gpu_without_a_gpu_per_trainer_is_refused(resources):
    with pytest.raises(ConfigError, match=r"use_gpu = true needs one GPU per trainer \(trainers = 2\), but the Ray "
                                          rf"cluster offers {resources.get('GPU', 0.0):g} GPU\(s\)"):
        check_gpus(_gpu_config(2), resources)


def test_enough_gpus_or_cpu_training_pass_the_check():
    check_gpus(_gpu_config(2), {"CPU": 16.0, "GPU": 2.0})
    check_gpus(JobConfig().replace(cluster={"trainers": 2}), {"CPU": 2.0})   # use_gpu = false: no GPU needed


def _int8_slower(subject, variant, run):
    return 2e-3 if variant.startswith("int8") else 1e-3


@pytest.mark.parametrize("use_gpu", [False, True])
def test_the_int8_comparison_says_it_runs_on_the_cpu(tmp_path, use_gpu):
    data = write_synthetic_criteo(tmp_path / "c.tsv", 400, seed=5)
    config = CONFIG.replace(cluster={"use_gpu": use_gpu})
    r = compare(config, _trained_state(CONFIG), data, timer=_int8_slower)
    assert r["device"] == "cpu"
    results = {"job": "demo", "config": {"cluster": {"trainers": 1, "parameter_servers": 0},
                                         "job": {"steps": 2, "batch_size": 8}}, "phases": {}, "inference": r}
    line = "int8 comparison: a CPU inference measurement (FBGEMM int8 kernels), on the launcher's CPU"
    assert (line in table(results)) is use_gpu
