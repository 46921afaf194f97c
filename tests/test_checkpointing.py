"""Parity of slackswap_ds.checkpointing with DeepSpeed's own deepspeed.checkpointing.

Every case compares outputs and every gradient with torch.equal against a plain call and against
DeepSpeed's functions: our functions in delegate mode (no plan) and in plan mode (plan_active()),
before and after install(). Each test leaves DeepSpeed unpatched (checked by an autouse fixture).
"""

from __future__ import annotations

import os
from contextlib import contextmanager

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import pytest  # noqa: E402

torch = pytest.importorskip("torch")
deepspeed = pytest.importorskip("deepspeed")

import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from deepspeed.runtime.activation_checkpointing import checkpointing as C  # noqa: E402
from deepspeed.runtime.pipe.module import PipelineModule  # noqa: E402

from slackswap_ds import checkpointing as ckpt  # noqa: E402

API = ("checkpoint", "non_reentrant_checkpoint", "configure", "is_configured", "reset", "get_cuda_rng_tracker",
       "model_parallel_cuda_manual_seed", "model_parallel_reconfigure_tp_seed", "CheckpointFunction")
DS = {name: getattr(C, name) for name in API}  # DeepSpeed's originals, captured before any install()
PIPE_DEFAULTS = PipelineModule.__init__.__defaults__


@pytest.fixture(autouse=True)
def _deepspeed_left_unpatched():
    yield
    ckpt.uninstall()
    ckpt.set_plan_active(False)
    assert not ckpt.is_installed()
    for name in API:
        assert getattr(deepspeed.checkpointing, name) is DS[name], name
    assert not hasattr(C, "_slackswap_originals")
    assert PipelineModule.__init__.__defaults__ is PIPE_DEFAULTS


# --------------------------------------------------------------------------------------------
# cases: each returns (fn, args, kwargs, leaves) built from a fixed seed


def mixed_case():
    """None arg, bool and float masks, float/str args; outputs mix tensors (float, bool, long)
    and non-tensors in every position."""
    lin = nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    bmask = torch.rand(4, 8) > 0.5
    fmask = (torch.rand(4, 8) > 0.3).float()

    def fn(x, none_arg, bmask, scale, fmask, tag):
        assert none_arg is None and tag == "t"
        h = F.gelu(lin(x)) * scale
        h = h.masked_fill(bmask, 0.0) * fmask
        return "before", h, 3, torch.tanh(h).sum(dim=1), None, bmask.logical_not(), h.argmax(dim=1)

    return fn, (x, None, bmask, 2.0, fmask, "t"), {}, [x, lin.weight, lin.bias]


def two_input_case():
    """Two differentiable inputs, one of them only used through a float mask; one tuple output."""
    lin = nn.Linear(8, 8)
    x, y = torch.randn(4, 8, requires_grad=True), torch.randn(4, 8, requires_grad=True)
    fmask = (torch.rand(4, 8) > 0.5).float()

    def fn(x, y, fmask):
        return (F.gelu(lin(x)) * y.sigmoid() * fmask,)  # a 1-tuple comes back unwrapped

    return fn, (x, y, fmask), {}, [x, y, lin.weight, lin.bias]


def dropout_case():
    """Dropout inside fn: recomputation must replay the same mask."""
    lin1, lin2, drop = nn.Linear(8, 16), nn.Linear(16, 8), nn.Dropout(0.3).train()
    x = torch.randn(4, 8, requires_grad=True)

    def fn(x):
        return lin2(drop(F.gelu(lin1(x)))) + drop(x)

    return fn, (x,), {}, [x, lin1.weight, lin1.bias, lin2.weight]


def kwargs_case():
    """A tensor passed by keyword takes part in autograd; a bool mask and a float by keyword."""
    lin = nn.Linear(8, 8)
    x, y = torch.randn(4, 8, requires_grad=True), torch.randn(4, 8, requires_grad=True)
    bmask = torch.rand(4, 8) > 0.5

    def fn(x, y=None, *, mask=None, scale=1.0):
        h = F.gelu(lin(x)) * scale + y * y
        return h.masked_fill(mask, 0.0), mask

    return fn, (x,), {"y": y, "mask": bmask, "scale": 0.5}, [x, y, lin.weight]


