"""Bucketing: padding to the next multiple (slackswap_ds/bucketing.py) and the engine option
`pad_to_multiple` that plans one shape per bucket."""

import pytest
import torch

import slackswap_ds as ss
from slackswap_ds.bucketing import BucketingError, pad_to_multiple, padded_length


def test_padding_values_lengths_and_a_fresh_dict():
    ids = torch.arange(1, 11).reshape(2, 5)
    batch = {"input_ids": ids, "labels": ids.clone(), "pixel_values": torch.ones(2, 3), "use_cache": False}
    out = pad_to_multiple(batch, 4)
    assert out["input_ids"].shape == (2, 8) and out["labels"].shape == (2, 8)
    assert torch.equal(out["input_ids"][:, :5], ids) and (out["input_ids"][:, 5:] == 0).all()
    assert (out["labels"][:, 5:] == -100).all()
    assert torch.equal(out["attention_mask"], torch.tensor([[1] * 5 + [0] * 3] * 2))  # made: 1 on real tokens
    assert out["pixel_values"] is batch["pixel_values"] and out["use_cache"] is False
    assert "attention_mask" not in batch and batch["input_ids"] is ids  # the caller's batch is left alone
    assert pad_to_multiple({"input_ids": ids[:, :4]}, 4)["input_ids"].shape == (2, 4)  # already a multiple
    assert [padded_length(n, 64) for n in (1, 64, 65, 128)] == [64, 64, 128, 128]


def test_unknown_tensors_of_the_sequence_length_and_bad_input_are_refused():
    ids = torch.ones(2, 5, dtype=torch.long)
    with pytest.raises(BucketingError, match="does not know how to pad 'span_mask'.*pad_values"):
        pad_to_multiple({"input_ids": ids, "span_mask": torch.ones(2, 5)}, 4)
    assert pad_to_multiple({"input_ids": ids, "span_mask": torch.ones(2, 5)}, 4,
                           pad_values={"span_mask": 7})["span_mask"][0, -1] == 7
    with pytest.raises(BucketingError, match="needs a batch with input_ids"):
        pad_to_multiple({"x": ids}, 4)
    with pytest.raises(BucketingError, match=">= 1"):
        pad_to_multiple({"input_ids": ids}, 0)


def _gpt2():
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=64, vocab_size=64,
                                  bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg).train()


def _train(multiple, enabled: bool, lengths):
    model = _gpt2()
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**6,
              "optimizer": {"type": "SGD", "params": {"lr": 1e-2}},
              "slackswap": {"enabled": enabled, "profile_steps": 1, "hardware": "a100-80g-pcie4",
                            "activation_budget": 0.75, "pad_to_multiple": multiple}}
    engine, *_ = ss.initialize(model=model, model_parameters=model.parameters(), config=config)
    torch.manual_seed(1)
    losses = []
    for step, n in enumerate(lengths):
        ids = torch.randint(1, 64, (2, n))
        batch = {"input_ids": ids, "labels": ids}
        if not enabled:  # the same padding, by hand
            batch = pad_to_multiple(batch, multiple)
        torch.manual_seed(100 + step)
        loss = engine(**batch, use_cache=False).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses, getattr(engine, "slackswap", None)


def test_the_engine_plans_one_shape_per_bucket_with_the_losses_of_padding_by_hand(single_process_group):
    lengths = [5, 7, 8, 9, 12, 16, 3, 15]
    off, _ = _train(8, False, lengths)
    on, runtime = _train(8, True, lengths)
    assert on == off
    assert sorted(key[0][0] for key in runtime.shapes) == [(2, 8), (2, 16)]  # 8 lengths, 2 buckets


def test_padding_keeps_the_loss_of_the_unpadded_batch_up_to_rounding():
    model = _gpt2().eval()
    ids = torch.randint(1, 64, (2, 11))
    plain = model(input_ids=ids, labels=ids).loss
    padded = model(**pad_to_multiple({"input_ids": ids, "labels": ids}, 8)).loss
    assert torch.allclose(plain, padded, rtol=1e-5, atol=1e-6)
