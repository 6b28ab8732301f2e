"""Job config parsing: defaults, the bundled file, errors that name the bad key, CLI overrides."""

from __future__ import annotations

import pytest

from jobs import table_sizes
from jobs.config import DEFAULT_CONFIG, ConfigError, JobConfig, load_config, parse_config, to_dict
from jobs.launcher.cli import apply_overrides, main


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
        ("[job]\nsteps = 0\n", r"\[job\] steps = 0: must be an integer in 1\.\.1_000_000_000"),
        ("[job]\nlr = nan\n", r"\[job\] lr = nan: must be a finite number in \(0, 10\]"),
        ('[phases]\npasses = ["async_rpc", "fusee"]\n', r"\[phases\] passes: unknown pass 'fusee'; known passes: "
                                                        r"async_rpc, async_rpc_prefetch, dce, fuse, (\w+, )*reinplace"),
        ("[job]\nsteps = \n", r"invalid TOML"),
        ('[cluster]\ntransport = "tcp"\n', r'\[cluster\] transport = \'tcp\': must be "torch_rpc", "ray" or "socket"'),
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
    assert "[job] steps = -1: must be an integer in 1..1_000_000_000" in capsys.readouterr().err


def test_taken_metrics_port_is_a_config_error():
    import socket

    from jobs.launcher.checks import check_ports

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        config = JobConfig().replace(metrics={"port": port})
        with pytest.raises(ConfigError, match=rf"127.0.0.1:{port} is in use.*--set metrics.port="):
            check_ports(config)


# Every numeric key of every section has a range; one value just outside it per bound, and the message
# names the table, the key, the value and the allowed range.
OUT_OF_RANGE = [
    ("job", "steps", 0, r"an integer in 1\.\.1_000_000_000"),
    ("job", "batch_size", 2**20 + 1, r"an integer in 1\.\.1_048_576"),
    ("job", "eval_epochs", float("inf"), r"a finite number in \[0, 1000\]"),
    ("job", "eval_epochs", -0.5, r"a finite number in \[0, 1000\]"),
    ("job", "seed", -1, r"an integer in 0\.\.4_294_967_295"),
    ("job", "lr", -1.0, r"a finite number in \(0, 10\]"),
    ("cluster", "server_threads", 0, r"an integer in 1\.\.1_024"),
    ("train", "table_lr", -0.1, r"a finite number in \[0, 10\]"),
    ("job", "lr", 0.0, r"a finite number in \(0, 10\]"),
    ("job", "lr", float("nan"), r"a finite number in \(0, 10\]"),
    ("job", "checkpoint_every", -1, r"an integer in 0\.\.1_000_000_000"),
    ("job", "max_failures", -1, r"an integer in 0\.\.1_000"),
    ("data", "synthetic_rows", 0, r"an integer in 1\.\.10_000_000"),
    ("data", "eval_fraction", 0.9, r"a finite number in \[0, 0\.5\]"),
    ("data", "reader_workers", 65, r"an integer in 0\.\.64"),
    ("data", "eval_max_rows", 0, r"an integer in 1\.\.100_000_000"),
    ("data", "follow_poll_s", 0.0, r"a finite number in \[0\.01, 60\]"),
    ("export", "every_steps", -1, r"an integer in 0\.\.1_000_000_000"),
    ("model", "embedding_dim", 10**6, r"an integer in 1\.\.4_096"),
    ("model", "table_size", 1, r"an integer in 2\.\.4_294_967_296"),
    ("model", "table_size", 2**32 + 1, r"an integer in 2\.\.4_294_967_296"),
    ("model", "table_sizes", [5] * 25, r"a list of 26 to 26 items"),
    ("model", "table_sizes", [5] * 25 + [1], r"item 25 \(1\) is out of range: each must be an integer in 2\.\."),
    ("model", "max_table_size", 1, r"an integer in 2\.\.4_294_967_296"),
    ("model", "dynamic_capacity", 0, r"an integer in 1\.\.4_294_967_296"),
    ("model", "dynamic_min_count", 0, r"an integer in 1\.\.1_000_000_000"),
    ("model", "dynamic_expire_steps", -1, r"an integer in 0\.\.1_000_000_000"),
    ("model", "local_below_rows", -1, r"an integer in 0\.\.4_294_967_296"),
    ("model", "bottom_mlp", [], r"a list of 1 to 16 items"),
    ("model", "top_mlp", [8, 0], r"item 1 \(0\) is out of range: each must be an integer in 1\.\.65_536"),
    ("cluster", "trainers", 0, r"an integer in 1\.\.1_024"),
    ("cluster", "parameter_servers", 27, r"an integer in 0\.\.26"),
    ("cluster", "cpus_per_trainer", 0.0, r"a finite number in \(0, 1024\]"),
    ("cluster", "rpc_timeout_s", float("inf"), r"a finite number in \(0, 3600\]"),
    ("cluster", "server_fetch_delay_ms", -1.0, r"a finite number in \[0, 10000\]"),
    ("phases", "passes", ["dce"] * 33, r"a list of 0 to 32 items"),
    ("phases", "block_steps", 0, r"an integer in 1\.\.1_000_000_000"),
    ("phases", "max_staleness", -1, r"an integer in 0\.\.64"),
    ("phases", "staleness_tolerance", 1.5, r"a finite number in \[0, 1\]"),
    ("metrics", "port", 0, r"an integer in 1\.\.65_535"),
    ("quant", "calibration_batches", -1, r"an integer in 1\.\.10_000"),
    ("quant", "calibration_batches", 0, r"an integer in 1\.\.10_000"),
    ("quant", "eval_batch_size", 0, r"an integer in 1\.\.1_048_576"),
    ("faults", "kill_trainer_at_step", -2, r"an integer in -1\.\.1_000_000_000"),
    ("faults", "pause_at_step", -2, r"an integer in -1\.\.1_000_000_000"),
    ("faults", "pause_seconds", -1.0, r"a finite number in \[0, 3600\]"),
]


