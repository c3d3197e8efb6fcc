"""A program that never builds an Accelerator: under a sharding strategy, the strategy would have no effect."""

import torch

model = torch.nn.Linear(4, 2)
model(torch.ones(1, 4)).sum().backward()
