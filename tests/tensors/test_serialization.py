import copy
import io
import pickle

import pytest
import torch

import qmoe
from tests.tensors.helpers import RECIPES, assert_same_quantized


def _roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("name", list(RECIPES))
def test_save_load_weights_only(name):
    q = qmoe.quantize(torch.randn(5, 129, dtype=torch.bfloat16), RECIPES[name])
    out = _roundtrip(q)
    assert_same_quantized(out, q)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    assert torch.equal(out.dequantize(), q.dequantize())


def test_state_dict_of_mixed_types():
    x = torch.randn(3, 256)
    sd = {n: qmoe.quantize(x, r) for n, r in RECIPES.items()}
    sd["plain"] = x
    out = _roundtrip(sd)
    for n in RECIPES:
        assert_same_quantized(out[n], sd[n])
    assert torch.equal(out["plain"], x)


@pytest.mark.parametrize("name", list(RECIPES))
def test_pickle_roundtrip(name):
    """Plain pickle (multiprocessing, Ray): torch 2.13 cannot load fp8 storages it pickled
    itself; our types travel with their bits as uint8."""
    x = torch.randn(5, 129, dtype=torch.bfloat16)
    q = qmoe.quantize(x, RECIPES[name])
    for obj in (q, q[1:4], q.detach().requires_grad_()):
        out = pickle.loads(pickle.dumps(obj))
        assert_same_quantized(out, obj)
        assert out.requires_grad == obj.requires_grad and out.dtype == obj.dtype


def test_views_share_storage_through_save():
    q = qmoe.quantize(torch.randn(6, 256), qmoe.Blockwise())
    out = _roundtrip({"q": q, "v": q[2:]})
    assert_same_quantized(out["v"], q[2:])
    ptr = [out[k].qdata.untyped_storage().data_ptr() for k in ("q", "v")]
    assert ptr[0] == ptr[1]


class _TorchReduction:
    """Pickles ``q`` the way torch's own Tensor reduction did before ``__reduce_ex__``."""

    def __init__(self, q):
        self.q = q

    def __reduce__(self):
        return torch.Tensor.__reduce_ex__(self.q, 2)


@pytest.mark.parametrize("name", ["pertensor-e4m3", "blockwise-e5m2", "mx-e4m3"])
def test_files_of_torchs_own_reduction_still_load(name):
    q = qmoe.quantize(torch.randn(5, 129), RECIPES[name])
    assert_same_quantized(_roundtrip(_TorchReduction(q)), q)


def test_parameters_and_attributes_survive():
    """A quantized Parameter stays a Parameter through torch.save (weights_only) and
    pickle, user attributes come along, and torch.export's save/load of a module holding
    one works; a non-leaf needing grad pickles (loaded as a leaf), as torch's tensors do."""
    p = torch.nn.Parameter(qmoe.quantize(torch.randn(4, 64), qmoe.Blockwise(32)),
                           requires_grad=False)
    p.tag = "experts.0"
    for out in (_roundtrip(p), pickle.loads(pickle.dumps(p))):
        assert isinstance(out, torch.nn.Parameter) and out.tag == "experts.0"
        assert_same_quantized(out, p)

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(qmoe.quantize(torch.randn(16, 64), qmoe.MXFP8()),
                                        requires_grad=False)

        def forward(self, x):
            return x @ self.w.dequantize(torch.float32).t()

    ep = torch.export.export(M(), (torch.randn(3, 64),))
    buf = io.BytesIO()
    torch.export.save(ep, buf)
    buf.seek(0)
    x = torch.randn(3, 64)
    assert torch.equal(torch.export.load(buf).module()(x), ep.module()(x))
    q = qmoe.quantize(torch.randn(4, 64, requires_grad=True), qmoe.Blockwise())
    assert pickle.loads(pickle.dumps(q)).requires_grad  # a non-leaf pickles, as torch's do


def test_rebuild_quantized_checks_its_arguments():
    from qmoe.tensors.base import rebuild_quantized

    bits = torch.zeros(2, 4, dtype=torch.uint8)
    with pytest.raises(TypeError, match="not a qmoe quantized tensor type"):
        rebuild_quantized(torch.nn.Parameter, bits, torch.float8_e4m3fn, torch.tensor(1.0),
                          (torch.float32,), False)
    with pytest.raises(TypeError, match="fp8 dtype"):
        rebuild_quantized(qmoe.Float8Tensor, bits, torch.int8, torch.tensor(1.0),
                          (torch.float32,), False)


# --------------------------------------------------------------- corrupt and crafted files
class _Pickled:
    """Pickles as the given reduce value: a file built by hand (corrupt or crafted)."""

    def __init__(self, reduce_value):
        self.reduce_value = reduce_value

    def __reduce__(self):
        return self.reduce_value


