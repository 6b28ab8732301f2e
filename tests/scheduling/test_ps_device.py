"""A trainer on any device with CPU parameter servers (:mod:`scheduling.ps.device`).

The servers and their RPC group stay on the CPU; a model on CUDA sends CPU ids and gradients and gets its
rows on its own device, through pinned memory and a side stream. Differential: a model on the GPU trained
with its tables on 2 real servers (blocking, and with ``async_rpc_prefetch``) gives the losses and tables of
the same model trained with local tables on the GPU.

The tests marked ``cuda`` need a CUDA device and skip without one; the others run everywhere.
"""

from __future__ import annotations

import copy
import functools
import threading
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor

import fxdist
import scheduling
from scheduling import placement
from scheduling.ps import LocalCluster, get_client
from scheduling.ps.device import Lookup, RowCopyError, decode, to_host
from tests.scheduling._graphs import offline_client

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch.cuda.is_available() "
                                                                "is False on this machine)")
LR_TABLES = 0.05
B, STEPS = 8, 4


class Hybrid(nn.Module):
    """A ``KeyedJaggedTensor`` into an ``EmbeddingBagCollection``, a ``(B, 2)`` id tensor into an
    ``nn.EmbeddingBag`` (mean) and its last column into an ``nn.Embedding``, and a dense MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection(tables=[
            EmbeddingBagConfig(name="t0", embedding_dim=4, num_embeddings=23, feature_names=["f0"]),
            EmbeddingBagConfig(name="t1", embedding_dim=4, num_embeddings=17, feature_names=["f1", "f2"])])
        self.bag = nn.EmbeddingBag(11, 4, mode="mean")
        self.item = nn.Embedding(9, 4)
        self.dense = nn.Linear(5, 4)
        self.top = nn.Linear(24, 1)

    def forward(self, dense, ids, kjt):
        parts = [self.dense(dense), self.ebc(kjt).values(), self.bag(ids), self.item(ids[:, 1] % 9)]
        return self.top(torch.cat(parts, dim=1)).squeeze(1)


def _batches(seed: int) -> list[tuple[tuple, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(STEPS):
        lengths = torch.randint(0, 3, (3 * B,), generator=gen)
        highs = torch.tensor([23, 17, 17]).repeat_interleave(B).repeat_interleave(lengths)
        values = (torch.rand(int(lengths.sum()), generator=gen) * highs).long()
        kjt = KeyedJaggedTensor(keys=["f0", "f1", "f2"], values=values, lengths=lengths)
        inputs = (torch.rand(B, 5, generator=gen), torch.randint(0, 11, (B, 2), generator=gen), kjt)
        out.append((inputs, torch.rand(B, generator=gen).round()))
    return out


def _on(inputs: tuple, device: str, kjt_device: str) -> tuple:
    dense, ids, kjt = inputs
    return dense.to(device), ids.to(device), kjt.to(torch.device(kjt_device))


def _tables(model: nn.Module) -> dict[str, nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if "ebc" in n or n.startswith(("bag.", "item."))}


def _train_local(model: nn.Module, batches: list, device: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = model.to(device)
    tables = _tables(model)
    dense_opt = torch.optim.SGD([p for n, p in model.named_parameters() if n not in tables], lr=0.1)
    table_opt = torch.optim.SGD(list(tables.values()), lr=LR_TABLES)
    losses = []
    for inputs, labels in batches:
        loss = F.binary_cross_entropy_with_logits(model(*_on(inputs, device, device)), labels.to(device))
        dense_opt.zero_grad()
        table_opt.zero_grad()
        loss.backward()
        dense_opt.step()
        table_opt.step()
        losses.append(loss.item())
    return losses, {n: w.detach().cpu() for n, w in tables.items()}


def _train_on_servers(model: nn.Module, batches: list, device: str, prefetch: bool, kjt_device: str):
    """(losses, tables as the model's state dict names them, prefetch hits, lookups per step)."""
    model = model.to(device)
    ps = functools.partial(scheduling.parameter_servers, optimizer="sgd", lr=LR_TABLES, verbose=False)
    gm = fxdist.optimize(model, passes=(ps, "async_rpc_prefetch") if prefetch else (ps,))
    try:
        opt = torch.optim.SGD(gm.parameters(), lr=0.1)
        losses = []
        moved = [(_on(inputs, device, kjt_device), labels) for inputs, labels in batches]  # moved once, as a job does
        for (inputs, labels), nxt in scheduling.lookahead(moved):
            extra = {}
            if prefetch:  # the same input objects the next step gets: its lookups were prefetched for them
                ahead = (None,) * 3 if nxt is None else nxt[0]
                extra = {"next_dense": ahead[0], "next_ids": ahead[1], "next_kjt": ahead[2]}
                extra = {k: v for k, v in extra.items() if k in gm.forward.__code__.co_varnames}
            out = gm(*inputs, **extra)
            assert out.device.type == torch.device(device).type
            loss = F.binary_cross_entropy_with_logits(out, labels.to(device))
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        placement.flush(gm)
        clients = [get_client(n) for n in placement.client_names(gm)]
        state = placement.table_state_dict(gm)
        return losses, state, sum(c.prefetch_hits for c in clients), sum(len(c.servers_for()) for c in clients)
    finally:
        placement.close(gm)


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(2, timeout_s=30) as cl:
        yield cl


def _assert_trains_as_local(device: str, kjt_device: str, cluster) -> None:
    torch.manual_seed(0)
    model = Hybrid()
    batches = _batches(seed=3)
    ref_losses, ref_tables = _train_local(copy.deepcopy(model), batches, device)
    blocking = _train_on_servers(copy.deepcopy(model), batches, device, False, kjt_device)
    losses, tables, hits, fetches = _train_on_servers(model, batches, device, True, kjt_device)
    for run_losses, run_tables in ((blocking[0], blocking[1]), (losses, tables)):
        torch.testing.assert_close(run_losses, ref_losses, rtol=1e-5, atol=1e-6)
        assert run_tables.keys() == ref_tables.keys()
        for key in ref_tables:
            torch.testing.assert_close(run_tables[key].cpu(), ref_tables[key], rtol=1e-5, atol=1e-6)
    assert losses == blocking[0]              # same rows from the servers either way
    assert hits == fetches * (STEPS - 1)      # every lookup after the first step was prefetched


def test_cpu_model_trains_as_local(cluster):
    """The reference case of the GPU test below, on the CPU (so the harness itself is checked in CI)."""
    _assert_trains_as_local("cpu", "cpu", cluster)


@CUDA
@pytest.mark.parametrize("kjt_device", ["cuda", "cpu"])
def test_gpu_model_with_cpu_servers_trains_as_local(cluster, kjt_device):
    """Rows reach the model's GPU whether the ids are on the GPU or (as the job keeps a server model's
    ``KeyedJaggedTensor``) on the CPU; losses and tables match local GPU tables."""
    _assert_trains_as_local("cuda", kjt_device, cluster)


@CUDA
def test_meta_tables_rows_go_to_the_dense_device(cluster):
    """Tables on ``meta`` (the servers initialise them) take the device of the model's other parameters."""
    model = Hybrid()
    model.ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name="t0", embedding_dim=4, num_embeddings=23,
                                                                  feature_names=["f0", "f1", "f2"])],
                                       device=torch.device("meta"))
    for module in (model.dense, model.bag, model.item, model.top):
        module.cuda()
    ps = functools.partial(scheduling.parameter_servers, optimizer="sgd", lr=LR_TABLES, verbose=False)
    gm = fxdist.optimize(model, passes=(ps,))
    try:
        (inputs, _), = _batches(seed=1)[:1]
        out = gm(*_on(inputs, "cuda", "cpu"))
        assert out.device.type == "cuda"
        assert {get_client(n).device.type for n in placement.client_names(gm)} == {"cuda"}
    finally:
        placement.close(gm)