def no_grad_input_case():
    """No tensor input requires grad; the parameters inside fn do."""
    lin1, lin2 = nn.Linear(8, 8), nn.Linear(8, 8)
    x = torch.randn(4, 8)
    bmask = torch.rand(4, 8) > 0.5

    def fn(x, bmask):
        return lin2(F.gelu(lin1(x))).masked_fill(bmask, 0.0)

    return fn, (x, bmask), {}, [lin1.weight, lin1.bias, lin2.weight]


CASES = {"mixed": mixed_case, "two_input": two_input_case, "dropout": dropout_case, "kwargs": kwargs_case,
         "no_grad_input": no_grad_input_case}


# --------------------------------------------------------------------------------------------
# ways to call fn


def plain(fn, *args, **kwargs):
    return fn(*args, **kwargs)


@contextmanager
def nothing():
    yield


def through(func, plan=False, installed=False):
    """Call `func` (resolved lazily, so install() can be in effect) in delegate or plan mode."""

    def call(fn, *args, **kwargs):
        if installed:
            ckpt.install()
        try:
            with ckpt.plan_scope() if plan else nothing():
                return func()(fn, *args, **kwargs)
        finally:
            if installed:
                ckpt.uninstall()

    return call


MODES = {
    "deepspeed": through(lambda: DS["checkpoint"]),
    "deepspeed_non_reentrant": through(lambda: DS["non_reentrant_checkpoint"]),
    "ours": through(lambda: ckpt.checkpoint),
    "ours_non_reentrant": through(lambda: ckpt.non_reentrant_checkpoint),
    "ours_plan": through(lambda: ckpt.checkpoint, plan=True),
    "ours_non_reentrant_plan": through(lambda: ckpt.non_reentrant_checkpoint, plan=True),
    "installed": through(lambda: deepspeed.checkpointing.checkpoint, installed=True),
    "installed_plan": through(lambda: deepspeed.checkpointing.checkpoint, plan=True, installed=True),
    "installed_non_reentrant_plan": through(lambda: deepspeed.checkpointing.non_reentrant_checkpoint, plan=True,
                                            installed=True),
    # DeepSpeed's original checkpoint still bound somewhere, under a plan after install():
    # routed through our CheckpointFunction
    "bound_original_plan": through(lambda: DS["checkpoint"], plan=True, installed=True),
}

UNSUPPORTED = {
    ("deepspeed_non_reentrant", "kwargs"),  # DeepSpeed's non_reentrant_checkpoint takes no kwargs
    ("deepspeed", "no_grad_input"),  # DeepSpeed's reentrant checkpoint drops the parameter grads
}


def as_tuple(out):
    return out if isinstance(out, tuple) else (out,)


def loss_of(out):
    return sum((t.float() * (i + 1)).sum() for i, t in enumerate(as_tuple(out))
               if torch.is_tensor(t) and t.requires_grad)


def execute(call, case, grad=True):
    torch.manual_seed(1234)
    fn, args, kwargs, leaves = case()
    torch.manual_seed(99)
    with torch.set_grad_enabled(grad):
        out = call(fn, *args, **kwargs)
    if grad:
        loss_of(out).backward()
    after = torch.get_rng_state()  # a checkpoint consumes the same random numbers as a plain call
    outs = tuple(o.detach() if torch.is_tensor(o) else o for o in as_tuple(out))
    return outs, [leaf.grad for leaf in leaves], after


