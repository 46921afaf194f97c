"""deepspeed_api.py against a real ZeRO-3 engine in this process (one gloo rank on loopback): the
layers gathered whole, and ZeRO-3's hooks paused around a replay. The launched jobs that train
exactly with recomputing plans under ZeRO-3 are tests/test_zero_plans.py's."""

import pytest

pytest.importorskip("deepspeed")


def _zero3_engine():
    import deepspeed
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=32, vocab_size=64)
    model = transformers.GPT2LMHeadModel(cfg).train()
    config = {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 10**6,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
              # nothing persistent: every parameter is gathered and released by the hooks
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine, model


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_zero3_layers_gathered_whole_and_their_hooks_paused_for_a_replay(single_process_group):
    import torch
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    from slackswap_ds.deepspeed_api import gather_layers_whole
    from slackswap_ds.runtime.regions import find_layers

    engine, model = _zero3_engine()
    layers = [layer for _, layer in find_layers(model)]
    assert [type(layer).__name__ for layer in layers] == ["GPT2Block", "GPT2Block"]
    inner = layers[0].attn.c_attn
    assert inner._forward_pre_hooks  # ZeRO-3 hooked every module, the layers' own too
    zero = gather_layers_whole(engine, layers)
    assert zero is not None and zero.layers == layers
    # the layers' children have no ZeRO-3 hooks now: the layer's gather them all
    assert not inner._forward_pre_hooks and not inner._forward_hooks
    assert all(not hasattr(p, "ds_z3_leaf_module") for p in model.parameters())  # reduction per parameter

    seen: list[list[str]] = []

    def in_backward(grad):  # runs inside layer 1's backward, after ZeRO-3 gathered it
        seen.append([p.ds_status.name for p in layers[1].parameters()])
        before = [list(d) for d in (layers[1]._forward_pre_hooks, layers[1]._forward_hooks)]
        with zero.replaying(layers[1]):
            assert not layers[1]._forward_pre_hooks and not layers[1]._forward_hooks  # only ZeRO-3's were there
        assert [list(d) for d in (layers[1]._forward_pre_hooks, layers[1]._forward_hooks)] == before
        return grad

    ids = torch.randint(0, 64, (1, 16))
    out = {}

    def keep_inner(module, args, output):
        output.register_hook(in_backward)  # the block's MLP output: read inside the block's backward
        out["mlp"] = output

    handle = layers[1].mlp.register_forward_hook(keep_inner)
    loss = engine(input_ids=ids, labels=ids).loss
    handle.remove()
    # outside its forward and backward a layer's parameters are partitioned: a replay there would
    # have to gather on this rank alone, so it is refused before anything runs
    assert all(p.ds_status == ZeroParamStatus.NOT_AVAILABLE for p in layers[1].parameters())
    with pytest.raises(RuntimeError, match="partitioned"):
        with zero.replaying(layers[1]):
            pass
    engine.backward(loss)
    engine.step()
    assert seen and set(seen[0]) == {"AVAILABLE"}