def test_table_sizes_are_uniform_data_or_26_sizes():
    assert table_sizes.sizes(JobConfig()) == [20000] * 26
    sizes = list(range(2, 28))
    assert table_sizes.sizes(JobConfig().replace(model={"table_sizes": sizes})) == sizes
    unresolved = JobConfig().replace(model={"table_sizes": "data"})
    with pytest.raises(ConfigError, match=r'table_sizes = "data" has not been resolved'):
        table_sizes.sizes(unresolved)
    with pytest.raises(ConfigError, match=r'\[model\] table_sizes = \'all\': must be "uniform", "data", "dynamic" or a list'):
        JobConfig().replace(model={"table_sizes": "all"})
    with pytest.raises(ConfigError, match=r"\[model\] table_sizes: expected a list or str, got int \(7\)"):
        JobConfig().replace(model={"table_sizes": 7})


def test_a_plan_keeps_your_tables_local_and_refuses_local_for_the_builtin_dlrm():
    yours = JobConfig().replace(model={"factory": "mypkg.models:make", "plan": {"pos": "local", "t_C1": 0},
                                       "local_below_rows": 0}, data={"batches": "mypkg.data:batches"})
    assert yours.model.plan == {"pos": "local", "t_C1": 0} and yours.model.local_below_rows == 0
    assert JobConfig().model.local_below_rows == 32
    with pytest.raises(ConfigError, match=r"\[model\] plan: t_C1 = \"local\": only your model's tables \(\[model\] "
                                          r"factory\) can stay on the trainers; for the built-in DLRM's set \[cluster\] "
                                          r"parameter_servers = 0"):
        JobConfig().replace(model={"plan": {"t_C1": "local"}})


def test_parity_mode_is_error_or_warn():
    assert JobConfig().replace(phases={"parity": "warn"}).phases.parity == "warn"
    with pytest.raises(ConfigError, match=r'\[phases\] parity = \'off\': must be "error" or "warn"'):
        JobConfig().replace(phases={"parity": "off"})


@pytest.mark.parametrize("table, key, value, allowed", OUT_OF_RANGE)
def test_every_key_has_a_range(table, key, value, allowed):
    with pytest.raises(ConfigError, match=rf"\[{table}\] {key} = .*: .*{allowed}"):
        JobConfig().replace(**{table: {key: value}})


def test_the_range_table_covers_every_numeric_key():
    import dataclasses

    tested = {(t, k) for t, k, _, _ in OUT_OF_RANGE}
    config = JobConfig()
    for table in to_dict(config):
        for f in dataclasses.fields(getattr(config, table)):
            numeric = f.type in ("int", "float", "list[int]", "list[str]", "list[int] | str")
            assert numeric == ("range" in f.metadata), (table, f.name)
            assert not numeric or (table, f.name) in tested or f.name == "kill_server_at_step", (table, f.name)