def assert_same(a, b):
    (out_a, grads_a, rng_a), (out_b, grads_b, rng_b) = a, b
    assert len(out_a) == len(out_b)
    for x, y in zip(out_a, out_b):
        if torch.is_tensor(x):
            assert torch.is_tensor(y) and x.dtype == y.dtype and torch.equal(x, y)
        else:
            assert not torch.is_tensor(y) and x == y
    assert len(grads_a) == len(grads_b)
    for g, h in zip(grads_a, grads_b):
        assert g is not None and h is not None, "a gradient was dropped"
        assert torch.equal(g, h)
    assert torch.equal(rng_a, rng_b)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", CASES)
def test_outputs_and_every_gradient_equal_plain_call(case, mode):
    if (mode, case) in UNSUPPORTED:
        pytest.skip("not supported by DeepSpeed itself; see the dedicated tests")
    assert_same(execute(MODES[mode], CASES[case]), execute(plain, CASES[case]))


@pytest.mark.parametrize("mode", [m for m in MODES if m != "bound_original_plan"])
def test_outputs_equal_under_no_grad(mode):
    for case in ("mixed", "dropout", "no_grad_input"):
        ref = execute(plain, CASES[case], grad=False)
        got = execute(MODES[mode], CASES[case], grad=False)
        assert all(not (torch.is_tensor(o) and o.requires_grad) for o in got[0])
        assert_same((got[0], [], got[2]), (ref[0], [], ref[2]))


def test_output_conventions_match_deepspeed():
    """A lone tensor stays a tensor, a 1-tuple or 1-list is unwrapped, a list becomes a tuple."""
    x = torch.randn(3, requires_grad=True)
    for fn in (lambda t: t * 2, lambda t: (t * 2,), lambda t: [t * 2], lambda t: [t * 2, None, t + 1],
               lambda t: (None, t * 3)):
        ref = DS["checkpoint"](fn, x)
        for call in (ckpt.checkpoint, ckpt.non_reentrant_checkpoint):
            for plan in (False, True):
                with ckpt.plan_scope(plan):
                    got = call(fn, x)
                assert type(got) is type(ref)
                for g, r in zip(as_tuple(got), as_tuple(ref)):
                    assert (g is None and r is None) or torch.equal(g, r)


def test_kwargs_deepspeed_checkpoint_accepts_them_non_reentrant_does_not_ours_both_do():
    ref = execute(plain, kwargs_case)
    assert_same(execute(MODES["deepspeed"], kwargs_case), ref)
    with pytest.raises(TypeError, match="unexpected keyword"):
        execute(MODES["deepspeed_non_reentrant"], kwargs_case)
    assert_same(execute(MODES["ours_non_reentrant"], kwargs_case), ref)


def test_deepspeed_reentrant_drops_parameter_grads_when_no_input_requires_grad_ours_does_not():
    def run(call):
        torch.manual_seed(0)
        lin, head = nn.Linear(8, 8), nn.Parameter(torch.randn(8))
        x = torch.randn(4, 8)  # e.g. token embeddings computed without grad
        out = call(lin, x)
        (out * head).sum().backward()
        return lin.weight.grad, head.grad

    w_plain, head_plain = run(plain)
    w_ds, head_ds = run(DS["checkpoint"])
    assert w_ds is None and torch.equal(head_ds, head_plain)  # DeepSpeed: silently dropped
    for call in (ckpt.checkpoint, MODES["ours_plan"], MODES["installed"], DS["non_reentrant_checkpoint"]):
        w, head = run(call)
        assert torch.equal(w, w_plain) and torch.equal(head, head_plain)

    # with nothing else requiring grad, DeepSpeed's backward fails outright; ours works
    torch.manual_seed(0)
    lin = nn.Linear(8, 8)
    with pytest.raises(RuntimeError, match="does not require grad"):
        DS["checkpoint"](lin, torch.randn(4, 8)).sum().backward()
    ckpt.checkpoint(lin, torch.randn(4, 8)).sum().backward()
    assert lin.weight.grad is not None


