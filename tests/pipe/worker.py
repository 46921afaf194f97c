"""A 2-stage deepspeed.pipe.PipelineModule trained by `ss.initialize` (see tests/test_engine.py).

    deepspeed --num_gpus 2 tests/pipe/worker.py --config CONFIG.json --losses OUT.json
"""

import argparse
import json

import deepspeed
import torch
from deepspeed.pipe import PipelineModule

import slackswap_ds as ss

p = argparse.ArgumentParser()
p.add_argument("--local_rank", type=int, default=0)
p.add_argument("--config", required=True)
p.add_argument("--losses", required=True)
args = p.parse_args()
deepspeed.init_distributed(dist_backend="gloo")
torch.manual_seed(0)
layers = [torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16)]
net = PipelineModule(layers=layers, num_stages=2, loss_fn=torch.nn.MSELoss())
with open(args.config) as f:
    config = json.load(f)
engine, *_ = ss.initialize(model=net, model_parameters=list(net.parameters()), config=config)


def batches():
    g = torch.Generator().manual_seed(1)
    while True:
        yield torch.randn(2, 16, generator=g), torch.randn(2, 16, generator=g)


data = batches()
losses = [float(engine.train_batch(data)) for _ in range(3)]
if engine.global_rank == 0:
    with open(args.losses, "w") as f:
        json.dump(losses, f)
