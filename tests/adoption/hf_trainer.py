"""Hugging Face's Trainer with `deepspeed=<json>` (it calls deepspeed.initialize through Accelerate).
One job is `main(argv)` (several in one process under tests/launch/in_turn.py)."""

import tempfile

import torch
import transformers

from common import STEPS, batch, model, parse_args, trainer_options, write_losses


class Data(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        ids = batch(-1 - i)
        return {"input_ids": ids, "labels": ids}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as out:
        training = transformers.TrainingArguments(
            output_dir=out, deepspeed=args.deepspeed_config, max_steps=args.steps or STEPS, per_device_train_batch_size=2,
            logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, seed=0, dataloader_num_workers=0,
            **trainer_options(args))
        trainer = transformers.Trainer(model=model(), args=training, train_dataset=Data())
        trainer.train()
    write_losses(args.losses, [h["loss"] for h in trainer.state.log_history if "loss" in h])
    return 0


if __name__ == "__main__":
    main()