def _ours(q, *, arg_scale=None, **state):
    """``q`` as ``QuantizedTensor.__reduce_ex__`` writes it, with ``rebuild_quantized``'s
    scale argument and the pickled state edited."""
    fn, (rebuild, cls, args, st) = q.__reduce_ex__(2)
    if arg_scale is not None:
        args = (*args[:3], arg_scale, *args[4:])
    return _Pickled((fn, (rebuild, cls, args, {**st, **state})))


def _torchs(q, *, size=None, dtype=None, drop=(), **state):
    """``q`` as torch's own Tensor reduction writes it (``_rebuild_wrapper_subclass`` with
    the wrapper's metadata; the fields in the state), with the metadata and state edited."""
    fn, (func, cls, args, st) = torch.Tensor.__reduce_ex__(q, 2)
    args = list(args)
    if dtype is not None:
        args[1] = dtype
    if size is not None:
        args[2] = tuple(size)
        args[3] = torch.empty(size).stride()
    st = {k: v for k, v in {**st, **state}.items() if k not in drop}
    return _Pickled((fn, (func, cls, tuple(args), st)))


LOADS = {
    "weights_only": lambda b: torch.load(io.BytesIO(b), weights_only=True),
    "full": lambda b: torch.load(io.BytesIO(b), weights_only=False),
}