@pytest.mark.parametrize(
    "changes, match",
    [
        # the exporters use port .. port + trainers + servers - 1
        ({"metrics": {"port": 65535}}, r"\[metrics\] port = 65535: the exporters use ports 65535\.\.65537 .*"
                                       r"use a base <= 65533"),
        ({"job": {"name": "../../etc/x"}}, r"\[job\] name = '\.\./\.\./etc/x': it names the run folder, so it may "
                                           r"only contain letters, digits, '\.', '_' and '-', must not start with '\.'"),
        ({"job": {"name": ".hidden"}}, r"must not start with '\.'"),
        ({"job": {"name": "a/b"}}, r"\[job\] name = 'a/b'"),
        ({"job": {"name": ""}}, r"\[job\] name = ''"),
        ({"job": {"run_dir": " "}}, r"\[job\] run_dir must not be empty"),
        ({"metrics": {"host": ""}}, r"\[metrics\] host must not be empty"),
        ({"faults": {"kill_trainer_at_step": 201}}, r"\[faults\] kill_trainer_at_step = 201: must be -1 \(never\) "
                                                    r"or a step in 1\.\.\[job\] steps = 200"),
        ({"faults": {"kill_server_at_step": 0}}, r"\[faults\] kill_server_at_step = 0"),
        ({"faults": {"kill_server_at_step": 5}, "cluster": {"parameter_servers": 0}},
         r"kill_server_at_step is set but \[cluster\] parameter_servers = 0"),
        ({"faults": {"pause_at_step": 0}}, r"\[faults\] pause_at_step = 0: must be -1 \(never\) or a step"),
        ({"faults": {"pause_at_step": 5, "pause_seconds": 30.0}},
         r"\[faults\] pause_seconds = 30\.0: must be below \[cluster\] rpc_timeout_s = 30\.0"),
    ],
)
def test_constraints_between_keys(changes, match):
    with pytest.raises(ConfigError, match=match):
        JobConfig().replace(**changes)


def test_edges_of_the_ranges_are_accepted():
    config = JobConfig().replace(
        job={"name": "a.b_c-1", "max_failures": 0, "lr": 10, "eval_epochs": 0, "seed": 2**32 - 1},
        metrics={"port": 65533}, data={"eval_fraction": 0.5}, model={"table_size": 2},
        cluster={"parameter_servers": 0}, phases={"passes": []}, faults={"kill_trainer_at_step": 200})
    assert config.metrics.port == 65533 and config.job.name == "a.b_c-1"
    # with metrics off, the port range does not matter
    assert JobConfig().replace(metrics={"enabled": False, "port": 65535}).metrics.port == 65535


@pytest.mark.parametrize("host", ["0.0.0.0", "node", "192.0.2.7", "::", "myhost.example"])
def test_a_metrics_host_beyond_loopback_needs_expose(host):
    """A non-loopback [metrics] host serves every exporter to the network: refused unless expose = true."""
    with pytest.raises(ConfigError, match=rf"\[metrics\] host = '{host}' is not a loopback address: .*set "
                                          r"\[metrics\] expose = true"):
        JobConfig().replace(metrics={"host": host})
    assert JobConfig().replace(metrics={"host": host, "expose": True}).metrics.expose
    assert JobConfig().replace(metrics={"host": host, "enabled": False}).metrics.host == host  # nothing served


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "localhost", "::1"])
def test_loopback_metrics_hosts_need_nothing(host):
    assert JobConfig().replace(metrics={"host": host}).metrics.expose is False


def test_defaults_of_the_exposure_keys():
    m, c = load_config().metrics, load_config().cluster
    assert (m.host, m.expose, m.certfile, m.keyfile, m.client_cafile, m.client_auth_required) == (
        "127.0.0.1", False, "", "", "", False)
    assert c.allow_unauthenticated is False


@pytest.mark.parametrize("metrics, match", [
    ({"certfile": "c.pem"}, r"certfile and keyfile go together"),
    ({"keyfile": "k.pem"}, r"certfile and keyfile go together"),
    ({"client_cafile": "ca.pem"}, r"client_cafile needs certfile and keyfile"),
    ({"certfile": "c.pem", "keyfile": "k.pem", "client_auth_required": True}, r"client_auth_required = true needs "
                                                                                r"client_cafile"),
    ({"expose": "yes"}, r"\[metrics\] expose: expected bool"),
])
def test_the_tls_keys_go_together(metrics, match):
    with pytest.raises(ConfigError, match=match):
        JobConfig().replace(metrics=metrics)


def test_tls_options_are_start_http_servers_keywords():
    from jobs.trainer.metrics import tls_options

    assert tls_options(JobConfig().metrics) is None
    m = JobConfig().replace(metrics={"certfile": "c.pem", "keyfile": "k.pem", "client_cafile": "ca.pem",
                                     "client_auth_required": True}).metrics
    assert tls_options(m) == {"certfile": "c.pem", "keyfile": "k.pem", "client_cafile": "ca.pem",
                              "client_auth_required": True}