def test_delegate_mode_routes_only_grad_less_inputs_to_non_reentrant(monkeypatch):
    calls = []
    for name in ("checkpoint", "non_reentrant_checkpoint"):
        monkeypatch.setattr(C, name, lambda fn, *a, _n=name, _f=DS[name]: calls.append(_n) or _f(fn, *a))
    lin = nn.Linear(4, 4)
    ckpt.checkpoint(lin, torch.randn(2, 4, requires_grad=True))
    ckpt.checkpoint(lin, torch.randn(2, 4))
    with torch.no_grad():
        ckpt.checkpoint(lin, torch.randn(2, 4))  # eval: DeepSpeed's own path, as before
    assert calls == ["checkpoint", "non_reentrant_checkpoint", "checkpoint"]


def _count_saved(call, fn, *args):
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t.shape) or t, lambda t: t):
        out = call(fn, *args)
    return len(packed), out


def test_plan_mode_exposes_every_activation_to_saved_tensor_hooks():
    torch.manual_seed(0)
    lin1, lin2 = nn.Linear(8, 16), nn.Linear(16, 8)

    def fn(x):
        return lin2(F.gelu(lin1(x)))

    x = torch.randn(4, 8, requires_grad=True)
    n_plain, _ = _count_saved(plain, fn, x)
    assert n_plain > 0
    assert _count_saved(DS["checkpoint"], fn, x)[0] == 0  # DeepSpeed hides them from outer hooks
    assert _count_saved(DS["non_reentrant_checkpoint"], fn, x)[0] == 0
    assert _count_saved(ckpt.checkpoint, fn, x)[0] == 0  # delegate mode: unchanged
    for mode in ("ours_plan", "ours_non_reentrant_plan", "installed_plan", "bound_original_plan"):
        n, out = _count_saved(MODES[mode], fn, x)
        assert n == n_plain, mode
        assert "CheckpointFunction" not in type(out.grad_fn).__name__


def test_checkpoint_function_applies_like_deepspeeds_in_delegate_mode_and_runs_directly_in_plan_mode():
    cls = ckpt.CheckpointFunction
    assert issubclass(cls, DS["CheckpointFunction"]) and cls is ckpt.CheckpointFunction

    def fn(x, none_arg):
        return "tag", torch.tanh(x) * 2

    for plan in (False, True):
        x = torch.randn(3, requires_grad=True)
        all_outputs = []
        with ckpt.plan_scope(plan):
            returned = cls.apply(fn, all_outputs, x, None)
        assert all_outputs[0] == "tag" and torch.equal(all_outputs[1], torch.tanh(x) * 2)
        assert len(returned) == 1 and returned[0] is all_outputs[1]
        all_outputs[1].sum().backward()
        x_plain = x.detach().requires_grad_()
        fn(x_plain, None)[1].sum().backward()
        assert torch.equal(x.grad, x_plain.grad)


def test_install_uninstall_round_trip_restores_every_identity():
    before = {name: getattr(deepspeed.checkpointing, name) for name in API}
    assert ckpt.install() is True and ckpt.is_installed()
    assert ckpt.install() is False  # idempotent
    for name in API:
        assert getattr(deepspeed.checkpointing, name) is getattr(ckpt, name), name
    assert ckpt.checkpoint in PipelineModule.__init__.__defaults__
    assert DS["checkpoint"] not in PipelineModule.__init__.__defaults__
    # our delegations still reach DeepSpeed's originals, not themselves
    assert ckpt.get_cuda_rng_tracker() is DS["get_cuda_rng_tracker"]()
    assert ckpt.is_configured() == DS["is_configured"]()
    ckpt.reset()
    assert ckpt.uninstall() is True and ckpt.uninstall() is False
    for name in API:
        assert getattr(deepspeed.checkpointing, name) is before[name], name
    assert PipelineModule.__init__.__defaults__ is PIPE_DEFAULTS
    ckpt.install()  # and again after a full round trip
    assert deepspeed.checkpointing.checkpoint is ckpt.checkpoint


