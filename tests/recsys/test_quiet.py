"""recsys.quiet: each known noise line is dropped, and the lines around it still show."""

from __future__ import annotations

import logging
import os
import warnings

from recsys import quiet


def test_the_stderr_filter_drops_tensorpipe_shutdown_lines_and_keeps_the_others(capfd):
    noise = ("[W1126 13:54:22.928249493 tensorpipe_agent.cpp:723] RPC agent for ps1 encountered error when reading "
             "incoming request from trainer: EOF: end of file (this error originated at tensorpipe/transport/uv/"
             "connection_impl.cc:132)\n")
    closed = ("[W1126 13:54:23.131188218 tensorpipe_agent.cpp:723] RPC agent for ps0 encountered error when reading "
              "incoming request from ps1: pipe closed (this error originated at tensorpipe/core/pipe_impl.cc:356)\n")
    real = "[E1126 13:54:23.1 tensorpipe_agent.cpp:723] RPC agent for ps0 failed: connection refused\n"
    with quiet.filtered_stderr():
        os.write(2, noise.encode())
        os.write(2, real.encode())
        os.write(2, closed.encode())
        os.write(2, b"Traceback (most recent call last):\n")
    err = capfd.readouterr().err
    assert err == real + "Traceback (most recent call last):\n"
    os.write(2, b"after\n")  # fd 2 is the real one again
    assert capfd.readouterr().err == "after\n"


def test_the_fx_tracing_notice_is_dropped_and_other_records_pass(caplog):
    import recsys  # noqa: F401  (installs the filter)

    logger = logging.getLogger("torch.fx._symbolic_trace")
    with caplog.at_level(logging.WARNING, logger="torch.fx._symbolic_trace"):
        logger.warning("is_fx_tracing will return true for both fx.symbolic_trace and torch.export. Please use ...")
        logger.warning("something else went wrong")
    assert [r.getMessage() for r in caplog.records] == ["something else went wrong"]
    quiet.quiet_fx_tracing_notice()  # installing again adds no second filter
    assert sum(isinstance(f, quiet._Drop) for f in logger.filters) == 1


def test_a_kjt_construction_prints_no_notice(capfd):
    import subprocess
    import sys

    code = ("import recsys, torch; from torchrec import KeyedJaggedTensor; "
            "KeyedJaggedTensor(keys=['f'], values=torch.tensor([1]), lengths=torch.tensor([1])); print('ok')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == "ok" and "is_fx_tracing" not in proc.stderr, proc.stderr


def test_the_gloo_deprecation_warning_is_ignored_around_rpc_init_only():
    message = ("You are using a Backend <class 'torch.distributed.distributed_c10d.ProcessGroupGloo'> as a "
               "ProcessGroup. This usage is deprecated since PyTorch 2.0. Please use a public API of PyTorch "
               "Distributed instead.")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        # B028: the filter under test matches messages; where a warning points does not matter here
        with quiet.rpc_init_warnings_filtered():
            warnings.warn(message, UserWarning)  # noqa: B028
            warnings.warn("another warning", UserWarning)  # noqa: B028
        warnings.warn(message, UserWarning)  # noqa: B028
    assert [str(w.message) for w in seen] == ["another warning", message]


def test_the_ray_token_notice_is_dropped_and_errors_pass(caplog):
    name = quiet.RAY_TOKEN_AUTH_LOGGER
    quiet.drop_log_records(name, quiet.RAY_TOKEN_AUTH_ENABLED)
    logger = logging.getLogger(name)
    with caplog.at_level(logging.INFO, logger=name):
        logger.warning("Token authentication is enabled for this Ray cluster. Set RAY_AUTH_MODE=disabled to opt out.")
        logger.error("Token authentication failed")
    assert [r.getMessage() for r in caplog.records] == ["Token authentication failed"]
