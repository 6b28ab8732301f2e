"""``[cluster] servers_in_trainers``: the config's refusals and ``"auto"``'s rule on CPU counts
(:mod:`jobs.hosting`); no Ray."""

from __future__ import annotations

import pytest

from jobs.config import ConfigError, JobConfig, parse_config
from jobs.hosting import choose_hosting, cpus_needed
from jobs.launcher import runs
from jobs.launcher.report import table


def _config(**cluster) -> JobConfig:
    """A config with ``cluster``'s keys, over ``torch_rpc`` unless it says (the CPU rule is torch_rpc's)."""
    return JobConfig().replace(cluster={"transport": "torch_rpc", **cluster})


@pytest.mark.parametrize("trainers, cpus_per_trainer, cpus, in_trainers", [
    (2, 1.0, 2, True),     # benchmarks/peer.py's 2-core EPYC (2 trainers, 2 servers): in the trainers was faster
    (2, 1.0, 12, False),   # its 12-core Xeon: separate servers were faster
    (2, 1.0, 4, True),     # 2 + 2 + 1 = 5: a core for each process and the rest
    (2, 1.0, 5, False),
    (2, 0.5, 3, True),     # ceil(2 x 0.5) + 2 + 1 = 4
    (2, 0.5, 4, False),
    (4, 2.0, 12, True),    # 8 + 4 + 1 = 13
    (4, 2.0, 13, False),
    (1, 1.0, 2, True),     # 1 + 1 + 1 = 3
])
def test_auto_puts_the_servers_in_the_trainers_when_they_would_lack_cores(trainers, cpus_per_trainer, cpus,
                                                                          in_trainers):
    config = _config(trainers=trainers, parameter_servers=trainers, cpus_per_trainer=cpus_per_trainer)
    assert config.cluster.servers_in_trainers == "auto"  # the default
    hosting = choose_hosting(config, float(cpus))
    assert hosting.in_trainers is in_trainers and hosting.cpus == cpus
    need = cpus_needed(config.cluster)
    assert (cpus < need) is in_trainers
    assert f"{cpus} CPUs {'<' if in_trainers else '>='} {need}" in hosting.reason
    assert hosting.to_json() == {"chosen": in_trainers, "setting": "auto", "reason": hosting.reason, "cpus": cpus}


def test_auto_keeps_separate_servers_where_the_config_needs_them_or_a_trainer_would_serve_the_others():
    two = {"trainers": 2, "parameter_servers": 2}
    cases = [(_config(**two, transport="ray"), 'transport = "ray"'),
             (_config(**two, transport="socket"), 'transport = "socket" (servers in the trainers over sockets: only'),
             (JobConfig().replace(cluster=two), 'transport = "socket" (servers'),   # the default transport
             (JobConfig().replace(cluster=two, faults={"kill_server_at_step": 5}), "kill_server_at_step"),
             (_config(trainers=2, parameter_servers=3), "parameter_servers = 3 > trainers = 2"),
             (JobConfig(), "parameter_servers = 1 < trainers = 2 (the trainers hosting a server would also serve"),
             (_config(trainers=4, parameter_servers=2), "parameter_servers = 2 < trainers = 4")]
    for config, why in cases:
        hosting = choose_hosting(config, 1.0)
        assert not hosting.in_trainers and why in hosting.reason, hosting.reason
    assert not choose_hosting(_config(**two), None).in_trainers  # CPUs unknown
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


def test_true_puts_the_servers_in_the_trainers_over_sockets_too():
    config = parse_config({"cluster": {"servers_in_trainers": True, "transport": "socket", "parameter_servers": 2}})
    hosting = choose_hosting(config, None)
    assert hosting.in_trainers and hosting.reason == "[cluster] servers_in_trainers = true: the servers run in the trainers"