def test_torch_rpc_on_a_cluster_needs_allow_unauthenticated():
    """The launcher's checks (before Ray starts) refuse torch_rpc when the job runs on a cluster, saying why."""
    from jobs.launcher.checks import check

    config = JobConfig().replace(cluster={"transport": "torch_rpc"})
    with pytest.raises(ConfigError, match=r'(?s)transport = "torch_rpc" on a Ray cluster: torch.distributed.rpc has no '
                                          r"authentication, and its rendezvous store listens on every interface.*"
                                          r'Use transport = "socket".*allow_unauthenticated = true'):
        check(config, local=False)
    with pytest.raises(ConfigError, match=r"\[cluster\] allow_unauthenticated: expected bool"):
        JobConfig().replace(cluster={"allow_unauthenticated": 1})
    from jobs.config_rules import torch_rpc_error

    allowed = config.replace(cluster={"allow_unauthenticated": True}).cluster
    assert torch_rpc_error(allowed, on_cluster=True) is None                          # the risk accepted
    assert torch_rpc_error(config.cluster, on_cluster=False) is None                  # one host, loopback rendezvous
    assert torch_rpc_error(JobConfig().cluster, on_cluster=True) is None              # socket: authenticated
    assert torch_rpc_error(config.replace(cluster={"parameter_servers": 0}).cluster, on_cluster=True) is None


def test_tls_is_off_by_default_and_needs_the_socket_transport():
    assert JobConfig().cluster.tls is False
    assert JobConfig().replace(cluster={"tls": True}).cluster.tls is True     # socket, the default transport
    for transport in ("ray", "torch_rpc"):
        with pytest.raises(ConfigError, match=rf'\[cluster\] tls = true needs transport = "socket" \(not '
                                              rf"'{transport}'\)"):
            JobConfig().replace(cluster={"tls": True, "transport": transport})


def test_every_section_of_jobs_config_sections_is_a_table_of_the_config():
    import dataclasses

    import jobs.config_sections as sections

    tables = {config_field.name: config_field.type for config_field in dataclasses.fields(JobConfig)
              if config_field.name not in ("source", "named")}
    defined = {name for name in sections.__all__ if name.endswith("Section")}
    assert set(tables.values()) == defined, "a section class that is not a table of JobConfig, or the other way round"
    assert JobConfig().export == sections.ExportSection() and JobConfig().export.every_steps == 0
    assert JobConfig().data.follow is False


def test_follow_needs_a_folder_or_a_glob_the_criteo_reader_and_no_data_table_sizes(tmp_path):
    (tmp_path / "day_0").write_text("")
    follow = JobConfig().replace(data={"follow": True, "path": str(tmp_path)})
    follow.validate()
    follow.replace(data={"path": str(tmp_path / "part-*.tsv")}).validate()
    for change, match in [({"data": {"path": ""}}, r"\[data\] follow = true needs \[data\] path = a folder or a glob"),
                          ({"data": {"path": str(tmp_path / "day_0")}}, r"not the file '.*day_0'"),
                          ({"data": {"batches": "m:f"}, "model": {"factory": "m:g"}},
                           r"\[data\] follow = true .* cannot follow \[data\] batches = 'm:f'"),
                          ({"model": {"table_sizes": "data"}}, r'\[model\] table_sizes = "data": the sizes come')]:
        with pytest.raises(ConfigError, match=match):
            follow.replace(**change).validate()
    JobConfig().replace(data={"path": str(tmp_path / "day_0")}).validate()  # without follow, a file is fine


def test_an_unset_job_name_follows_the_model_and_a_set_one_is_kept(tmp_path):
    from jobs.config_sections import NAME_PATTERN, default_name

    user = {"model": {"factory": "mypkg.models:make_model"}, "data": {"batches": "mypkg.data:batches"}}
    assert parse_config({}).job.name == load_config().job.name == "dlrm-criteo"  # the built-in DLRM
    assert parse_config(user).job.name == "models-make_model"
    assert parse_config({**user, "job": {"name": "dlrm-criteo"}}).job.name == "dlrm-criteo"  # set: kept
    assert parse_config({**user, "job": {"name": "mine"}}).job.name == "mine"
    # --set on the bundled default (which leaves the name unset) derives it again; a name set stays through --set
    derived = apply_overrides(load_config(), ['model.factory="jobs.movielens:model"', 'data.batches="jobs.movielens:batches"'])
    assert derived.job.name == "movielens-model" and not derived.named
    assert apply_overrides(derived, ['job.name="mf"', "job.steps=3"]).job.name == "mf"
    assert apply_overrides(apply_overrides(derived, ['job.name="mf"']), ['model.factory="a.b:c"']).job.name == "mf"
    assert load_config("jobs/movielens.toml").job.name == "movielens-mf"
    assert apply_overrides(derived, ['model.factory=""', 'data.batches=""']).job.name == "dlrm-criteo"
    for factory in ("a.b:c", "weird mod:fn$", ".hidden:x", ":", "m" * 300 + ":f"):
        assert NAME_PATTERN.fullmatch(default_name(factory)), factory
    assert default_name(":") == "user-model" and default_name("weird mod:fn$") == "weird_mod-fn_"
