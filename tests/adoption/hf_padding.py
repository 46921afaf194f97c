"""Hugging Face's Trainer with `DataCollatorWithPadding`: each batch padded to its own longest
sequence, so every data-parallel rank sees its own input shapes at every step (the job a user
fine-tuning on text of varying lengths runs). 30 steps.

Besides the losses (rank 0), every rank writes what SlackSwap did on it to `<losses>.rank<R>`:
each step's device-resident saved bytes, the budget of the plan it ran (None: a warm-up or
profiled step), its padded length and the bytes it saved; the budget fraction, its profiled steps and derived plans, and the input shapes it saw; rank 0 also
writes a digest of the final parameters (equal on every data-parallel rank; gathered under
ZeRO-3)."""

import hashlib
import json
import os
import random
import tempfile

import deepspeed
import torch
import transformers
from tokenizers import Tokenizer, models

from common import VOCAB, parse_args, trainer_options, write_losses

STEPS, BATCH = 30, 2

transformers.logging.set_verbosity_error()
vocab = {"[PAD]": 0, "[UNK]": 1, **{f"t{i}": i for i in range(2, VOCAB)}}
tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="[UNK]")),
                                                 pad_token="[PAD]", unk_token="[UNK]")


class Texts(torch.utils.data.Dataset):
    """Token sequences of 5 to 40 tokens: examples of one batch have different lengths."""

    def __len__(self):
        return 4 * STEPS * BATCH

    def __getitem__(self, i):
        rng = random.Random(i)
        return {"input_ids": [rng.randrange(2, VOCAB) for _ in range(rng.randint(5, 40))]}


class CausalLM(transformers.GPT2LMHeadModel):
    """A causal LM whose labels are its inputs, padding left out of the loss."""

    def forward(self, input_ids=None, attention_mask=None, **kwargs):
        labels = input_ids.masked_fill(attention_mask == 0, -100)
        return super().forward(input_ids=input_ids, attention_mask=attention_mask, labels=labels, **kwargs)


def model():
    torch.manual_seed(0)
    # use_cache off, as in training scripts: SlackSwap turns a KV cache off while it runs (takeover.py),
    # and the unmodified model with the cache on takes another attention-mask path (last bits differ)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=64, vocab_size=VOCAB,
                                  bos_token_id=0, eos_token_id=0, use_cache=False)
    return CausalLM(cfg).train()


class Watch(transformers.TrainerCallback):
    """Each step's measured peak and plan budget on this rank (SlackSwap's runtime on the engine)."""

    def __init__(self):
        self.trainer, self.steps = None, []

    def on_step_end(self, args, state, control, **kwargs):
        runtime = getattr(self.trainer.model_wrapped, "slackswap", None)
        if runtime is not None:
            plan, stats = runtime.active_plan, runtime.last_stats
            saved = stats.kept_bytes + stats.swapped_bytes + stats.recomputed_bytes
            self.steps.append([stats.peak_device_bytes, plan.budget_bytes if plan else None,
                               runtime.step_shapes[0][0][1], saved])


def main(argv: list[str] | None = None) -> int:
    """One training job (several in one process under tests/launch/in_turn.py)."""
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as out:
        training = transformers.TrainingArguments(
            output_dir=out, deepspeed=args.deepspeed_config, max_steps=STEPS, per_device_train_batch_size=BATCH,
            logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, seed=0, dataloader_num_workers=0,
            **trainer_options(args))
        watch = Watch()
        trainer = transformers.Trainer(model=model(), args=training, train_dataset=Texts(), callbacks=[watch],
                                       data_collator=transformers.DataCollatorWithPadding(tokenizer))
        watch.trainer = trainer
        trainer.train()
    runtime = getattr(trainer.model_wrapped, "slackswap", None)
    rank = int(os.environ.get("RANK", "0"))
    mine = {"steps": watch.steps}
    if runtime is not None:
        mine.update(profiled=runtime.profiled_steps, derived=runtime.derived_plans,
                    shapes=sorted({key[0][0][1] for key in runtime.shapes}), fraction=runtime.cfg.activation_budget)
    params = list(trainer.model.parameters())
    with deepspeed.zero.GatheredParameters(params):  # under ZeRO-3 each rank holds a partition (all ranks gather)
        if rank == 0:
            digest = hashlib.sha256()
            for p in params:
                digest.update(p.detach().numpy().tobytes())
            mine["parameters"] = digest.hexdigest()
    with open(f"{args.losses}.rank{rank}", "w") as f:
        json.dump(mine, f)
    write_losses(args.losses, [h["loss"] for h in trainer.state.log_history if "loss" in h])
    return 0


if __name__ == "__main__":
    main()
