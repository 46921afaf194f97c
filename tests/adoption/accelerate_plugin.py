"""An Accelerate loop with its DeepSpeed plugin (Accelerator.prepare calls deepspeed.initialize)."""

import torch
from accelerate import Accelerator
from accelerate.utils import DeepSpeedPlugin

from common import STEPS, batch, model, parse_args, write_losses

args = parse_args()
net = model()
accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=args.deepspeed_config))
optimizer = torch.optim.AdamW(net.parameters(), lr=1e-4)
net, optimizer = accelerator.prepare(net, optimizer)
losses = []
for step in range(STEPS):
    ids = batch(step)
    torch.manual_seed(100 + step)
    loss = net(input_ids=ids, labels=ids).loss
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    losses.append(loss.item())
write_losses(args.losses, losses)
