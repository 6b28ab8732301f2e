"""``[cluster] servers_in_trainers`` (issue 32): the config's refusals and ``"auto"``'s rule on CPU counts
(:mod:`jobs.hosting`); no Ray."""

from __future__ import annotations

import pytest

from jobs.config import ConfigError, JobConfig, parse_config
from jobs.hosting import choose_hosting, cpus_needed
from jobs.launcher import runs
from jobs.launcher.report import table


def _config(**cluster) -> JobConfig:
    return JobConfig().replace(cluster=cluster)


@pytest.mark.parametrize("trainers, servers, cpus_per_trainer, cpus, in_trainers", [
    (2, 1, 1.0, 2, True),     # the default job on 2 cores: 2 < 2 + 1 + 1
    (2, 2, 1.0, 2, True),     # benchmarks/peer.py's 2-core EPYC: in the trainers was faster
    (2, 2, 1.0, 12, False),   # its 12-core Xeon: separate servers were faster
    (2, 1, 1.0, 4, False),    # a core for each of 2 trainers, 1 server and the rest
    (2, 2, 1.0, 4, True),
    (2, 2, 1.0, 5, False),
    (2, 1, 0.5, 2, True),     # ceil(2 x 0.5) + 1 + 1 = 3
    (2, 1, 0.5, 3, False),
    (4, 2, 2.0, 10, True),    # 8 + 2 + 1 = 11
    (4, 2, 2.0, 11, False),
])
def test_auto_puts_the_servers_in_the_trainers_when_they_would_lack_cores(trainers, servers, cpus_per_trainer,
                                                                          cpus, in_trainers):
    config = _config(trainers=trainers, parameter_servers=servers, cpus_per_trainer=cpus_per_trainer)
    assert config.cluster.servers_in_trainers == "auto"  # the default
    hosting = choose_hosting(config, float(cpus))
    assert hosting.in_trainers is in_trainers and hosting.cpus == cpus
    need = cpus_needed(config.cluster)
    assert (cpus < need) is in_trainers
    assert f"{cpus} CPUs {'<' if in_trainers else '>='} {need}" in hosting.reason
    assert hosting.to_json() == {"chosen": in_trainers, "setting": "auto", "reason": hosting.reason, "cpus": cpus}


def test_auto_keeps_separate_servers_where_the_config_needs_them():
    cases = [(_config(transport="ray"), 'transport = "ray"'),
             (JobConfig().replace(faults={"kill_server_at_step": 5}), "kill_server_at_step"),
             (_config(trainers=2, parameter_servers=3), "parameter_servers = 3 > trainers = 2")]
    for config, why in cases:
        hosting = choose_hosting(config, 1.0)
        assert not hosting.in_trainers and why in hosting.reason, hosting.reason
    assert not choose_hosting(JobConfig(), None).in_trainers  # CPUs unknown
    none = choose_hosting(_config(parameter_servers=0), 1.0)
    assert not none.in_trainers and "parameter_servers = 0" in none.reason


def test_true_and_false_ignore_the_cpus():
    assert choose_hosting(_config(servers_in_trainers=True), 64.0).in_trainers
    assert not choose_hosting(_config(servers_in_trainers=False), 1.0).in_trainers
    assert choose_hosting(_config(servers_in_trainers=True, parameter_servers=2), None).in_trainers


@pytest.mark.parametrize("raw, message", [
    ({"cluster": {"servers_in_trainers": "yes"}}, r'servers_in_trainers = \'yes\': must be true, false or "auto"'),
    ({"cluster": {"servers_in_trainers": 1}}, r"servers_in_trainers: expected bool or str, got int"),
    ({"cluster": {"servers_in_trainers": True, "parameter_servers": 0}},
     r"servers_in_trainers = true needs \[cluster\] parameter_servers >= 1"),
    ({"cluster": {"servers_in_trainers": True, "transport": "ray"}},
     r'servers_in_trainers = true: \[cluster\] transport = "ray" calls the server actors'),
    ({"cluster": {"servers_in_trainers": True}, "faults": {"kill_server_at_step": 3}},
     r"servers_in_trainers = true: \[faults\] kill_server_at_step kills a server process"),
    ({"cluster": {"servers_in_trainers": True, "trainers": 2, "parameter_servers": 3}},
     r"servers_in_trainers = true: \[cluster\] parameter_servers = 3 > trainers = 2"),
])
def test_config_refuses_what_servers_in_the_trainers_cannot_do(raw, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(raw)


def test_the_setting_may_change_on_resume_and_the_table_says_where_the_servers_ran():
    saved = JobConfig()
    runs.check_resume_changes(saved, saved.replace(cluster={"servers_in_trainers": True}))  # same checkpoints
    results = {"job": "x", "config": {"cluster": {"trainers": 2, "parameter_servers": 1}, "job": {"steps": 4}},
               "phases": {}}
    assert "1 parameter server, 4 steps" in table(results)
    results["servers_in_trainers"] = {"chosen": True, "setting": "auto", "reason": "r", "cpus": 2.0}
    assert "1 parameter server (in the trainers), 4 steps" in table(results)