def _saved(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _refused(obj, match, loads=tuple(LOADS)):
    data = _saved(obj)
    for how in loads:
        with pytest.raises((ValueError, TypeError, AttributeError), match=match):
            LOADS[how](data)


def _per_tensor():
    return qmoe.quantize(torch.randn(4, 64), qmoe.PerTensor())


def _blockwise(block_size=32, h=256):
    return qmoe.quantize(torch.randn(4, h), qmoe.Blockwise(block_size))


def test_state_cannot_replace_the_scale():
    """The issue's case: a [4, 1] scale of 0 and -1 in the pickled state replaced the
    checked one, and the tensor dequantized row by row."""
    bad = torch.tensor([[0.0], [-1.0], [1.0], [1.0]])
    _refused(_ours(_per_tensor(), scale=bad), "scale")
    _refused(_ours(_blockwise(), scale=torch.ones(4, 3)), "scale")
    _refused(_ours(_blockwise(), scale=torch.full((4, 8), 0.5)), "scale")  # right shape
    with pytest.raises(ValueError, match="scale"):
        pickle.loads(pickle.dumps(_ours(_per_tensor(), scale=bad)))


@pytest.mark.parametrize("field, value", [
    ("qdata", torch.zeros(7, 256, dtype=torch.float8_e4m3fn)),
    ("block_size", 64),
    ("orig_dtype", torch.int32),
])
def test_state_cannot_replace_other_fields(field, value):
    _refused(_ours(_blockwise(), **{field: value}), field)


def test_state_may_repeat_fields_unchanged():
    q = _blockwise()
    obj = _ours(q, scale=q.scale.clone(), orig_dtype=q.dtype, block_size=32, tag="w")
    for how in LOADS:
        out = LOADS[how](_saved(obj))
        assert_same_quantized(out, q)
        assert out.tag == "w"


def test_state_cannot_give_a_per_tensor_type_blocks():
    _refused(_ours(_per_tensor(), block_size=32), "block_size")
    _refused(_ours(qmoe.quantize(torch.randn(2, 64), qmoe.MXFP8()), block_size=16), "block_size")


@pytest.mark.parametrize("value", [0.0, -1.0, float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("layout", ["pertensor", "blockwise"])
def test_scale_values_are_checked(layout, value):
    """fp32 scales are positive, and non-finite only where quantize writes them (a block
    whose fp8 data holds a NaN): through rebuild_quantized's arguments, through torch's
    own reduction, and through plain pickle."""
    q = _per_tensor() if layout == "pertensor" else _blockwise()
    scale = q.scale.clone()
    scale.view(-1)[-1] = value
    _refused(_ours(q, arg_scale=scale), "scale")
    _refused(_torchs(q, scale=scale), "scale")
    with pytest.raises(ValueError, match="scale"):
        pickle.loads(pickle.dumps(_ours(q, arg_scale=scale)))


@pytest.mark.parametrize("name", list(RECIPES))
def test_non_finite_input_still_round_trips(name):
    """quantize writes a NaN scale for a block holding NaN and +inf for one holding inf
    (its data then holds NaN); such tensors save and load."""
    x = torch.randn(3, 300)
    x[0, 5], x[1, 200], x[2, 299] = float("nan"), float("inf"), -float("inf")
    q = qmoe.quantize(x, RECIPES[name])
    for how in LOADS:
        assert_same_quantized(LOADS[how](_saved(q)), q)
    assert_same_quantized(pickle.loads(pickle.dumps(q)), q)
    assert_same_quantized(copy.deepcopy(q), q)


def test_torchs_reduction_with_a_wrong_wrapper_is_refused():
    """Files of torch's own reduction carry the wrapper's metadata apart from qdata."""
    q = _blockwise(h=256)
    q7 = qmoe.quantize(torch.randn(7, 256), qmoe.Blockwise(32))
    _refused(_torchs(q7, size=(2, 256)), "shape")
    _refused(_torchs(q, dtype=torch.float16), "dtype")
    _refused(_torchs(q, qdata=q7.qdata), "scale shape")
    _refused(_torchs(q, scale=torch.ones(4, 3)), "scale shape")
    _refused(_torchs(q, drop=("scale",)), "lacks")
    _refused(_torchs(q, orig_dtype=torch.int32), "orig_dtype")
    _refused(_torchs(q, block_size=0), "block_size")


def test_torchs_reduction_of_mx_files_with_an_e8m0_scale_load():
    """MXFP8 files written by torch's reduction before the scale was kept as bits hold
    the e8m0 ``scale``."""
    q = qmoe.quantize(torch.randn(3, 64), qmoe.MXFP8())
    obj = _torchs(q, drop=("scale_bits",), scale=q.scale.clone())
    for how in LOADS:
        assert_same_quantized(LOADS[how](_saved(obj)), q)


def test_a_plain_tensor_made_a_subclass_by_the_state_is_refused():
    """``_rebuild_from_type_v2`` turns a plain tensor into the type with ``as_subclass``
    when the rebuild function returns a plain tensor: it is not a wrapper."""
    q = _per_tensor()
    func, args = torch.Tensor.__reduce_ex__(torch.randn(4, 64), 2)
    state = {"qdata": q.qdata, "scale": q.scale, "orig_dtype": q.dtype}
    _refused(_Pickled((torch._tensor._rebuild_from_type_v2,
                       (func, qmoe.Float8Tensor, args, state))), "wrapper")


def test_parameter_state_cannot_replace_fields():
    """torch's ``_rebuild_parameter_with_state`` (weights_only allows it) applies the state
    with setattr to the tensor ``Parameter(data)`` made: fields are read-only."""
    from collections import OrderedDict

    q = _per_tensor()
    rebuild = torch._utils._rebuild_parameter_with_state
    bad = torch.tensor([[0.0], [-1.0], [1.0], [1.0]])
    _refused(_Pickled((rebuild, (q, False, OrderedDict(), {"scale": bad}))), "read-only")
    _refused(_Pickled((rebuild, (q, False, OrderedDict(), {"block_size": 32}))), "read-only")
    obj = _Pickled((rebuild, (q, False, OrderedDict(), {"tag": "w"})))
    for how in LOADS:
        out = LOADS[how](_saved(obj))
        assert isinstance(out, torch.nn.Parameter) and out.tag == "w"
        assert_same_quantized(out, q)
    with pytest.raises(AttributeError, match="read-only"):
        q.scale = q.scale.clone()


def test_swap_tensors_still_works():
    """Read-only fields leave ``__class__`` and ``__dict__`` to torch.utils.swap_tensors
    (module.to with swap_module_params_on_conversion)."""
    a, b = _blockwise(), _blockwise()
    qa, qb = a.qdata, b.qdata
    torch.utils.swap_tensors(a, b)
    assert a.qdata is qb and b.qdata is qa
    c = torch.randn(3, 5)
    torch.utils.swap_tensors(a, c)
    assert type(a) is torch.Tensor and type(c) is qmoe.Float8BlockwiseTensor
    assert c.qdata is qb and c.shape == (4, 256)
    m = torch.nn.Linear(64, 4)
    m.weight = torch.nn.Parameter(qmoe.quantize(torch.randn(4, 64), qmoe.MXFP8()),
                                  requires_grad=False)
    old = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        m.half()
    finally:
        torch.__future__.set_swap_module_params_on_conversion(old)
    assert type(m.weight) is torch.nn.Parameter and m.weight.dtype == torch.float16


def test_copies_end_validated():
    """deepcopy (torch's: clone, then the __dict__ copied over) and copy.copy (our
    __reduce_ex__) check the scale values too."""
    p = torch.nn.Parameter(_blockwise(), requires_grad=False)
    p.tag = "w"
    out = copy.deepcopy(p)
    assert isinstance(out, torch.nn.Parameter) and out.tag == "w"
    assert_same_quantized(out, p)
    q = _blockwise()
    q.__dict__["scale"] = torch.zeros(4, 8)  # corrupt in place, past the read-only fields
    with pytest.raises(ValueError, match="scale"):
        copy.deepcopy(q)
    with pytest.raises(ValueError, match="scale"):
        copy.copy(q)
