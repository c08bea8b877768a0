"""PyTorch callers: tensors keyed from their attributes, launches on PyTorch's current stream.

PyTorch is optional, so most of these tests drive the code with a stand-in: a
tensor class over a NumPy array whose ``__cuda_array_interface__`` is PyTorch's
own implementation (``torch/_tensor.py``), contiguity rule included, in a fake
``torch`` module put in ``sys.modules``. The fast key must equal the key the
interface gives, or one tensor would be cached (and validated) twice. The
``gpu`` tests repeat the checks on real tensors.
"""

import dataclasses
import os
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

import numba_cp
from numba_cp import _torch, arrays, launcher, ops
from numba_cp import reference as ref
from numba_cp.backend import TARGET
from numba_cp.launcher import LaunchCache, array_signature, call_signature
from support import to_device, to_host

# -- a stand-in for torch ---------------------------------------------------------------


class FakeDtype:
    def __init__(self, name, itemsize):
        self.name, self.itemsize = name, itemsize

    def __repr__(self):
        return f"torch.{self.name}"


DTYPES = {name: FakeDtype(name, np.dtype(name if name != "bfloat16" else "uint16").itemsize)
          for name in ("float16", "float32", "float64", "uint8", "int8", "int16", "int32",
                       "int64", "bool", "bfloat16")}
STRIDED, SPARSE_COO = object(), object()


def _dtype_to_typestr(dtype):  # torch/_tensor.py, current releases
    return {
        DTYPES["bfloat16"]: "<V2",
        DTYPES["float16"]: "<f2",
        DTYPES["float32"]: "<f4",
        DTYPES["float64"]: "<f8",
        DTYPES["uint8"]: "|u1",
        DTYPES["int8"]: "|i1",
        DTYPES["int16"]: "<i2",
        DTYPES["int32"]: "<i4",
        DTYPES["int64"]: "<i8",
        DTYPES["bool"]: "|b1",
    }[dtype]


class Size(tuple):
    """torch.Size: a tuple subclass."""


