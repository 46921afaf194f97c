"""A plain DeepSpeed training loop: deepspeed.initialize, engine forward/backward/step."""

import deepspeed
import torch

from common import STEPS, batch, model, parse_args, write_losses

args = parse_args()
net = model()
engine, _, _, _ = deepspeed.initialize(args=args, model=net, model_parameters=net.parameters())
losses = []
for step in range(STEPS):
    ids = batch(step)
    torch.manual_seed(100 + step)  # dropout draws the same masks with and without SlackSwap
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    losses.append(loss.item())
write_losses(args.losses, losses)
