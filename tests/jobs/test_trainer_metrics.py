"""Prometheus exporter: private registries, label sets, HTTP exposition on loopback; stats helpers."""

from __future__ import annotations

import math
import urllib.request

import pytest
import torch

from jobs.stats import auc, gain_percent, log_loss, percentile, qps_series
from jobs.trainer.metrics import Exporter, free_port_block


def test_exporter_uses_a_private_registry():
    from prometheus_client import REGISTRY

    a, b = Exporter("job", 0), Exporter("job", 1)
    a.observe_step("baseline", samples=128, step_seconds=0.01, lookup_seconds=0.002, loss=0.7)
    a.observe_step("baseline", samples=128, step_seconds=0.03, lookup_seconds=None, loss=0.6)
    labels = {"job": "job", "phase": "baseline", "rank": "0"}
    get = a.registry.get_sample_value
    assert get("fxdist_samples_total", labels) == 256
    assert get("fxdist_step_seconds_count", labels) == 2
    assert get("fxdist_step_seconds_sum", labels) == pytest.approx(0.04)
    assert get("fxdist_ps_lookup_seconds_count", labels) == 1
    assert get("fxdist_loss", labels) == 0.6
    assert b.registry.get_sample_value("fxdist_samples_total", {**labels, "rank": "1"}) is None
    assert REGISTRY.get_sample_value("fxdist_samples_total", labels) is None
    # each phase has its own series (the labelled children are cached per phase)
    a.observe_step("optimized", samples=64, step_seconds=0.02, lookup_seconds=0.001, loss=0.5)
    a.observe_lookup("optimized", 0.004)
    opt = {**labels, "phase": "optimized"}
    assert get("fxdist_samples_total", opt) == 64 and get("fxdist_samples_total", labels) == 256
    assert get("fxdist_ps_lookup_seconds_count", opt) == 2 and get("fxdist_loss", labels) == 0.6
    # the old name stays exported, with the same observations, for one release (README, DEPRECATED_ALIASES)
    assert get("fxdist_rpc_fetch_seconds_count", opt) == 2 and get("fxdist_rpc_fetch_seconds_count", labels) == 1


def test_touch_creates_zero_series_and_http_serves_them():
    e = Exporter("j", "ps0")
    e.touch(["baseline", "optimized"])
    port = e.serve(0)
    try:
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    finally:
        e.close()
    assert 'fxdist_samples_total{job="j",phase="optimized",rank="ps0"} 0.0' in body
    assert 'fxdist_step_seconds_bucket{job="j",le="0.01",phase="baseline",rank="ps0"} 0.0' in body
    assert "python_gc" not in body  # no default collectors in a private registry


def test_port_taken_error_names_the_port():
    a = Exporter("j", 0)
    port = a.serve(0)
    try:
        with pytest.raises(OSError, match=f"cannot bind 127.0.0.1:{port}"):
            Exporter("j", 1).serve(port)
    finally:
        a.close()
    base = free_port_block(3)
    assert 20000 <= base < 60000


def test_auc_and_log_loss():
    labels = torch.tensor([0, 0, 1, 1, 0, 1.0])
    assert auc(torch.tensor([0.1, 0.2, 0.8, 0.9, 0.3, 0.7]), labels) == 1.0
    assert auc(torch.tensor([0.9, 0.8, 0.2, 0.1, 0.7, 0.3]), labels) == 0.0
    assert auc(torch.full((6,), 0.5), labels) == 0.5  # ties count half
    # hand-computed: positives at scores 0.4, 0.6 ; negatives 0.5, 0.1 -> pairs won 3 of 4
    assert auc(torch.tensor([0.4, 0.6, 0.5, 0.1]), torch.tensor([1, 1, 0, 0.0])) == 0.75
    assert math.isnan(auc(torch.tensor([0.1, 0.2]), torch.tensor([1.0, 1.0])))
    p = torch.tensor([0.9, 0.2])
    assert log_loss(p, torch.tensor([1.0, 0.0])) == pytest.approx(-(math.log(0.9) + math.log(0.8)) / 2)


def test_percentile_series_gain():
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 50) == 3.0
    assert percentile([1.0, 2.0], 100) == 2.0
    assert math.isnan(percentile([], 50))
    series = qps_series([0.1 * i for i in range(1, 31)], 100, window=10)
    assert all(q == pytest.approx(1000.0) for _, q in series)
    assert gain_percent(100.0, 110.0) == pytest.approx(10.0)
    assert math.isnan(gain_percent(0.0, 1.0))


def _self_signed(folder, name: str) -> tuple[str, str]:
    """A self-signed certificate for 127.0.0.1 and its key (PEM files), made with the ``openssl`` command (the
    ``cryptography`` package is not a dependency); skips the test without it."""
    import shutil
    import subprocess

    if shutil.which("openssl") is None:
        pytest.skip("no openssl command to make a self-signed certificate (and no cryptography package)")
    cert, key = folder / f"{name}.pem", folder / f"{name}.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", f"/CN={name}",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=60)
    return str(cert), str(key)


def test_an_exporter_serves_https_and_can_require_client_certificates(tmp_path):
    """[metrics] certfile/keyfile: HTTPS on 127.0.0.1; with client_cafile and client_auth_required a scraper
    without a certificate signed by that CA is refused (prometheus_client has no basic auth: this is the lock)."""
    import ssl
    import urllib.error

    from jobs.config import JobConfig
    from jobs.trainer.metrics import tls_options

    cert, key = _self_signed(tmp_path, "server")
    client_cert, client_key = _self_signed(tmp_path, "scraper")
    m = JobConfig().replace(metrics={"certfile": cert, "keyfile": key, "client_cafile": client_cert,
                                     "client_auth_required": True}).metrics
    e = Exporter("j", "0")
    e.touch(["baseline"])
    port = e.serve(0, "127.0.0.1", tls_options(m))
    url = f"https://127.0.0.1:{port}/metrics"
    try:
        trusting = ssl.create_default_context(cafile=cert)
        with pytest.raises((urllib.error.URLError, ssl.SSLError, ConnectionError)):   # no client certificate
            urllib.request.urlopen(url, timeout=5, context=trusting).read()
        with pytest.raises((urllib.error.URLError, ConnectionError)):                  # plain HTTP: no answer
            urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
        trusting.load_cert_chain(client_cert, client_key)
        body = urllib.request.urlopen(url, timeout=5, context=trusting).read().decode()
    finally:
        e.close()
    assert 'fxdist_samples_total{job="j",phase="baseline",rank="0"} 0.0' in body
    with pytest.raises(OSError, match=r"cannot bind 127.0.0.1:0 or read its TLS files"):
        Exporter("j", "1").serve(0, "127.0.0.1", {**tls_options(m), "certfile": str(tmp_path / "missing.pem")})