@CUDA
def test_lookup_copies_on_a_side_stream_as_the_rows_arrive():
    """The copy starts when the Future completes (before anyone waits) on the side stream; waiting makes the
    current stream wait for it."""
    future = torch.futures.Future()
    lookup = Lookup(future, torch.device("cuda"))
    rows = torch.randn(B, 4)
    threading.Thread(target=lambda: (time.sleep(0.05), future.set_result(rows))).start()
    future.wait()
    deadline = time.time() + 5
    while lookup._staged is None and time.time() < deadline:
        time.sleep(0.01)
    assert lookup._staged is not None                 # staged by the callback, not by wait()
    assert lookup._staged.rows.device.type == "cuda"
    out = lookup.wait()
    assert out.device.type == "cuda" and torch.equal(out.cpu(), rows)


@CUDA
def test_cuda_ids_out_of_range_raise_the_cpu_error(cluster):
    """A local ``nn.Embedding`` on CUDA would hit a device-side assert; the moved one raises IndexError."""
    model = nn.Sequential(nn.Embedding(9, 4)).cuda()
    ps = functools.partial(scheduling.parameter_servers, optimizer="sgd", lr=LR_TABLES, verbose=False)
    gm = fxdist.optimize(model, passes=(ps,))
    try:
        with pytest.raises(IndexError, match="index out of range in self"):
            gm(torch.tensor([3, 9], device="cuda"))
        assert gm(torch.tensor([3, 8], device="cuda")).device.type == "cuda"
    finally:
        placement.close(gm)


