"""Job config parsing: defaults, the bundled file, errors that name the bad key, CLI overrides."""

from __future__ import annotations

import pytest

from jobs.cli import apply_overrides, main
from jobs.config import DEFAULT_CONFIG, ConfigError, JobConfig, load_config, parse_config, to_dict


def test_bundled_default_matches_dataclass_defaults():
    # default.toml spells out every key with the dataclass defaults, so both routes agree
    assert to_dict(load_config()) == to_dict(JobConfig())
    assert load_config().source == str(DEFAULT_CONFIG)


def test_values_are_parsed_into_sections(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text('[job]\nsteps = 7\nlr = 1\n[cluster]\ntrainers = 3\n[phases]\npasses = ["fuse", "async_rpc"]\n')
    config = load_config(path)
    assert config.job.steps == 7 and config.job.lr == 1.0 and isinstance(config.job.lr, float)
    assert config.cluster.trainers == 3
    assert config.phases.passes == ["fuse", "async_rpc"]
    assert config.job.batch_size == JobConfig().job.batch_size  # untouched keys keep defaults


@pytest.mark.parametrize(
    "text, match",
    [
        ("[jobb]\nsteps = 1\n", r"unknown table \[jobb\]"),
        ("[job]\nstep = 1\n", r"\[job\] unknown key 'step'"),
        ('[cluster]\ntrainers = "two"\n', r"\[cluster\] trainers: expected int, got str \('two'\)"),
        ("[cluster]\ntrainers = true\n", r"\[cluster\] trainers: expected int, got bool"),
        ('[phases]\npasses = ["fuse", 3]\n', r"\[phases\] passes\[1\]: expected str, got int"),
        ("[job]\nsteps = 0\n", r"\[job\] steps must be >= 1"),
        ("[job]\nsteps = \n", r"invalid TOML"),
    ],
)
def test_errors_name_the_key(tmp_path, text, match):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=match) as info:
        load_config(path)
    assert str(path) in str(info.value)


def test_missing_file():
    with pytest.raises(FileNotFoundError, match="job config not found"):
        load_config("/nonexistent/job.toml")


def test_overrides_parse_toml_values():
    config = apply_overrides(JobConfig(), ["job.steps=20", "phases.passes=[]", "job.name=demo", "metrics.enabled=false"])
    assert (config.job.steps, config.phases.passes, config.job.name, config.metrics.enabled) == (20, [], "demo", False)
    with pytest.raises(ConfigError, match="expected TABLE.KEY=VALUE"):
        apply_overrides(JobConfig(), ["steps=20"])
    with pytest.raises(ConfigError, match=r"\[job\] unknown key 'stepz'"):
        apply_overrides(JobConfig(), ["job.stepz=20"])
    assert parse_config({}).job.steps == JobConfig().job.steps


def test_cli_config_command_and_bad_config_exit_status(capsys, tmp_path):
    assert main(["config", "--set", "job.steps=3"]) == 0
    assert "steps = 3" in capsys.readouterr().out
    bad = tmp_path / "bad.toml"
    bad.write_text("[job]\nsteps = -1\n")
    assert main(["launch", str(bad)]) == 2
    assert "[job] steps must be >= 1" in capsys.readouterr().err


def test_taken_metrics_port_is_a_config_error():
    import socket

    from jobs.launch import _check_ports

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        config = JobConfig().replace(metrics={"port": port})
        with pytest.raises(ConfigError, match=rf"127.0.0.1:{port} is in use.*--set metrics.port="):
            _check_ports(config)
