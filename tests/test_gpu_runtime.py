"""The runtime's GPU path (boo_backend/gpu.py), checked where a CPU can check it.

- Fenced calls: GPU modules take a wait and a signal fence. A CPU module compiled the same
  way runs through the same code (gpu.Queue), end to end through torch.compile, with and
  without `sync`.
- Ordering hooks, device matching by UUID, one HAL device per device (and ROCm stream), and
  the driver flags set before the driver starts: with IREE's and torch's device calls faked.
- Targets: the async ABI on GPU targets, Hopper/Blackwell's explicit choice, cache keys that
  leave the host CPU out for GPU modules.
Running on a real GPU is in test_gpu_run.py (marked `gpu`).
"""

import copy
import dataclasses
import logging

import iree.runtime as rt
import pytest
import torch

import boo_backend
from boo_backend import cache as cache_mod, gpu, graph
from boo_backend.compile import parse_target
from boo_backend.config import BooError, Options


def _fenced_cpu_target():
    return dataclasses.replace(parse_target("llvm-cpu"), fenced=True)


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = torch.nn.LayerNorm(48)
        self.fc = torch.nn.Linear(48, 48)

    def forward(self, x):
        h = torch.nn.functional.gelu(self.fc(self.ln(x)))
        return (h * x[:, :1]).softmax(-1)  # a broadcast view of the input too


@pytest.mark.parametrize("sync", [False, True], ids=["async", "sync"])
def test_fenced_modules_train_like_eager(monkeypatch, sync):
    """Forward and backward through modules with the GPU calling convention (fences), on the
    CPU: the same values as eager, and every module really took fences."""
    target = _fenced_cpu_target()
    monkeypatch.setattr(graph, "target_for", lambda spec, tensors: target)
    queues = []
    real = gpu.Queue.invoke

    def invoke(self, *a, **k):
        queues.append((self, a[-1] if len(a) == 5 else k["sync"]))
        return real(self, *a, **k)

    monkeypatch.setattr(gpu.Queue, "invoke", invoke)
    torch.manual_seed(0)
    model = _Block()
    ref = _Block()
    ref.load_state_dict(model.state_dict())
    x = torch.randn(8, 48)
    compiled = torch.compile(model, backend="boo", options={"target": "llvm-cpu", "sync": sync, "cpu_driver": "local-task"})
    for _ in range(2):
        out = compiled(x)
        out.square().sum().backward()
    for _ in range(2):
        ref(x).square().sum().backward()
    torch.testing.assert_close(out, ref(x), rtol=1e-5, atol=1e-6)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6)
    assert queues and all(s is sync for _, s in queues)
    assert all(q.host_wait for q, _ in queues)  # a CPU queue always waits for its fence


def test_attention_traced_as_for_a_gpu_trains_like_eager(monkeypatch):
    """A GPU target traces F.scaled_dot_product_attention in its math form (CUDA's own
    kernels would be eager islands); here that form runs on the CPU against eager."""
    from boo_backend import backend
    from torch.nn.attention import SDPBackend, sdpa_kernel

    monkeypatch.setattr(backend, "_attention_for", lambda target: sdpa_kernel([SDPBackend.MATH]))
    boo_backend.reset()  # the placements below are this test's alone
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    ref = copy.deepcopy(layer)
    x = torch.randn(2, 10, 32)
    mask = torch.nn.Transformer.generate_square_subsequent_mask(10)
    out = torch.compile(layer, backend="boo")(x, src_mask=mask, is_causal=True)
    out.square().mean().backward()
    expected = ref(x, src_mask=mask, is_causal=True)
    expected.square().mean().backward()
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
    for p, q in zip(layer.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)
    names = {n for p in boo_backend.placements() for n, _ in p.composite_names}
    assert "_softmax" in names and not any("flash_attention" in n for n in names)


def _fake_hal():
    class Hal:
        def create_semaphore(self, value):
            return rt.get_device("local-sync").create_semaphore(value)
    return Hal()