# ---- everywhere -------------------------------------------------------------------------------------------------
def test_to_host_copies_only_what_is_not_on_the_cpu():
    t = torch.randn(3)
    assert to_host(t) is t and to_host(None) is None and to_host(5) == 5


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
@pytest.mark.parametrize("error", [ValueError("bad table"), KeyError("t9"), RuntimeError("EOF from server")])
def test_a_lookup_raises_the_servers_error_as_raised(device, error):
    """``Future.then`` would turn every error into a RuntimeError; a lookup keeps the class (the client maps only
    plain RuntimeErrors, the transport's, to PSUnavailableError)."""
    future = torch.futures.Future()
    lookup = Lookup(future, torch.device(device))
    future.set_exception(error)
    with pytest.raises(type(error)) as info:
        lookup.wait()
    assert type(info.value) is type(error)


def test_a_lookup_decodes_fused_8bit_rows_and_takes_its_part_of_a_tuple():
    pytest.importorskip("fbgemm_gpu")
    rows = torch.randn(B, 8)
    packed = torch.ops.fbgemm.FloatToFused8BitRowwiseQuantized(rows)
    future = torch.futures.Future()
    lookup = Lookup(future, torch.device("cpu"), "fused8bit", index=1)
    future.set_result((3, packed))
    out = lookup.wait()
    assert torch.equal(out, decode(packed, "fused8bit"))
    torch.testing.assert_close(out, rows, atol=0.05, rtol=0.02)


def test_a_failed_copy_is_not_taken_for_a_dead_server():
    """An error bringing the rows over (here: a tuple index that is not there) is a RowCopyError, not the
    RuntimeError the client would report as the server being unavailable."""
    future = torch.futures.Future()
    lookup = Lookup(future, torch.device("cpu"), index=2)
    future.set_result((1, torch.zeros(1)))
    with pytest.raises(RowCopyError, match="copying a lookup's rows to cpu failed: IndexError"):
        lookup.wait()


def test_rows_follow_accelerator_ids_else_the_clients_device():
    client = offline_client("device-rule")
    try:
        kjt = KeyedJaggedTensor(keys=["f0"], values=torch.tensor([1]), lengths=torch.tensor([1]))
        assert client.device is None and client.rows_device(kjt) == torch.device("cpu")
        client.device = torch.device("meta")
        assert client.rows_device(kjt) == torch.device("meta")     # CPU ids: the client's device
        meta = KeyedJaggedTensor(keys=["f0"], values=torch.tensor([1], device="meta"),
                                 lengths=torch.tensor([1], device="meta"))
        assert client.rows_device(meta) == torch.device("meta")    # ids elsewhere: theirs
    finally:
        client.close(flush=False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_a_cuda_client_without_cuda_is_refused():
    from scheduling.ps.client import PSClient
    from scheduling.ps.shard_plan import TableSpec

    with pytest.raises(ValueError, match=r"device='cuda:0', but CUDA is not available"):
        PSClient([TableSpec("t0", 20, 4, ("f0",))], ["ps0"], name="no-cuda", configure=False, device="cuda:0")


def test_the_pass_records_the_models_device(cluster):
    model = Hybrid()
    ps = functools.partial(scheduling.parameter_servers, optimizer="sgd", lr=LR_TABLES, verbose=False)
    gm = fxdist.optimize(model, passes=(ps,))
    try:
        assert {get_client(n).device for n in placement.client_names(gm)} == {torch.device("cpu")}
    finally:
        placement.close(gm)