def test_patched_by_hand_without_install_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(C, "checkpoint", ckpt.checkpoint)
    with pytest.raises(ckpt.CheckpointingError, match="install"):
        ckpt.checkpoint(nn.Linear(2, 2), torch.randn(1, 2, requires_grad=True))


def test_rng_tracker_is_deepspeeds():
    assert ckpt.get_cuda_rng_tracker() is DS["get_cuda_rng_tracker"]()
    assert ckpt.is_configured() == DS["is_configured"]()


# --------------------------------------------------------------------------------------------
# needs deepspeed.comm: configure / seeds, and PipelineModule


_DS_STATE = ("deepspeed_checkpointing_enabled", "mpu", "mp_rank", "mp_size", "mp_group", "num_layers",
             "PARTITION_ACTIVATIONS", "CONTIGUOUS_CHECKPOINTING", "CPU_CHECKPOINT", "SYNCHRONIZE", "PROFILE_TIME")


@pytest.fixture
def deepspeed_checkpointing_state():
    """configure() and the seed functions change DeepSpeed's module state: put it back."""
    tracker = C.get_cuda_rng_tracker()
    saved = {k: getattr(C, k) for k in _DS_STATE}
    states, seeds, rng = tracker.get_states(), set(tracker.seeds_), torch.get_rng_state()
    yield
    for k, v in saved.items():
        setattr(C, k, v)
    tracker.set_states(states)
    tracker.seeds_ = seeds
    torch.set_rng_state(rng)


class _Mpu:
    def get_model_parallel_rank(self):
        return 0

    def get_model_parallel_world_size(self):
        return 1

    def get_model_parallel_group(self):
        return None

    def get_data_parallel_rank(self):
        return 0


def test_configure_and_seed_functions_delegate_to_deepspeed(single_process_group, deepspeed_checkpointing_state):
    tracker = C.get_cuda_rng_tracker()
    mpu = _Mpu()
    ckpt.configure(mpu, partition_activations=False, checkpoint_in_cpu=False, synchronize=False, profile=False)
    assert ckpt.is_configured() and C.is_configured() and C.mpu is mpu and C.PARTITION_ACTIVATIONS is False
    ckpt.configure(num_checkpoints=3)  # mpu_ may be omitted: keeps DeepSpeed's
    assert C.mpu is mpu and C.num_layers == 3

    def seeded(seed_fn, reconfigure_fn):
        tracker.reset()
        seed_fn(7)
        reconfigure_fn(11)
        return {k: v.clone() for k, v in tracker.get_states().items()}, torch.get_rng_state()

    ours = seeded(ckpt.model_parallel_cuda_manual_seed, ckpt.model_parallel_reconfigure_tp_seed)
    theirs = seeded(DS["model_parallel_cuda_manual_seed"], DS["model_parallel_reconfigure_tp_seed"])
    assert ours[0].keys() == theirs[0].keys() == {"model-parallel-rng"}
    assert all(torch.equal(ours[0][k], theirs[0][k]) for k in ours[0]) and torch.equal(ours[1], theirs[1])


class Block(nn.Module):
    forwards = 0

    def __init__(self, d=8):
        super().__init__()
        self.lin, self.drop = nn.Linear(d, d), nn.Dropout(0.2)

    def forward(self, x):
        Block.forwards += 1
        return self.drop(F.gelu(self.lin(x)))


def _pipe(interval=1):
    from deepspeed.pipe import LayerSpec

    torch.manual_seed(0)
    module = PipelineModule([LayerSpec(Block, 8) for _ in range(3)], num_stages=1,
                            activation_checkpoint_interval=interval)
    # Without a PipelineEngine nothing computes the per-block "checkpointable" flags, and
    # forward() would zip the blocks against an empty list and return its input unchanged.
    module.set_checkpoint_interval(interval)
    return module.train()


def _pipe_step(module, x_requires_grad=True):
    torch.manual_seed(5)
    x = torch.randn(4, 8, requires_grad=x_requires_grad)
    Block.forwards = 0
    out = module(x)
    out.pow(2).sum().backward()
    grads = [p.grad.clone() for p in module.parameters()]
    return out.detach(), grads, (x.grad.clone() if x_requires_grad else None), Block.forwards