def test_queue_orders_calls_with_torch():
    """CUDA: torch's device is synchronized before every call; `sync` also waits after it.
    HIP (host_wait False): nothing before, and after only with `sync`."""
    calls = []

    class Context:
        def invoke(self, function, args, results):
            calls.append("invoke")
            # What the module does: signal the fence it was given (the last argument).
            args.get_as_object(len(args) - 1, rt.HalFence).signal()

    for host_wait, sync, expected in [
        (True, False, ["before", "invoke"]),
        (True, True, ["before", "invoke", "after"]),
        (False, False, ["invoke"]),
        (False, True, ["invoke", "after"]),
    ]:
        calls.clear()
        before = (lambda: calls.append("before")) if host_wait else None
        queue = gpu.Queue(_fake_hal(), gpu.DLPACK_CUDA, 0, host_wait, before, lambda: calls.append("after"))
        queue.invoke(Context(), None, rt.VmVariantList(2), 0, sync)
        assert calls == expected, (host_wait, sync)


def test_a_failed_fence_raises_at_its_call():
    """A call whose work fails raises there when the queue waits (CUDA, or `sync`)."""
    class Context:
        def invoke(self, function, args, results):
            args.get_as_object(len(args) - 1, rt.HalFence).fail("kernel faulted")

    queue = gpu.Queue(_fake_hal(), gpu.DLPACK_ROCM, 0, host_wait=False)
    queue.invoke(Context(), None, rt.VmVariantList(2), 0, sync=False)  # HIP: not waited for
    with pytest.raises(Exception, match="kernel faulted"):
        queue.invoke(Context(), None, rt.VmVariantList(2), 0, sync=True)


def test_devices_are_matched_by_uuid(monkeypatch):
    """torch's cuda:1 is the IREE device with its UUID, whatever IREE's own numbering."""
    infos = [{"device_id": 7, "path": "GPU-aaaaaaaa-0000-0000-0000-000000000001", "name": "a"},
             {"device_id": 9, "path": "GPU-bbbbbbbb-0000-0000-0000-000000000002", "name": "b"}]

    class Driver:
        def query_available_devices(self):
            return infos

    class Props:
        def __init__(self, uuid):
            self.uuid = uuid

    uuids = {0: "bbbbbbbb-0000-0000-0000-000000000002", 1: "AAAAAAAA-0000-0000-0000-000000000001"}
    monkeypatch.setattr(gpu, "_driver", lambda name: Driver())
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: Props(uuids[i]))
    gpu._device_infos.cache_clear()
    try:
        assert gpu._device_info("cuda", 1)["device_id"] == 7
        assert gpu._device_info("cuda", 0)["device_id"] == 9
        uuids[2] = "cccccccc-0000-0000-0000-000000000003"
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
        with pytest.raises(gpu.BooDeviceError, match="no device with the UUID"):
            gpu._device_info("cuda", 2)
        # One GPU on each side: that one, whatever UUID each reports (with a warning).
        del infos[1]
        gpu._device_infos.cache_clear()
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
        assert gpu._device_info("cuda", 2)["device_id"] == 7
    finally:
        gpu._device_infos.cache_clear()


def test_one_queue_per_device_and_rocm_stream(monkeypatch):
    made = []
    stream = {0: 100, 1: 200}
    monkeypatch.setattr(gpu, "_make_queue", lambda driver, index, s: made.append((driver, index, s)) or object())
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: stream[index], raising=False)
    monkeypatch.setattr(gpu, "_QUEUES", {})
    a = gpu.queue_for("hip", 0)
    assert gpu.queue_for("hip", 0) is a
    stream[0] = 101  # torch switched streams: IREE must dispatch on the new one
    assert gpu.queue_for("hip", 0) is not a
    gpu.queue_for("hip", 1)
    c = gpu.queue_for("cuda", 0)
    stream[0] = 102
    assert gpu.queue_for("cuda", 0) is c  # CUDA has no external stream: one per device
    assert made == [("hip", 0, 100), ("hip", 0, 101), ("hip", 1, 200), ("cuda", 0, 0)]


def test_driver_flags_come_before_the_driver(monkeypatch):
    """--cuda_async_allocations=false (exportable results) and torch's libamdhip64 must be
    set before IREE creates the driver."""
    events = []
    monkeypatch.setattr(rt.flags, "parse_flags", lambda *f: events.append(("flags", *f)))
    monkeypatch.setattr(rt, "get_driver", lambda name: events.append(("driver", name)) or name)
    monkeypatch.setattr(gpu, "_torch_hip_library", lambda: "/opt/torch/lib/libamdhip64.so")
    monkeypatch.setattr(gpu, "_DRIVER_FLAGS_SET", set())
    gpu._driver("cuda")
    gpu._driver("hip")
    gpu._driver("cuda")
    assert events == [("flags", "--cuda_async_allocations=false"), ("driver", "cuda"),
                      ("flags", "--hip_dylib_path=file:/opt/torch/lib/libamdhip64.so"), ("driver", "hip"),
                      ("driver", "cuda")]