class FakeTensor:
    """What ``array_signature`` and ``default_stream_for`` read of a tensor, over NumPy memory."""

    interface_reads = 0

    def __init__(self, array, *, dtype=None, is_cuda=True, requires_grad=False,
                 layout=STRIDED):
        self._array = array
        self.dtype = dtype or DTYPES[array.dtype.name]
        self.is_cuda, self.requires_grad, self.layout = is_cuda, requires_grad, layout

    @property
    def shape(self):
        return Size(self._array.shape)

    def stride(self):
        return tuple(s // self._array.itemsize for s in self._array.strides)

    def element_size(self):
        return self.dtype.itemsize

    def numel(self):
        return self._array.size

    def data_ptr(self):  # the view's first element: the storage offset is in it
        return self._array.__array_interface__["data"][0]

    @property
    def device(self):
        return "cuda:0" if self.is_cuda else "cpu"

    @property
    def is_sparse(self):
        return self.layout is SPARSE_COO

    def is_contiguous(self):
        """PyTorch's rule: an empty tensor is contiguous, and size-1 dimensions have any
        stride."""
        if self.numel() == 0:
            return True
        expected = 1
        for n, step in zip(reversed(self.shape), reversed(self.stride())):
            if n != 1:
                if step != expected:
                    return False
                expected *= n
        return True

    @property
    def __cuda_array_interface__(self):  # torch/_tensor.py, less the torch_function hook
        FakeTensor.interface_reads += 1
        if not self.is_cuda:
            raise AttributeError("Can't get __cuda_array_interface__ on non-CUDA tensor type")
        if self.is_sparse:
            raise AttributeError("Can't get __cuda_array_interface__ on sparse type")
        if self.requires_grad:
            raise RuntimeError(
                "Can't get __cuda_array_interface__ on Variable that requires grad. "
                "If gradients aren't required, use var.detach() to get Variable that "
                "doesn't require grad.")
        typestr = _dtype_to_typestr(self.dtype)
        itemsize = self.element_size()
        shape = tuple(self.shape)
        if self.is_contiguous():
            strides = None
        else:
            strides = tuple(s * itemsize for s in self.stride())
        data_ptr = self.data_ptr() if self.numel() > 0 else 0
        return dict(typestr=typestr, shape=shape, strides=strides, data=(data_ptr, False),
                    version=2)


class Parameter(FakeTensor):
    """A subclass, as ``torch.nn.Parameter`` is."""


class FakeStream:
    def __init__(self, handle):
        self.cuda_stream = handle


def fake_torch(current=0x5150, private=True):
    """A ``torch`` module with the attributes numba_cp reads; ``module.current`` is the
    raw handle of its current stream (a ``torch.cuda.stream(...)`` context sets it)."""
    torch = types.ModuleType("torch")
    torch.Tensor, torch.strided, torch.sparse_coo = FakeTensor, STRIDED, SPARSE_COO
    for name, dtype in DTYPES.items():
        setattr(torch, name, dtype)
    torch.current = current
    torch.public_calls = 0

    def current_stream():
        torch.public_calls += 1
        return FakeStream(torch.current)

    torch.cuda = types.SimpleNamespace(current_stream=current_stream)
    if private:
        torch._C = types.SimpleNamespace(_cuda_getDevice=lambda: 0,
                                         _cuda_getCurrentRawStream=lambda device: torch.current)
    else:
        torch._C = types.SimpleNamespace()
    return torch


@pytest.fixture
def torch(monkeypatch):
    """The fake torch, imported (in sys.modules), and looked up afresh."""
    module = fake_torch()
    monkeypatch.setitem(sys.modules, "torch", module)
    monkeypatch.setattr(_torch, "_FOUND", None)
    return module


@pytest.fixture
def gpu_keys(monkeypatch):
    """``array_signature`` as on a GPU target (under the simulator it keys NumPy arrays
    only). HIP, not CUDA: the key's context token would ask the CUDA driver."""
    monkeypatch.setattr(launcher, "TARGET", dataclasses.replace(TARGET, name="hip"))


class InterfaceOnly:
    """Only the interface of ``tensor``: the key every other array gets."""

    def __init__(self, tensor):
        self.__cuda_array_interface__ = tensor.__cuda_array_interface__


def _base(dtype="float32"):
    return np.arange(2 * 3 * 8).astype(dtype).reshape(2, 3, 8)


# name: (the view, whether PyTorch calls it contiguous)
VIEWS = {
    "contiguous": (lambda: _base(), True),
    "transposed": (lambda: _base().transpose(0, 2, 1), False),
    "strided": (lambda: _base()[:, :, ::2], False),
    "offset": (lambda: _base()[:, 1:], False),
    "offset, one head": (lambda: _base()[1:, 1:], True),  # a size-1 dimension's stride
    "offset contiguous": (lambda: _base()[1:], True),
    "size-1 dim, odd stride": (lambda: np.lib.stride_tricks.as_strided(
        _base(), shape=(2, 1, 8), strides=(32, 1000, 4)), True),
    "one row": (lambda: _base()[:, :1], False),
    "empty": (lambda: _base()[:, :0], True),
    "empty, strided": (lambda: _base()[:, :, ::2][:0], True),
    "scalar": (lambda: _base()[0, 0, 0:1].reshape(()), True),
    "int32": (lambda: _base("int32")[:, ::2], False),
    "int64": (lambda: _base("int64"), True),
    "int16": (lambda: _base("int16").transpose(2, 1, 0), False),
    "float64": (lambda: _base("float64"), True),
    "uint8": (lambda: _base("uint8")[::-1], False),
}


# -- the key ------------------------------------------------------------------------------

@pytest.mark.parametrize("view", sorted(VIEWS))
def test_tensor_key_is_the_interface_key_without_reading_the_interface(view, torch, gpu_keys):
    build, contiguous = VIEWS[view]
    array = build()
    tensor = FakeTensor(array)
    slow = array_signature(InterfaceOnly(tensor))
    reads = FakeTensor.interface_reads
    fast = array_signature(tensor)
    assert FakeTensor.interface_reads == reads, "the fast path read the interface"
    assert fast == slow
    key, pointer = fast
    assert key[:2] == (np.dtype(array.dtype).str, array.shape)
    assert pointer == (0 if array.size == 0 else array.__array_interface__["data"][0])
    assert key[3] is False  # tensors are writable
    assert key[2] == (None if contiguous else array.strides), (
        "PyTorch omits a contiguous tensor's strides, and only those")


def test_one_tensor_is_one_cache_entry(torch, gpu_keys):
    tensors = [FakeTensor(VIEWS[v][0]()) for v in ("transposed", "offset", "int32")]
    fast_key, fast_pointers = call_signature(tensors, (4, 1))
    slow_key, slow_pointers = call_signature([InterfaceOnly(t) for t in tensors], (4, 1))
    assert fast_key == slow_key and hash(fast_key) == hash(slow_key)
    assert fast_pointers == slow_pointers


@pytest.mark.parametrize("dtype", ["bool", "bfloat16"])
def test_a_dtype_outside_the_table_takes_the_interface(dtype, torch, gpu_keys):
    base = np.zeros((3, 4), np.uint8 if dtype == "bool" else np.uint16)
    tensor = FakeTensor(base[:, ::2], dtype=DTYPES[dtype])
    reads = FakeTensor.interface_reads
    key, pointer = array_signature(tensor)
    assert FakeTensor.interface_reads == reads + 1
    assert key == (_dtype_to_typestr(DTYPES[dtype]), (3, 2), tuple(base[:, ::2].strides), False)
    assert pointer == base.__array_interface__["data"][0]


def test_tensors_the_interface_refuses_are_not_keyed(torch, gpu_keys):
    host = FakeTensor(_base(), is_cuda=False)
    grad = FakeTensor(_base(), requires_grad=True)
    sparse = FakeTensor(_base(), layout=SPARSE_COO)
    for tensor in (host, grad, sparse):
        reads = FakeTensor.interface_reads
        assert array_signature(tensor) is None, "validation must see it, every call"
        assert FakeTensor.interface_reads == reads + 1, "the interface's refusal decides"
    assert call_signature([FakeTensor(_base()), grad], ()) == (None, None)


class NestedTensor(FakeTensor):
    """A nested tensor of PyTorch's strided layout: its type is torch.Tensor, and
    reading its shape raises."""

    @property
    def shape(self):
        raise RuntimeError("Internal error: NestedTensorImpl doesn't support sizes.")


def test_a_tensor_without_a_shape_is_refused_naming_the_argument(monkeypatch, torch,
                                                                  gpu_keys):
    monkeypatch.setattr(sys.modules["torch"], "Tensor", NestedTensor)
    monkeypatch.setattr(_torch, "_FOUND", None)
    nested = NestedTensor(_base())
    assert array_signature(nested) is None
    monkeypatch.setattr(arrays, "TARGET", dataclasses.replace(TARGET, name="hip"))
    with pytest.raises(TypeError, match="^scores: .*NestedTensorImpl"):
        arrays.as_kernel_array(nested, "scores")


def test_a_subclass_keeps_the_interface(torch, gpu_keys):
    """A subclass may override the interface (PyTorch's __torch_function__ hook): its own
    answer is the key."""
    tensor = Parameter(_base()[:, ::2])
    reads = FakeTensor.interface_reads
    assert array_signature(tensor) == array_signature(InterfaceOnly(tensor))
    assert FakeTensor.interface_reads == reads + 2


def test_a_tensor_that_requires_grad_is_refused_naming_the_argument(monkeypatch, torch):
    monkeypatch.setattr(arrays, "TARGET", dataclasses.replace(TARGET, name="hip"))
    with pytest.raises(TypeError, match=r"^scores: Can't get __cuda_array_interface__ on "
                                        r"Variable that requires grad"):
        arrays.as_kernel_array(FakeTensor(_base(), requires_grad=True), "scores")


def test_torch_is_never_imported_here(monkeypatch, gpu_keys):
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    monkeypatch.setattr(_torch, "_FOUND", None)
    finder = types.SimpleNamespace(find_spec=lambda name, *a: pytest.fail(f"imported {name}")
                                   if name == "torch" else None)
    monkeypatch.setattr(sys, "meta_path", [finder, *sys.meta_path])
    assert _torch.found() is None
    tensor = FakeTensor(_base())  # a stand-in that is no torch.Tensor: the interface
    assert array_signature(tensor) == array_signature(InterfaceOnly(tensor))
    assert "torch" not in sys.modules
    # imported later, by the caller: found then, and kept
    module = fake_torch()
    monkeypatch.setitem(sys.modules, "torch", module)
    found = _torch.found()
    assert found is not None and found.tensor is FakeTensor
    assert _torch.found() is found
    assert found.typestrs[DTYPES["int32"]] == ("<i4", 4)
    assert DTYPES["bool"] not in found.typestrs and DTYPES["bfloat16"] not in found.typestrs


def test_keys_follow_an_import_of_torch_and_a_change_of_target(monkeypatch, gpu_keys):
    """The key's type tests are looked up once per (target, torch), not once per
    array: a torch imported after the first call, or another target, is still seen."""
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    monkeypatch.setattr(_torch, "_FOUND", None)
    tensor = FakeTensor(_base())
    reads = FakeTensor.interface_reads
    before = array_signature(tensor)
    assert FakeTensor.interface_reads == reads + 1, "no torch yet: the interface"
    monkeypatch.setitem(sys.modules, "torch", fake_torch())
    reads = FakeTensor.interface_reads
    assert array_signature(tensor) == before
    assert FakeTensor.interface_reads == reads, "torch imported: the tensor's attributes"
    assert call_signature([tensor], [])[1] == [before[1]]
    assert FakeTensor.interface_reads == reads
    # on the simulator, only NumPy arrays are keyed
    monkeypatch.setattr(launcher, "TARGET", dataclasses.replace(TARGET, name="sim"))
    assert array_signature(tensor) is None
    array = _base()
    assert array_signature(array) == ((array.dtype.str, array.shape, array.strides, False),
                                      array.__array_interface__["data"][0])


class FakeCupyArray:
    """What the key reads of a CuPy array (dtype, shape, strides, data.ptr), over NumPy."""

    def __init__(self, array, dtype=None):
        self._array = array
        self.dtype = np.dtype(dtype or array.dtype)  # a dtype object of its own
        self.shape, self.strides = array.shape, array.strides
        self.data = types.SimpleNamespace(ptr=array.__array_interface__["data"][0])

    @property
    def __cuda_array_interface__(self):
        return dict(typestr=self.dtype.str, shape=self.shape, strides=self.strides,
                    data=(self.data.ptr, False), version=3)


def test_cupy_arrays_are_keyed_as_their_interface_keys_them(monkeypatch, gpu_keys):
    """A CuPy array's key comes from its attributes, its typestr from a table per dtype:
    equal to the interface's key, and the same for equal dtypes that are distinct
    objects or of other byte orders."""
    monkeypatch.setattr(launcher, "_cupy_ndarray", lambda: FakeCupyArray)
    monkeypatch.setattr(launcher, "_SIGNERS", (None, None, None))
    for dtype in ("<i4", "=i4", "int32", ">i4", "<i8", "<f4", "|u1"):
        array = FakeCupyArray(_base("int32").transpose(0, 2, 1), dtype)
        for _ in range(2):  # the table's first answer, then its kept one
            assert array_signature(array) == array_signature(InterfaceOnly(array)), dtype
    big = FakeCupyArray(_base("int32"), ">i4")
    assert array_signature(big)[0][0] == ">i4"


def test_a_call_of_mixed_arrays_is_keyed_as_each_array_is(monkeypatch, torch, gpu_keys):
    """A call's key is its arrays' keys in order, whichever way each is read (the CuPy
    key written out in the call's loop, a tensor's attributes, the interface), with
    None for an absent array; one array that cannot be keyed leaves the call unkeyed."""
    monkeypatch.setattr(launcher, "_cupy_ndarray", lambda: FakeCupyArray)
    monkeypatch.setattr(launcher, "_SIGNERS", (None, None, None))
    cupy_array = FakeCupyArray(_base("int64")[:, 1:], "<i8")
    tensor = FakeTensor(VIEWS["transposed"][0]())
    other = InterfaceOnly(FakeCupyArray(_base("int32")))
    fixed = numba_cp.arrays.FixedView(dict(InterfaceOnly(FakeCupyArray(
        _base("float32")[:, ::2])).__cuda_array_interface__))
    assert array_signature(fixed) == array_signature(InterfaceOnly(fixed))
    arrays = [cupy_array, None, tensor, other, fixed, FakeCupyArray(_base("int32")[::-1])]
    key, pointers = call_signature(arrays, (4, None))
    each = [(None, None) if a is None else array_signature(a) for a in arrays]
    assert key[0] == tuple(k for k, _ in each)
    assert pointers == [p for _, p in each]
    assert key[1:3] == ((4, None), (int, type(None)))
    grad = FakeTensor(_base(), requires_grad=True)
    assert call_signature(arrays + [grad], ()) == (None, None)
    assert call_signature([grad] + arrays, ()) == (None, None)


def test_a_module_mid_import_is_not_looked_up(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", types.ModuleType("torch"))  # no Tensor yet
    monkeypatch.setattr(_torch, "_FOUND", None)
    assert _torch.found() is None
    assert _torch._FOUND is None, "looked up again once the import is done"


# -- the stream ---------------------------------------------------------------------------

class FakeNumbaStream:
    def __init__(self, handle):
        self.handle = handle

    def synchronize(self):
        pass


@pytest.fixture
def gpu_streams(monkeypatch):
    """``resolve_stream`` as on a GPU target, with Numba's streams faked."""
    made = []

    def external_stream(handle):
        made.append(handle)
        return FakeNumbaStream(handle)

    fake_cuda = types.SimpleNamespace(external_stream=external_stream,
                                      default_stream=lambda: FakeNumbaStream("default"))
    monkeypatch.setattr(arrays, "TARGET", dataclasses.replace(TARGET, name="hip"))
    monkeypatch.setattr(arrays, "cuda", fake_cuda)
    monkeypatch.setattr(arrays, "_EXTERNAL_STREAMS", {})
    monkeypatch.setattr(arrays, "_STREAM_KINDS", {})
    return made


@pytest.fixture
def cupy(monkeypatch):
    module = types.ModuleType("cupy")
    module.cuda = types.SimpleNamespace(
        get_current_stream=lambda: types.SimpleNamespace(ptr=0xC0))
    monkeypatch.setitem(sys.modules, "cupy", module)
    return module


def test_a_tensor_first_launches_on_torchs_current_stream(torch, cupy, gpu_streams):
    tensor = FakeTensor(_base())
    assert arrays.resolve_stream(None, tensor).handle == 0x5150
    torch.current = 0xABC  # inside `with torch.cuda.stream(s)`
    assert arrays.resolve_stream(None, tensor).handle == 0xABC
    assert arrays.resolve_stream(None, Parameter(_base())).handle == 0xABC
    torch.current = 0  # PyTorch's default stream
    assert arrays.resolve_stream(None, tensor).handle == "default"
    assert torch.public_calls == 0, "the raw handle, not a Stream object per call"


def test_anything_else_launches_on_cupys_current_stream(monkeypatch, torch, cupy, gpu_streams):
    for like in (None, _base(), InterfaceOnly(FakeTensor(_base()))):
        assert arrays.resolve_stream(None, like).handle == 0xC0
    monkeypatch.delitem(sys.modules, "cupy")
    assert arrays.resolve_stream(None, _base()).handle == "default"
    assert arrays.resolve_stream(None, FakeTensor(_base())).handle == 0x5150


def test_a_given_stream_wins(torch, cupy, gpu_streams):
    tensor = FakeTensor(_base())
    cupy_stream = type("Stream", (), {"ptr": 0x98})
    for _ in range(2):  # what each stream's type holds is found once, then remembered
        assert arrays.resolve_stream(77, tensor).handle == 77
        assert arrays.resolve_stream(np.int64(78), tensor).handle == 78
        assert arrays.resolve_stream(FakeStream(0x99), tensor).handle == 0x99
        assert arrays.resolve_stream(cupy_stream(), tensor).handle == 0x98
        numba_stream = FakeNumbaStream(5)
        assert arrays.resolve_stream(numba_stream, tensor) is numba_stream
        with pytest.raises(TypeError, match="^stream: expected"):
            arrays.resolve_stream("s", tensor)
    assert gpu_streams == [77, 78, 0x99, 0x98], "one wrapper per handle"


def test_without_the_private_getter_the_public_current_stream(monkeypatch, cupy, gpu_streams):
    module = fake_torch(current=0x77, private=False)
    monkeypatch.setitem(sys.modules, "torch", module)
    monkeypatch.setattr(_torch, "_FOUND", None)
    assert arrays.resolve_stream(None, FakeTensor(_base())).handle == 0x77
    assert module.public_calls == 1


def test_the_launch_asks_its_first_array_for_the_stream(monkeypatch):
    """Both wrappers hand their first array (scores, keys) to resolve_stream. The
    simulator never resolves a stream, so the launch is made to believe it runs on a GPU
    (its kernels still simulate)."""
    monkeypatch.setattr(launcher, "TARGET", dataclasses.replace(TARGET, name="hip"))
    asked = []

    def resolve_stream(stream, like=None):
        asked.append((stream, like))
        return 0

    monkeypatch.setattr(launcher, "resolve_stream", resolve_stream)
    monkeypatch.setattr(ops, "_PACK_LAUNCHES", LaunchCache())
    monkeypatch.setattr(ops, "_MERGE_LAUNCHES", LaunchCache())
    full = np.random.default_rng(3).standard_normal((1, 2, 20)).astype(np.float32)
    seq = np.array([20 * 128, 900], np.int32)
    window = dict(query_len=1, init_blocks=1, local_blocks=1)
    keys, seq_d = to_device(np.zeros((2, 1, 2, 4), np.int64)), to_device(seq)
    shards = [to_device(ref.shard_scores(full, rank=r, world=2, global_blocks=20))
              for r in range(2)]
    for r in range(2):
        numba_cp.local_topk_keys(shards[r], seq_d, topk=4, rank=r, world=2, global_blocks=20,
                                 out=keys[r], **window)
    idx = to_device(np.zeros((1, 2, 4), np.int32))
    numba_cp.merge_topk_keys(keys, idx, seq_d, stream=3, **window)
    assert [s for s, _ in asked] == [None, None, 3]
    assert asked[0][1] is shards[0] and asked[1][1] is shards[1] and asked[2][1] is keys
    np.testing.assert_array_equal(to_host(idx), ref.global_topk(
        full, seq, topk=4, global_blocks=20, **window))


def test_every_step_of_an_exchange_takes_the_callers_stream(monkeypatch):
    """The plan's own buffers (the gathered keys, the IPC views) never pick the stream:
    left to them, a PyTorch caller's merge would run on CuPy's stream after a pack on
    PyTorch's."""
    MPI = pytest.importorskip("mpi4py.MPI")
    from numba_cp import exchange

    asked, used = [], []
    real = exchange.resolve_stream

    def resolve_stream(stream, like=None):
        # the simulator's one stream is 0 whoever asks: a token per answer instead
        resolved = object() if TARGET.simulator else real(stream, like)
        asked.append((stream, like, resolved))
        return resolved

    def recording(fn):
        def call(*args, **kwargs):
            used.append((fn.__name__, kwargs["stream"]))
            return fn(*args, **kwargs)
        return call

    monkeypatch.setattr(exchange, "resolve_stream", resolve_stream)
    for name in ("local_topk_keys", "merge_topk_keys", "global_topk_ids"):
        monkeypatch.setattr(exchange, name, recording(getattr(exchange, name)))
    config = exchange.ExchangeConfig(heads=1, max_tokens=2, topk=4, world=1, global_blocks=20,
                                     init_blocks=1, local_blocks=1)
    scores = to_device(np.random.default_rng(5).standard_normal((1, 2, 20)).astype(np.float32))
    seq = to_device(np.array([20 * 128, 900], np.int32))
    with exchange.CandidateExchange(MPI.COMM_SELF, config) as plan:
        plan(scores, seq)
        plan.pack(scores, seq)
        plan.all_gather(2, seq_lens=seq, stream=0)
        plan.merge(seq, 2)
    assert [(s, like is scores, like is seq) for s, like, _ in asked] == [
        (None, True, False), (None, True, False), (0, False, True), (None, False, True)]
    assert [name for name, _ in used] == ["global_topk_ids", "local_topk_keys",
                                          "merge_topk_keys"]
    for (_, stream), (_, _, resolved) in zip(used, [asked[0], asked[1], asked[3]]):
        assert stream is resolved


# -- the benchmark ------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[1]


def _profile_call(*args):
    env = dict(os.environ, NUMBA_CP_BACKEND="sim")
    return subprocess.run([sys.executable, "benchmarks/profile_call.py", *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120)


def test_profile_call_parses_its_options_and_refuses_the_simulator():
    shown = _profile_call("--help")
    assert shown.returncode == 0, shown.stderr
    assert all(option in shown.stdout for option in ("--torch", "--json", "--repeats"))
    refused = _profile_call("--torch", "--calls", "10", "--json", "calls.json")
    assert refused.returncode == 1
    assert "times a GPU's host calls: run it with NUMBA_CP_BACKEND=cuda" in refused.stderr
    assert not (ROOT / "calls.json").exists()
    lonely = _profile_call("--json", "calls.json")
    assert lonely.returncode == 2 and "add --torch" in lonely.stderr


# -- on a GPU, with PyTorch and CuPy --------------------------------------------------------

def _real_torch():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("PyTorch has no GPU here")
    return torch


@pytest.mark.gpu
def test_real_tensor_keys_equal_their_interface_keys():
    torch = _real_torch()
    base = torch.arange(2 * 3 * 8, device="cuda", dtype=torch.float32).reshape(2, 3, 8)
    views = [base, base.transpose(1, 2), base[:, :, ::2], base[1:, 1:], base[1:], base[:, :1],
             base[:, :0], base.as_strided((2, 1, 8), (24, 1000, 1)), base.to(torch.int32)[:, ::2],
             base.to(torch.int64), base.to(torch.float16).transpose(0, 2), base[0, 0, 0]]
    assert type(base) is _torch.found().tensor
    interface = type(base).__cuda_array_interface__
    reads = []
    counted = property(lambda tensor: reads.append(1) or interface.__get__(tensor))
    for view in views:
        expected = array_signature(InterfaceOnly(view))
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(type(base), "__cuda_array_interface__", counted)
            assert array_signature(view) == expected, (view.shape, view.stride(), view.dtype)
        assert not reads, f"the key of {view.shape} read the interface"
    flags = base > 3
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(type(base), "__cuda_array_interface__", counted)
        assert array_signature(flags) == array_signature(InterfaceOnly(flags))
    assert len(reads) == 2, "a bool tensor's key is the interface's"
    grad = torch.zeros((1, 1, 32), device="cuda", requires_grad=True)
    assert array_signature(grad) is None
    with pytest.raises(TypeError, match="^scores: .*requires grad"):
        numba_cp.local_topk_keys(grad, torch.ones(1, dtype=torch.int32, device="cuda"),
                                 topk=4, rank=0, world=1, query_len=1, global_blocks=32,
                                 init_blocks=1, local_blocks=1,
                                 out=torch.zeros((1, 1, 4), dtype=torch.int64, device="cuda"))


@pytest.mark.gpu
def test_the_raw_stream_handle_is_torchs_current_stream():
    torch = _real_torch()
    found = _torch.found()
    side = torch.cuda.Stream()
    assert found.current_stream() == torch.cuda.current_stream().cuda_stream
    with torch.cuda.stream(side):
        assert found.current_stream() == side.cuda_stream == \
            torch.cuda.current_stream().cuda_stream
        stream = arrays.resolve_stream(None, torch.zeros(1, device="cuda"))
        assert arrays.stream_handle(stream) == side.cuda_stream


@pytest.mark.gpu
def test_torch_callers_launch_on_torchs_stream_and_get_exact_results(monkeypatch):
    torch = _real_torch()
    import cupy

    handles = []
    real = launcher.resolve_stream

    def resolve_stream(stream, like=None):
        resolved = real(stream, like)
        handles.append(int(getattr(resolved.handle, "value", resolved.handle) or 0))
        return resolved

    monkeypatch.setattr(launcher, "resolve_stream", resolve_stream)
    monkeypatch.setattr(ops, "_PACK_LAUNCHES", LaunchCache())
    monkeypatch.setattr(ops, "_MERGE_LAUNCHES", LaunchCache())
    rng = np.random.default_rng(11)
    window = dict(query_len=1, init_blocks=1, local_blocks=2)
    seq = np.array([64 * 128, 3000, 900, 128], np.int32)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        t_seq = torch.from_numpy(seq).cuda()
        for call in range(3):  # the first through Numba's dispatch, then the direct path
            full = rng.standard_normal((2, 4, 64)).astype(np.float32)
            keys = torch.zeros((2, 2, 4, 16), dtype=torch.int64, device="cuda")
            for r in range(2):
                shard = torch.from_numpy(ref.shard_scores(full, rank=r, world=2,
                                                          global_blocks=64)).cuda()
                numba_cp.local_topk_keys(shard, t_seq, topk=16, rank=r, world=2,
                                         global_blocks=64, out=keys[r], **window)
            idx = torch.full((2, 4, 16), 7, dtype=torch.int32, device="cuda")
            numba_cp.merge_topk_keys(keys, idx, t_seq, **window)
            side.synchronize()
            np.testing.assert_array_equal(idx.cpu().numpy(), ref.global_topk(
                full, seq, topk=16, global_blocks=64, **window))
    assert handles and set(handles) == {side.cuda_stream}
    assert len(ops._PACK_LAUNCHES) == 2 and len(ops._MERGE_LAUNCHES) == 1  # per rank; once
    handles.clear()
    theirs = cupy.cuda.Stream(non_blocking=True)
    with theirs:
        out = cupy.zeros((2, 4, 16), cupy.int64)
        numba_cp.local_topk_keys(cupy.asarray(ref.shard_scores(full, rank=0, world=2,
                                                               global_blocks=64)),
                                 cupy.asarray(seq), topk=16, rank=0, world=2,
                                 global_blocks=64, out=out, **window)
    assert handles == [theirs.ptr], "a CuPy caller keeps CuPy's stream"