def _assert_pipe_same(a, b):
    assert torch.equal(a[0], b[0])
    assert len(a[1]) == len(b[1]) == 6 and all(torch.equal(g, h) for g, h in zip(a[1], b[1]))
    assert (a[2] is None and b[2] is None) or torch.equal(a[2], b[2])


def test_pipeline_module_routes_through_us_after_install(single_process_group, monkeypatch):
    plain_run = _pipe_step(_pipe(0))
    assert plain_run[3] == 3
    reference = _pipe_step(_pipe(1))  # DeepSpeed's reentrant checkpoint, not installed
    assert reference[3] == 6  # each block recomputed once in backward
    _assert_pipe_same(reference, plain_run)

    ckpt.install()
    module = _pipe(1)
    assert module.activation_checkpoint_func is ckpt.checkpoint
    assert module.is_checkpointable_results == [True, True, True]

    counts = {"checkpoint": 0, "non_reentrant_checkpoint": 0, "direct": 0}
    originals = C._slackswap_originals
    for name in ("checkpoint", "non_reentrant_checkpoint"):
        def counted(fn, *args, _n=name, _f=originals[name]):
            counts[_n] += 1
            return _f(fn, *args)
        monkeypatch.setitem(originals, name, counted)
    run_direct = ckpt._run_direct

    def direct(*a):
        counts["direct"] += 1
        return run_direct(*a)

    monkeypatch.setattr(ckpt, "_run_direct", direct)

    delegated = _pipe_step(module)  # delegate mode: through us, to DeepSpeed's reentrant checkpoint
    assert counts == {"checkpoint": 3, "non_reentrant_checkpoint": 0, "direct": 0} and delegated[3] == 6
    _assert_pipe_same(delegated, reference)

    module.zero_grad(set_to_none=True)
    with ckpt.plan_scope():  # plan mode: the blocks run directly, nothing is recomputed
        planned = _pipe_step(module)
    assert counts["direct"] == 3 and counts["checkpoint"] == 3 and planned[3] == 3
    _assert_pipe_same(planned, reference)


def test_pipeline_module_input_without_grad_keeps_every_parameter_grad(single_process_group, monkeypatch):
    plain_run = _pipe_step(_pipe(0), x_requires_grad=False)
    with pytest.raises(RuntimeError, match="does not require grad"):
        _pipe_step(_pipe(1), x_requires_grad=False)  # DeepSpeed's: the whole chain is detached

    ckpt.install()
    counts = {"checkpoint": 0, "non_reentrant_checkpoint": 0}
    originals = C._slackswap_originals
    for name in counts:
        def counted(fn, *args, _n=name, _f=originals[name]):
            counts[_n] += 1
            return _f(fn, *args)
        monkeypatch.setitem(originals, name, counted)
    module = _pipe(1)
    ours = _pipe_step(module, x_requires_grad=False)
    # only the first block sees an input without grad; the others keep DeepSpeed's reentrant path
    assert counts == {"checkpoint": 2, "non_reentrant_checkpoint": 1}
    _assert_pipe_same(ours, plain_run)
    module.zero_grad(set_to_none=True)
    with ckpt.plan_scope():
        _assert_pipe_same(_pipe_step(module, x_requires_grad=False), plain_run)


def test_pipeline_module_built_before_install_is_routed_in_plan_mode(single_process_group):
    module = _pipe(1)
    reference = _pipe_step(module)
    assert module.activation_checkpoint_func is DS["checkpoint"]
    ckpt.install()
    module.zero_grad(set_to_none=True)
    with ckpt.plan_scope():  # DeepSpeed's checkpoint looks CheckpointFunction up at call time
        planned = _pipe_step(module)
    assert planned[3] == 3
    _assert_pipe_same(planned, reference)