def test_gpu_targets_take_fences_and_name_their_arch(caplog):
    for spec in ("cuda:sm_80", "rocm:gfx942", "rocm:mi300x"):
        assert parse_target(spec).fenced
    assert not parse_target("llvm-cpu").fenced  # CPU modules stay synchronous
    assert "--iree-cuda-target-features=+ptx87" in parse_target("cuda:sm_120").flags
    assert "--iree-cuda-target-features=+ptx88" in parse_target("cuda:sm_121").flags
    with caplog.at_level(logging.INFO, logger="boo_backend"):
        hopper = parse_target("cuda:sm_90")
        blackwell = parse_target("cuda:sm_100")
    assert hopper.name == blackwell.name == "cuda:sm_89"
    assert "no sm_90 target; compiling sm_89 code" in caplog.text
    assert "no sm_100 target" in caplog.text


def test_gpu_cache_keys_leave_the_host_out(monkeypatch):
    """A module cross-compiled for a GPU is found on the GPU machine, whose CPU differs; a
    CPU module is not."""
    gpu_key = lambda: cache_mod.CompileCache.key("vmfb", "module", host=parse_target("cuda:sm_80").host_specific)
    cpu_key = lambda: cache_mod.CompileCache.key("vmfb", "module", host=parse_target("llvm-cpu").host_specific)
    before = gpu_key(), cpu_key()
    monkeypatch.setattr(cache_mod, "host_id", lambda: "machine=x86_64;cpu=Another CPU")
    assert gpu_key() == before[0]
    assert cpu_key() != before[1]


def test_graph_keys_leave_devices_out():
    g = torch.fx.Graph()
    g.call_function(torch.ops.aten.arange.start, (0, 4), {"device": torch.device("cpu")})
    h = torch.fx.Graph()
    h.call_function(torch.ops.aten.arange.start, (0, 4), {"device": torch.device("cuda", 1)})
    text = graph.graph_text(torch.fx.GraphModule({}, g))
    assert "device: ..." in text and "cpu" not in text
    assert text == graph.graph_text(torch.fx.GraphModule({}, h))


def test_sync_and_compile_only_options(monkeypatch):
    assert Options.resolve({"sync": "1"}).sync
    monkeypatch.setenv("BOO_SYNC", "1")
    assert Options.resolve().sync
    assert Options.resolve({"compile_only": True, "target": "cuda:sm_80"}).compile_only
    with pytest.raises(BooError, match="compile_only .* needs a target"):
        Options.resolve({"compile_only": True})
    with pytest.raises(BooError, match="not a boolean"):
        Options.resolve({"sync": "maybe"})


def test_uuid_forms():
    assert gpu._uuid("GPU-0A1b2c3d-0000-1111-2222-333344445555") == gpu._uuid("0a1b2c3d-0000-1111-2222-333344445555")
    assert len(gpu._uuid("GPU-0a1b2c3d-0000-1111-2222-333344445555")) == 32


def test_cpu_modules_take_no_fences(monkeypatch):
    """The CPU path is the synchronous call it was (its speed is unchanged by the GPU path)."""
    fenced = []
    monkeypatch.setattr(gpu.Queue, "invoke", lambda *a, **k: fenced.append(a))
    x = torch.randn(16, 48)
    torch.testing.assert_close(torch.compile(torch.nn.functional.gelu, backend="boo")(x), torch.nn.functional.gelu(x))
    assert boo_backend.placements()[-1].iree > 0 and not fenced


def test_a_cpu_scalar_does_not_pick_the_target(monkeypatch):
    """A device graph whose first input is a CPU scalar gets the device's target (a meta
    tensor stands for the GPU one here)."""
    from boo_backend import compile as compile_mod

    monkeypatch.setattr(compile_mod, "target_for_device", lambda device: device.type)
    scalar, other = torch.tensor(2.0), torch.empty(4, device="meta")
    assert compile_mod.target_for(None, [scalar, 3, other]) == "meta"
    assert compile_mod.target_for(None, [scalar]) == "cpu"
    assert compile_mod.target_for("rocm:gfx942", [scalar]).name == "rocm:gfx942"
